// fmoe_grouped_topk: DeepSeek-V3 "noaux_tc" routing. Router logits [M, E] and a selection bias [E]
// -> for each row, top_k experts chosen within the topk_group best expert groups, weighted by their
// unbiased sigmoid scores. One warp per row.
//
// The contract is the CPU twin's (crates/fmoe-kernels/src/routing/cpu.rs, grouped_row), step for
// step, so that ids are identical and weights differ only where exp does:
// - s_e = sigmoid(x_e) in f32 with the twin's formula (1 / (1 + exp(-x)) for x >= 0,
//   exp(x) / (1 + exp(x)) below), exp being f32(exp(f64(x))): correctly rounded but for ~2^-29 of
//   inputs, so it agrees with the host's libm expf wherever that one rounds correctly too (CUDA's
//   expf is off by up to 2 ulp, which would move near-ties across a selection boundary);
// - b_e = s_e + bias_e selects, s_e weighs;
// - group g = experts [g*G, (g+1)*G), G = E / n_group; its score is the sum of its two largest b
//   (its one b if G = 1): a value of the multiset, so the scan order cannot change it;
// - the topk_group best groups are kept, then the top_k best experts of kept groups are chosen;
//   both orders: higher first, ties to the lower index (common/routing.cuh);
// - w_r = s_{e_r}; if renormalize, w_r / (w_0 + ... + w_{k-1} + 1e-20), summed in rank order; then
//   w_r * routed_scaling_factor.
// - a NaN or +-Inf logit sets bad[0] to the lowest flat index (row * E + e) holding one; the warp
//   of row 0 scans the bias and sets bad[1] to the lowest non-finite index (it runs even when
//   rows == 0: the grid has at least one block). The host turns either into the twin's NonFinite
//   error; the outputs of such a call are written, with meaningless values.
// Every output element of every row is written.
//
// Compile-time constants (-D, generated from named fields in routing/cuda.rs):
//   FMOE_LOGITS_DTYPE  0 = f32, 1 = bf16, 2 = f16 (common/routing.cuh)
//   EXPERTS_PER_LANE   ceil(E / 32) rounded up to a power of two, <= 32 (E <= 1024)
//   WARPS_PER_BLOCK    rows per block
// Dynamic shared memory: WARPS_PER_BLOCK * (E + n_group + ceil(n_group / 32)) * 4 bytes.
// Any n_group dividing E and any top_k <= topk_group * G (checked on the host).
//
// NVRTC: no libstdc++; only built-in device functions and common/routing.cuh.

#if !defined(FMOE_LOGITS_DTYPE) || !defined(EXPERTS_PER_LANE) || !defined(WARPS_PER_BLOCK)
#error "FMOE_LOGITS_DTYPE, EXPERTS_PER_LANE and WARPS_PER_BLOCK must be defined"
#endif
#if EXPERTS_PER_LANE < 1 || EXPERTS_PER_LANE > 32
#error "EXPERTS_PER_LANE must be in 1..=32 (a lane's 'taken' mask is 32 bits)"
#endif

#include "common/routing.cuh"

// exp rounded once from double precision (see the header comment).
__device__ __forceinline__ float exp_rn(float x) { return (float)exp((double)x); }

// The twin's overflow-free logistic function: exp only ever sees a non-positive argument.
__device__ __forceinline__ float sigmoid(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + exp_rn(-x));
    const float e = exp_rn(x);
    return e / (1.0f + e);
}

__device__ __forceinline__ bool is_kept(const unsigned int* kept, unsigned int g) {
    return (kept[g >> 5] >> (g & 31u)) & 1u;
}

