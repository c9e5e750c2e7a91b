// moe_gemm_fp8_block_sm90: block-scaled fp8 grouped expert GEMM (DeepSeek-V3 scheme) on Hopper
// tensor cores, compiled for sm_90a only.
//
// Operands (e4m3fn codes; scales are dequantization multipliers, x ~ q * s):
//   activations a [rows, kd] with 1 x 128 group scales a_scale f32 [rows, ceil(kd / 128)]
//     (MODE 1: rows = tokens, route rt reads row rt / top_k; MODE 2: rows = routes);
//   weights w [E, w_rows, kd] with 128 x 128 block scales w_scale f32 [E, ceil(w_rows / 128), ceil(kd / 128)]
//     (DeepSeek-V3's weight_scale_inv; MODE 1: w13 with w_rows = 2N, gate rows first; MODE 2: w2 with
//     w_rows = n_out).
// Per 128-wide K block kb (BK = 128 fp8 = one 128-byte swizzle row = one scale block), each warpgroup
// issues its 4 wgmma.m64n128k32.f32.e4m3.e4m3 into a fresh partial accumulator, waits, and promotes on
// the CUDA cores: acc += partial * (a_scale[row, kb] * w_scale[e, block(col), kb]), the order of
// moe_gemm/cpu.rs (scale product first). The scales of tile kt + 1 are loaded while tile kt runs.
//
// CTA: 64 rows (one M tile of moe_align with BLOCK_M = 64) x 256 weight rows, two warpgroups side by
// side along N, each a 64 x 128 slab (accumulator + partial = 128 registers; a 64 x 256 slab per
// warpgroup would need 256). Ring: STAGES x (64 + 256) x 128 bytes through cp.async (A rows gathered by
// route); the wgmma of a tile is retired before the next barrier, so the ring prefetches STAGES - 1
// tiles ahead.
//
// MODE 1 (GEMM1, w13): the CTA covers 128 output columns n0 = 128 * blockIdx.x (aligned with the
//   1 x 128 output groups); warpgroup w takes gate rows n0 + 64w + [0, 64) and the matching up rows
//   N + n0 + 64w + [0, 64). The gate rows lie in one weight block; the up rows straddle two when
//   N % 128 != 0, so their scale is chosen per column. Epilogue: h = silu(gate) * up in f32, then the
//   per-token-group quantization of h fused: the row amax over the CTA's 128 columns (quad shuffles,
//   then the two warpgroups through shared memory), s = max(amax, 1e-10) / 448, q = sat_rne(h / s)
//   -> q_out e4m3 [R, n_out] and s_out f32 [R, ceil(n_out / 128)] (route order): the GEMM2 operand.
//   A non-finite h sets *error_flag. No split-K (gridDim.z must be 1).
// MODE 2 (GEMM2, w2): output columns n0 = 256 * blockIdx.x, warpgroup w's 128 columns lie in weight
//   block n0 / 128 + w; y32[rt / top_k] += topk_weights[rt] * value with f32 vector atomics
//   (red.global.add.v2.f32; y32 zeroed by the caller); the K blocks may be split over gridDim.z.
//
// Contract: kd % 16 == 0 (16-byte cp.async rows, zero-filled past kd: a ragged last K block is
// fine), n_out % 16 == 0 in MODE 1 (it is GEMM2's kd), n_out % 2 == 0 in MODE 2.
// Launch: grid (MODE 1: ceil(n_out / 128), MODE 2: ceil(n_out / 256); capacity / 64; splits), block 256
// threads, dynamic shared memory STAGES * 320 * 128 + 1024 bytes (STAGES 3..5).

#include "common/async_copy.cuh"
#include "common/atomics.cuh"
#include "common/fp8.cuh"
#include "common/k_split.cuh"
#include "common/math.cuh"
#include "common/sm90_wgmma.cuh"
#include "common/pdl.cuh"

#ifndef MODE
#define MODE 1
#endif
#ifndef STAGES
#define STAGES 5
#endif
#define BM 64
#define BK 128  // fp8 elements (= bytes) = one 128-byte swizzle row = one scale block along K
#define NB 256  // weight rows per CTA: two warpgroups x 128
#define NTHREADS 256
#define A_BYTES (BM * BK)
#define B_BYTES (NB * BK)
#define STAGE_BYTES (A_BYTES + B_BYTES)

