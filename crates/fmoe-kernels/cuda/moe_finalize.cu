// moe_finalize: the top-k sum of the fused GEMM2's per-route rows (moe_gemm/cuda.rs
// `sum_route_rows`; the CPU twin is moe_gemm/cpu.rs `sum_route_rows`, same order):
//
//   y[t, c] = out(sum_{j = 0 .. top_k-1, ids[t, j] < num_experts} f32(rows[t * top_k + j, c]))
//
// rows: bf16 [M * top_k, K], each route's routing-weighted GEMM2 row (plain stores by GEMM2's
// ROUTE_ROWS epilogue); the j order is fixed, so y is deterministic. A route whose expert id is out
// of range was dropped by moe_align (its row was never written) and adds nothing, as in the y32 path.
// out: bf16 (OUT_F32=0) or f32 (OUT_F32=1), rounded once. Each thread takes one 16-byte chunk (8
// columns) of a token, grid-stride; K % 8 == 0 (checked by the host).

#include <cuda_bf16.h>
#include "common/pdl.cuh"

#ifndef OUT_F32
#define OUT_F32 0
#endif

extern "C" __global__ void fmoe_moe_finalize(const uint4* __restrict__ rows, const unsigned int* __restrict__ ids,
#if OUT_F32
                                             float4* __restrict__ y,
#else
                                             uint4* __restrict__ y,
#endif
                                             unsigned long long chunks, unsigned int top_k, unsigned int k8,
                                             unsigned int num_experts) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    rows = fmoe_pdl_fresh(rows);
    ids = fmoe_pdl_fresh(ids);
    y = fmoe_pdl_fresh(y);
#endif
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < chunks;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long t = i / k8;
        const unsigned int ch = (unsigned int)(i - t * k8);
        float acc[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
        for (unsigned int j = 0; j < top_k; ++j) {
            const unsigned long long r = t * top_k + j;
            if (ids[r] >= num_experts) continue;
            const uint4 v = __ldcs(rows + r * k8 + ch);  // read once: streaming
            const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float2 f = __bfloat1622float2(p[q]);
                acc[2 * q] += f.x;
                acc[2 * q + 1] += f.y;
            }
        }
#if OUT_F32
        y[2 * i] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        y[2 * i + 1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
#else
        uint4 o;
        __nv_bfloat162* po = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int q = 0; q < 4; ++q) po[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
        y[i] = o;
#endif
    }
}
