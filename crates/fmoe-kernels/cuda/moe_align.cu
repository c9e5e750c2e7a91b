// moe_align: routes grouped by expert, each expert's run padded to BLOCK_M (see moe_align/mod.rs).
// One thread block does the whole batch: counts in shared memory, a block-wide prefix over experts
// (a serial one by one thread took 9 us for DeepSeek-V3's 256 experts on an H200, as long as the
// rest of the kernel three times over), then a scatter. Launch: one block, a multiple of 32 threads. Route order inside an expert is unspecified on the GPU (atomics);
// the grouped GEMMs do not depend on it.
//
// Outputs are sized for the worst case (num_routes + E * (BLOCK_M - 1)); `total` tells the GEMMs
// where the padded runs end, so the host never waits for this kernel.
//
// TALL_M > 0 (mixed tile heights, TALL_M = 3/2 BLOCK_M): each expert's run is `short` BLOCK_M
// blocks then `tall` TALL_M blocks (mixed_blocks; the rule puts every expert in one of the two);
// only the last block holds padding. The BLOCK_M blocks fill slots [0, capacity) as above
// (expert_offsets: each expert's first short slot); the TALL_M blocks a second segment of
// `tall_slots` slots from `capacity` (tall_offsets: each expert's first tall slot, its blocks from
// capacity / BLOCK_M in block_experts, its padded length in `tall_total`), which the GEMM with
// TALL_M-row tiles runs as its own launch.

#include "common/pdl.cuh"

#ifndef TALL_M
#define TALL_M 0
#endif

#if TALL_M
static_assert(2 * TALL_M == 3 * BLOCK_M, "mixed tiles of 2 and 3 half-blocks");
// An expert's blocks under mixed tiles: all short or all tall, whichever pads it to fewer slots;
// on a tie tall up to two tall blocks (one pass fewer over the expert's weights where that pass is
// a large part of its time), short past that (compute-bound experts, where the short tiles run
// faster). An expert is never split between the two: each launch would stream its weights. The
// host's twin: moe_align::mixed_blocks.
struct MixedBlocks {
    unsigned int short_blocks, tall_blocks;
};
__device__ __forceinline__ MixedBlocks mixed_blocks(unsigned int count) {
    const unsigned int s = (count + BLOCK_M - 1) / BLOCK_M, t = (count + TALL_M - 1) / TALL_M;
    const bool tall = count > 0 && (t * TALL_M < s * BLOCK_M || (t * TALL_M == s * BLOCK_M && t <= 2));
    return tall ? MixedBlocks{0u, t} : MixedBlocks{s, 0u};
}
// A padded run as a scan value: short-segment slots in the low word, tall-segment slots in the
// high word, so one block-wide scan gives both segments' offsets.
typedef unsigned long long PadSlots;
#else
typedef unsigned int PadSlots;
#endif

__device__ __forceinline__ PadSlots padded_run(unsigned int count) {
#if TALL_M
    const MixedBlocks b = mixed_blocks(count);
    return ((PadSlots)(b.tall_blocks * TALL_M) << 32) | (PadSlots)(b.short_blocks * BLOCK_M);
#else
    return (count + BLOCK_M - 1) / BLOCK_M * BLOCK_M;
#endif
}

// f(r, ids[r]) for every route r, the block's threads striding over them. The ids four at a time
// where they are 16-byte aligned, two loads in flight per thread before f runs: one block runs the
// whole batch, so its passes over the ids are bound by load latency, not bandwidth (DeepSeek-V3 at
// M = 8192: 64 dependent loads per thread per pass one id at a time, ~99 us in all).
template <typename F>
__device__ __forceinline__ void for_each_route(const unsigned int* __restrict__ ids, unsigned int num_routes, F f) {
    const unsigned int tid = threadIdx.x;
    const unsigned int nvec = (reinterpret_cast<unsigned long long>(ids) & 15) == 0 ? num_routes / 4 : 0;
    const uint4* ids4 = reinterpret_cast<const uint4*>(ids);
    for (unsigned int v = tid; v < nvec; v += 2 * blockDim.x) {
        const unsigned int w = v + blockDim.x;
        const bool two = w < nvec;
        const uint4 q0 = ids4[v];
        const uint4 q1 = two ? ids4[w] : q0;
        f(4 * v, q0.x), f(4 * v + 1, q0.y), f(4 * v + 2, q0.z), f(4 * v + 3, q0.w);
        if (two) f(4 * w, q1.x), f(4 * w + 1, q1.y), f(4 * w + 2, q1.z), f(4 * w + 3, q1.w);
    }
    for (unsigned int r = 4 * nvec + tid; r < num_routes; r += blockDim.x) f(r, ids[r]);
}