static_assert(STAGES >= 2, "one tile in wgmma, one loading");

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fmoe_moe_gemm_fp8_block(const unsigned char* __restrict__ a, const float* __restrict__ a_scale,
                        const unsigned char* __restrict__ w, const float* __restrict__ w_scale,
                        const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                        const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                        unsigned char* __restrict__ q_out, float* __restrict__ s_out, float* __restrict__ y32,
                        unsigned int* __restrict__ error_flag, unsigned int num_routes, unsigned int top_k,
                        unsigned int kd, unsigned int n_out) {
#if PDL
    FMOE_PDL_ENTER_GEMM_FP8_BLOCK();  // first: see common/pdl.cuh
#endif
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ unsigned int route[BM];

    const unsigned int m0 = blockIdx.y * BM;
    if (m0 >= *total) return;
    const unsigned int e = block_experts[blockIdx.y];
    const unsigned int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned int g = lane >> 2, t = lane & 3, wg = tid >> 7;

    // 1024-byte aligned ring (swizzle atoms must be).
    const unsigned int raw = static_cast<unsigned int>(__cvta_generic_to_shared(smem_raw));
    const unsigned int ring = (raw + 1023) & ~1023u;

    const unsigned int kblocks = (kd + BK - 1) / BK;  // K tiles = scale blocks along K
#if MODE == 1
    const unsigned int n0 = blockIdx.x * 128;
    const unsigned int w_rows = 2 * n_out;
#else
    const unsigned int n0 = blockIdx.x * NB;
    const unsigned int w_rows = n_out;
#endif
    const unsigned char* we = w + (unsigned long long)e * w_rows * kd;
    const unsigned int wrb = (w_rows + 127) / 128;
    const float* wse = w_scale + (unsigned long long)e * wrb * kblocks;

    if (tid < BM) route[tid] = sorted_routes[m0 + tid];
    __syncthreads();

    auto load_stage = [&](unsigned int stage, unsigned int k0) {
        const unsigned int sa = ring + stage * STAGE_BYTES, sb = sa + A_BYTES;
#pragma unroll
        for (int i = 0; i < BM * 8 / NTHREADS; ++i) {
            const unsigned int c = tid + i * NTHREADS, r = c >> 3, ch = c & 7, col = k0 + ch * 16;
            const unsigned int rt = route[r];
            const bool ok = rt < num_routes && col < kd;
#if MODE == 1
            const unsigned long long row = ok ? rt / top_k : 0;
#else
            const unsigned long long row = ok ? rt : 0;
#endif
            cp_async16(sa + swz(r, ch), a + (ok ? row * kd + col : 0), ok);
        }
#pragma unroll
        for (int i = 0; i < NB * 8 / NTHREADS; ++i) {
            const unsigned int c = tid + i * NTHREADS, r = c >> 3, ch = c & 7, col = k0 + ch * 16;
#if MODE == 1
            // smem rows [128w, 128w + 64): gate rows n0 + 64w + i; [128w + 64, 128w + 128): the up rows.
            const unsigned int rr = r & 127, n = n0 + 64 * (r >> 7) + (rr & 63);
            const unsigned long long wr = (rr < 64 ? 0ull : (unsigned long long)n_out) + n;
            const bool ok = n < n_out && col < kd;
#else
            const unsigned long long wr = n0 + r;
            const bool ok = n0 + r < n_out && col < kd;
#endif
            cp_async16(sb + swz(r, ch), we + (ok ? wr * kd + col : 0), ok);
        }
    };

    // This thread's accumulator rows (both warpgroups cover the same 64 rows).
    const unsigned int r0 = (warp & 3) * 16 + g;
    const unsigned int rt0 = route[r0], rt1 = route[r0 + 8];
    const bool v0 = rt0 < num_routes, v1 = rt1 < num_routes;
#if MODE == 1
    const float* as0 = a_scale + (v0 ? (unsigned long long)(rt0 / top_k) * kblocks : 0);
    const float* as1 = a_scale + (v1 ? (unsigned long long)(rt1 / top_k) * kblocks : 0);
    // Gate rows n0 + 64 wg + [0, 64) lie in block n0 / 128; the up rows n_out + n0 + 64 wg + c lie in
    // block bu for c < thr and in bu + 1 beyond (N % 128 != 0).
    const unsigned int up0 = n_out + n0 + 64 * wg;
    // A warpgroup whose columns all lie past N (n0 + 64 wg >= N) would index a block past the
    // last one: clamp; its results are never stored.
    const unsigned int bu = min(up0 >> 7, wrb - 1), bu1 = min(bu + 1, wrb - 1);
    const int thr = (int)((bu + 1) * 128 - up0);
    const float* wsg = wse + (unsigned long long)(n0 >> 7) * kblocks;
    const float* wsu0 = wse + (unsigned long long)bu * kblocks;
    const float* wsu1 = wse + (unsigned long long)bu1 * kblocks;
#else
    const float* as0 = a_scale + (v0 ? (unsigned long long)rt0 * kblocks : 0);
    const float* as1 = a_scale + (v1 ? (unsigned long long)rt1 * kblocks : 0);
    const float* wsn = wse + (unsigned long long)min((n0 >> 7) + wg, wrb - 1) * kblocks;
#endif

    float acc[64], part[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = part[i] = 0.0f;

    const KSplit split = k_split(kblocks);
    const unsigned int kb0 = split.first, ktiles = split.count;
    if (ktiles == 0) return;

    constexpr int AHEAD = STAGES - 1;  // every wgmma is retired before the next barrier
#pragma unroll
    for (int st = 0; st < AHEAD; ++st) {
        if (st < ktiles) load_stage(st, (kb0 + st) * BK);
        cp_async_commit();
    }

    // Scales of the next tile, loaded one tile ahead.
    float nsa0, nsa1;
#if MODE == 1
    float nwg, nwu0, nwu1;
#else
    float nwn;
#endif
    auto load_scales = [&](unsigned int kb) {
        nsa0 = v0 ? as0[kb] : 0.0f;
        nsa1 = v1 ? as1[kb] : 0.0f;
#if MODE == 1
        nwg = wsg[kb]; nwu0 = wsu0[kb]; nwu1 = wsu1[kb];
#else
        nwn = wsn[kb];
#endif
    };
    load_scales(kb0);

    for (unsigned int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<AHEAD - 1>();
        fence_proxy_async_shared();  // the copies above, for the tensor cores
        // Tile kt is complete for everyone, and every warpgroup has retired tile kt - 1, whose slot
        // is refilled below.
        __syncthreads();
        if (kt + AHEAD < ktiles) load_stage((kt + AHEAD) % STAGES, (kb0 + kt + AHEAD) * BK);
        cp_async_commit();

        const float sa0 = nsa0, sa1 = nsa1;
#if MODE == 1
        const float cwg = nwg, cwu0 = nwu0, cwu1 = nwu1;
#else
        const float cwn = nwn;
#endif
        if (kt + 1 < ktiles) load_scales(kb0 + kt + 1);

        const unsigned int sa = ring + (kt % STAGES) * STAGE_BYTES;
        const unsigned int sb = sa + A_BYTES + wg * (128 * 128);
        const unsigned long long da = smem_desc(sa), db = smem_desc(sb);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 32; ++ks)
            // 32 fp8 elements along K = 32 bytes = 2 descriptor units; the first step overwrites.
            wgmma_m64n128k32_e4m3(part, da + 2 * ks, db + 2 * ks, ks > 0);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands<64>(part);

        // Promotion. part[4j + 2h + q]: row r0 + 8h, slab column 8j + 2t + q.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float s_a = h ? sa1 : sa0;
#if MODE == 1
            const float sg = s_a * cwg, su0 = s_a * cwu0, su1 = s_a * cwu1;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int i = 4 * j + 2 * h + q;
                    acc[i] = fmaf(part[i], sg, acc[i]);
                    const int iu = 4 * (j + 8) + 2 * h + q;
                    acc[iu] = fmaf(part[iu], (8 * j + 2 * (int)t + q) < thr ? su0 : su1, acc[iu]);
                }
            }
