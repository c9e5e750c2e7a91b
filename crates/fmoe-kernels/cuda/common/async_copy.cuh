// cp.async (sm_80+): global -> shared copies that bypass the registers, committed in groups, so a
// ring of K tiles can be in flight while the tensor cores consume an earlier one. The grouped GEMMs
// load with it rather than TMA because their A rows are gathered by route, which a tensor map
// cannot express.

#ifndef FMOE_COMMON_ASYNC_COPY_CUH
#define FMOE_COMMON_ASYNC_COPY_CUH

// 16 bytes from gmem to the shared-space address smem (.cg: L2 only; streamed weights would just
// evict L1). pred == false copies 0 source bytes, which zero-fills the 16: rows past the batch and
// columns past K read as zeros without a branch (gmem must still be a valid address).
__device__ __forceinline__ void cp_async16(unsigned int smem, const void* gmem, bool pred) {
    int n = pred ? 16 : 0;  // 0 source bytes: zero-fill
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(n));
}

// Same, for a generic pointer into shared memory.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
    cp_async16(static_cast<unsigned int>(__cvta_generic_to_shared(smem)), gmem, pred);
}

// 4 bytes (.ca: the only cache mode below 16 bytes), zero-filled when pred == false: the group
// scales that travel with an A tile (moe_gemm_fp8_sm90_ws.cu).
__device__ __forceinline__ void cp_async4(unsigned int smem, const void* gmem, bool pred) {
    int n = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem), "l"(gmem), "r"(n));
}

// Closes the copies issued since the last commit into one group. The kernels commit once per
// stage, empty groups included, so the count passed to cp_async_wait stays uniform.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N committed groups are pending (an immediate in PTX, hence the template).
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Arrives on the mbarrier `bar` (shared-space address) once every cp.async this thread issued so
// far has landed, counting as one of the barrier's expected arrivals (.noinc): a loader can end
// each stage with it instead of waiting for its copies, so every stage of a ring is in flight.
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned int bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

#endif  // FMOE_COMMON_ASYNC_COPY_CUH
