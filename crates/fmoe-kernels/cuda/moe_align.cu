// moe_align: routes grouped by expert, each expert's run padded to BLOCK_M (see moe_align/mod.rs).
// One thread block does the whole batch: counts in shared memory, a serial prefix over experts
// (E <= 1024), then a scatter. Route order inside an expert is unspecified on the GPU (atomics);
// the grouped GEMMs do not depend on it.
//
// Outputs are sized for the worst case (num_routes + E * (BLOCK_M - 1)); `total` tells the GEMMs
// where the padded runs end, so the host never waits for this kernel.

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
    if (tid == 0) {
        unsigned int acc = 0;
        offsets[0] = 0;
        for (unsigned int e = 0; e < num_experts; ++e) {
            acc += (counts[e] + BLOCK_M - 1) / BLOCK_M * BLOCK_M;
            offsets[e + 1] = acc;
        }
        *total = acc;
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