#else
            const float s = s_a * cwn;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
#pragma unroll
                for (int q = 0; q < 2; ++q) acc[4 * j + 2 * h + q] = fmaf(part[4 * j + 2 * h + q], s, acc[4 * j + 2 * h + q]);
            }
#endif
        }
    }

#if MODE == 1
    // h = silu(gate) * up for output columns n0 + 64 wg + 8j + 2t + q (j < 8), then the 1 x 128 group
    // quantization of h over the CTA's 128 columns.
    __shared__ unsigned int red[2][BM];
    float hv[2][16];
    unsigned int m[2] = {0u, 0u};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const bool valid = h ? v1 : v0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const float v = silu(acc[4 * j + 2 * h + q]) * acc[4 * (j + 8) + 2 * h + q];
                hv[h][2 * j + q] = v;
                const unsigned int n = n0 + 64 * wg + 8 * j + 2 * t + q;
                if (valid && n < n_out) m[h] = max(m[h], __float_as_uint(v) & 0x7FFFFFFFu);
            }
        }
        m[h] = max(m[h], __shfl_xor_sync(0xffffffffu, m[h], 1));
        m[h] = max(m[h], __shfl_xor_sync(0xffffffffu, m[h], 2));
        if (t == 0) red[wg][r0 + 8 * h] = m[h];
    }
    __syncthreads();
    const unsigned int groups = (n_out + 127) / 128;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!(h ? v1 : v0)) continue;
        const unsigned int rt = h ? rt1 : rt0;
        const unsigned int ab = max(red[0][r0 + 8 * h], red[1][r0 + 8 * h]);
        const float s = scale_from_amax(__uint_as_float(ab));
        unsigned char* qrow = q_out + (unsigned long long)rt * n_out;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const unsigned int n = n0 + 64 * wg + 8 * j + 2 * t;  // even; n_out even
            if (n < n_out)
                *reinterpret_cast<unsigned short*>(qrow + n) =
                    e4m3x2(__fdiv_rn(hv[h][2 * j], s), __fdiv_rn(hv[h][2 * j + 1], s));
        }
        if (wg == 0 && t == 0) {
            s_out[(unsigned long long)rt * groups + blockIdx.x] = s;
            if (ab >= 0x7F800000u) atomicExch(error_flag, 1u);
        }
    }
#else
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (!(h ? v1 : v0)) continue;
        const unsigned int rt = h ? rt1 : rt0;
        const float wt = topk_weights[rt];
        float* yrow = y32 + (unsigned long long)(rt / top_k) * n_out;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned int c = n0 + 128 * wg + 8 * j + 2 * t;  // even; n_out even
            if (c < n_out) red_add_v2(yrow + c, wt * acc[4 * j + 2 * h], wt * acc[4 * j + 2 * h + 1]);
        }
    }
#endif
}
