// Element access by dtype code (0 = f32, 1 = bf16, 2 = f16): load widens to f32, store rounds to
// nearest even. Shared by the kernels compiled per dtype with -D DT (elementwise, norm, rotary).

#ifndef FMOE_COMMON_ELEM_CUH
#define FMOE_COMMON_ELEM_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <int D>
struct Elem;
template <>
struct Elem<0> {
    typedef float T;
    static __device__ __forceinline__ float load(T v) { return v; }
    static __device__ __forceinline__ T store(float v) { return v; }
};
template <>
struct Elem<1> {
    typedef __nv_bfloat16 T;
    static __device__ __forceinline__ float load(T v) { return __bfloat162float(v); }
    static __device__ __forceinline__ T store(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Elem<2> {
    typedef __half T;
    static __device__ __forceinline__ float load(T v) { return __half2float(v); }
    static __device__ __forceinline__ T store(float v) { return __float2half_rn(v); }
};

#endif  // FMOE_COMMON_ELEM_CUH
