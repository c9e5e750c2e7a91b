// Programmatic Dependent Launch (Hopper). A kernel launched with the attribute
// PROGRAMMATIC_STREAM_SERIALIZATION (src/launch.rs, PdlLaunch; FMOE_DEV_PDL) may start while the
// previous kernel of the stream still runs. Every kernel PdlLaunch launches calls fmoe_pdl_enter()
// first, before any access to global memory: it waits for the previous kernel to complete and
// flush (griddepcontrol.wait; that kernel waited for its own predecessor the same way, so every
// earlier op is complete too), then lets the next kernel launch (launch_dependents), which only
// makes it resident early: it waits in turn. The asm is volatile with a "memory" clobber so no load
// or store, .nc ones of __restrict__ inputs included, is moved above it. Without the attribute, or
// below sm_90, both are no-ops.

#ifndef FMOE_COMMON_PDL_CUH
#define FMOE_COMMON_PDL_CUH

__device__ __forceinline__ void fmoe_pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// `p` re-derived through an opaque asm after fmoe_pdl_enter(): a load through it can be neither an
// ld.global.nc of a `const __restrict__` parameter (which ptxas takes as constant for the kernel
// and may schedule before griddepcontrol.wait, racing with the previous kernel) nor moved above
// this point. Every PDL kernel passes each pointer parameter through it right after the wait.
template <typename T>
__device__ __forceinline__ T* fmoe_pdl_fresh(T* p) {
    unsigned long long u = reinterpret_cast<unsigned long long>(p);
    asm volatile("mov.b64 %0, %0;\n" : "+l"(u) : : "memory");
    return reinterpret_cast<T*>(u);
}

#endif  // FMOE_COMMON_PDL_CUH