extern "C" __global__ void __launch_bounds__(WARPS_PER_BLOCK * 32)
fmoe_grouped_topk(const logit_t* __restrict__ logits,     // [rows, experts]
                  const float* __restrict__ bias,         // [experts]
                  float* weights,                         // [rows, top_k] (read back: no restrict)
                  unsigned int* __restrict__ ids,         // [rows, top_k]
                  unsigned long long* __restrict__ bad,   // [2], in: ~0ull each
                  unsigned long long rows,
                  unsigned int experts,
                  unsigned int n_group,
                  unsigned int topk_group,
                  unsigned int top_k,
                  int renormalize,
                  float routed_scaling_factor) {
    extern __shared__ float smem[];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned long long row = (unsigned long long)blockIdx.x * WARPS_PER_BLOCK + warp;

    // The bias is shared by every row: one warp checks it.
    if (row == 0) {
        for (unsigned int e = lane; e < experts; e += 32u) {
            if (!is_finite(bias[e])) atomicMin(bad + 1, (unsigned long long)e);
        }
    }
    // `row` is uniform across the warp, so whole warps leave together and the shuffles below
    // always see all 32 lanes.
    if (row >= rows) return;

    // Per-warp scratch: b[E], group scores[n_group], kept-group bits[ceil(n_group / 32)].
    const unsigned int mask_words = (n_group + 31u) >> 5;
    float* sb = smem + (unsigned long long)warp * (experts + n_group + mask_words);
    float* gscore = sb + experts;
    unsigned int* kept = (unsigned int*)(gscore + n_group);

    const logit_t* in = logits + row * experts;
    float b[EXPERTS_PER_LANE];  // biased scores: selection
    float s[EXPERTS_PER_LANE];  // unbiased scores: weights
    unsigned int taken = 0;     // bit j: expert lane + 32 j is absent, dropped or already chosen
#pragma unroll
    for (int j = 0; j < EXPERTS_PER_LANE; ++j) {
        const unsigned int e = lane + 32u * j;
        b[j] = neg_inf();
        s[j] = 0.0f;
        if (e < experts) {
            float x = load_logit(in + e);
            if (!is_finite(x)) {
                atomicMin(bad, row * experts + e);
                x = neg_inf();  // keeps the selection well defined; the host reports an error
            }
            s[j] = sigmoid(x);
            b[j] = s[j] + bias[e];
            sb[e] = b[j];
        } else {
            taken |= 1u << j;
        }
    }
    for (unsigned int w = lane; w < mask_words; w += 32u) kept[w] = 0u;
    __syncwarp();

    // Group scores: one lane per group, the twin's top-2 scan.
    const unsigned int group_size = experts / n_group;
    for (unsigned int g = lane; g < n_group; g += 32u) {
        const float* grp = sb + g * group_size;
        float top1 = neg_inf(), top2 = neg_inf();
        for (unsigned int i = 0; i < group_size; ++i) {
            const float v = grp[i];
            if (v > top1) {
                top2 = top1;
                top1 = v;
            } else if (v > top2) {
                top2 = v;
            }
        }
        gscore[g] = group_size == 1u ? top1 : top1 + top2;
    }
    __syncwarp();

    // Kept groups: topk_group rounds of a warp-wide arg-best over the groups not yet kept.
    for (unsigned int r = 0; r < topk_group; ++r) {
        float bv = neg_inf();
        unsigned int bi = 0xffffffffu;
        for (unsigned int g = lane; g < n_group; g += 32u) {
            if (!is_kept(kept, g) && ranks_before(gscore[g], g, bv, bi)) {
                bv = gscore[g];
                bi = g;
            }
        }
        warp_arg_best(bv, bi);
        // topk_group <= n_group guarantees a real winner; the check only guards the index.
        if (lane == 0 && bi < n_group) kept[bi >> 5] |= 1u << (bi & 31u);
        __syncwarp();
    }

    // Experts of dropped groups are never candidates.
#pragma unroll
    for (int j = 0; j < EXPERTS_PER_LANE; ++j) {
        const unsigned int e = lane + 32u * j;
        if (e < experts && !is_kept(kept, e / group_size)) taken |= 1u << j;
    }

    // Top-k among the kept groups' experts; the owner lane writes the unbiased score and the id.
    float* w_out = weights + row * top_k;
    unsigned int* id_out = ids + row * top_k;
    for (unsigned int r = 0; r < top_k; ++r) {
        float bv = neg_inf();
        unsigned int bi = 0xffffffffu;
#pragma unroll
        for (int j = 0; j < EXPERTS_PER_LANE; ++j) {
            const unsigned int e = lane + 32u * j;
            if (!((taken >> j) & 1u) && ranks_before(b[j], e, bv, bi)) {
                bv = b[j];
                bi = e;
            }
        }
        warp_arg_best(bv, bi);
        // top_k <= topk_group * G guarantees a real winner; the check only guards the shift.
        if (bi < experts && (bi & 31u) == lane) {
            const unsigned int jw = bi >> 5;
            float sw = 0.0f;
#pragma unroll
            for (int j = 0; j < EXPERTS_PER_LANE; ++j) {
                if ((unsigned int)j == jw) sw = s[j];  // a select, not a dynamic register index
            }
            taken |= 1u << jw;
            w_out[r] = sw;
            id_out[r] = bi;
        }
    }
    // Orders the owners' writes before lane 0 reads them back.
    __syncwarp();

    float denom = 1.0f;
    if (renormalize) {
        float sum = 0.0f;
        if (lane == 0) {
            for (unsigned int r = 0; r < top_k; ++r) sum += w_out[r];
            // sigmoid can underflow to 0: the guard keeps 0/0 out.
            sum += 1e-20f;
        }
        denom = __shfl_sync(FULL_MASK, sum, 0);
    }
    for (unsigned int r = lane; r < top_k; r += 32u) {
        float w = w_out[r];
        if (renormalize) w = w / denom;
        w_out[r] = w * routed_scaling_factor;
    }
}
