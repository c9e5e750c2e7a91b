// moe_gemm_fp8_sm90_ws: the prefill-sized fp8 grouped expert GEMMs, warp-specialized like
// moe_gemm_bf16_sm90_ws.cu. Same arguments, MODEs, epilogues and contract as the kernels they
// replace at large M (moe_gemm_fp8_sm90.cu, moe_gemm_fp8_block_sm90.cu; read those for the
// operands and epilogues), plus one trailing argument: the weights' tensor map `b_map`.
// Compiled for sm_90a only. BLOCK_SCALED=0: per-tensor scales (entry fmoe_moe_gemm_fp8);
// BLOCK_SCALED=1: 1x128 / 128x128 block scales (entry fmoe_moe_gemm_fp8_block).
//
// Tile: BM = 128 routes x NB = 256 weight rows, BK = 128 fp8 bytes (one 128-byte swizzle row =
// one scale block along K). Three warpgroups: warpgroup 0 only loads (A rows gathered by route
// with cp.async; the weight tile as two TMA boxes of 128 rows x 128 bytes, 128-byte swizzle, from
// the tensor map over w viewed as [E * w_rows, kd]: MODE 1 gate rows n0.. and up rows n_out + n0..,
// MODE 2 rows n0.. and n0 + 128..), warpgroups 1 and 2 only multiply, 64 rows x 256 weight rows
// each. A STAGES-deep mbarrier ring (full: the loaders' copies and the TMA bytes landed; empty: the
// 8 MMA warps are done with the stage). Tiles in grouped order (raster_grouped, RASTER_GM M blocks
// per group). Weight rows past n_out read the next rows of w (finite codes of columns the epilogue
// drops); past the last expert and past kd the copy engine fills zeros; A past kd is zero-filled.
//
// BLOCK_SCALED=0: wgmma.m64n256k32 into one 128-register accumulator, one group in flight, the
//   whole reduction unpromoted (as FP8_TENSOR_LARGE always was); per-tensor scales in the epilogue.
// BLOCK_SCALED=1: per K block, each MMA warpgroup multiplies the two 128-row halves of the weight
//   tile in turn into a 64-register partial accumulator (wgmma.m64n128k32, 4 per half), waits, and
//   promotes on the CUDA cores: acc += partial * (a_scale[row, kb] * w_scale[e, block(row'), kb]),
//   the order of moe_gemm/cpu.rs. acc (128) + partial (64) do not fit the 168 registers of 384
//   threads: setmaxnreg gives the loaders 40 and the MMA warpgroups 232 (the warpgroup that is
//   promoting leaves the tensor cores to the other). The loaders bring A's group scales of the
//   stage's K block (cp.async, 4 bytes per row) into the stage; the MMA warps read the expert's
//   four weight-block scales of the K block from global memory before waiting for the stage. A
//   half whose 128 rows straddle two weight blocks (the up rows when N % 128 != 0) picks the scale
//   per column; MODE 1's 128 output columns are one 1 x 128 group of h, whole in each thread's row,
//   so the group quantization needs only quad shuffles.
//
// Launch: grid (ceil(n_out / (MODE 1 ? 128 : 256)), capacity / 128, MODE 1 ? 1 : splits), 384
// threads, dynamic shared memory STAGES * (128 + 256) * 128 + 1024 bytes.

#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "common/atomics.cuh"
#include "common/fp8.cuh"
#include "common/math.cuh"
#include "common/moe_epilogue.cuh"
#include "common/moe_tile.cuh"
#include "common/sm90_pipeline.cuh"
#include "common/sm90_wgmma.cuh"

#ifndef MODE
#define MODE 1
#endif
#ifndef BLOCK_SCALED
#define BLOCK_SCALED 0
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef RASTER_GM
#define RASTER_GM 16
#endif
#define BM 128
#define BK 128  // fp8 elements (= bytes): one 128-byte swizzle row, one scale block along K
#define NB 256  // weight rows per tile: two TMA boxes of 128
#define NTHREADS 384
#define LOADERS 128
#define A_BYTES (BM * BK)
#define HALF_BYTES (NB / 2 * BK)
#define B_BYTES (NB * BK)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define NO_ROW 0xFFFFFFFFu

