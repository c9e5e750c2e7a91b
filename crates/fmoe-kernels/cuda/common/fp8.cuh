// fp8 (OCP e4m3fn) encoding, shared by the quantization kernels (quant_fp8.cu) and the GEMM
// epilogue that requantizes h (moe_gemm_fp8_block_sm90.cu): both must produce the codes and scales
// of quant_fp8/cpu.rs bit for bit, so they share one definition of each step.

#ifndef FMOE_COMMON_FP8_CUH
#define FMOE_COMMON_FP8_CUH

#define FP8_MAX 448.0f      // largest finite e4m3fn
#define AMAX_FLOOR 1e-10f   // keeps the scale of an all-zero group finite and non-zero

// The dequantization scale of a group with max |x| = amax: max(amax, 1e-10) / 448, IEEE division
// (not the fast reciprocal), as the CPU twin computes it.
__device__ __forceinline__ float scale_from_amax(float amax) { return __fdiv_rn(fmaxf(amax, AMAX_FLOOR), FP8_MAX); }

// Two f32 -> two e4m3 codes (lo in the low byte): round to nearest even, saturate to ±448, NaN -> NaN.
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

#endif  // FMOE_COMMON_FP8_CUH
