// moe_gemm_bf16_sm90_ws: the wgmma grouped expert GEMM of moe_gemm_bf16_sm90.cu, warp-specialized.
// Same arguments, MODEs and contract; compiled for sm_90a only; BM = 128, WG_N = 256. With B_TMA=1
// it was SM90_LARGE (cuda.rs), now the experiment "tma"; moe_gemm_bf16_sm90_pipe.cu took over.
//
// Three warpgroups: warpgroup 0 only loads (cp.async: A rows are gathered by route), warpgroups 1
// and 2 only multiply, 64 rows x WG_N each. A STAGES-deep ring of shared-memory stages is handed
// over through mbarriers instead of a block-wide barrier per K tile: `full[s]` completes when the
// 128 loaders' copies of stage s have landed (each waits for its own copies and fences them for
// the async proxy before arriving), `empty[s]` when the 8 MMA warps have retired the wgmma group
// that read it. No setmaxnreg: 156 registers fit 384 threads, and at 40 or 56 the loaders spill.
// Blocks take their tiles in grouped order (RASTER_GM M blocks per group, raster_grouped in moe_tile.cuh).
//
// B_TMA=1: the weight tile comes through the copy engine (cp.async.bulk.tensor, 128-byte swizzle,
// the same layout swz() writes) from a 2-D tensor map over w viewed as [E * w_rows, kd] (`b_map`,
// one extra kernel argument, built on the host with box {64, WG_N / 2 (MODE 1) or WG_N}); loader
// thread 0 adds its bytes to `full[s]`. Rows past n_out read the next rows of w (finite weights of
// columns the epilogue drops); past the last expert and past kd the copy engine fills zeros.
//
// Shared memory (dynamic): STAGES * (BM + WG_N) * BK * 2 bytes + 1024 for alignment.

#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "common/math.cuh"
#include "common/moe_epilogue.cuh"
#include "common/moe_tile.cuh"
#include "common/sm90_pipeline.cuh"
#include "common/sm90_wgmma.cuh"

#ifndef MODE
#define MODE 1
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef RASTER_GM
#define RASTER_GM 16
#endif
#define WG_N 256
#define BM 128
#define BK 64
#define NTHREADS 384
#define LOADERS 128
#define A_BYTES (BM * BK * 2)
#define B_BYTES (WG_N * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define NO_ROW 0xFFFFFFFFu
#ifndef B_TMA
#define B_TMA 0
#endif

static_assert(STAGES >= 3, "the loaders publish a tile one K step late (see the loader loop)");

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fmoe_moe_gemm_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ w,
                   const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                   const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                   __nv_bfloat16* __restrict__ h_out, float* __restrict__ y32, unsigned int num_routes,
                   unsigned int top_k, unsigned int kd, unsigned int n_out
#if B_TMA
                   ,
                   const __grid_constant__ TmaDesc b_map
#endif
) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ unsigned int route[BM];
    __shared__ unsigned int a_row[BM];  // gathered A row of each tile row, NO_ROW for padding
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];

    const TileCoord tc = raster_grouped(RASTER_GM);
    const unsigned int m0 = tc.m_block * BM;
    if (m0 >= *total) return;
    const KSplit split = k_split((kd + BK - 1) / BK);
    const unsigned int kbase = split.first * BK, ktiles = split.count;
    if (ktiles == 0) return;
    const unsigned int e = block_experts[tc.m_block];
    const unsigned int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned int g = lane >> 2, t = lane & 3, wg = tid >> 7;

    const unsigned int raw = static_cast<unsigned int>(__cvta_generic_to_shared(smem_raw));
    const unsigned int ring = (raw + 1023) & ~1023u;
    const unsigned int full0 = static_cast<unsigned int>(__cvta_generic_to_shared(full_bar));
    const unsigned int empty0 = static_cast<unsigned int>(__cvta_generic_to_shared(empty_bar));

#if MODE == 1
    const unsigned int n0 = tc.n_tile * (WG_N / 2);
    const unsigned long long w_rows = 2ull * n_out;
#else
    const unsigned int n0 = tc.n_tile * WG_N;
    const unsigned long long w_rows = n_out;