extern "C" __global__ void fmoe_moe_align(const unsigned int* __restrict__ ids,
                                          unsigned int num_routes,
                                          unsigned int num_experts,
                                          unsigned int* __restrict__ sorted_routes,
                                          unsigned int* __restrict__ block_experts,
                                          unsigned int* __restrict__ expert_offsets,
                                          unsigned int* __restrict__ expert_counts,
                                          unsigned int* __restrict__ total,
                                          unsigned int* __restrict__ error_flag,
                                          unsigned int capacity
#if TALL_M
                                          , unsigned int* __restrict__ tall_offsets,
                                          unsigned int* __restrict__ tall_total, unsigned int tall_slots
#endif
                                          ) {
#if PDL
    fmoe_pdl_enter();  // first: see common/pdl.cuh
    ids = fmoe_pdl_fresh(ids);
    sorted_routes = fmoe_pdl_fresh(sorted_routes);
    block_experts = fmoe_pdl_fresh(block_experts);
    expert_offsets = fmoe_pdl_fresh(expert_offsets);
    expert_counts = fmoe_pdl_fresh(expert_counts);
    total = fmoe_pdl_fresh(total);
    error_flag = fmoe_pdl_fresh(error_flag);
#if TALL_M
    tall_offsets = fmoe_pdl_fresh(tall_offsets);
    tall_total = fmoe_pdl_fresh(tall_total);
#endif
#endif
    extern __shared__ unsigned int smem[];
    unsigned int* counts = smem;                    // [E]
    unsigned int* cursor = smem + num_experts;      // [E]
    unsigned int* offsets = smem + 2 * num_experts; // [E + 1]
#if TALL_M
    unsigned int* toffsets = smem + 3 * num_experts + 1;  // [E + 1]: tall-segment offsets
#endif
    const unsigned int tid = threadIdx.x;

    for (unsigned int e = tid; e < num_experts; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    auto count_route = [&](unsigned int, unsigned int id) {
        if (id < num_experts) {
            atomicAdd(&counts[id], 1u);
        } else {
            atomicExch(error_flag, 1u);  // reported by the host-side check of the caller
        }
    };
    for_each_route(ids, num_routes, count_route);
    __syncthreads();
    {
        // Exclusive prefix of the padded counts: thread t owns experts [t * per, (t + 1) * per);
        // a warp scan of the owners' sums, then a scan of the warp totals.
        __shared__ PadSlots warp_sums[32];
        const unsigned int lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
        const unsigned int per = (num_experts + blockDim.x - 1) / blockDim.x;
        const unsigned int e0 = min(tid * per, num_experts), e1 = min(e0 + per, num_experts);
        PadSlots mine = 0;
        for (unsigned int e = e0; e < e1; ++e) mine += padded_run(counts[e]);
        PadSlots incl = mine;
#pragma unroll
        for (unsigned int d = 1; d < 32; d <<= 1) {
            const PadSlots v = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += v;
        }
        if (lane == 31) warp_sums[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            PadSlots w = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
            for (unsigned int d = 1; d < 32; d <<= 1) {
                const PadSlots v = __shfl_up_sync(0xffffffffu, w, d);
                if (lane >= d) w += v;
            }
            if (lane < warps) warp_sums[lane] = w;  // inclusive totals of warps 0..lane
        }
        __syncthreads();
        PadSlots acc = incl - mine + (warp > 0 ? warp_sums[warp - 1] : 0);
        for (unsigned int e = e0; e < e1; ++e) {
            const PadSlots run = padded_run(counts[e]);
#if TALL_M
            offsets[e] = (unsigned int)acc;
            toffsets[e] = (unsigned int)(acc >> 32);
#else
            offsets[e] = acc;
#endif
            acc += run;
        }
        if (tid == blockDim.x - 1) {
#if TALL_M
            offsets[num_experts] = (unsigned int)acc;
            toffsets[num_experts] = (unsigned int)(acc >> 32);
            *total = (unsigned int)acc;
            *tall_total = (unsigned int)(acc >> 32);
#else
            offsets[num_experts] = acc;
            *total = acc;
#endif
        }
    }
    __syncthreads();
#if TALL_M
    for (unsigned int e = tid; e < num_experts; e += blockDim.x) {
        cursor[e] = 0;  // routes of e placed so far (the scatter splits them between segments)
        expert_offsets[e] = offsets[e];
        tall_offsets[e] = capacity + toffsets[e];
        expert_counts[e] = counts[e];
    }
    if (tid == 0) {
        expert_offsets[num_experts] = offsets[num_experts];
        tall_offsets[num_experts] = capacity + toffsets[num_experts];
    }
    const unsigned int short_blocks = capacity / BLOCK_M;
    for (unsigned int i = tid; i < capacity + tall_slots; i += blockDim.x) sorted_routes[i] = num_routes;
    for (unsigned int b = tid; b < short_blocks + tall_slots / TALL_M; b += blockDim.x) block_experts[b] = num_experts;
    __syncthreads();  // the block ids below overwrite these fills
    for (unsigned int e = tid; e < num_experts; e += blockDim.x) {
        const MixedBlocks mb = mixed_blocks(counts[e]);
        for (unsigned int b = 0; b < mb.short_blocks; ++b) block_experts[offsets[e] / BLOCK_M + b] = e;
        for (unsigned int b = 0; b < mb.tall_blocks; ++b)
            block_experts[short_blocks + toffsets[e] / TALL_M + b] = e;
    }
#else
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
#endif
    __syncthreads();
#if TALL_M
    // The first short_blocks * BLOCK_M routes of an expert fill its short blocks, the rest its
    // tall ones (which hold the padding).
    auto place_route = [&](unsigned int r, unsigned int id) {
        if (id >= num_experts) return;
        const unsigned int i = atomicAdd(&cursor[id], 1u);
        const unsigned int s_len = mixed_blocks(counts[id]).short_blocks * BLOCK_M;
        sorted_routes[i < s_len ? offsets[id] + i : capacity + toffsets[id] + (i - s_len)] = r;
    };
#else
    auto place_route = [&](unsigned int r, unsigned int id) {
        if (id < num_experts) sorted_routes[atomicAdd(&cursor[id], 1u)] = r;
    };
#endif
    // Each route into its expert's next slot.
    for_each_route(ids, num_routes, place_route);
}
