// Pieces shared by the routing kernels (topk_softmax.cu, grouped_topk.cu): the logits' storage
// type, the finiteness test, the selection order and a warp-wide arg-best under that order. Both
// kernels must select exactly as their CPU twins (crates/fmoe-kernels/src/routing/cpu.rs), so the
// order is defined once.
//
// Needs FMOE_LOGITS_DTYPE (-D): 0 = f32, 1 = bf16, 2 = f16 (converted to f32 exactly on load).

#ifndef FMOE_COMMON_ROUTING_CUH
#define FMOE_COMMON_ROUTING_CUH

#if !defined(FMOE_LOGITS_DTYPE)
#error "FMOE_LOGITS_DTYPE must be defined"
#endif

#if FMOE_LOGITS_DTYPE == 0
typedef float logit_t;
__device__ __forceinline__ float load_logit(const logit_t* p) { return *p; }
#elif FMOE_LOGITS_DTYPE == 1
typedef unsigned short logit_t;
// bf16 is the top half of an f32.
__device__ __forceinline__ float load_logit(const logit_t* p) {
    return __uint_as_float(((unsigned int)*p) << 16);
}
#elif FMOE_LOGITS_DTYPE == 2
typedef unsigned short logit_t;
__device__ __forceinline__ float load_logit(const logit_t* p) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
    return f;
}
#else
#error "FMOE_LOGITS_DTYPE must be 0 (f32), 1 (bf16) or 2 (f16)"
#endif

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

__device__ __forceinline__ bool is_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// The selection order: a ranks before b (higher value first, then lower index). Total on
// non-NaN values with distinct indices; -0.0 == +0.0, so they tie on the index.
__device__ __forceinline__ bool ranks_before(float av, unsigned int ai, float bv, unsigned int bi) {
    return av > bv || (av == bv && ai < bi);
}

// Each lane brings its best (value, index) candidate (index 0xffffffff = none); every lane leaves
// with the warp's best. The order is total, so the butterfly agrees in all lanes.
__device__ __forceinline__ void warp_arg_best(float& bv, unsigned int& bi) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, bv, off);
        const unsigned int oi = __shfl_xor_sync(FULL_MASK, bi, off);
        if (ranks_before(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

#endif  // FMOE_COMMON_ROUTING_CUH
