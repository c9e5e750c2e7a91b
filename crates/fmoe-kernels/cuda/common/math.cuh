// Small numeric helpers that several kernels must compute identically: the fused GEMM epilogues
// and the portable path's glue kernels give the same h only if they evaluate the same expression.

#ifndef FMOE_COMMON_MATH_CUH
#define FMOE_COMMON_MATH_CUH

// SiLU, x * sigmoid(x), as x / (1 + e^-x) with the fast __expf (a few ulps off expf).
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// Max over the 32 lanes of a warp (every lane gets it); all lanes must be active. Non-negative
// floats compare as their bits, so the amax reductions pass |x| bits through this.
__device__ __forceinline__ unsigned int warp_max(unsigned int m) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
}

#endif  // FMOE_COMMON_MATH_CUH
