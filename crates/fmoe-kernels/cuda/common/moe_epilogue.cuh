// The fused epilogues of the wgmma grouped MoE GEMMs (bf16 and per-tensor fp8), for one row of
// one MMA warp's accumulator, so every kernel stores h and adds into y the same way.
//
// acc is a 64 x N wgmma slab: acc[4j + 2 half + q] is column col0 + 8j + 2t + q of the warp's row
// g (half 0) or g + 8 (half 1), t = lane % 4. `scale` multiplies each dot product first (fp8
// per-tensor: a_scale * w_scale; bf16: 1, exact). Adjacent column pairs go out as one bf16x2 store
// or one 8-byte reduction when n_out is even (then every pair is aligned); otherwise one by one.
// EVEN_N: the caller's contract already makes n_out even (the fp8 kernels; the bf16 pipe kernel's
// N_OUT_EVEN builds): pairs only, and GEMM1's every pair computed with its store predicated, so
// the epilogue has no branch per pair (the MMA warps run it while the tensor cores wait).

#ifndef FMOE_COMMON_MOE_EPILOGUE_CUH
#define FMOE_COMMON_MOE_EPILOGUE_CUH

#include <cuda_bf16.h>

#include "common/atomics.cuh"
#include "common/math.cuh"

// The bf16 pair h = silu(gate) * up of output columns 8j + 2t, 8j + 2t + 1 of the slab (gate in its
// first N / 2 columns, up in the rest), each dot product scaled first.
template <int N>
__device__ __forceinline__ __nv_bfloat162 silu_mul_pair(const float (&acc)[N / 2], const int half, const int j,
                                                        const float scale) {
    const float g0 = acc[4 * j + 2 * half] * scale, g1 = acc[4 * j + 2 * half + 1] * scale;
    const float u0 = acc[4 * (j + N / 16) + 2 * half] * scale, u1 = acc[4 * (j + N / 16) + 2 * half + 1] * scale;
    return __floats2bfloat162_rn(silu(g0) * u0, silu(g1) * u1);
}

// max(hmax, the bits of the pair's larger |h|).
__device__ __forceinline__ unsigned int pair_amax(unsigned int hmax, __nv_bfloat162 hv) {
    return max(hmax, max(__float_as_uint(fabsf(__low2float(hv))), __float_as_uint(fabsf(__high2float(hv)))));
}

// GEMM1: h_row[n] = bf16(silu(gate) * up) for the N / 2 output columns from n0, gate the slab's
// first N / 2 columns, up the rest. Returns max(hmax, the bits of the row's max |h| as stored)
// (non-negative floats order as unsigned ints), for the per-tensor requantization of h.
template <int N, bool EVEN_N>
__device__ __forceinline__ unsigned int silu_mul_row(const float (&acc)[N / 2], const int half, const unsigned int t,
                                                     const float scale, __nv_bfloat16* __restrict__ h_row,
                                                     const unsigned int n0, const unsigned int n_out,
                                                     unsigned int hmax) {
    if (EVEN_N) {
        // Pairs only: one row pointer, every pair computed, the stores predicated (no branch per
        // pair; columns past n_out hold finite products of the next weight rows).
        __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(h_row + n0 + 2 * t);
#pragma unroll
        for (int j = 0; j < N / 16; ++j) {
            const __nv_bfloat162 hv = silu_mul_pair<N>(acc, half, j, scale);
            if (n0 + j * 8 + 2 * t < n_out) {
                out[j * 4] = hv;
                hmax = pair_amax(hmax, hv);
            }
        }
        return hmax;
    }
#pragma unroll
    for (int j = 0; j < N / 16; ++j) {
        const unsigned int n = n0 + j * 8 + 2 * t;
        const __nv_bfloat162 hv = silu_mul_pair<N>(acc, half, j, scale);
        if (n + 1 < n_out && (n_out & 1) == 0) {
            *reinterpret_cast<__nv_bfloat162*>(h_row + n) = hv;
            hmax = pair_amax(hmax, hv);
        } else {
            if (n < n_out) {
                h_row[n] = __low2bfloat16(hv);
                hmax = max(hmax, __float_as_uint(fabsf(__low2float(hv))));
            }
            if (n + 1 < n_out) {
                h_row[n + 1] = __high2bfloat16(hv);
                hmax = max(hmax, __float_as_uint(fabsf(__high2float(hv))));
            }
        }
    }
    return hmax;
}

