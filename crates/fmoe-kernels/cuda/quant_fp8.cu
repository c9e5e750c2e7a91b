// quant_fp8: dynamic fp8 (OCP e4m3fn) quantization of activations on the GPU, the CUDA twin of
// quant_fp8/cpu.rs with the same arithmetic, so that codes and scales agree bit for bit:
//   scale = max(amax, 1e-10) / 448 (IEEE f32 division), q = sat_rne(x / scale) (IEEE division,
//   then one RNE rounding to e4m3 with finite saturation: cvt.rn.satfinite.e4m3x2.f32).
// A NaN or ±Inf in the data makes the dynamic scale meaningless: the CPU twin returns an error, these
// kernels set *error_flag = 1 (outputs are still written for every element) for the caller to check.
//
// Input element type: bf16 by default, f32 with -DQUANT_IN_F32=1. Pointers must be 16-byte aligned.
//
// Kernels (all launch with any 1-D grid; block sizes below are what they are written for):
//   fmoe_fp8_amax          grid-stride |x| max into *amax_bits (u32 bits of a non-negative float,
//                          so unsigned order is float order; NaN/Inf bits compare above every finite
//                          value). *amax_bits must be zeroed before. Block 256 threads (any multiple
//                          of 32 up to 1024).
//   fmoe_fp8_quant_tensor  q = sat_rne(x / s), s = max(amax, 1e-10) / 448 from *amax_bits; writes
//                          s to scale_out[0]; flags a non-finite amax. Block 256, grid-stride.
//   fmoe_fp8_quant_tensor_static  q = sat_rne(x / s) with a given scale *scale (a static
//                          checkpoint's input_scale): the cast of fmoe_fp8_quant_tensor without the
//                          amax; flags any non-finite element. Block 256, grid-stride.
//   fmoe_fp8_quant_group   per-token-group 1 x 128 along the last dim: x [rows, k] ->
//                          q [rows, k], scales f32 [rows, ceil(k / 128)]; one warp per group
//                          (a ragged last group uses the amax of its own columns). Block 256
//                          (8 groups), grid ceil(rows * ceil(k/128) / 8).
//   fmoe_fp8_quant_block   dynamic 128 x 128 block quantization of a stack of row-major matrices
//                          (weights, DeepSeek-V3's weight_scale_inv layout): x [mats, rows, cols] ->
//                          q [mats, rows, cols], scale_inv f32 [mats, ceil(rows/128), ceil(cols/128)]; a
//                          ragged edge block uses the amax of the elements it covers. One block of 256
//                          threads per 128 x 128 block, grid (ceil(cols/128), ceil(rows/128), mats); each
//                          warp walks rows, its lanes the columns. Flags a non-finite block amax.
//   fmoe_fp8_quant_tensor_small  both steps in one block of 1024 threads for a small x (decode
//                          batches: the two launches and the zeroing of amax cost more than the
//                          work); writes ctrl = {amax bits, error flag} itself. Grid 1.
// Per-tensor quantization of a large x is two launches (amax, then cast) because the scale needs a
// grid-wide reduction first; the GEMM1 epilogue of moe_gemm_fp8_sm90.cu produces the amax of h
// itself, so only the cast pass remains for the GEMM2 operand.

#include <cuda_bf16.h>

#include "common/fp8.cuh"
#include "common/math.cuh"
#include "common/pdl.cuh"

#if QUANT_IN_F32
typedef float in_t;
__device__ __forceinline__ float to_f32(float v) { return v; }
#define VEC 4  // elements per 16-byte load
#else
typedef __nv_bfloat16 in_t;
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
#define VEC 8
#endif

#define NONFINITE_BITS 0x7F800000u

__device__ __forceinline__ unsigned int abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }

// Loads VEC consecutive elements (16 bytes) as f32.
__device__ __forceinline__ void load_vec(const in_t* p, float* v) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
#if QUANT_IN_F32
    v[0] = __uint_as_float(u.x); v[1] = __uint_as_float(u.y); v[2] = __uint_as_float(u.z); v[3] = __uint_as_float(u.w);
#else
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
#endif
}

// max |x| bits over the elements this thread visits (VEC-wide chunks from `first`, step `stride`,
// then the ragged tail one by one).
__device__ __forceinline__ unsigned int amax_range(const in_t* __restrict__ x, unsigned long long n,
                                                   unsigned long long first, unsigned long long stride) {
    unsigned int m = 0;
    const unsigned long long nv = n / VEC;
    for (unsigned long long i = first; i < nv; i += stride) {
        float v[VEC];
        load_vec(x + i * VEC, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) m = max(m, abs_bits(v[j]));
    }
    for (unsigned long long i = nv * VEC + first; i < n; i += stride) m = max(m, abs_bits(to_f32(x[i])));
    return m;
}

