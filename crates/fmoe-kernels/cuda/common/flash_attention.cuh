// Flash attention (FlashAttention-2 style) on mma.sync m16n8k16: the one tile routine behind both
// attention kernels (attention_prefill.cu, attention_decode.cu), which differ only in how the CTA's
// four warps split the tile.
//
// Work unit: a tile of BM "packed rows" of one sequence and one kv head. A span's packed rows
// are (query i, head of the GQA group) pairs, x = i * group + head_in_group, so one K/V read
// serves every query head of the group (FlashInfer's and FA3's GQA packing). The CTA walks the
// key tiles of its KV split (all of them without split-KV): K and V through shared memory with
// cp.async double buffering, S = Q·Kᵀ and O += P·V on the tensor cores, the online softmax in
// registers (f32, base-2 exponent: scores are pre-multiplied by scale·log2 e). Key tiles outside
// the causal / sliding-window band of every row are never visited; tiles inside it for every row
// skip the mask arithmetic.
//
// Warp layout: WARPS_M x WARPS_N warps; warp (wm, wn) owns packed rows wm·16·MI.. +16·MI (MI
// m16 row tiles) and keys wn·(BN/WARPS_N).. of each key tile, with its own softmax state; it
// walks its keys in steps of at most 32 (one online-softmax update each, bounding the score
// registers). Prefill: 4 x 1 with MI = 2 (128 rows; each K/V fragment read from shared memory
// feeds two row tiles) or MI = 1 for widths above 128. Decode: 1 x 4 with MI = 1 (16 rows, each
// warp a quarter of the keys). The epilogue merges the WARPS_N states through shared memory and
// writes either the output (one split) or the f32 partial (max, sum, unnormalized acc) of this
// split for fmoe_attention_combine.
//
// Tile descriptor (DESC_WORDS u32, built by the launch code): q_start, q_len, kv_start, past,
// row0 (first packed row of the tile), nsplit, ws_slot (first workspace slot of its splits),
// key_tile0, key_tiles (the band's key tiles of BN keys). Grid: x = tile · num_kv_heads + kv head
// (tiles heaviest first), z = split (CTAs with z >= nsplit exit).
//
// Paged K/V (kPaged): position j of the sequence is k/v row block_tables[kv_start + j / block_size]
// · block_size + j % block_size (kv_start indexes the block tables). Each key tile's 64 rows are
// looked up once, one key per thread of the first 64, and their k and v offsets stored in shared
// memory for the copies: once tile kt's data is visible (the loop's first barrier), tile kt + 2's
// offsets go into the slot that tile kt's copies no longer need, from the table entry read during
// the previous tile (so the table's latency hides behind a tile's work). Everything else is the contiguous
// routine, so both give the same bits for the same rows.
//
// Contract (checked on the host): dtype bf16 or f16; qk_dim, v_dim multiples of 8 (16-byte
// cp.async chunks), qk_dim <= DQ, v_dim <= DV (DQ, DV multiples of 16: the padding dims are
// zero-filled); every buffer 16-byte aligned; all positions and packed row counts fit 32 bits.

#ifndef FMOE_COMMON_FLASH_ATTENTION_CUH
#define FMOE_COMMON_FLASH_ATTENTION_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/async_copy.cuh"
#include "common/mma_sm80.cuh"

#define FA_DESC_WORDS 9
#define FA_KEY_TILE 64
#define FA_THREADS 128
// -inf without <math.h> (NVRTC has none): masked scores and empty rows' running max.
#define FA_NEG_INF __int_as_float(0xff800000)

// The kernels' paged-K/V build (-D FMOE_ATTN_PAGED=1) takes two more parameters, the block tables
// and the block size; the contiguous build passes none (FA_PAGED_ARGS fills the routine's).
#ifdef FMOE_ATTN_PAGED
#define FA_PAGED true
#define FA_PAGED_PARAMS , const unsigned int *__restrict__ block_tables, unsigned int block_size
#define FA_PAGED_ARGS block_tables, block_size
#else
#define FA_PAGED false
#define FA_PAGED_PARAMS
#define FA_PAGED_ARGS nullptr, 1u
#endif

