// Global-memory reductions used by the GEMM2 epilogues, which sum the top-k experts' outputs of a
// token (and split-K partial sums) into one f32 row.

#ifndef FMOE_COMMON_ATOMICS_CUH
#define FMOE_COMMON_ATOMICS_CUH

// y[0..1] += (a, b): one vector reduction (sm_90) instead of two atomicAdd; y must be 8-byte
// aligned. A reduction returns nothing, so the thread does not wait for the old value.
__device__ __forceinline__ void red_add_v2(float* y, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(y), "f"(a), "f"(b) : "memory");
}

#endif  // FMOE_COMMON_ATOMICS_CUH
