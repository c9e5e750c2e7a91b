// moe_gemm_fp8_sm90: the grouped expert GEMM of moe_gemm_bf16_sm90.cu with per-tensor-scaled fp8
// (OCP e4m3fn) operands, on Hopper tensor cores: wgmma.m64n{WG_N}k32.f32.e4m3.e4m3, both operands
// K-major (the only layout fp8 wgmma takes). Compiled for sm_90a only.
//
// Same structure as the bf16 kernel: BM / 64 warpgroups per CTA compute a BM x WG_N tile; a
// STAGES-deep cp.async ring of 128-byte-swizzled tiles (A rows gathered by route); BK = 128 fp8
// elements = 128 bytes = one swizzle row, so the tile bytes, descriptors and the 32-byte K step per
// wgmma are exactly the bf16 kernel's (k32 fp8 = k16 bf16 = 32 bytes). One wgmma group stays in
// flight; the ring prefetches STAGES - 2 tiles ahead.
//
// Scales (per-tensor, dequantization multipliers, x ~ q * s): the activation scale a_scale[0] and
// the expert's weight scale w_scale[e] are applied once per dot product, in the epilogue
// (value = acc * (a_scale * w_scale[e]), as moe_gemm/cpu.rs does).
//
// MODE 1 (GEMM1): a = quantized tokens [M, K] (row rt / top_k), w = w13 codes [E, 2N, K] (gate rows
//   first); a CTA's WG_N B rows pair WG_N / 2 gate rows with the matching up rows. Epilogue:
//   h = silu(gate) * up rounded to bf16 into h_out [R, N] (route order), and, if h_amax is not null,
//   atomicMax of the bits of |h| (the bf16-rounded value) into *h_amax (zeroed by the caller): the
//   global amax for the per-tensor requantization of h, so only the cast pass
//   (quant_fp8.cu:fmoe_fp8_quant_tensor with that amax) remains before GEMM2. A non-finite h shows up
//   as amax bits >= 0x7F800000, which the cast pass flags.
// MODE 2 (GEMM2): a = quantized h [R, N] (row rt), w = w2 codes [E, K, N]; y32[rt / top_k] +=
//   topk_weights[rt] * value with f32 vector atomics (red.global.add.v2.f32); the reduction may be
//   split over gridDim.z (y32 zeroed by the caller).
//
// PROMOTE 1 (WG_N 128 only): each 128-wide K tile goes into a fresh partial accumulator that is
// added to an f32 register accumulator once the tile's wgmma retire (no wgmma overlap across tiles,
// ring prefetch STAGES - 1), as the block-scaled kernel does; PROMOTE 0 keeps the whole K reduction in
// the tensor-core accumulator, whose fp8 accumulation keeps fewer bits than f32. Measured on an H200
// against an f64 reference on the same codes (M = 64): PROMOTE 0 adds ~2e-3 (GEMM1, K = 4096/7168)
// and 1.1e-3..2.2e-3 (GEMM2, K = 2048/14336) relative error, PROMOTE 1 ~2e-4; both far below the
// fp8 quantization error itself (~6.5e-2). PROMOTE 1 costs nothing while bandwidth-bound (M <= 256)
// and ~1.3-1.6x GEMM time when compute-bound (no wgmma overlap, 64 x 128 tiles).
//
// Contract: kd % 16 == 0 (16-byte rows for cp.async; zero-filled past kd), n_out % 2 == 0 (paired
// stores; GEMM2's reduction dim is GEMM1's n_out, so N % 16 == 0 for the whole layer). Routes
// aligned by moe_align.cu with BLOCK_M = BM.
// Launch: grid (ceil(n_out / (MODE 1 ? WG_N / 2 : WG_N)), capacity / BM, MODE 1 ? 1 : splits),
// block BM / 64 * 128 threads, dynamic shared memory STAGES * (BM + WG_N) * 128 + 1024 bytes.

#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "common/atomics.cuh"
#include "common/math.cuh"
#include "common/moe_epilogue.cuh"
#include "common/moe_tile.cuh"
#include "common/sm90_wgmma.cuh"
#include "common/pdl.cuh"

#ifndef MODE
#define MODE 1
#endif
#ifndef WG_N
#define WG_N 256
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef BM
#define BM 64  // 64 or 128: one warpgroup per 64 rows
#endif
#ifndef PROMOTE
#define PROMOTE 0  // 1: promote to an f32 register accumulator every K tile (WG_N 128 only)
#endif
#define BK 128  // fp8 elements (= bytes): one 128-byte swizzle row
#define NTHREADS (BM / 64 * 128)
#define A_BYTES (BM * BK)
#define B_BYTES (WG_N * BK)
#define STAGE_BYTES (A_BYTES + B_BYTES)

