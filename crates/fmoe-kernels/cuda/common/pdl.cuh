// Programmatic Dependent Launch (Hopper), a compile-time variant. A kernel launched with the
// attribute PROGRAMMATIC_STREAM_SERIALIZATION (src/launch.rs, PdlLaunch) may start while the
// previous kernel of the stream still runs. The host launches with it only the MoE chain of small
// batches (launch::PdlChain) and compiles exactly those launches with -D PDL=1; every other launch
// uses the PDL=0 build, whose code is the same as without this header (the chain's kernels do not
// pay for the wait or the laundering below where PDL measured no gain).
//
// Under PDL=1 each chain kernel calls fmoe_pdl_enter() before touching any data an earlier kernel
// may write: it waits for the previous kernel to complete and flush (griddepcontrol.wait; that
// kernel waited for its own predecessor the same way, so every earlier op is complete too), then
// lets the next kernel launch (launch_dependents), which only makes it resident early: it waits in
// turn. The asm is volatile with a "memory" clobber so the compiler moves no load or store above it.

#ifndef FMOE_COMMON_PDL_CUH
#define FMOE_COMMON_PDL_CUH

#ifndef PDL
#define PDL 0
#endif

__device__ __forceinline__ void fmoe_pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// `p` re-derived through an opaque asm after fmoe_pdl_enter(): a load through it can be neither an
// ld.global.nc of a `const __restrict__` parameter (which ptxas takes as constant for the kernel
// and may schedule before griddepcontrol.wait, racing with the previous kernel) nor moved above
// this point. Laundered: only pointers to what an earlier kernel of the chain (or routing before
// it) writes or what this kernel writes: activations, routes and their weights, activation
// scales, h, y, flags, tile counters. Not the weights and weight scales (and their tensor maps):
// nothing on the stream writes them after load, so a load of them hoisted above the wait reads
// the same bytes, they keep the read-only path, and a kernel may even prefetch them before it.
template <typename T>
__device__ __forceinline__ T* fmoe_pdl_fresh(T* p) {
    unsigned long long u = reinterpret_cast<unsigned long long>(p);
    asm volatile("mov.b64 %0, %0;\n" : "+l"(u) : : "memory");
    return reinterpret_cast<T*>(u);
}

// The grouped GEMMs' entry under PDL, one per contract (the kernels of a contract share its
// parameter names): the wait, then every pointer of the contract that the chain writes. A kernel
// with more (the persistent ones' tile counter) launders those after it.
#define FMOE_PDL_ENTER_GEMM_BF16()                      \
    fmoe_pdl_enter();                                   \
    a = fmoe_pdl_fresh(a);                              \
    sorted_routes = fmoe_pdl_fresh(sorted_routes);      \
    block_experts = fmoe_pdl_fresh(block_experts);      \
    total = fmoe_pdl_fresh(total);                      \
    topk_weights = fmoe_pdl_fresh(topk_weights);        \
    h_out = fmoe_pdl_fresh(h_out);                      \
    y32 = fmoe_pdl_fresh(y32)
#define FMOE_PDL_ENTER_GEMM_FP8()                       \
    fmoe_pdl_enter();                                   \
    a = fmoe_pdl_fresh(a);                              \
    sorted_routes = fmoe_pdl_fresh(sorted_routes);      \
    block_experts = fmoe_pdl_fresh(block_experts);      \
    total = fmoe_pdl_fresh(total);                      \
    topk_weights = fmoe_pdl_fresh(topk_weights);        \
    a_scale = fmoe_pdl_fresh(a_scale);                  \
    h_out = fmoe_pdl_fresh(h_out);                      \
    h_amax = fmoe_pdl_fresh(h_amax);                    \
    y32 = fmoe_pdl_fresh(y32)
#define FMOE_PDL_ENTER_GEMM_FP8_BLOCK()                 \
    fmoe_pdl_enter();                                   \
    a = fmoe_pdl_fresh(a);                              \
    a_scale = fmoe_pdl_fresh(a_scale);                  \
    sorted_routes = fmoe_pdl_fresh(sorted_routes);      \
    block_experts = fmoe_pdl_fresh(block_experts);      \
    total = fmoe_pdl_fresh(total);                      \
    topk_weights = fmoe_pdl_fresh(topk_weights);        \
    q_out = fmoe_pdl_fresh(q_out);                      \
    s_out = fmoe_pdl_fresh(s_out);                      \
    y32 = fmoe_pdl_fresh(y32);                          \
    error_flag = fmoe_pdl_fresh(error_flag)

#endif  // FMOE_COMMON_PDL_CUH