// The block's max of m, valid in thread 0 (red: 32 shared words).
__device__ __forceinline__ unsigned int block_max(unsigned int m, unsigned int* red) {
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0u;
        m = warp_max(m);
    }
    return m;
}

// q = sat_rne(x / s) over the elements this thread visits (as amax_range).
__device__ __forceinline__ void cast_range(const in_t* __restrict__ x, unsigned long long n, float s,
                                           unsigned char* __restrict__ q, unsigned long long first,
                                           unsigned long long stride) {
    const unsigned long long nv = n / VEC;
    for (unsigned long long i = first; i < nv; i += stride) {
        float v[VEC];
        load_vec(x + i * VEC, v);
        unsigned int w[VEC / 4];
#pragma unroll
        for (int j = 0; j < VEC / 4; ++j)
            w[j] = (unsigned int)e4m3x2(__fdiv_rn(v[4 * j], s), __fdiv_rn(v[4 * j + 1], s)) |
                   ((unsigned int)e4m3x2(__fdiv_rn(v[4 * j + 2], s), __fdiv_rn(v[4 * j + 3], s)) << 16);
#if VEC == 8
        *reinterpret_cast<uint2*>(q + i * VEC) = make_uint2(w[0], w[1]);
#else
        *reinterpret_cast<unsigned int*>(q + i * VEC) = w[0];
#endif
    }
    for (unsigned long long i = nv * VEC + first; i < n; i += stride)
        q[i] = (unsigned char)(e4m3x2(__fdiv_rn(to_f32(x[i]), s), 0.0f) & 0xFF);
}

extern "C" __global__ void fmoe_fp8_amax(const in_t* __restrict__ x, unsigned long long n,
                                         unsigned int* __restrict__ amax_bits) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    x = fmoe_pdl_fresh(x);
    amax_bits = fmoe_pdl_fresh(amax_bits);
#endif
    __shared__ unsigned int red[32];
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned int m = block_max(amax_range(x, n, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x, stride), red);
    if (threadIdx.x == 0 && m != 0) atomicMax(amax_bits, m);
}

extern "C" __global__ void fmoe_fp8_quant_tensor(const in_t* __restrict__ x, unsigned long long n,
                                                 const unsigned int* __restrict__ amax_bits,
                                                 unsigned char* __restrict__ q, float* __restrict__ scale_out,
                                                 unsigned int* __restrict__ error_flag) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    x = fmoe_pdl_fresh(x);
    amax_bits = fmoe_pdl_fresh(amax_bits);
    q = fmoe_pdl_fresh(q);
    scale_out = fmoe_pdl_fresh(scale_out);
    error_flag = fmoe_pdl_fresh(error_flag);
#endif
    const unsigned int ab = *amax_bits;
    const float s = scale_from_amax(__uint_as_float(ab));
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        scale_out[0] = s;
        if (ab >= NONFINITE_BITS) atomicExch(error_flag, 1u);
    }
    cast_range(x, n, s, q, (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x,
               (unsigned long long)gridDim.x * blockDim.x);
}

extern "C" __global__ void __launch_bounds__(1024)
fmoe_fp8_quant_tensor_small(const in_t* __restrict__ x, unsigned long long n, unsigned int* __restrict__ ctrl,
                            unsigned char* __restrict__ q, float* __restrict__ scale_out) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    x = fmoe_pdl_fresh(x);
    ctrl = fmoe_pdl_fresh(ctrl);
    q = fmoe_pdl_fresh(q);
    scale_out = fmoe_pdl_fresh(scale_out);
#endif
    __shared__ unsigned int red[32];
    __shared__ unsigned int total;
    const unsigned int m = block_max(amax_range(x, n, threadIdx.x, blockDim.x), red);
    if (threadIdx.x == 0) total = m;
    __syncthreads();
    const unsigned int ab = total;
    const float s = scale_from_amax(__uint_as_float(ab));
    if (threadIdx.x == 0) {
        scale_out[0] = s;
        ctrl[0] = ab;
        ctrl[1] = ab >= NONFINITE_BITS ? 1u : 0u;
    }
    cast_range(x, n, s, q, threadIdx.x, blockDim.x);
}

extern "C" __global__ void fmoe_fp8_quant_tensor_static(const in_t* __restrict__ x, unsigned long long n,
                                                        const float* __restrict__ scale,
                                                        unsigned char* __restrict__ q,
                                                        unsigned int* __restrict__ error_flag) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    x = fmoe_pdl_fresh(x);
    scale = fmoe_pdl_fresh(scale);
    q = fmoe_pdl_fresh(q);
    error_flag = fmoe_pdl_fresh(error_flag);
