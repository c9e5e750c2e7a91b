// attention_decode: flash-decoding for spans of at most 16 packed (query, head) rows (q_len = 1
// with a GQA group up to 16, or a few queries). A CTA owns one span's 16-row tile for one kv head
// and one KV split; its 4 warps take a quarter of each 64-key tile each, so the K/V stream is read
// once per (kv head, split) by every warp of the CTA together (common/flash_attention.cuh). With
// several splits each CTA leaves f32 partials (max, sum, acc) and fmoe_attention_combine merges
// them.
//
// Defines: FMOE_ATTN_DTYPE (1 = bf16, 2 = f16); for fmoe_attention_decode also DQ, DV (padded
// widths, multiples of 16) and FMOE_ATTN_PAGED=1 for paged K/V (two more parameters:
// block_tables, block_size; the combine is the same for both). Dynamic shared memory:
// fa::smem_bytes(16, DQ, DV, 4).

#include "common/flash_attention.cuh"

#if FMOE_ATTN_DTYPE == 1
typedef __nv_bfloat16 elem_t;
#else
typedef __half elem_t;
#endif

#ifdef DQ
extern "C" __global__ void __launch_bounds__(FA_THREADS)
fmoe_attention_decode(const elem_t* __restrict__ q, const elem_t* __restrict__ k, const elem_t* __restrict__ v,
                      elem_t* __restrict__ out, float* __restrict__ ws_acc, float* __restrict__ ws_ml,
                      const unsigned int* __restrict__ desc, unsigned int num_heads, unsigned int num_kv_heads,
                      unsigned int qk_dim, unsigned int v_dim, float scale_log2, unsigned int window FA_PAGED_PARAMS) {
    fa::flash_tile<elem_t, DQ, DV, 1, 1, 4, FA_PAGED>(q, k, v, out, ws_acc, ws_ml, desc, num_heads, num_kv_heads,
                                                      qk_dim, v_dim, scale_log2, window, FA_PAGED_ARGS);
}
#endif

// Merges the splits of the tiles listed in split_tiles (indices into desc): out = Σ_z e^(m_z - M)
// acc_z / Σ_z e^(m_z - M) l_z, M = max_z m_z (base 2, as the tile routine stores them). Grid: x =
// list entry · num_kv_heads + kv head; bm is the tile height the partials were written with.
extern "C" __global__ void __launch_bounds__(FA_THREADS)
fmoe_attention_combine(const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                       elem_t* __restrict__ out, const unsigned int* __restrict__ desc,
                       const unsigned int* __restrict__ split_tiles, unsigned int bm, unsigned int num_heads,
                       unsigned int num_kv_heads, unsigned int v_dim) {
    const unsigned int kvh = blockIdx.x % num_kv_heads;
    const unsigned int* d = desc + (unsigned long long)split_tiles[blockIdx.x / num_kv_heads] * FA_DESC_WORDS;
    const unsigned int q_start = d[0], q_len = d[1], row0 = d[4], nsplit = d[5], ws_slot = d[6];
    const unsigned int group = num_heads / num_kv_heads, rows = q_len * group;
    const unsigned long long out_stride = (unsigned long long)num_heads * v_dim;
    const unsigned int c4 = v_dim / 4;
    for (unsigned int idx = threadIdx.x; idx < bm * c4; idx += blockDim.x) {
        const unsigned int r = idx / c4, col = (idx % c4) * 4, x = row0 + r;
        if (x >= rows) continue;
        float mx = FA_NEG_INF;
        for (unsigned int z = 0; z < nsplit; ++z) {
            const unsigned long long slot = (unsigned long long)(ws_slot + z) * num_kv_heads + kvh;
            mx = fmaxf(mx, ws_ml[(slot * bm + r) * 2]);
        }
        float l = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (unsigned int z = 0; z < nsplit; ++z) {
            const unsigned long long slot = (unsigned long long)(ws_slot + z) * num_kv_heads + kvh;
            const float2 ml = *reinterpret_cast<const float2*>(ws_ml + (slot * bm + r) * 2);
            const float f = exp2f(ml.x - mx);  // a split that saw no key of this row: 0
            const float4 p = *reinterpret_cast<const float4*>(ws_acc + (slot * bm + r) * v_dim + col);
            l += ml.y * f;
            acc.x += p.x * f;
            acc.y += p.y * f;
            acc.z += p.z * f;
            acc.w += p.w * f;
        }
        const float inv = 1.0f / l;
        elem_t* dst = out + (unsigned long long)(q_start + x / group) * out_stride +
                      (unsigned long long)(kvh * group + x % group) * v_dim + col;
        *reinterpret_cast<uint2*>(dst) = make_uint2(fa::Elem<elem_t>::pack(acc.x * inv, acc.y * inv),
                                                    fa::Elem<elem_t>::pack(acc.z * inv, acc.w * inv));
    }
}