static_assert(STAGES >= 3, "the loaders publish a tile one K step late (see the loader loop)");
static_assert(STAGE_BYTES % 1024 == 0, "swizzle atoms are 1024-byte aligned");

#if BLOCK_SCALED
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fmoe_moe_gemm_fp8_block(const unsigned char* __restrict__ a, const float* __restrict__ a_scale,
                        const unsigned char* __restrict__ w, const float* __restrict__ w_scale,
                        const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                        const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                        unsigned char* __restrict__ q_out, float* __restrict__ s_out, float* __restrict__ y32,
                        unsigned int* __restrict__ error_flag, unsigned int num_routes, unsigned int top_k,
                        unsigned int kd, unsigned int n_out, const __grid_constant__ TmaDesc b_map) {
#else
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fmoe_moe_gemm_fp8(const unsigned char* __restrict__ a, const unsigned char* __restrict__ w,
                  const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                  const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                  const float* __restrict__ a_scale, const float* __restrict__ w_scale,
                  __nv_bfloat16* __restrict__ h_out, unsigned int* __restrict__ h_amax, float* __restrict__ y32,
                  unsigned int num_routes, unsigned int top_k, unsigned int kd, unsigned int n_out,
                  const __grid_constant__ TmaDesc b_map) {
#endif
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ unsigned int route[BM];
    __shared__ unsigned int a_row[BM];  // gathered A row of each tile row, NO_ROW for padding
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];
#if BLOCK_SCALED
    __shared__ float a_sc[STAGES][BM];  // A's group scale of each tile row for the stage's K block
#endif

    const TileCoord tc = raster_grouped(RASTER_GM);
    const unsigned int m0 = tc.m_block * BM;
    if (m0 >= *total) return;
    const unsigned int kblocks = (kd + BK - 1) / BK;
    const KSplit split = k_split(kblocks);
    const unsigned int kb0 = split.first, ktiles = split.count;
    if (ktiles == 0) return;
    const unsigned int e = block_experts[tc.m_block];
    const unsigned int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned int g = lane >> 2, t = lane & 3, wg = tid >> 7;

    const unsigned int raw = static_cast<unsigned int>(__cvta_generic_to_shared(smem_raw));
    const unsigned int ring = (raw + 1023) & ~1023u;
    const unsigned int full0 = static_cast<unsigned int>(__cvta_generic_to_shared(full_bar));
    const unsigned int empty0 = static_cast<unsigned int>(__cvta_generic_to_shared(empty_bar));

    // First weight row (within the expert) of each 128-row half of the tile.
#if MODE == 1
    const unsigned int n0 = tc.n_tile * (NB / 2);  // output columns n0 .. n0 + 127
    const unsigned int w_rows = 2 * n_out;
    const unsigned int half0 = n0, half1 = n_out + n0;  // gate rows, up rows
#else
    const unsigned int n0 = tc.n_tile * NB;  // output columns n0 .. n0 + 255
    const unsigned int w_rows = n_out;
    const unsigned int half0 = n0, half1 = n0 + NB / 2;
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
#if BLOCK_SCALED
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
#endif
        const int row0 = (int)(e * w_rows);
        for (unsigned int kt = 0; kt < ktiles; ++kt) {
            const unsigned int s = kt % STAGES;
            // Slot s last held tile kt - STAGES: wait until the MMA warps released it.
            if (kt >= STAGES) mbar_wait(empty0 + 8 * s, ((kt / STAGES) - 1) & 1);
            const unsigned int sa = ring + s * STAGE_BYTES, k0 = (kb0 + kt) * BK;
#pragma unroll
            for (int i = 0; i < BM * 8 / LOADERS; ++i) {
                const unsigned int c = tid + i * LOADERS, r = c >> 3, ch = c & 7, col = k0 + ch * 16;
                const unsigned int row = a_row[r];
                const bool ok = row != NO_ROW && col < kd;
                cp_async16(sa + swz(r, ch), a + (ok ? (unsigned long long)row * kd + col : 0), ok);
            }
#if BLOCK_SCALED
            {
                const unsigned int row = a_row[tid];
                const bool ok = row != NO_ROW;
                cp_async4(static_cast<unsigned int>(__cvta_generic_to_shared(&a_sc[s][tid])),
                          a_scale + (ok ? (unsigned long long)row * kblocks + kb0 + kt : 0), ok);
            }
#endif
            if (tid == 0) {
                // Expected before the issuing thread's own arrival, so the phase cannot complete
                // without these bytes.
                const unsigned int full_s = full0 + 8 * s;
                mbar_expect_tx(full_s, B_BYTES);
                tma_load_2d(sa + A_BYTES, &b_map, (int)k0, row0 + (int)half0, full_s);
                tma_load_2d(sa + A_BYTES + HALF_BYTES, &b_map, (int)k0, row0 + (int)half1, full_s);
            }
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

    // MMA warpgroups 1 and 2: tile rows 64 * cw .. 64 * cw + 63.
#if BLOCK_SCALED
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
#endif
    const unsigned int cw = wg - 1;
    // acc[4j + 2h + q]: tile row r0 + 8h, weight-tile column 8j + 2t + q (j < 32: the first half's
    // 128 rows for j < 16, the second half's beyond).
    const unsigned int r0 = cw * 64 + (warp & 3) * 16 + g;
    float acc[NB / 2];
#pragma unroll
    for (int i = 0; i < NB / 2; ++i) acc[i] = 0.0f;

#if BLOCK_SCALED
    // Weight-scale blocks of each half: rows half_h + c lie in block b_h for c < thr_h, b_h + 1
    // beyond. A half past the expert's rows (columns never stored) is clamped to the last block.
    const unsigned int wrb = (w_rows + 127) / 128;
    const float* wse = w_scale + (unsigned long long)e * wrb * kblocks;
    const unsigned int b0 = min(half0 >> 7, wrb - 1), b0n = min(b0 + 1, wrb - 1);
    const unsigned int b1 = min(half1 >> 7, wrb - 1), b1n = min(b1 + 1, wrb - 1);
    const int thr0 = 128 - (int)(half0 & 127), thr1 = 128 - (int)(half1 & 127);
    const float* ws00 = wse + (unsigned long long)b0 * kblocks;
    const float* ws01 = wse + (unsigned long long)b0n * kblocks;
    const float* ws10 = wse + (unsigned long long)b1 * kblocks;
    const float* ws11 = wse + (unsigned long long)b1n * kblocks;
    float part[64];

    for (unsigned int kt = 0; kt < ktiles; ++kt) {
        const unsigned int s = kt % STAGES, kb = kb0 + kt;
        // Issued before the wait, so their latency hides behind it.
        const float w00 = ws00[kb], w01 = ws01[kb], w10 = ws10[kb], w11 = ws11[kb];
        mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
        const unsigned int st = ring + s * STAGE_BYTES;
        const unsigned long long da = smem_desc(st + cw * (64 * 128));
        const float sa0 = a_sc[s][r0], sa1 = a_sc[s][r0 + 8];
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const unsigned long long db = smem_desc(st + A_BYTES + hf * HALF_BYTES);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 32; ++ks)
                // 32 fp8 elements along K = 32 bytes = 2 descriptor units; the first step overwrites.
                wgmma_m64n128k32_e4m3(part, da + 2 * ks, db + 2 * ks, ks > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operands<64>(part);
            const float wlo = hf ? w10 : w00, whi = hf ? w11 : w01;
            const int thr = hf ? thr1 : thr0;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float s_a = h ? sa1 : sa0;
                const float slo = s_a * wlo, shi = s_a * whi;
#pragma unroll
                for (int j = 0; j < 16; ++j) {
#pragma unroll
                    for (int q = 0; q < 2; ++q) {
                        const int i = 4 * j + 2 * h + q;
                        acc[64 * hf + i] = fmaf(part[i], (8 * j + 2 * (int)t + q) < thr ? slo : shi, acc[64 * hf + i]);
                    }
                }
            }
        }
        // Both halves' wgmma retired and the stage's scales read: the slot goes back to the loaders.
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * s);
    }