#endif

    if (tid < BM) {
        const unsigned int rt = sorted_routes[m0 + tid];
        route[tid] = rt;
#if MODE == 1
        a_row[tid] = rt < num_routes ? rt / top_k : NO_ROW;
#else
        a_row[tid] = rt < num_routes ? rt : NO_ROW;
#endif
    }
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, LOADERS);
            mbar_init(empty0 + 8 * s, 8);  // one arrival per MMA warp
        }
    }
    __syncthreads();

    if (wg == 0) {
        // Loader warpgroup.
#if !B_TMA
        const __nv_bfloat16* we = w + (unsigned long long)e * w_rows * kd;
#endif
        for (unsigned int kt = 0; kt < ktiles; ++kt) {
            const unsigned int s = kt % STAGES;
            // Slot s last held tile kt - STAGES: wait until the MMA warps released it.
            if (kt >= STAGES) mbar_wait(empty0 + 8 * s, ((kt / STAGES) - 1) & 1);
            const unsigned int sa = ring + s * STAGE_BYTES, k0 = kbase + kt * BK;
#pragma unroll
            for (int i = 0; i < BM * 8 / LOADERS; ++i) {
                const unsigned int c = tid + i * LOADERS, r = c >> 3, ch = c & 7, col = k0 + ch * 8;
                const unsigned int row = a_row[r];
                const bool ok = row != NO_ROW && col < kd;
                cp_async16(sa + swz(r, ch), a + (ok ? (unsigned long long)row * kd + col : 0), ok);
            }
#if B_TMA
            if (tid == 0) {
                // Expected before the issuing thread's own arrival, so the phase cannot complete
                // without these bytes.
                const unsigned int full_s = full0 + 8 * s;
                mbar_expect_tx(full_s, B_BYTES);
                const int row = (int)((unsigned long long)e * w_rows) + (int)n0;
#if MODE == 1
                tma_load_2d(sa + A_BYTES, &b_map, (int)k0, row, full_s);
                tma_load_2d(sa + A_BYTES + (WG_N / 2) * 128, &b_map, (int)k0, row + (int)n_out, full_s);
#else
                tma_load_2d(sa + A_BYTES, &b_map, (int)k0, row, full_s);
#endif
            }
#else
            load_weight_tile<__nv_bfloat16, WG_N, LOADERS, MODE == 1>(sa + A_BYTES, we, n0, n_out, kd, k0, tid);
#endif
            cp_async_commit();
            // Publish the previous tile once its copies landed; this one stays in flight meanwhile.
            if (kt > 0) {
                cp_async_wait<1>();
                fence_proxy_async_shared();
                mbar_arrive(full0 + 8 * ((kt - 1) % STAGES));
            }
        }
        cp_async_wait<0>();
        fence_proxy_async_shared();
        mbar_arrive(full0 + 8 * ((ktiles - 1) % STAGES));
        return;
    }

    // MMA warpgroups 1 and 2: rows 64 * (wg - 1) of the tile.
    const unsigned int cw = wg - 1;
    float acc[WG_N / 2];
#pragma unroll
    for (int i = 0; i < WG_N / 2; ++i) acc[i] = 0.0f;

    for (unsigned int kt = 0; kt < ktiles; ++kt) {
        const unsigned int s = kt % STAGES;
        mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
        const unsigned int sa = ring + s * STAGE_BYTES + cw * (64 * 128), sb = ring + s * STAGE_BYTES + A_BYTES;
        const unsigned long long da = smem_desc(sa), db = smem_desc(sb);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) wgmma_m64n256k16_bf16(acc, da + 2 * ks, db + 2 * ks, 1);
        wgmma_commit();
        // The group of tile kt - 1 has retired: its slot goes back to the loaders.
        wgmma_wait<1>();
        if (kt > 0) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * ((kt - 1) % STAGES));
        }
    }
    wgmma_wait<0>();
    wgmma_fence_operands<WG_N / 2>(acc);

    // Epilogue. acc[4j + q]: row 64 * cw + 16 * (warp % 4) + g (+8 for q >= 2), column 8j + 2t + (q & 1).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const unsigned int rt = route[cw * 64 + (warp & 3) * 16 + g + half * 8];
        if (rt >= num_routes) continue;
#if MODE == 1
        silu_mul_row<WG_N, false>(acc, half, t, 1.0f, h_out + (unsigned long long)rt * n_out, n0, n_out, 0);
#else
        weighted_add_row<WG_N, false>(acc, half, t, 1.0f, topk_weights[rt], y32 + (unsigned long long)(rt / top_k) * n_out, n0, n_out);
#endif
    }
}
