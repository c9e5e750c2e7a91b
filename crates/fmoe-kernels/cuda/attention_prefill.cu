// attention_prefill: causal / sliding-window flash attention for spans with more than 16 packed
// (query, head) rows. A CTA owns 64 * MI packed rows of one sequence and one kv head (4 warps x
// 16 * MI rows; every warp sees all 64 keys of a key tile), see common/flash_attention.cuh.
//
// Defines: FMOE_ATTN_DTYPE (1 = bf16, 2 = f16), DQ, DV (padded q·k and v widths, multiples of 16),
// MI (m16 row tiles per warp: 2 while DV <= 128, else 1 to bound the accumulator registers);
// FMOE_ATTN_PAGED=1 for paged K/V (two more parameters: block_tables, block_size).
// Dynamic shared memory: fa::smem_bytes(64 * MI, DQ, DV, 1).

#include "common/flash_attention.cuh"

#if FMOE_ATTN_DTYPE == 1
typedef __nv_bfloat16 elem_t;
#else
typedef __half elem_t;
#endif

extern "C" __global__ void __launch_bounds__(FA_THREADS)
fmoe_attention_prefill(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                       elem_t* __restrict__ out, float* __restrict__ ws_acc, float* __restrict__ ws_ml,
                       const unsigned int* __restrict__ desc, unsigned int num_heads, unsigned int num_kv_heads,
                       unsigned int qk_dim, unsigned int v_dim, float scale_log2, unsigned int window FA_PAGED_PARAMS) {
    fa::flash_tile<elem_t, DQ, DV, MI, 4, 1, FA_PAGED>(q, k, v, out, ws_acc, ws_ml, desc, num_heads, num_kv_heads,
                                                       qk_dim, v_dim, scale_log2, window, FA_PAGED_ARGS);
}