#else
    for (unsigned int kt = 0; kt < ktiles; ++kt) {
        const unsigned int s = kt % STAGES;
        mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
        const unsigned int st = ring + s * STAGE_BYTES;
        const unsigned long long da = smem_desc(st + cw * (64 * 128)), db = smem_desc(st + A_BYTES);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 32; ++ks) wgmma_m64n256k32_e4m3(acc, da + 2 * ks, db + 2 * ks, 1);
        wgmma_commit();
        // The group of tile kt - 1 has retired: its slot goes back to the loaders.
        wgmma_wait<1>();
        if (kt > 0) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * ((kt - 1) % STAGES));
        }
    }
    wgmma_wait<0>();
    wgmma_fence_operands<NB / 2>(acc);
#endif

    // Epilogue. acc[4j + 2h + q]: tile row r0 + 8h, weight-tile column 8j + 2t + q.
#if BLOCK_SCALED && MODE == 1
    // h = silu(gate) * up for output columns n0 + 8j + 2t + q (j < 16), into the gate slots; then
    // the 1 x 128 group quantization of each row (the row's 128 columns are this quad's).
    const unsigned int groups = (n_out + 127) / 128;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned int rt = route[r0 + 8 * h];
        const bool valid = rt < num_routes;
        unsigned int m = 0;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int i = 4 * j + 2 * h + q;
                const float v = silu(acc[i]) * acc[64 + i];
                acc[i] = v;
                const unsigned int n = n0 + 8 * j + 2 * t + q;
                if (valid && n < n_out) m = max(m, __float_as_uint(v) & 0x7FFFFFFFu);
            }
        }
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
        if (!valid) continue;
        const float s = scale_from_amax(__uint_as_float(m));
        unsigned char* qrow = q_out + (unsigned long long)rt * n_out;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned int n = n0 + 8 * j + 2 * t;  // even; n_out even
            const int i = 4 * j + 2 * h;
            if (n < n_out)
                *reinterpret_cast<unsigned short*>(qrow + n) = e4m3x2(__fdiv_rn(acc[i], s), __fdiv_rn(acc[i + 1], s));
        }
        if (t == 0) {
            s_out[(unsigned long long)rt * groups + tc.n_tile] = s;
            if (m >= 0x7F800000u) atomicExch(error_flag, 1u);
        }
    }
#elif BLOCK_SCALED
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned int rt = route[r0 + 8 * h];
        if (rt >= num_routes) continue;
        weighted_add_row<NB, true>(acc, h, t, 1.0f, topk_weights[rt], y32 + (unsigned long long)(rt / top_k) * n_out, n0, n_out);
    }
#else
    // Per-tensor scales, once per dot product.
    const float sc = a_scale[0] * w_scale[e];
#if MODE == 1
    unsigned int hmax = 0;  // bits of max |h|
#endif
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned int rt = route[r0 + 8 * h];
        if (rt >= num_routes) continue;
#if MODE == 1
        hmax = silu_mul_row<NB, true>(acc, h, t, sc, h_out + (unsigned long long)rt * n_out, n0, n_out, hmax);
#else
        weighted_add_row<NB, true>(acc, h, t, sc, topk_weights[rt], y32 + (unsigned long long)(rt / top_k) * n_out, n0, n_out);
#endif
    }
#if MODE == 1
    if (h_amax != nullptr) {
        hmax = warp_max(hmax);
        if (lane == 0 && hmax != 0) atomicMax(h_amax, hmax);
    }
#endif
#endif
}
