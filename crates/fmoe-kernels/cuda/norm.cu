// norm: RMSNorm and fused residual add + RMSNorm (see src/norm/mod.rs), DT = the tensors' dtype
// (-D DT: 0 = f32, 1 = bf16, 2 = f16).
//
//   fmoe_rms_norm      y = DT(w * DT(x * inv)),             inv = 1 / sqrt(mean(x^2) + eps)
//   fmoe_add_rms_norm  r' = DT(r + x); y = rms_norm(r')     (r' written out too)
//
// One block per row (blocks stride over rows). Pass 1 reads the row (and writes r'), summing
// squares in f32 per thread, then across the block; pass 2 reads it again (an L1/L2 hit: 14 KiB
// for H = 7168 bf16) with w and writes y. With `vec` (H a whole number of 16-byte words, so every
// row is aligned) loads and stores are 16 bytes wide. Each thread revisits in pass 2 exactly the
// elements it wrote in pass 1, so reading r' back needs no barrier.

#include "common/elem.cuh"

typedef Elem<DT> E;

template <int N>
struct alignas(sizeof(E::T) * N) Pack {
    E::T v[N];
};

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    __syncthreads();  // part[] may still be read from the previous row
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < warps ? part[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One row, N elements per access.
template <int N, bool ADD>
__device__ __forceinline__ void norm_row(const E::T* __restrict__ r, const E::T* __restrict__ x,
                                         const E::T* __restrict__ w, E::T* __restrict__ r_out,
                                         E::T* __restrict__ y, unsigned int h, float eps) {
    typedef Pack<N> P;
    const unsigned int words = h / N;
    float acc = 0.0f;
    for (unsigned int c = threadIdx.x; c < words; c += blockDim.x) {
        P xv = reinterpret_cast<const P*>(x)[c];
        if (ADD) {
            const P rv = reinterpret_cast<const P*>(r)[c];
#pragma unroll
            for (int j = 0; j < N; ++j) xv.v[j] = E::store(E::load(rv.v[j]) + E::load(xv.v[j]));
            reinterpret_cast<P*>(r_out)[c] = xv;
        }
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float v = E::load(xv.v[j]);
            acc += v * v;
        }
    }
    const float inv = 1.0f / sqrtf(block_sum(acc) / (float)h + eps);
    const E::T* src = ADD ? r_out : x;
    for (unsigned int c = threadIdx.x; c < words; c += blockDim.x) {
        const P xv = reinterpret_cast<const P*>(src)[c];
        const P wv = reinterpret_cast<const P*>(w)[c];
        P yv;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const float n = E::load(E::store(E::load(xv.v[j]) * inv));
            yv.v[j] = E::store(E::load(wv.v[j]) * n);
        }
        reinterpret_cast<P*>(y)[c] = yv;
    }
}

template <bool ADD>
__device__ __forceinline__ void norm_rows(const E::T* r, const E::T* x, const E::T* w, E::T* r_out,
                                          E::T* y, unsigned long long rows, unsigned int h,
                                          float eps, unsigned int vec) {
    constexpr int N = 16 / sizeof(E::T);
    for (unsigned long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const unsigned long long o = row * h;
        if (vec) {
            norm_row<N, ADD>(r + o, x + o, w, r_out + o, y + o, h, eps);
        } else {
            norm_row<1, ADD>(r + o, x + o, w, r_out + o, y + o, h, eps);
        }
    }
}

extern "C" __global__ void fmoe_rms_norm(const E::T* __restrict__ x, const E::T* __restrict__ w,
                                         E::T* __restrict__ y, unsigned long long rows,
                                         unsigned int h, float eps, unsigned int vec) {
    norm_rows<false>(x, x, w, y, y, rows, h, eps, vec);
}

extern "C" __global__ void fmoe_add_rms_norm(const E::T* __restrict__ r, const E::T* __restrict__ x,
                                             const E::T* __restrict__ w, E::T* __restrict__ r_out,
                                             E::T* __restrict__ y, unsigned long long rows,
                                             unsigned int h, float eps, unsigned int vec) {
    norm_rows<true>(r, x, w, r_out, y, rows, h, eps, vec);
}