namespace fa {

// Element type traits: the tensor-core instruction and the f32 -> 2 x 16-bit packing.
template <typename T>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
    static __device__ __forceinline__ void mma(float* c, const unsigned int* a, const unsigned int* b) {
        mma_m16n8k16_bf16(c, a, b);
    }
    static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
};

template <>
struct Elem<__half> {
    static __device__ __forceinline__ void mma(float* c, const unsigned int* a, const unsigned int* b) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
    static __device__ __forceinline__ unsigned int pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<unsigned int*>(&v);
    }
};

// ldmatrix with .trans: lane l addresses row l % 8 of matrix l / 8 and receives the transposed
// fragment, i.e. the column-major B operand straight from a row-major [k][n] tile (V).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* r, const void* smem) {
    unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// Dynamic shared memory of a tile routine: Q [BM][DQ+8] and two stages of K [BN][DQ+8] and
// V [BN][DV+8] (16-bit elements; the +8 pad makes every ldmatrix conflict-free), or, if larger,
// the epilogue's WARPS_N x BM x (DV+4) f32 staging, which reuses the same bytes.
__host__ __device__ constexpr unsigned int smem_bytes(int bm, int dq, int dv, int warps_n) {
    return 2u * (bm * (dq + 8) + 2 * FA_KEY_TILE * (dq + 8) + 2 * FA_KEY_TILE * (dv + 8)) >
                   4u * warps_n * bm * (dv + 4)
               ? 2u * (bm * (dq + 8) + 2 * FA_KEY_TILE * (dq + 8) + 2 * FA_KEY_TILE * (dv + 8))
               : 4u * warps_n * bm * (dv + 4);
}

