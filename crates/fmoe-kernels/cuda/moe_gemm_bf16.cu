// moe_gemm_bf16: grouped expert GEMM over routes sorted by moe_align, bf16 in, f32 accumulate,
// tensor cores through mma.sync m16n8k16 (the sm_80+ stepping stone before wgmma).
//
// MODE 1 (GEMM1): A = tokens x [M, K] gathered by route / top_k, W = w13 [E, 2N, K]. A tile pairs
//   64 gate rows with the matching 64 up rows, so the epilogue writes h = silu(gate) * up (bf16,
//   [num_routes, N], row = route).
// MODE 2 (GEMM2): A = h [num_routes, N] by route, W = w2 [E, K, N]. The epilogue multiplies by the
//   route's routing weight and adds into y32 [M, K] (f32, zeroed by the caller): the top-k
//   reduction is fused through atomics.
//
// MODE 2 may split the reduction over gridDim.z (split-K): each split adds its partial sum into
// y32, so decode-sized batches still spread the weight stream over every SM. MODE 1 needs
// gridDim.z == 1 (SiLU is not linear).
//
// Contract: the reduction length is a multiple of 8 (16-byte loads); moe_align ran with
// block_m == BM, so every BM rows of sorted_routes belong to one expert. Shared memory is dynamic:
// STAGES * (BM + BN) * (BK + 8) * 2 bytes (see fmoe_moe_gemm_bf16_smem_bytes in the Rust side).

#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "common/k_split.cuh"
#include "common/math.cuh"
#include "common/mma_sm80.cuh"
#include "common/pdl.cuh"

#ifndef MODE
#define MODE 1
#endif
#define BM 64
#define BN 128
#ifndef BK
#define BK 32        // reduction tile: 16-byte chunks per row = BK / 8
#endif
#ifndef STAGES
#define STAGES 3     // cp.async ring: STAGES - 1 tiles in flight while one is consumed
#endif
#define SK (BK + 8)  // padded shared-memory row (bf16 elements): conflict-free ldmatrix
#define NTHREADS 128
#define CHUNKS (BK / 8)

