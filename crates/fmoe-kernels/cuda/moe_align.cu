// moe_align: routes grouped by expert, each expert's run padded to BLOCK_M (see moe_align/mod.rs).
// One thread block does the whole batch: counts in shared memory, a block-wide prefix over experts
// (a serial one by one thread took 9 us for DeepSeek-V3's 256 experts on an H200, as long as the
// rest of the kernel three times over), then a scatter. Launch: one block, a multiple of 32 threads. Route order inside an expert is unspecified on the GPU (atomics);
// the grouped GEMMs do not depend on it.
//
// Outputs are sized for the worst case (num_routes + E * (BLOCK_M - 1)); `total` tells the GEMMs
// where the padded runs end, so the host never waits for this kernel.

#include "common/pdl.cuh"

extern "C" __global__ void fmoe_moe_align(const unsigned int* __restrict__ ids,
                                          unsigned int num_routes,
                                          unsigned int num_experts,
                                          unsigned int* __restrict__ sorted_routes,
                                          unsigned int* __restrict__ block_experts,
                                          unsigned int* __restrict__ expert_offsets,
                                          unsigned int* __restrict__ expert_counts,
                                          unsigned int* __restrict__ total,
                                          unsigned int* __restrict__ error_flag,
                                          unsigned int capacity) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    ids = fmoe_pdl_fresh(ids);
    sorted_routes = fmoe_pdl_fresh(sorted_routes);
    block_experts = fmoe_pdl_fresh(block_experts);
    expert_offsets = fmoe_pdl_fresh(expert_offsets);
    expert_counts = fmoe_pdl_fresh(expert_counts);
    total = fmoe_pdl_fresh(total);
    error_flag = fmoe_pdl_fresh(error_flag);
#endif
    extern __shared__ unsigned int smem[];
    unsigned int* counts = smem;                    // [E]
    unsigned int* cursor = smem + num_experts;      // [E]
    unsigned int* offsets = smem + 2 * num_experts; // [E + 1]
    const unsigned int tid = threadIdx.x;

    for (unsigned int e = tid; e < num_experts; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (unsigned int r = tid; r < num_routes; r += blockDim.x) {
        unsigned int id = ids[r];
        if (id < num_experts) {
            atomicAdd(&counts[id], 1u);
        } else {
            atomicExch(error_flag, 1u);  // reported by the host-side check of the caller
        }
    }
    __syncthreads();
    {
        // Exclusive prefix of the padded counts: thread t owns experts [t * per, (t + 1) * per);
        // a warp scan of the owners' sums, then a scan of the warp totals.
        __shared__ unsigned int warp_sums[32];
        const unsigned int lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
        const unsigned int per = (num_experts + blockDim.x - 1) / blockDim.x;
        const unsigned int e0 = min(tid * per, num_experts), e1 = min(e0 + per, num_experts);
        unsigned int mine = 0;
        for (unsigned int e = e0; e < e1; ++e) mine += (counts[e] + BLOCK_M - 1) / BLOCK_M * BLOCK_M;
        unsigned int incl = mine;
#pragma unroll
        for (unsigned int d = 1; d < 32; d <<= 1) {
            const unsigned int v = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += v;
        }
        if (lane == 31) warp_sums[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            unsigned int w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
            for (unsigned int d = 1; d < 32; d <<= 1) {
                const unsigned int v = __shfl_up_sync(0xffffffffu, w, d);
                if (lane >= d) w += v;
            }
            if (lane < warps) warp_sums[lane] = w;  // inclusive totals of warps 0..lane
        }
        __syncthreads();
        unsigned int acc = incl - mine + (warp > 0 ? warp_sums[warp - 1] : 0);
        for (unsigned int e = e0; e < e1; ++e) {
            offsets[e] = acc;
            acc += (counts[e] + BLOCK_M - 1) / BLOCK_M * BLOCK_M;
        }
        if (tid == blockDim.x - 1) {
            offsets[num_experts] = acc;
            *total = acc;
        }
    }
    __syncthreads();
    const unsigned int padded = offsets[num_experts];
    for (unsigned int e = tid; e < num_experts; e += blockDim.x) {
        cursor[e] = offsets[e];
        expert_offsets[e] = offsets[e];
        expert_counts[e] = counts[e];
    }
    if (tid == 0) expert_offsets[num_experts] = padded;
    for (unsigned int i = tid; i < capacity; i += blockDim.x) sorted_routes[i] = num_routes;
    for (unsigned int b = tid; b < capacity / BLOCK_M; b += blockDim.x) {
        // Expert of block b: the last e with offsets[e] <= b * BLOCK_M (binary search).
        unsigned int lo = 0, hi = num_experts, at = b * BLOCK_M;
        while (hi - lo > 1) {
            unsigned int mid = (lo + hi) / 2;
            if (offsets[mid] <= at) lo = mid; else hi = mid;
        }
        block_experts[b] = at < padded ? lo : num_experts;
    }
    __syncthreads();
    for (unsigned int r = tid; r < num_routes; r += blockDim.x) {
        unsigned int id = ids[r];
        if (id < num_experts) sorted_routes[atomicAdd(&cursor[id], 1u)] = r;
    }
}
