// moe_gemm_bf16_sm90: the grouped expert GEMM of moe_gemm_bf16.cu on Hopper tensor cores (wgmma).
// Same arguments, MODEs and contract as moe_gemm_bf16.cu; compiled for sm_90a only.
//
// BM / 64 warpgroups per CTA compute a BM x WG_N tile, each 64 rows with wgmma.m64n{WG_N}k16 (A and
// B K-major from 128-byte-swizzled shared memory). Operands arrive through a STAGES-deep cp.async
// ring (A rows are gathered by route, which TMA cannot do); one wgmma group stays in flight while
// the next tile is waited for, so the ring prefetches STAGES - 2 tiles ahead. GEMM1 (MODE 1) tiles pair WG_N/2 gate rows with the
// matching up rows; GEMM2 (MODE 2) may split the reduction over gridDim.z.
//
// Used as SM90_SMALL and SM90_SYNC (cuda.rs); SM90_LARGE is moe_gemm_bf16_sm90_pipe.cu.
// RASTER_GM (optional): blocks take their tiles in grouped order (raster_grouped in moe_tile.cuh).
//
// Shared memory (dynamic): STAGES * (BM + WG_N) * BK * 2 bytes + 1024 for alignment.

#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "common/math.cuh"
#include "common/moe_epilogue.cuh"
#include "common/moe_tile.cuh"
#include "common/sm90_wgmma.cuh"
#include "common/pdl.cuh"

#ifndef MODE
#define MODE 1
#endif
#ifndef WG_N
#define WG_N 256
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef BM
#define BM 64  // 64 or 128: one warpgroup per 64 rows
#endif
#define BK 64  // one 128-byte swizzle atom per row
#define NTHREADS (BM / 64 * 128)
#define A_BYTES (BM * BK * 2)
#define B_BYTES (WG_N * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)

static_assert(WG_N == 128 || WG_N == 256, "wgmma tile width");
static_assert(BM == 64 || BM == 128, "M tile");
static_assert(STAGES >= 3, "one tile in wgmma, one landing, one loading");

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fmoe_moe_gemm_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ w,
                   const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                   const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                   __nv_bfloat16* __restrict__ h_out, float* __restrict__ y32, unsigned int num_routes,
                   unsigned int top_k, unsigned int kd, unsigned int n_out) {
#if PDL
    FMOE_PDL_ENTER_GEMM_BF16();  // first: see common/pdl.cuh
#endif
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ unsigned int route[BM];

#ifdef RASTER_GM
    const TileCoord tc = raster_grouped(RASTER_GM);
    const unsigned int m_block = tc.m_block, n_tile = tc.n_tile;
#else
    const unsigned int m_block = blockIdx.y, n_tile = blockIdx.x;
#endif
    const unsigned int m0 = m_block * BM;
    if (m0 >= *total) return;
    const unsigned int e = block_experts[m_block];
    const unsigned int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned int g = lane >> 2, t = lane & 3, wg = tid >> 7;

    // 1024-byte aligned ring (swizzle atoms must be).
    const unsigned int raw = static_cast<unsigned int>(__cvta_generic_to_shared(smem_raw));
    const unsigned int ring = (raw + 1023) & ~1023u;

#if MODE == 1
    const unsigned int n0 = n_tile * (WG_N / 2);
    const unsigned long long w_rows = 2ull * n_out;
#else
    const unsigned int n0 = n_tile * WG_N;
    const unsigned long long w_rows = n_out;
#endif
    const __nv_bfloat16* we = w + (unsigned long long)e * w_rows * kd;

    if (tid < BM) route[tid] = sorted_routes[m0 + tid];
    __syncthreads();

    auto load_stage = [&](unsigned int stage, unsigned int k0) {
        const unsigned int sa = ring + stage * STAGE_BYTES, sb = sa + A_BYTES;
        // A rows are gathered inline: the same loop moved into a helper changes the MODE 2 code
        // NVRTC emits (cubin fingerprints), which only a GPU run could vouch for.
#pragma unroll
        for (int i = 0; i < BM * 8 / NTHREADS; ++i) {
            const unsigned int c = tid + i * NTHREADS, r = c >> 3, ch = c & 7, col = k0 + ch * 8;
            const unsigned int rt = route[r];
            const bool ok = rt < num_routes && col < kd;
#if MODE == 1
            const unsigned long long row = ok ? rt / top_k : 0;
#else
            const unsigned long long row = ok ? rt : 0;
#endif
            cp_async16(sa + swz(r, ch), a + (ok ? row * kd + col : 0), ok);
        }
        load_weight_tile<__nv_bfloat16, WG_N, NTHREADS, MODE == 1>(sb, we, n0, n_out, kd, k0, tid);
    };

    float acc[WG_N / 2];
#pragma unroll
    for (int i = 0; i < WG_N / 2; ++i) acc[i] = 0.0f;

    const KSplit split = k_split((kd + BK - 1) / BK);
    const unsigned int kbase = split.first * BK, ktiles = split.count;
    if (ktiles == 0) return;

    constexpr int AHEAD = STAGES - 2;  // tiles prefetched beyond the one being consumed
#pragma unroll
    for (int st = 0; st < AHEAD; ++st) {
        if (st < ktiles) load_stage(st, kbase + st * BK);
        cp_async_commit();
    }
    for (unsigned int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<AHEAD - 1>();
        fence_proxy_async_shared();  // the copies above, for the tensor cores
        // Tile kt is complete for everyone, and every warpgroup has retired the wgmma group of
        // tile kt - 2, whose slot is refilled below (the group of kt - 1 may still be running).
        __syncthreads();
        if (kt + AHEAD < ktiles) load_stage((kt + AHEAD) % STAGES, kbase + (kt + AHEAD) * BK);
        cp_async_commit();

        const unsigned int sa = ring + (kt % STAGES) * STAGE_BYTES + wg * (64 * 128), sb = ring + (kt % STAGES) * STAGE_BYTES + A_BYTES;
        const unsigned long long da = smem_desc(sa), db = smem_desc(sb);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            // Advancing 16 elements along K moves the start address by 32 bytes (2 in 16-byte units).
#if WG_N == 256
            wgmma_m64n256k16_bf16(acc, da + 2 * ks, db + 2 * ks, 1);
#else
            wgmma_m64n128k16_bf16(acc, da + 2 * ks, db + 2 * ks, 1);
#endif
        }
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    wgmma_fence_operands<WG_N / 2>(acc);

    // Epilogue. acc[4j + q]: row 64 * wg + 16 * (warp % 4) + g (+8 for q >= 2), column 8j + 2t + (q & 1).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const unsigned int rt = route[wg * 64 + (warp & 3) * 16 + g + half * 8];
        if (rt >= num_routes) continue;
#if MODE == 1
        silu_mul_row<WG_N, false>(acc, half, t, 1.0f, h_out + (unsigned long long)rt * n_out, n0, n_out, 0);
#else
        weighted_add_row<WG_N, false>(acc, half, t, 1.0f, topk_weights[rt], y32 + (unsigned long long)(rt / top_k) * n_out, n0, n_out);
#endif
    }
}