#endif
    const float s = *scale;
    // No amax to carry a NaN/Inf: each thread checks what it reads (the CPU twin's error).
    unsigned int bad = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long nv = n / VEC;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < nv; i += stride) {
        float v[VEC];
        load_vec(x + i * VEC, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) bad |= abs_bits(v[j]) >= NONFINITE_BITS;
        unsigned int w[VEC / 4];
#pragma unroll
        for (int j = 0; j < VEC / 4; ++j)
            w[j] = (unsigned int)e4m3x2(__fdiv_rn(v[4 * j], s), __fdiv_rn(v[4 * j + 1], s)) |
                   ((unsigned int)e4m3x2(__fdiv_rn(v[4 * j + 2], s), __fdiv_rn(v[4 * j + 3], s)) << 16);
#if VEC == 8
        *reinterpret_cast<uint2*>(q + i * VEC) = make_uint2(w[0], w[1]);
#else
        *reinterpret_cast<unsigned int*>(q + i * VEC) = w[0];
#endif
    }
    for (unsigned long long i = nv * VEC + (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = to_f32(x[i]);
        bad |= abs_bits(v) >= NONFINITE_BITS;
        q[i] = (unsigned char)(e4m3x2(__fdiv_rn(v, s), 0.0f) & 0xFF);
    }
    if (bad) atomicExch(error_flag, 1u);
}

extern "C" __global__ void fmoe_fp8_quant_group(const in_t* __restrict__ x, unsigned int rows, unsigned int k,
                                                unsigned char* __restrict__ q, float* __restrict__ scales,
                                                unsigned int* __restrict__ error_flag) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    x = fmoe_pdl_fresh(x);
    q = fmoe_pdl_fresh(q);
    scales = fmoe_pdl_fresh(scales);
    error_flag = fmoe_pdl_fresh(error_flag);
#endif
    const unsigned int lane = threadIdx.x & 31;
    const unsigned int groups = (k + 127) / 128;
    const unsigned long long gid = (unsigned long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (gid >= (unsigned long long)rows * groups) return;
    const unsigned int row = (unsigned int)(gid / groups), grp = (unsigned int)(gid % groups);
    const unsigned long long base = (unsigned long long)row * k + grp * 128u;
    const unsigned int cnt = min(128u, k - grp * 128u);
    float v[4];
    unsigned int m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int c = lane + 32 * i;
        v[i] = c < cnt ? to_f32(x[base + c]) : 0.0f;
        m = max(m, abs_bits(v[i]));
    }
    m = warp_max(m);
    const float s = scale_from_amax(__uint_as_float(m));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int c = lane + 32 * i;
        if (c < cnt) q[base + c] = (unsigned char)(e4m3x2(__fdiv_rn(v[i], s), 0.0f) & 0xFF);
    }
    if (lane == 0) {
        scales[(unsigned long long)row * groups + grp] = s;
        if (m >= NONFINITE_BITS) atomicExch(error_flag, 1u);
    }
}

extern "C" __global__ void fmoe_fp8_quant_block(const in_t* __restrict__ x, unsigned int rows, unsigned int cols,
                                                unsigned char* __restrict__ q, float* __restrict__ scale_inv,
                                                unsigned int* __restrict__ error_flag) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    x = fmoe_pdl_fresh(x);
    q = fmoe_pdl_fresh(q);
    scale_inv = fmoe_pdl_fresh(scale_inv);
    error_flag = fmoe_pdl_fresh(error_flag);
#endif
    __shared__ unsigned int red[32];
    __shared__ float block_scale;
    const unsigned int r0 = blockIdx.y * 128u, c0 = blockIdx.x * 128u;
    const unsigned int nr = min(128u, rows - r0), nc = min(128u, cols - c0);
    const unsigned long long base = (unsigned long long)blockIdx.z * rows * cols + (unsigned long long)r0 * cols + c0;
    const unsigned int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    unsigned int m = 0;
    for (unsigned int r = threadIdx.x >> 5; r < nr; r += warps) {
        const in_t* xr = x + base + (unsigned long long)r * cols;
        for (unsigned int c = lane; c < nc; c += 32) m = max(m, abs_bits(to_f32(xr[c])));
    }
    m = warp_max(m);
    if (lane == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < warps ? red[threadIdx.x] : 0u;
        m = warp_max(m);
        if (threadIdx.x == 0) {
            const float s = scale_from_amax(__uint_as_float(m));
            block_scale = s;
            scale_inv[((unsigned long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = s;
            if (m >= NONFINITE_BITS) atomicExch(error_flag, 1u);
        }
    }
    __syncthreads();
    const float s = block_scale;
    for (unsigned int r = threadIdx.x >> 5; r < nr; r += warps) {
        const in_t* xr = x + base + (unsigned long long)r * cols;
        unsigned char* qr = q + base + (unsigned long long)r * cols;
        for (unsigned int c = lane; c < nc; c += 32) qr[c] = (unsigned char)(e4m3x2(__fdiv_rn(to_f32(xr[c]), s), 0.0f) & 0xFF);
    }
}
