// fmoe_topk_softmax: Mixtral routing. Router logits [M, E] -> for each row, the top-k experts by
// logit (ties to the lower expert index), with their softmax probabilities, optionally
// renormalized over the k. One warp per row.
//
// The contract is the CPU twin's (crates/fmoe-kernels/src/routing/cpu.rs), step for step:
// - selection is on the logits (softmax is monotonic), order: higher value first, then lower index;
//   -0.0 and +0.0 are equal and tie on the index;
// - max = the top-1 logit; p_e = expf(x_e - max) / sum, where sum adds expf(x_e - max) over
//   e = 0..E-1 in index order (one lane, sequentially): the same additions in the same order as
//   the twin, so results differ from it only by expf's few ulps, not by summation order;
// - renormalize: w_r / (w_0 + ... + w_{k-1}), summed in rank order.
// - a NaN or +-Inf logit sets *bad_index to the lowest flat index (row * E + e) holding one (the
//   host turns it into the twin's NonFinite error); such a row's outputs are still written, with
//   meaningless values.
// Every output element of every row is written.
//
// Compile-time constants (-D, generated from named fields in routing/cuda.rs):
//   FMOE_LOGITS_DTYPE  0 = f32, 1 = bf16, 2 = f16: the logits' storage type (converted to f32
//                      exactly on load, common/routing.cuh)
//   EXPERTS_PER_LANE   ceil(E / 32) rounded up to a power of two, <= 32 (E <= 1024)
//   WARPS_PER_BLOCK    rows per block
// Dynamic shared memory: WARPS_PER_BLOCK * (E + 2 * top_k) * 4 bytes.
//
// NVRTC: no libstdc++; only built-in device functions and common/routing.cuh.

#if !defined(FMOE_LOGITS_DTYPE) || !defined(EXPERTS_PER_LANE) || !defined(WARPS_PER_BLOCK)
#error "FMOE_LOGITS_DTYPE, EXPERTS_PER_LANE and WARPS_PER_BLOCK must be defined"
#endif
#if EXPERTS_PER_LANE < 1 || EXPERTS_PER_LANE > 32
#error "EXPERTS_PER_LANE must be in 1..=32 (a lane's 'taken' mask is 32 bits)"
#endif

#include "common/routing.cuh"

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
fmoe_topk_softmax(const logit_t* __restrict__ logits,  // [rows, experts]
                  float* __restrict__ weights,         // [rows, top_k]
                  unsigned int* __restrict__ ids,      // [rows, top_k]
                  unsigned long long* __restrict__ bad_index,  // in: ~0ull
                  unsigned long long rows,
                  unsigned int experts,
                  unsigned int top_k,
                  int renormalize) {
    extern __shared__ float smem[];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned long long row = (unsigned long long)blockIdx.x * WARPS_PER_BLOCK + warp;
    // `row` is uniform across the warp, so whole warps leave together and the shuffles below
    // always see all 32 lanes.
    if (row >= rows) return;

    // Per-warp scratch: exps[E], then the k selected values and ids in rank order.
    float* exps = smem + (unsigned long long)warp * (experts + 2u * top_k);
    float* sel_val = exps + experts;
    unsigned int* sel_id = (unsigned int*)(sel_val + top_k);

    const logit_t* in = logits + row * experts;
    float v[EXPERTS_PER_LANE];
    unsigned int taken = 0;  // bit j: expert lane + 32 j is absent or already selected
#pragma unroll
    for (int j = 0; j < EXPERTS_PER_LANE; ++j) {
        const unsigned int e = lane + 32u * j;
        v[j] = neg_inf();
        if (e < experts) {
            float x = load_logit(in + e);
            if (!is_finite(x)) {
                atomicMin(bad_index, row * experts + e);
                x = neg_inf();  // keeps the selection well defined; the host reports an error
            }
            v[j] = x;
        } else {
            taken |= 1u << j;
        }
    }

    // Top-k: k rounds of a warp-wide arg-best over the experts not yet taken. The order is total
    // (distinct indices), so the butterfly leaves the same winner in every lane.
    for (unsigned int r = 0; r < top_k; ++r) {
        float bv = neg_inf();
        unsigned int bi = 0xffffffffu;
#pragma unroll
        for (int j = 0; j < EXPERTS_PER_LANE; ++j) {
            const unsigned int e = lane + 32u * j;
            if (!((taken >> j) & 1u) && ranks_before(v[j], e, bv, bi)) {
                bv = v[j];
                bi = e;
            }
        }
        warp_arg_best(bv, bi);
        // top_k <= E guarantees a real winner; the bound check only guards the shift.
        if (bi < experts && (bi & 31u) == lane) taken |= 1u << (bi >> 5);
        if (lane == 0) {
            sel_val[r] = bv;
            sel_id[r] = bi;
        }
    }
    __syncwarp();

    // Softmax over all E, with the top-1 logit as the max.
    const float mx = sel_val[0];
#pragma unroll
    for (int j = 0; j < EXPERTS_PER_LANE; ++j) {
        const unsigned int e = lane + 32u * j;
        if (e < experts) exps[e] = expf(v[j] - mx);
    }
    __syncwarp();
    float sum = 0.0f;
    float renorm = 1.0f;
    if (lane == 0) {
        for (unsigned int e = 0; e < experts; ++e) sum += exps[e];
        if (renormalize) {
            float s = 0.0f;
            for (unsigned int r = 0; r < top_k; ++r) s += exps[sel_id[r]] / sum;
            renorm = s;
        }
    }
    sum = __shfl_sync(FULL_MASK, sum, 0);
    renorm = __shfl_sync(FULL_MASK, renorm, 0);

    float* w_out = weights + row * top_k;
    unsigned int* id_out = ids + row * top_k;
    for (unsigned int r = lane; r < top_k; r += 32u) {
        const unsigned int e = sel_id[r];
        float w = exps[e] / sum;
        if (renormalize) w = w / renorm;
        w_out[r] = w;
        id_out[r] = e;
    }
}
