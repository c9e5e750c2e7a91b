// Small numeric helpers that several kernels must compute identically: the fused GEMM epilogues
// and the portable path's glue kernels give the same h only if they evaluate the same expression.

#ifndef FMOE_COMMON_MATH_CUH
#define FMOE_COMMON_MATH_CUH

// SiLU, x * sigmoid(x), as x / (1 + e^-x) with the fast __expf and the fast division (each a few
// ulps off; far below bf16's rounding). The IEEE division's Newton steps and slow-path branch were
// most of the GEMM1 epilogue's instructions, which the MMA warps run while the tensor cores idle.
// e^-x = inf (x < -88) divides to -0, as IEEE does. e^-x is __expf's ex2.approx with denormal
// results flushed (x > 87, where 1 + e^-x rounds to 1 either way): the same values without
// __expf's denormal fix-up around the MUFU.
__device__ __forceinline__ float silu(float x) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
    return __fdividef(x, 1.0f + e);
}

// Max over the 32 lanes of a warp (every lane gets it); all lanes must be active. Non-negative
// floats compare as their bits, so the amax reductions pass |x| bits through this.
__device__ __forceinline__ unsigned int warp_max(unsigned int m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

#endif  // FMOE_COMMON_MATH_CUH