static_assert(WG_N == 128 || WG_N == 256, "wgmma tile width");
static_assert(BM == 64 || BM == 128, "M tile");
static_assert(STAGES >= 3, "one tile in wgmma, one landing, one loading");
static_assert(!PROMOTE || WG_N == 128, "promotion needs a second accumulator: 64 + 64 registers");

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fmoe_moe_gemm_fp8(const unsigned char* __restrict__ a, const unsigned char* __restrict__ w,
                  const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                  const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                  const float* __restrict__ a_scale, const float* __restrict__ w_scale,
                  __nv_bfloat16* __restrict__ h_out, unsigned int* __restrict__ h_amax, float* __restrict__ y32,
                  unsigned int num_routes, unsigned int top_k, unsigned int kd, unsigned int n_out) {
#if PDL
    FMOE_PDL_ENTER_GEMM_FP8();  // first: see common/pdl.cuh
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

#if MODE == 1
    const unsigned int n0 = blockIdx.x * (WG_N / 2);
    const unsigned long long w_rows = 2ull * n_out;
#else
    const unsigned int n0 = blockIdx.x * WG_N;
    const unsigned long long w_rows = n_out;
#endif
    const unsigned char* we = w + (unsigned long long)e * w_rows * kd;

    if (tid < BM) route[tid] = sorted_routes[m0 + tid];
    __syncthreads();

    auto load_stage = [&](unsigned int stage, unsigned int k0) {
        const unsigned int sa = ring + stage * STAGE_BYTES, sb = sa + A_BYTES;
        // A rows are gathered inline: the same loop moved into a helper changes the MODE 2 code
        // NVRTC emits (cubin fingerprints), which only a GPU run could vouch for.
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
        load_weight_tile<unsigned char, WG_N, NTHREADS, MODE == 1>(sb, we, n0, n_out, kd, k0, tid);
    };

    float acc[WG_N / 2];
#pragma unroll
    for (int i = 0; i < WG_N / 2; ++i) acc[i] = 0.0f;
#if PROMOTE
    float part[WG_N / 2];
#pragma unroll
    for (int i = 0; i < WG_N / 2; ++i) part[i] = 0.0f;
#endif

    const KSplit split = k_split((kd + BK - 1) / BK);
    const unsigned int kbase = split.first * BK, ktiles = split.count;
    if (ktiles == 0) return;

#if PROMOTE
    constexpr int AHEAD = STAGES - 1;  // every wgmma is retired before the next barrier
#else
    constexpr int AHEAD = STAGES - 2;  // tiles prefetched beyond the one being consumed
#endif
#pragma unroll
    for (int st = 0; st < AHEAD; ++st) {
        if (st < ktiles) load_stage(st, kbase + st * BK);
        cp_async_commit();
    }
    for (unsigned int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<AHEAD - 1>();
        fence_proxy_async_shared();  // the copies above, for the tensor cores
        // Tile kt is complete for everyone, and every warpgroup has retired the wgmma group of
        // tile kt - 2, whose slot is refilled below (the group of kt - 1 may still be running).
        __syncthreads();
        if (kt + AHEAD < ktiles) load_stage((kt + AHEAD) % STAGES, kbase + (kt + AHEAD) * BK);
        cp_async_commit();

        const unsigned int sa = ring + (kt % STAGES) * STAGE_BYTES + wg * (64 * 128), sb = ring + (kt % STAGES) * STAGE_BYTES + A_BYTES;
        const unsigned long long da = smem_desc(sa), db = smem_desc(sb);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 32; ++ks) {
            // Advancing 32 fp8 elements along K moves the start address by 32 bytes (2 in 16-byte units).
#if PROMOTE
            wgmma_m64n128k32_e4m3(part, da + 2 * ks, db + 2 * ks, ks > 0);
#elif WG_N == 256
            wgmma_m64n256k32_e4m3(acc, da + 2 * ks, db + 2 * ks, 1);
#else
            wgmma_m64n128k32_e4m3(acc, da + 2 * ks, db + 2 * ks, 1);
#endif
        }
        wgmma_commit();
#if PROMOTE
        // The tensor cores accumulate fp8 products with fewer mantissa bits than f32; adding each
        // 128-wide K tile's partial sums into registers bounds that error (DeepSeek-V3's promotion).
        wgmma_wait<0>();
        wgmma_fence_operands<WG_N / 2>(part);
#pragma unroll
        for (int i = 0; i < WG_N / 2; ++i) acc[i] += part[i];
#else
        wgmma_wait<1>();
#endif
    }
    wgmma_wait<0>();
    wgmma_fence_operands<WG_N / 2>(acc);

    // Per-tensor scales, once per dot product.
    const float sc = a_scale[0] * w_scale[e];

    // Epilogue. acc[4j + q]: row 64 * wg + 16 * (warp % 4) + g (+8 for q >= 2), column 8j + 2t + (q & 1).
#if MODE == 1
    unsigned int hmax = 0;  // bits of max |h|
#endif
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const unsigned int rt = route[wg * 64 + (warp & 3) * 16 + g + half * 8];
        if (rt >= num_routes) continue;
#if MODE == 1
        hmax = silu_mul_row<WG_N, true>(acc, half, t, sc, h_out + (unsigned long long)rt * n_out, n0, n_out, hmax);
#else
        weighted_add_row<WG_N, true>(acc, half, t, sc, topk_weights[rt], y32 + (unsigned long long)(rt / top_k) * n_out, n0, n_out);
#endif
    }
#if MODE == 1
    if (h_amax != nullptr) {
        hmax = warp_max(hmax);
        if (lane == 0 && hmax != 0) atomicMax(h_amax, hmax);
    }
#endif
}