// MI: m16 row tiles per warp (2 halves the shared-memory reads of K and V per MMA; the
// accumulators then take MI x DV / 2 registers per thread).
// kPaged: K/V through block_tables (see the header comment); unused otherwise.
template <typename T, int kDq, int kDv, int kMi, int WARPS_M, int WARPS_N, bool kPaged>
__device__ __forceinline__ void flash_tile(const T* __restrict__ q, const T* __restrict__ k,
                                           const T* __restrict__ v, T* __restrict__ out,
                                           float* __restrict__ ws_acc, float* __restrict__ ws_ml,
                                           const unsigned int* __restrict__ desc, unsigned int num_heads,
                                           unsigned int num_kv_heads, unsigned int qk_dim, unsigned int v_dim,
                                           float scale_log2, unsigned int window,
                                           const unsigned int* __restrict__ block_tables,
                                           unsigned int block_size) {
    constexpr int BN = FA_KEY_TILE;
    constexpr int NT = 32 * WARPS_M * WARPS_N;
    constexpr int WR = 16 * kMi;           // rows per warp
    constexpr int BM = WR * WARPS_M;
    constexpr int KPW = BN / WARPS_N;     // keys per warp per tile
    constexpr int KSUB = KPW < 32 ? KPW : 32;  // keys per softmax step (bounds the S registers)
    constexpr int NS = KSUB / 8;          // n8 score tiles per row tile
    constexpr int NO = kDv / 8;           // n8 output tiles per row tile
    constexpr int SQ = kDq + 8, SV = kDv + 8, SO = kDv + 4;
    constexpr int QC = kDq / 8, VC = kDv / 8;  // 16-byte chunks per row
    static_assert(NT == FA_THREADS, "the launch code uses FA_THREADS threads");
    static_assert(KSUB % 16 == 0 && KPW % KSUB == 0 && kDq % 16 == 0 && kDv % 16 == 0, "tile shapes");
    static_assert(NT >= BN, "one key lookup per thread of the first BN");
    static_assert(BN * QC % NT == 0 && BN * VC % NT == 0, "whole 16-byte chunks per thread");

    extern __shared__ __align__(16) unsigned char smem[];
    T* qs = reinterpret_cast<T*>(smem);
    T* ks = qs + BM * SQ;          // [2][BN][SQ]
    T* vs = ks + 2 * BN * SQ;      // [2][BN][SV]
    __shared__ float m_s[WARPS_N][BM], l_s[WARPS_N][BM];
    // Paged: per stage, each key's k and v row offsets (elements) from kh and vh.
    __shared__ ulonglong2 key_off[kPaged ? 2 : 1][kPaged ? BN : 1];

    const unsigned int kvh = blockIdx.x % num_kv_heads;
    const unsigned int* d = desc + (unsigned long long)(blockIdx.x / num_kv_heads) * FA_DESC_WORDS;
    const unsigned int q_start = d[0], q_len = d[1], kv_start = d[2], past = d[3], row0 = d[4];
    const unsigned int nsplit = d[5], ws_slot = d[6], kt0 = d[7], nkt = d[8];
    const unsigned int z = blockIdx.z;
    if (z >= nsplit) return;

    const unsigned int group = num_heads / num_kv_heads;
    const unsigned int rows = q_len * group;
    const unsigned int last_row = min(row0 + BM, rows) - 1;
    const unsigned int i_first = row0 / group, i_last = last_row / group;
    const unsigned int kv_len = past + q_len;
    const unsigned int chunk = (nkt + nsplit - 1) / nsplit;
    const unsigned int kt_begin = kt0 + min(z * chunk, nkt);
    const unsigned int kt_end = kt0 + min((z + 1) * chunk, nkt);

    const unsigned long long q_stride = (unsigned long long)num_heads * qk_dim;
    const unsigned long long k_stride = (unsigned long long)num_kv_heads * qk_dim;
    const unsigned long long v_stride = (unsigned long long)num_kv_heads * v_dim;
    // Contiguous: key j is row kv_start + j. Paged: key_off holds each key's offsets.
    const T* kh = k + (kPaged ? 0ull : (unsigned long long)kv_start * k_stride) + (unsigned long long)kvh * qk_dim;
    const T* vh = v + (kPaged ? 0ull : (unsigned long long)kv_start * v_stride) + (unsigned long long)kvh * v_dim;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp % WARPS_M, wn = warp / WARPS_M;
    const int g = lane >> 2, t = lane & 3;

    // Q: packed row x -> query row q_start + x / group, head kvh·group + x % group.
    for (int c = tid; c < BM * QC; c += NT) {
        const int r = c / QC, ch = c % QC;
        const unsigned int x = row0 + r;
        const bool ok = x < rows && (unsigned int)ch * 8 < qk_dim;
        const T* src = q;
        if (ok)
            src = q + (unsigned long long)(q_start + x / group) * q_stride +
                  (unsigned long long)(kvh * group + x % group) * qk_dim + ch * 8;
        cp_async16(qs + r * SQ + ch * 8, src, ok);
    }
    // Paged lookups, by the threads tid < BN, one key each: the cursor is the table entry (from
    // kv_start) and the slot in its block of key tid of the next tile to look up; it moves on a
    // tile per lookup without a division.
    unsigned int cur_blk = 0, cur_off = 0, step_blk = 0, step_off = 0;
    if constexpr (kPaged) {
        const unsigned int j = kt_begin * BN + tid;
        cur_blk = j / block_size;
        cur_off = j % block_size;
        step_blk = BN / block_size;
        step_off = BN % block_size;
    }
    // The block holding key tid of tile kt, the cursor's tile (0 past the sequence or the split,
    // whose copies are never made).
    auto fetch_block = [&](unsigned int kt) -> unsigned int {
        const unsigned int j = kt * BN + tid;
        return kt < kt_end && j < kv_len ? block_tables[kv_start + cur_blk] : 0u;
    };
    // Stores that key's offsets for `stage` and moves the cursor to the next tile.
    auto store_block = [&](int stage, unsigned int block) {
        const unsigned int row = block * block_size + cur_off;
        key_off[stage][tid] = make_ulonglong2((unsigned long long)row * k_stride, (unsigned long long)row * v_stride);
        cur_off += step_off;
        if (cur_off >= block_size) {
            cur_off -= block_size;
            ++cur_blk;
        }
        cur_blk += step_blk;
    };
    // K and V rows of key tile kt; keys past the sequence read as zeros.
    auto load_kv = [&](int stage, unsigned int kt) {
        const unsigned int n0 = kt * BN;
        T* kd = ks + stage * BN * SQ;
        T* vd = vs + stage * BN * SV;
        if constexpr (kPaged) {
            // A chunk's offset comes from key_off (unrolled by 4: the offsets' loads go out
            // together, and a full unroll of the 128-wide prefill spills). K and V of a row in
            // one loop when their chunk counts match.
            constexpr int KCH = BN * QC / NT, VCH = BN * VC / NT;
            const ulonglong2* off = key_off[stage];
            if constexpr (QC == VC) {
#pragma unroll 4
                for (int i = 0; i < KCH; ++i) {
                    const int c = tid + i * NT, r = c / QC, ch = c % QC;
                    const ulonglong2 o = off[r];
                    const bool in = n0 + r < kv_len;
                    const bool okk = in && (unsigned int)ch * 8 < qk_dim, okv = in && (unsigned int)ch * 8 < v_dim;
                    cp_async16(kd + r * SQ + ch * 8, kh + (okk ? o.x + ch * 8 : 0ull), okk);
                    cp_async16(vd + r * SV + ch * 8, vh + (okv ? o.y + ch * 8 : 0ull), okv);
                }
            } else {
#pragma unroll 4
                for (int i = 0; i < KCH; ++i) {
                    const int c = tid + i * NT, r = c / QC, ch = c % QC;
                    const unsigned long long o = off[r].x;
                    const bool ok = n0 + r < kv_len && (unsigned int)ch * 8 < qk_dim;
                    cp_async16(kd + r * SQ + ch * 8, kh + (ok ? o + ch * 8 : 0ull), ok);
                }
#pragma unroll 4
                for (int i = 0; i < VCH; ++i) {
                    const int c = tid + i * NT, r = c / VC, ch = c % VC;
                    const unsigned long long o = off[r].y;
                    const bool ok = n0 + r < kv_len && (unsigned int)ch * 8 < v_dim;
                    cp_async16(vd + r * SV + ch * 8, vh + (ok ? o + ch * 8 : 0ull), ok);
                }
            }
            return;
        }
        for (int c = tid; c < BN * QC; c += NT) {
            const int r = c / QC, ch = c % QC;
            const bool ok = n0 + r < kv_len && (unsigned int)ch * 8 < qk_dim;
            cp_async16(kd + r * SQ + ch * 8, kh + (ok ? (unsigned long long)(n0 + r) * k_stride + ch * 8 : 0ull), ok);
        }
        for (int c = tid; c < BN * VC; c += NT) {
            const int r = c / VC, ch = c % VC;
            const bool ok = n0 + r < kv_len && (unsigned int)ch * 8 < v_dim;
            cp_async16(vd + r * SV + ch * 8, vh + (ok ? (unsigned long long)(n0 + r) * v_stride + ch * 8 : 0ull), ok);
        }
    };
    // Paged: the offsets of the first two tiles (stages 0 and 1), and the block of tile
    // kt_begin + 2 fetched ahead.
    unsigned int pending = 0;
    if constexpr (kPaged) {
        if (tid < BN) {
            store_block(0, fetch_block(kt_begin));
            store_block(1, fetch_block(kt_begin + 1));
            pending = fetch_block(kt_begin + 2);
        }
        __syncthreads();
    }
    if (kt_begin < kt_end) load_kv(0, kt_begin);
    cp_async_commit();

    // This thread's rows: g and g + 8 of each of its warp's kMi row tiles. Padding rows take the
    // last valid row's position, so they stay finite and are simply not written.
    unsigned int pos[kMi][2];
#pragma unroll
    for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            pos[mi][h] = past + min(row0 + wm * WR + mi * 16 + g + h * 8, last_row) / group;

    float o[kMi][NO][4];
#pragma unroll
    for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
        for (int n = 0; n < NO; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mi][n][e] = 0.0f;
    float mrow[kMi][2], lrow[kMi][2];
#pragma unroll
    for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mrow[mi][h] = FA_NEG_INF;
            lrow[mi][h] = 0.0f;
        }

    const int a_row = lane & 15, a_col = (lane >> 4) * 8;                              // A, V^T
    const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;  // K
    const T* q_w = qs + (wm * WR + a_row) * SQ + a_col;
    for (unsigned int kt = kt_begin; kt < kt_end; ++kt) {
        const int stage = (kt - kt_begin) & 1;
        if (kt + 1 < kt_end) load_kv(stage ^ 1, kt + 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // tile kt (and Q) visible to every warp
        if constexpr (kPaged) {
            // Tile kt + 2's offsets into this stage's slot: every thread issued tile kt's copies
            // from it before the barrier above, and tile kt + 2's are issued after the one that
            // ends this tile. From the block fetched a tile ago; then tile kt + 3's block, read
            // while this tile computes.
            if (tid < BN) {
                store_block(stage, pending);
                pending = fetch_block(kt + 3);
            }
        }
        const unsigned int n0 = kt * BN;
        const bool full = n0 + BN - 1 <= past + i_first && (window == 0 || past + i_last - n0 < window);

#pragma unroll
        for (int sub = 0; sub < KPW / KSUB; ++sub) {
            const int kb = wn * KPW + sub * KSUB;  // first key of this step within the tile
            const T* k_w = ks + stage * BN * SQ + (kb + b_row) * SQ + b_col;
            const T* v_w = vs + stage * BN * SV + (kb + a_row) * SV + a_col;

            float s[kMi][NS][4];
#pragma unroll
            for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
                for (int j = 0; j < NS; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mi][j][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < kDq; kk += 16) {
                unsigned int a[kMi][4];
#pragma unroll
                for (int mi = 0; mi < kMi; ++mi) ldmatrix_x4(a[mi], q_w + mi * 16 * SQ + kk);
#pragma unroll
                for (int jp = 0; jp < NS / 2; ++jp) {
                    unsigned int b[4];
                    ldmatrix_x4(b, k_w + jp * 16 * SQ + kk);
#pragma unroll
                    for (int mi = 0; mi < kMi; ++mi) {
                        Elem<T>::mma(s[mi][2 * jp], a[mi], b);
                        Elem<T>::mma(s[mi][2 * jp + 1], a[mi], b + 2);
                    }
                }
            }

            // Scale into the log2 domain; mask unless the whole tile is visible to every row.
#pragma unroll
            for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
                for (int j = 0; j < NS; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float x = s[mi][j][e] * scale_log2;
                        if (!full) {
                            const unsigned int key = n0 + kb + j * 8 + 2 * t + (e & 1), p = pos[mi][e >> 1];
                            if (key > p || (window != 0 && p - key >= window)) x = FA_NEG_INF;
                        }
                        s[mi][j][e] = x;
                    }

            // Online softmax per row; a row with nothing visible yet keeps max -inf, sum 0.
#pragma unroll
            for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float mx = FA_NEG_INF;
#pragma unroll
                    for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[mi][j][2 * h], s[mi][j][2 * h + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float m_new = fmaxf(mrow[mi][h], mx);
                    const float m_use = m_new == FA_NEG_INF ? 0.0f : m_new;
                    const float alpha = exp2f(mrow[mi][h] - m_use);
                    mrow[mi][h] = m_new;
                    float sum = 0.0f;
#pragma unroll
                    for (int j = 0; j < NS; ++j) {
                        s[mi][j][2 * h] = exp2f(s[mi][j][2 * h] - m_use);
                        s[mi][j][2 * h + 1] = exp2f(s[mi][j][2 * h + 1] - m_use);
                        sum += s[mi][j][2 * h] + s[mi][j][2 * h + 1];
                    }
                    lrow[mi][h] = lrow[mi][h] * alpha + sum;
#pragma unroll
                    for (int n = 0; n < NO; ++n) {
                        o[mi][n][2 * h] *= alpha;
                        o[mi][n][2 * h + 1] *= alpha;
                    }
                }

            // O += P·V: two adjacent score tiles are one A fragment (the accumulator layout of
            // m16n8 equals the A layout of m16k16 split in k halves).
#pragma unroll
            for (int kk = 0; kk < KSUB / 16; ++kk) {
                unsigned int a[kMi][4];
#pragma unroll
                for (int mi = 0; mi < kMi; ++mi) {
                    a[mi][0] = Elem<T>::pack(s[mi][2 * kk][0], s[mi][2 * kk][1]);
                    a[mi][1] = Elem<T>::pack(s[mi][2 * kk][2], s[mi][2 * kk][3]);
                    a[mi][2] = Elem<T>::pack(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
                    a[mi][3] = Elem<T>::pack(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
                }
#pragma unroll
                for (int np = 0; np < NO / 2; ++np) {
                    unsigned int b[4];
                    ldmatrix_x4_trans(b, v_w + kk * 16 * SV + np * 16);
#pragma unroll
                    for (int mi = 0; mi < kMi; ++mi) {
                        Elem<T>::mma(o[mi][2 * np], a[mi], b);
                        Elem<T>::mma(o[mi][2 * np + 1], a[mi], b + 2);
                    }
                }
            }
        }
        __syncthreads();  // everyone is done with this stage before it is refilled
    }

    // Epilogue: per-row sums over the quad, then every warp's state into shared memory.
#pragma unroll
    for (int mi = 0; mi < kMi; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            lrow[mi][h] += __shfl_xor_sync(0xffffffffu, lrow[mi][h], 1);
            lrow[mi][h] += __shfl_xor_sync(0xffffffffu, lrow[mi][h], 2);
        }
    cp_async_wait<0>();  // an empty split never waited for its Q copy
    __syncthreads();
    float* os = reinterpret_cast<float*>(smem);  // [WARPS_N][BM][SO]
#pragma unroll
    for (int mi = 0; mi < kMi; ++mi) {
        const int r0 = wm * WR + mi * 16 + g;
#pragma unroll
        for (int n = 0; n < NO; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                *reinterpret_cast<float2*>(os + (wn * BM + r0 + h * 8) * SO + n * 8 + 2 * t) =
                    make_float2(o[mi][n][2 * h], o[mi][n][2 * h + 1]);
        if (t == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m_s[wn][r0 + h * 8] = mrow[mi][h];
                l_s[wn][r0 + h * 8] = lrow[mi][h];
            }
        }
    }
    __syncthreads();

    const bool final_out = nsplit == 1;
    const unsigned long long slot = (unsigned long long)(ws_slot + z) * num_kv_heads + kvh;
    const unsigned long long out_stride = (unsigned long long)num_heads * v_dim;
    for (int idx = tid; idx < BM * (kDv / 4); idx += NT) {
        const int r = idx / (kDv / 4), col = (idx % (kDv / 4)) * 4;
        const unsigned int x = row0 + r;
        if (x >= rows || (unsigned int)col >= v_dim) continue;
        float mx = FA_NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) mx = fmaxf(mx, m_s[w][r]);
        const float m_use = mx == FA_NEG_INF ? 0.0f : mx;
        float l = 0.0f;
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) {
            const float f = exp2f(m_s[w][r] - m_use);
            const float4 p = *reinterpret_cast<const float4*>(os + (w * BM + r) * SO + col);
            l += l_s[w][r] * f;
            acc.x += p.x * f;
            acc.y += p.y * f;
            acc.z += p.z * f;
            acc.w += p.w * f;
        }
        if (final_out) {
            const float inv = 1.0f / l;
            T* dst = out + (unsigned long long)(q_start + x / group) * out_stride +
                     (unsigned long long)(kvh * group + x % group) * v_dim + col;
            *reinterpret_cast<uint2*>(dst) =
                make_uint2(Elem<T>::pack(acc.x * inv, acc.y * inv), Elem<T>::pack(acc.z * inv, acc.w * inv));
        } else {
            *reinterpret_cast<float4*>(ws_acc + (slot * BM + r) * v_dim + col) = acc;
            if (col == 0) *reinterpret_cast<float2*>(ws_ml + (slot * BM + r) * 2) = make_float2(mx, l);
        }
    }
}

}  // namespace fa

#endif  // FMOE_COMMON_FLASH_ATTENTION_CUH
