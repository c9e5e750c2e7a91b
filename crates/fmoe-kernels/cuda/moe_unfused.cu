// moe_unfused: the glue kernels of the portable (unfused) CUDA MoE path, moe_gemm/cuda.rs's
// `portable`. The two GEMMs themselves are the fused family's grouped GEMM (moe_gemm_bf16.cu,
// MODE 2 with top_k = 1 and unit weights: a plain grouped GEMM into a zeroed f32 buffer), so the
// portable path is "the same GEMM engine, no fusion": every intermediate makes a round trip
// through device memory, and each step is its own launch.
//
//   fmoe_gather_rows  xr[r, :] = x[r / top_k, :]            (bf16, 16-byte chunks)
//   fmoe_silu_mul     h[r, j] = bf16(silu(gu[r, j]) * gu[r, N + j])   (f32 [R, 2N] -> bf16 [R, N])
//   fmoe_topk_reduce  y[t, c] = sum_j w[t, j] * o[t * top_k + j, c]   (f32, j ascending)
// and for the fp8 portable path (moe_gemm/cuda_fp8.rs), which gathers fp8 code rows with
// fmoe_gather_rows (K / 16 chunks of 16 bytes):
//   fmoe_gather_words xr[r, :] = x[r / top_k, :]            (32-bit words: f32 scale rows of any length)
//   fmoe_silu_mul_f32 h[r, j] = silu(gu[r, j]) * gu[r, N + j]        (f32 [R, 2N] -> f32 [R, N])
//
// One block walks rows (grid-stride over blockIdx.x), its threads walk the columns: no 64-bit
// divisions per element. silu is the fused epilogues' own (common/math.cuh).

#include <cuda_bf16.h>

#include "common/math.cuh"

extern "C" __global__ void fmoe_gather_rows(const uint4* __restrict__ x, uint4* __restrict__ xr,
                                            unsigned long long rows, unsigned int top_k,
                                            unsigned int chunks /* row length / 8 */) {
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const uint4* src = x + (r / top_k) * chunks;
        uint4* dst = xr + r * chunks;
        for (unsigned int c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = src[c];
    }
}

extern "C" __global__ void fmoe_silu_mul(const float* __restrict__ gu, __nv_bfloat16* __restrict__ h,
                                         unsigned long long rows, unsigned int n) {
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* g = gu + r * 2ull * n;
        __nv_bfloat16* out = h + r * (unsigned long long)n;
        for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) {
            const float gate = g[j], up = g[n + j];
            out[j] = __float2bfloat16(silu(gate) * up);
        }
    }
}

extern "C" __global__ void fmoe_topk_reduce(const float* __restrict__ o, const float* __restrict__ w,
                                            float* __restrict__ y, unsigned long long tokens,
                                            unsigned int top_k, unsigned int k) {
    for (unsigned long long t = blockIdx.x; t < tokens; t += gridDim.x) {
        const float* wt = w + t * top_k;
        const float* ot = o + t * top_k * (unsigned long long)k;
        float* yt = y + t * (unsigned long long)k;
        for (unsigned int c = threadIdx.x; c < k; c += blockDim.x) {
            float acc = 0.0f;
            for (unsigned int j = 0; j < top_k; ++j) acc += wt[j] * ot[j * (unsigned long long)k + c];
            yt[c] = acc;
        }
    }
}

extern "C" __global__ void fmoe_gather_words(const unsigned int* __restrict__ x, unsigned int* __restrict__ xr,
                                             unsigned long long rows, unsigned int top_k, unsigned int words) {
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned int* src = x + (r / top_k) * words;
        unsigned int* dst = xr + r * words;
        for (unsigned int c = threadIdx.x; c < words; c += blockDim.x) dst[c] = src[c];
    }
}

extern "C" __global__ void fmoe_silu_mul_f32(const float* __restrict__ gu, float* __restrict__ h,
                                             unsigned long long rows, unsigned int n) {
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* g = gu + r * 2ull * n;
        float* out = h + r * (unsigned long long)n;
        for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) {
            const float gate = g[j], up = g[n + j];
            out[j] = silu(gate) * up;
        }
    }
}