extern "C" __global__ void __launch_bounds__(NTHREADS)
fmoe_moe_gemm_bf16(const __nv_bfloat16* __restrict__ a,      // [rows_a, kd]
                   const __nv_bfloat16* __restrict__ w,      // [E, w_rows, kd]
                   const unsigned int* __restrict__ sorted_routes,
                   const unsigned int* __restrict__ block_experts,
                   const unsigned int* __restrict__ total,
                   const float* __restrict__ topk_weights,   // MODE 2: [num_routes]
                   __nv_bfloat16* __restrict__ h_out,        // MODE 1: [num_routes, n_out]
                   float* __restrict__ y32,                  // MODE 2: [num_routes / top_k, n_out]
                   unsigned int num_routes, unsigned int top_k, unsigned int kd, unsigned int n_out) {
#if PDL
    FMOE_PDL_ENTER_GEMM_BF16();  // first: see common/pdl.cuh
#endif
    extern __shared__ __align__(16) unsigned char smem_raw[];
    typedef __nv_bfloat16 ATile[BM][SK];
    typedef __nv_bfloat16 BTile[BN][SK];
    ATile* as = reinterpret_cast<ATile*>(smem_raw);
    BTile* bs = reinterpret_cast<BTile*>(smem_raw + STAGES * sizeof(ATile));
    __shared__ unsigned int route[BM];

    const unsigned int m0 = blockIdx.y * BM;
    if (m0 >= *total) return;  // past the padded runs of this batch
    const unsigned int e = block_experts[blockIdx.y];
    const unsigned int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const unsigned int g = lane >> 2, t = lane & 3;
    const unsigned int wm = warp >> 1, wn = warp & 1;

#if MODE == 1
    const unsigned int n0 = blockIdx.x * (BN / 2);
    const unsigned long long w_rows = 2ull * n_out;
#else
    const unsigned int n0 = blockIdx.x * BN;
    const unsigned long long w_rows = n_out;
#endif
    const __nv_bfloat16* we = w + (unsigned long long)e * w_rows * kd;

    if (tid < BM) route[tid] = sorted_routes[m0 + tid];
    __syncthreads();

    auto load_stage = [&](int stage, unsigned int k0) {
        // A: BM rows x BK cols in 16-byte chunks.
#pragma unroll
        for (int i = 0; i < BM * CHUNKS / NTHREADS; ++i) {
            unsigned int c = tid + i * NTHREADS, r = c / CHUNKS, col = (c % CHUNKS) * 8;
            unsigned int rt = route[r];
            bool ok = rt < num_routes && k0 + col < kd;
#if MODE == 1
            unsigned long long row = ok ? rt / top_k : 0;
#else
            unsigned long long row = ok ? rt : 0;
#endif
            cp_async16(&as[stage][r][col], a + row * kd + (ok ? k0 + col : 0), ok);
        }
        // W: BN rows x BK cols in 16-byte chunks.
#pragma unroll
        for (int i = 0; i < BN * CHUNKS / NTHREADS; ++i) {
            unsigned int c = tid + i * NTHREADS, r = c / CHUNKS, col = (c % CHUNKS) * 8;
#if MODE == 1
            unsigned int n = n0 + (r & 63);
            unsigned long long wr = (r < 64 ? 0ull : (unsigned long long)n_out) + n;
            bool ok = n < n_out && k0 + col < kd;
#else
            unsigned long long wr = n0 + r;
            bool ok = n0 + r < n_out && k0 + col < kd;
#endif
            cp_async16(&bs[stage][r][col], we + (ok ? wr * kd + k0 + col : 0), ok);
        }
    };

    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

    // This block's share of the reduction (all of it unless MODE 2 splits over gridDim.z).
    const KSplit split = k_split((kd + BK - 1) / BK);
    const unsigned int kbase = split.first * BK, ktiles = split.count;
    if (ktiles == 0) return;  // a trailing split with nothing left to reduce
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < ktiles) load_stage(st, kbase + st * BK);
        cp_async_commit();  // empty groups keep the wait count uniform
    }
    // ldmatrix row/column of this lane: A tiles take rows 0-15 x cols {0,8}; B tiles take two n8
    // tiles x cols {0,8}.
    const int a_row = lane & 15, a_col = (lane >> 4) * 8;
    const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;
    for (unsigned int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt is visible; everyone is done with the slot refilled below
        if (kt + STAGES - 1 < ktiles) load_stage((kt + STAGES - 1) % STAGES, kbase + (kt + STAGES - 1) * BK);
        cp_async_commit();
        const int s = kt % STAGES;
#pragma unroll
        for (int ks = 0; ks < BK; ks += 16) {
            unsigned int af[2][4], bf[8][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) ldmatrix_x4(af[mi], &as[s][wm * 32 + mi * 16 + a_row][ks + a_col]);
#pragma unroll
            for (int jp = 0; jp < 4; ++jp) {
#if MODE == 1
                const int base = jp < 2 ? wn * 32 + jp * 16 : 64 + wn * 32 + (jp - 2) * 16;
#else
                const int base = wn * 64 + jp * 16;
#endif
                unsigned int r[4];
                ldmatrix_x4(r, &bs[s][base + b_row][ks + b_col]);
                bf[2 * jp][0] = r[0];
                bf[2 * jp][1] = r[1];
                bf[2 * jp + 1][0] = r[2];
                bf[2 * jp + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int j = 0; j < 8; ++j) mma_m16n8k16_bf16(acc[mi][j], af[mi], bf[j]);
        }
    }

    // Epilogue. Fragment element q of tile (mi, j): row g (+8 for q >= 2), column 2t + (q & 1).
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const unsigned int rt = route[wm * 32 + mi * 16 + g + half * 8];
            if (rt >= num_routes) continue;
#if MODE == 1
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const unsigned int n = n0 + wn * 32 + j * 8 + 2 * t + q;
                    if (n < n_out) {
                        const float gate = acc[mi][j][half * 2 + q], up = acc[mi][j + 4][half * 2 + q];
                        h_out[(unsigned long long)rt * n_out + n] = __float2bfloat16(silu(gate) * up);
                    }
                }
            }
#else
            const float wt = topk_weights[rt];
            float* yrow = y32 + (unsigned long long)(rt / top_k) * n_out;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const unsigned int c = n0 + wn * 64 + j * 8 + 2 * t + q;
                    if (c < n_out) atomicAdd(yrow + c, wt * acc[mi][j][half * 2 + q]);
                }
            }
#endif
        }
    }
}

// y = bf16(y32), the last step of GEMM2's reduction.
extern "C" __global__ void fmoe_f32_to_bf16(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst,
                                            unsigned long long n) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    src = fmoe_pdl_fresh(src);
    dst = fmoe_pdl_fresh(dst);
#endif
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(src[i]);
}
