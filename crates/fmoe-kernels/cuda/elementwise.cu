// elementwise: the small device kernels around the MoE GEMMs (see src/elementwise/mod.rs), each
// the twin of a few lines of CPU code:
//   fmoe_cast        dst = DST(src) through f32, round to nearest even (SRC_DT -> DST_DT)
//   fmoe_add         out = DT(f32(a) + f32(b))                              (DT)
//   fmoe_randn       out[i] = DT(scale * normal(seed, i)), a counter-based normal (DT)
//   fmoe_sum_bf16    *out += sum of x (f32 accumulation; *out zeroed by the caller)
//   fmoe_silu_mul    y[r, c] = DT(silu(x[r, c]) * x[r, I + c]) for x [rows, 2I]   (DT)
//   fmoe_zero_words  out[i] = 0 for n u32 words (-D PDL=1 only): a memset as a kernel, so the MoE
//                    chain's launches stay adjacent under Programmatic Dependent Launch (common/pdl.cuh)
//   fmoe_rand_uniform[_e4m3]  out[i] = DT(offset + scale * uniform(seed, i))   (DT, or e4m3)
//
// Dtype codes (-D SRC_DT / DST_DT / DT): 0 = f32, 1 = bf16, 2 = f16. All kernels are grid-stride
// loops over 64-bit indices: any grid size covers any length.
//
// randn: h = mix64(i ^ mix64(seed)) (splitmix64's finalizer); u1 = (h >> 40) + 1 over 2^24, in
// (0, 1]; u2 = bits 16..39 of h over 2^24, in [0, 1); normal = sqrt(-2 ln u1) cos(2 pi u2) in f32
// (Box-Muller, one value per index). The CPU twin computes the same expression with Rust's f32
// ln/cos/sqrt; the two agree to a few f32 ulps.
//
// uniform (the dummy weights' generator): z = finalizer(seed ^ i * 0x9e3779b97f4a7c15) (splitmix64's
// finalizer without its increment), u = (z >> 40) / 2^23 - 1 in [-1, 1), exact in f32; then
// offset + scale * u with IEEE multiply and add, not contracted into an fma, so every device and
// the CPU twin give the same f32, and the same codes after the round-to-nearest-even store.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/elem.cuh"
#include "common/fp8.cuh"
#include "common/math.cuh"
#include "common/pdl.cuh"

#define GRID_STRIDE(i, n)                                                                     \
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; \
         i < (n); i += (unsigned long long)gridDim.x * blockDim.x)

#if defined(SRC_DT) && defined(DST_DT)
extern "C" __global__ void fmoe_cast(const typename Elem<SRC_DT>::T* __restrict__ src,
                                     typename Elem<DST_DT>::T* __restrict__ dst,
                                     unsigned long long n) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    src = fmoe_pdl_fresh(src);
    dst = fmoe_pdl_fresh(dst);
#endif
    GRID_STRIDE(i, n) dst[i] = Elem<DST_DT>::store(Elem<SRC_DT>::load(src[i]));
}
#endif

#if PDL
extern "C" __global__ void fmoe_zero_words(unsigned int* __restrict__ out, unsigned long long n) {
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    out = fmoe_pdl_fresh(out);
    GRID_STRIDE(i, n) out[i] = 0u;
}
#endif

__device__ __forceinline__ float uniform_at(unsigned long long seed, unsigned long long i, float scale,
                                            float offset) {
    unsigned long long z = seed ^ (i * 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = (float)(z >> 40) * 1.1920928955078125e-7f - 1.0f;  // 2^-23
    return __fadd_rn(offset, __fmul_rn(scale, u));
}

extern "C" __global__ void fmoe_rand_uniform_e4m3(unsigned char* __restrict__ out,
                                                  unsigned long long n, unsigned long long seed,
                                                  float scale, float offset) {
    GRID_STRIDE(i, n) out[i] = (unsigned char)(e4m3x2(uniform_at(seed, i, scale, offset), 0.0f) & 0xffu);
}

#ifdef DT
typedef Elem<DT> E;

extern "C" __global__ void fmoe_rand_uniform(E::T* __restrict__ out, unsigned long long n,
                                             unsigned long long seed, float scale, float offset) {
    GRID_STRIDE(i, n) out[i] = E::store(uniform_at(seed, i, scale, offset));
}

extern "C" __global__ void fmoe_add(const E::T* __restrict__ a, const E::T* __restrict__ b,
                                    E::T* __restrict__ out, unsigned long long n) {
    GRID_STRIDE(i, n) out[i] = E::store(E::load(a[i]) + E::load(b[i]));
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

extern "C" __global__ void fmoe_randn(E::T* __restrict__ out, unsigned long long n,
                                      unsigned long long seed, float scale) {
    const unsigned long long s = mix64(seed);
    GRID_STRIDE(i, n) {
        const unsigned long long h = mix64(i ^ s);
        const float u1 = (float)((h >> 40) + 1ull) * 5.9604644775390625e-8f;  // 2^-24
        const float u2 = (float)((h >> 16) & 0xffffffull) * 5.9604644775390625e-8f;
        const float z = sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
        out[i] = E::store(scale * z);
    }
}

// One 16-byte word of DT elements.
struct alignas(16) Vec16 {
    E::T v[16 / sizeof(E::T)];
};

// Blocks stride over rows, threads over columns; with `vec` (I and so every row half a multiple of
// 16 bytes, the allocation 256-byte aligned) 16-byte loads and stores.
extern "C" __global__ void fmoe_silu_mul(const E::T* __restrict__ x, E::T* __restrict__ y,
                                         unsigned long long rows, unsigned long long inner,
                                         unsigned int vec) {
    constexpr int N = 16 / sizeof(E::T);
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const E::T* g = x + r * 2 * inner;
        const E::T* u = g + inner;
        E::T* o = y + r * inner;
        if (vec) {
            for (unsigned long long c = threadIdx.x; c < inner / N; c += blockDim.x) {
                const Vec16 gv = reinterpret_cast<const Vec16*>(g)[c];
                const Vec16 uv = reinterpret_cast<const Vec16*>(u)[c];
                Vec16 ov;
#pragma unroll
                for (int j = 0; j < N; ++j) ov.v[j] = E::store(silu(E::load(gv.v[j])) * E::load(uv.v[j]));
                reinterpret_cast<Vec16*>(o)[c] = ov;
            }
        } else {
            for (unsigned long long c = threadIdx.x; c < inner; c += blockDim.x) {
                o[c] = E::store(silu(E::load(g[c])) * E::load(u[c]));
            }
        }
    }
}
#endif

// A read-only pass over x (the read-bandwidth ceiling of the benchmark): 16-byte loads for the
// aligned bulk, scalar loads for the tail, a warp-shuffle reduction, one atomic per warp.
extern "C" __global__ void fmoe_sum_bf16(const __nv_bfloat16* __restrict__ x, unsigned long long n,
                                         float* __restrict__ out) {
    float acc = 0.0f;
    const unsigned long long chunks = n / 8;
    const uint4* v = reinterpret_cast<const uint4*>(x);
    GRID_STRIDE(c, chunks) {
        const uint4 q = v[c];
        const unsigned int w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc += __uint_as_float(w[j] << 16) + __uint_as_float(w[j] & 0xffff0000u);
        }
    }
    GRID_STRIDE(i, n - chunks * 8) acc += __bfloat162float(x[chunks * 8 + i]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);
}