// GEMM2: y_row[c] += wt * (scale * acc) for the N columns from c0 (f32 reductions: the top-k
// routes of a token and the K splits meet in y).
template <int N, bool EVEN_N>
__device__ __forceinline__ void weighted_add_row(const float (&acc)[N / 2], const int half, const unsigned int t,
                                                 const float scale, const float wt, float* __restrict__ y_row,
                                                 const unsigned int c0, const unsigned int n_out) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const unsigned int c = c0 + j * 8 + 2 * t;
        if (EVEN_N) {
            if (c < n_out) red_add_v2(y_row + c, wt * (acc[4 * j + 2 * half] * scale), wt * (acc[4 * j + 2 * half + 1] * scale));
            continue;
        }
        const float v0 = wt * (acc[4 * j + 2 * half] * scale), v1 = wt * (acc[4 * j + 2 * half + 1] * scale);
        if (c + 1 < n_out && (n_out & 1) == 0) {
            red_add_v2(y_row + c, v0, v1);
        } else {
            if (c < n_out) atomicAdd(y_row + c, v0);
            if (c + 1 < n_out) atomicAdd(y_row + c + 1, v1);
        }
    }
}

#ifndef ROUTE_ROWS
#define ROUTE_ROWS 0
#endif

// GEMM2, per-route rows: row[c] = bf16(wt * (scale * acc)), plain stores (no route shares
// the row, and the caller runs one K split); moe_finalize.cu sums a token's top_k rows.
template <int N, bool EVEN_N>
__device__ __forceinline__ void weighted_store_row(const float (&acc)[N / 2], const int half, const unsigned int t,
                                                   const float scale, const float wt,
                                                   __nv_bfloat16* __restrict__ row, const unsigned int c0,
                                                   const unsigned int n_out) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
        const unsigned int c = c0 + j * 8 + 2 * t;
        const __nv_bfloat162 v =
            __floats2bfloat162_rn(wt * (acc[4 * j + 2 * half] * scale), wt * (acc[4 * j + 2 * half + 1] * scale));
        if (EVEN_N || (c + 1 < n_out && (n_out & 1) == 0)) {
            // Plain stores: streaming (evict-first) ones measured the same on the H200.
            if (!EVEN_N || c < n_out) *reinterpret_cast<__nv_bfloat162*>(row + c) = v;
        } else {
            if (c < n_out) row[c] = __low2bfloat16(v);
            if (c + 1 < n_out) row[c + 1] = __high2bfloat16(v);
        }
    }
}

// GEMM2's output for route rt, by the compile-time switch ROUTE_ROWS: 0 adds the weighted row into
// its token's f32 row of y32 [num_routes / top_k, n_out]; 1 stores it as the route's own bf16 row of
// the buffer y32 then points at (bf16 [num_routes, n_out]; the kernel signature stays the same).
template <int N, bool EVEN_N>
__device__ __forceinline__ void gemm2_row(const float (&acc)[N / 2], const int half, const unsigned int t,
                                          const float scale, const float wt, float* __restrict__ y32,
                                          const unsigned int rt, const unsigned int top_k, const unsigned int c0,
                                          const unsigned int n_out) {
#if ROUTE_ROWS
    weighted_store_row<N, EVEN_N>(acc, half, t, scale, wt,
                                  reinterpret_cast<__nv_bfloat16*>(y32) + (unsigned long long)rt * n_out, c0, n_out);
#else
    weighted_add_row<N, EVEN_N>(acc, half, t, scale, wt, y32 + (unsigned long long)(rt / top_k) * n_out, c0, n_out);
#endif
}

#endif  // FMOE_COMMON_MOE_EPILOGUE_CUH
