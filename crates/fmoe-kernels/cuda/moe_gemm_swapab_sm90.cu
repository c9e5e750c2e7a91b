// moe_gemm_swapab_sm90: the decode-sized grouped expert GEMMs ("swap-AB"), for batches with a few
// routes per expert, fp8 (ELEM_BF16=0, both scaling schemes) and bf16 (ELEM_BF16=1). Same
// arguments, MODEs, epilogues and outputs as the kernels they replace there (moe_gemm_fp8_sm90.cu,
// per-tensor; moe_gemm_fp8_block_sm90.cu, block-scaled; moe_gemm_bf16_sm90.cu, bf16: read those
// for the operands), plus the weights' tensor map `b_map` (as moe_gemm_fp8_sm90_ws.cu). Compiled
// for sm_90a only. Entries: fp8 BLOCK_SCALED=0 fmoe_moe_gemm_fp8, 1 fmoe_moe_gemm_fp8_block; bf16
// fmoe_moe_gemm_bf16. One source for both element types: the ring, the loader and the schedule
// are the same bytes (128 of K per row and stage); only the MMA, the promotion and the scales
// differ.
//
// Why: with 1-16 routes per expert a 64-route M tile makes the tensor cores do up to 64x the
// useful work and a CTA holds one tile, so the weight stream runs well below DRAM speed. Here the
// weights are the MMA's M operand and the routes its N: wgmma.m64nBNk32.f32.e4m3.e4m3 (bf16:
// m64nBNk16.f32.bf16.bf16) with A = 64 weight rows and B = the BN routes of one expert's block
// (moe_align with BLOCK_M = BN), the accumulator D[weight row, route] = the transposed output tile.
// BN (-D BN) = 16 below 16 routes per expert on average, 32 from 16 to below 25 (the host rule,
// moe_gemm/cuda_fp8/mod.rs: one block holds nearly every expert's routes there, two blocks per
// SM); 64 from 25 to below 49 (block-scaled: 57), one block per SM with a loader warpgroup and
// PERSISTENT=1 DYNAMIC=1 (below); 128 (bf16 keeping one wgmma group in flight, fp8 one partial for
// both slabs and setmaxnreg 40 / 232) through a dev knob only.
// The BN = 16 CUBINs are byte-identical to those before BN existed.
//
// Tile: 256 weight rows x BN routes, the whole K range (MODE 1) or a split of it (MODE 2). A CTA
// runs one tile (grid: route blocks, N tiles, splits) or, PERSISTENT=1, walks the tile space (N
// tiles fastest, then the busy route blocks, then splits; ROUTE_BLOCKS_FASTEST=1 swaps the first
// two) with one block per SM, striding by gridDim.x or, DYNAMIC=1, claiming tiles: the ring and its phases continue across
// tiles, so the loader fills the next tile's stages while the MMA warps run this one's epilogue,
// and N tiles fastest read a route block's activations once from DRAM. 288 threads (BN >= 64:
// 384): warpgroups 0 and 1 multiply, warp 8 (BN >= 64: warps 8-11) loads. Per 128-byte K step
// (BK = 128 fp8 or 64 bf16 elements) the loader issues two TMA boxes of 128 weight rows x 128 bytes
// (128-byte swizzle; w viewed as [E * w_rows, kd]) and gathers the BN activation rows with cp.async
// (16 bytes each, zero-filled for padding routes and past kd), both completing on the stage's full
// mbarrier (the copies through
// cp.async.mbarrier.arrive.noinc), through a STAGES-deep ring: STAGES x 32 KiB of weights in flight
// per CTA. Rows of the weight tile: [0, 128) from row half0, [128, 256) from row half1 of the
// expert; MODE 1: half0 = n0 (gate rows), half1 = n_out + n0 (the matching up rows), output
// columns n0 .. n0 + 127; MODE 2: half0 = n0, half1 = n0 + 128, output columns n0 .. n0 + 255.
// Rows past n_out read other rows of w or TMA's zero fill; their results are never stored.
// Warpgroup w multiplies the 64-row slabs w and 2 + w (MODE 1: gate and up rows of the same output
// columns n0 + 64w + [0, 64), so SiLU(gate) * up pairs registers of one thread).
//
// fp8: every 128-wide K step goes into a fresh partial accumulator (4 wgmma per slab), retired and
// promoted into f32 registers (per-tensor: acc += part, as the small per-tensor kernel's PROMOTE=1;
// block: acc += part * (a_scale[route, kb] * w_scale[e, row block, kb]), the order of
// moe_gemm/cpu.rs; A's group scales and the two weight-block rows of each 128-row half travel in
// the stage).
// bf16: the 4 wgmma per slab and step accumulate straight into acc (products of bf16 are exact in
// f32, as in moe_gemm_bf16_sm90.cu). Either way each step retires before its slot is released, so
// all STAGES slots stay loading.
// Accumulator layout (NACC = BN / 2 per slab): part[4j + 2h + q] = slab row 16 * (warp % 4) + g + 8h,
// route column 8j + 2t + q, j < BN / 8.
//
// Epilogues (as the kernels replaced; bf16 = per-tensor with s = 1 and no amax): MODE 1 per-tensor h = bf16(silu(gate * s) * (up * s)),
// s = a_scale * w_scale[e], into h_out [R, n_out], atomicMax of |h| bits into *h_amax (if not null);
// MODE 1 block: h in f32, its 1 x 128 group quantization over the CTA's 128 columns (a column
// reduction across the 8 MMA warps) into q_out / s_out, *error_flag on a non-finite h; MODE 2:
// y32[rt / top_k] += topk_weights[rt] * value (f32 reductions, split-K partial sums meet there).
//
// Contract: kd * element size % 16 == 0 (TMA rows and 16-byte copies: kd % 16 fp8, kd % 8 bf16);
// MODE 1 block: n_out % 16 == 0. Routes
// aligned by moe_align with BLOCK_M = BN. Launch: grid (route blocks, ceil(n_out / (MODE 1 ? 128 :
// 256)), MODE 1 ? 1 : splits) (route blocks fastest, so the blocks of one expert run together and
// share its weight tiles in L2), or PERSISTENT=1: at most one block per SM, the same three counts
// as trailing arguments (m_blocks, n_tiles, splits) and, DYNAMIC=1, a u32 tile counter zeroed by
// the host; NTHREADS threads, dynamic shared memory
// STAGES * (256 + BN) * 128 + 1024.

#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "common/fp8.cuh"
#include "common/k_split.cuh"
#include "common/math.cuh"
#include "common/sm90_pipeline.cuh"
#include "common/sm90_wgmma.cuh"
#include "common/pdl.cuh"

#ifndef MODE
#define MODE 1
#endif
#ifndef BLOCK_SCALED
#define BLOCK_SCALED 0
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef ELEM_BF16
#define ELEM_BF16 0
#endif
#ifndef BN
#define BN 16    // routes per tile (wgmma N): 16, 32, 64 or 128
#endif
// PERSISTENT=1: one block per SM walks the tile space (see "Tile" above; the host sets it for
// both GEMMs from BN = 64 on, where a block fills the SM); ROUTE_BLOCKS_FASTEST=1 orders that walk
// as the per-tile grid (a dev experiment).
#ifndef PERSISTENT
#define PERSISTENT 0
#endif
#ifndef ROUTE_BLOCKS_FASTEST
#define ROUTE_BLOCKS_FASTEST 0
#endif
// DYNAMIC=1 (PERSISTENT only; the host's default): block b takes tile b first, then the next id
// of a global counter (from gridDim.x on; zeroed by the host), as the warp-specialized kernels do:
// loader thread 0 claims and hands the id to the other loader threads (named barrier 2) and to
// the MMA warps (a two-slot ring with its own mbarriers), so faster SMs take more tiles (with the
// stride, GEMM2 ran slower persistent than a block per tile: the slowest SM's share decided).
#ifndef DYNAMIC
#define DYNAMIC 0
#endif
static_assert(!DYNAMIC || PERSISTENT, "the dynamic schedule is a persistent grid's");
#define NACC (BN / 2)  // accumulators per thread and 64-row slab (wgmma m64nBN)
#define NJ (BN / 8)    // 8-route column groups per slab
// fp8 partials: one per slab, or at BN = 128 one shared by both slabs in turn (2 x 64 accumulators
// + 2 x 64 partials would pass the 168 registers a thread may hold with 3 warps per SM sub-partition).
#define PARTS (BN >= 128 ? 1 : 2)
// fp8 at BN = 128: acc (128) + partial (64) pass the 168 registers of 384 threads; the loader
// warpgroup gives its registers to the MMA warpgroups (40 / 232, as moe_gemm_fp8_sm90_ws.cu).
#define SETMAXNREG (!ELEM_BF16 && BN >= 128)
#define ROW_BYTES 128  // of K per row and stage: one 128-byte swizzle row
#if ELEM_BF16
typedef __nv_bfloat16 elem_t;
#define BK 64    // bf16 elements per K step
#else
typedef unsigned char elem_t;
#define BK 128   // fp8 elements (= bytes) per K step: one scale block along K
#endif
#define ROWS 256  // weight rows per tile: two TMA boxes of 128
#define HALF_BYTES (128 * ROW_BYTES)
#define W_BYTES (ROWS * ROW_BYTES)
#define B_BYTES (BN * ROW_BYTES)
#define SLAB_BYTES (64 * ROW_BYTES)
// Loader warps: one up to BN = 32; a warpgroup from 64 on, so the BN * 8 activation copies per
// stage are issued by 128 threads instead of 32 (288 or 384 threads: 3 warps per SM sub-partition
// either way, so the same 168 registers per thread).
#define LOADER_WARPS (BN >= 64 ? 4 : 1)
#define LOADERS (32 * LOADER_WARPS)
#define NTHREADS (256 + LOADERS)
#define NO_ROW 0xFFFFFFFFu

static_assert(STAGES >= 2, "one stage in the tensor cores, one loading");
static_assert(BK * sizeof(elem_t) == ROW_BYTES, "one swizzle row per K step");
static_assert(!(ELEM_BF16 && BLOCK_SCALED), "block scales are fp8 only");
static_assert(B_BYTES % 1024 == 0, "swizzle atoms are 1024-byte aligned");
static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 128, "wgmma N of the route block");
static_assert(BN * 8 % LOADERS == 0, "whole 16-byte chunks per loader thread");
static_assert(BN <= LOADERS, "one group scale per loader thread and stage");
#define COPIES (BN * 8 / LOADERS)  // 16-byte activation copies per loader thread and stage

// The route block's MMA: D[64 weight rows x BN routes] (+)= A * B^T.
#if BN == 16
#define WGMMA_BF16 wgmma_m64n16k16_bf16
#define WGMMA_E4M3 wgmma_m64n16k32_e4m3
#elif BN == 32
#define WGMMA_BF16 wgmma_m64n32k16_bf16
#define WGMMA_E4M3 wgmma_m64n32k32_e4m3
#elif BN == 64
#define WGMMA_BF16 wgmma_m64n64k16_bf16
#define WGMMA_E4M3 wgmma_m64n64k32_e4m3
#else
#define WGMMA_BF16 wgmma_m64n128k16_bf16
#define WGMMA_E4M3 wgmma_m64n128k32_e4m3
#endif

// The 256 consumer threads only (the loader warp has left): bar.sync with a count.
__device__ __forceinline__ void mma_threads_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

// The activation row a route's column gathers: its token (MODE 1) or its own row (MODE 2), NO_ROW
// for padding.
__device__ __forceinline__ unsigned int route_row(unsigned int rt, unsigned int num_routes, unsigned int top_k) {
#if MODE == 1
    return rt < num_routes ? rt / top_k : NO_ROW;
#else
    (void)top_k;
    return rt < num_routes ? rt : NO_ROW;
#endif
}

// One tile: route block rb (its first slot m0), N tile nt (output columns n0 ..; weight rows of
// the two TMA boxes half0, half1) and its share of the K steps; idle: no busy slots or no K steps
// (both roles skip it alike).
struct SwapTile {
    unsigned int rb, m0, nt, n0, half0, half1, kb0, ktiles;
    bool idle;
};
// The persistent tile space (swap_tile's and the kernel's trailing parameters), and the kernel's
// tile counter after it with DYNAMIC.
#if PERSISTENT
#define SWAP_TILE_PARAMS , unsigned int m_blocks, unsigned int n_tiles, unsigned int splits
#define SWAPAB_TILE_SPACE_ARGS m_busy, n_tiles, splits,
#else
#define SWAP_TILE_PARAMS
#define SWAPAB_TILE_SPACE_ARGS
#endif
#if DYNAMIC
#define SWAPAB_TILE_SPACE SWAP_TILE_PARAMS, unsigned int* tile_counter
#else
#define SWAPAB_TILE_SPACE SWAP_TILE_PARAMS
#endif
__device__ __forceinline__ SwapTile swap_tile(unsigned int ti SWAP_TILE_PARAMS, unsigned int kblocks,
                                              unsigned int n_out, unsigned int busy) {
    SwapTile tile;
#if PERSISTENT
#if ROUTE_BLOCKS_FASTEST
    tile.rb = ti % m_blocks;
    tile.nt = (ti / m_blocks) % n_tiles;
#else
    tile.nt = ti % n_tiles;
    tile.rb = (ti / n_tiles) % m_blocks;
#endif
    const KSplit split = k_split_of(kblocks, ti / (m_blocks * n_tiles), splits);
#else
    (void)ti;
    tile.rb = blockIdx.x;
    tile.nt = blockIdx.y;
    const KSplit split = k_split(kblocks);
#endif
    tile.m0 = tile.rb * BN;
    tile.kb0 = split.first;
    tile.ktiles = split.count;
#if MODE == 1
    tile.n0 = tile.nt * 128;
    tile.half0 = tile.n0;
    tile.half1 = n_out + tile.n0;  // the matching up rows
#else
    (void)n_out;
    tile.n0 = tile.nt * ROWS;
    tile.half0 = tile.n0;
    tile.half1 = tile.n0 + 128;
#endif
    tile.idle = tile.m0 >= busy || tile.ktiles == 0;
    return tile;
}

#if ELEM_BF16
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fmoe_moe_gemm_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ w,
                   const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                   const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                   __nv_bfloat16* __restrict__ h_out, float* __restrict__ y32, unsigned int num_routes,
                   unsigned int top_k, unsigned int kd, unsigned int n_out, const __grid_constant__ TmaDesc b_map SWAPAB_TILE_SPACE) {
#if PDL
    FMOE_PDL_ENTER_GEMM_BF16();  // first: see common/pdl.cuh
#if DYNAMIC
    tile_counter = fmoe_pdl_fresh(tile_counter);
#endif
#endif
#elif BLOCK_SCALED
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fmoe_moe_gemm_fp8_block(const unsigned char* __restrict__ a, const float* __restrict__ a_scale,
                        const unsigned char* __restrict__ w, const float* __restrict__ w_scale,
                        const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                        const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                        unsigned char* __restrict__ q_out, float* __restrict__ s_out, float* __restrict__ y32,
                        unsigned int* __restrict__ error_flag, unsigned int num_routes, unsigned int top_k,
                        unsigned int kd, unsigned int n_out, const __grid_constant__ TmaDesc b_map SWAPAB_TILE_SPACE) {
#if PDL
    FMOE_PDL_ENTER_GEMM_FP8_BLOCK();  // first: see common/pdl.cuh
#if DYNAMIC
    tile_counter = fmoe_pdl_fresh(tile_counter);
#endif
#endif
#else
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
fmoe_moe_gemm_fp8(const unsigned char* __restrict__ a, const unsigned char* __restrict__ w,
                  const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                  const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                  const float* __restrict__ a_scale, const float* __restrict__ w_scale,
                  __nv_bfloat16* __restrict__ h_out, unsigned int* __restrict__ h_amax, float* __restrict__ y32,
                  unsigned int num_routes, unsigned int top_k, unsigned int kd, unsigned int n_out,
                  const __grid_constant__ TmaDesc b_map SWAPAB_TILE_SPACE) {
#if PDL
    FMOE_PDL_ENTER_GEMM_FP8();  // first: see common/pdl.cuh
#if DYNAMIC
    tile_counter = fmoe_pdl_fresh(tile_counter);
#endif
#endif
#endif
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];
#if DYNAMIC
    // Tile ids from loader thread 0 to the MMA warps: slot c % 2 holds the block's c-th claim.
    __shared__ __align__(8) unsigned long long tile_full[2], tile_empty[2];
    __shared__ unsigned int tile_ring[2];
#endif
#if BLOCK_SCALED
    __shared__ float a_sc[STAGES][BN];  // the routes' group scales of the stage's K block
    // The expert's weight-block scales of the stage's K block: the two block rows each 128-row
    // half of the weight tile may touch ([half 0: b, b + 1; half 1: b', b' + 1], clamped).
    __shared__ float w_sc[STAGES][4];
#endif

    const unsigned int kblocks = (kd + BK - 1) / BK;
    const unsigned int busy = *total;  // slots of the aligned routes that hold an expert's block
    const unsigned int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned int g = lane >> 2, t = lane & 3, wg = tid >> 7;
#if PERSISTENT
    // Only the busy route blocks (the host's m_blocks is an upper bound): with idle ones in the
    // space, the stride would hand some blocks nothing but idle tiles.
    const unsigned int m_busy = min(m_blocks, busy / BN);
    const unsigned int all_tiles = m_busy * n_tiles * splits;
    const unsigned int first_tile = blockIdx.x, tile_step = gridDim.x;
#else
    if (blockIdx.x * BN >= busy) return;
    const unsigned int all_tiles = 1, first_tile = 0, tile_step = 1;
#endif
#if MODE == 1
    const unsigned int w_rows = 2 * n_out;
#else
    const unsigned int w_rows = n_out;
#endif

    const unsigned int raw = static_cast<unsigned int>(__cvta_generic_to_shared(smem_raw));
    const unsigned int wring = (raw + 1023) & ~1023u;     // STAGES weight tiles
    const unsigned int bring = wring + STAGES * W_BYTES;  // STAGES route tiles
    const unsigned int full0 = static_cast<unsigned int>(__cvta_generic_to_shared(full_bar));
    const unsigned int empty0 = static_cast<unsigned int>(__cvta_generic_to_shared(empty_bar));

#if DYNAMIC
    const unsigned int tfull0 = static_cast<unsigned int>(__cvta_generic_to_shared(tile_full));
    const unsigned int tempty0 = static_cast<unsigned int>(__cvta_generic_to_shared(tile_empty));
#endif
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, LOADERS + 1);  // the loader threads' copies + the TMA issue
            mbar_init(empty0 + 8 * s, 8);      // one arrival per MMA warp
        }
#if DYNAMIC
        for (int j = 0; j < 2; ++j) {
            mbar_init(tfull0 + 8 * j, 1);   // loader thread 0's publication
            mbar_init(tempty0 + 8 * j, 8);  // every MMA warp has read the id
        }
#endif
    }
    __syncthreads();

    // Both roles walk the same tiles and skip the same ones, so their K-step counts (`it`, the
    // ring's slot and phase) agree across tiles.
    unsigned int it = 0;

#if LOADER_WARPS == 1
    if (warp == 8) {
        const unsigned int lt = lane;  // the loader warp
#else
    if (warp >= 8) {
        const unsigned int lt = tid - 256;  // the loader warpgroup
#endif
#if SETMAXNREG
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
#endif
        for (unsigned int claim = 0;; ++claim) {
#if DYNAMIC
            if (lt == 0) tile_claim(claim, tile_ring, tfull0, tempty0, tile_counter);
            // Every loader thread reads the slot before thread 0 refills it two claims later (after
            // the next claim's barrier).
            asm volatile("bar.sync 2, %0;\n" ::"n"(LOADERS) : "memory");
            const unsigned int ti = tile_ring[claim & 1];
#else
            const unsigned int ti = first_tile + claim * tile_step;
#endif
            if (ti >= all_tiles) break;
            const SwapTile tile = swap_tile(ti, SWAPAB_TILE_SPACE_ARGS kblocks, n_out, busy);
            if (tile.idle) continue;
            const unsigned int e = block_experts[tile.rb];
            const int row0 = (int)(e * w_rows);
            // The activation row each of this thread's 16-byte copies gathers (held for the tile).
            unsigned int rows[COPIES];
#pragma unroll
            for (int i = 0; i < COPIES; ++i) rows[i] = route_row(sorted_routes[tile.m0 + ((lt + i * LOADERS) >> 3)], num_routes, top_k);
#if BLOCK_SCALED
            const unsigned int srow = lt < BN ? route_row(sorted_routes[tile.m0 + lt], num_routes, top_k) : NO_ROW;
            // Loader threads 0-3: weight-block scale row lt & 1 of half lt >> 1.
            const unsigned int wrb = (w_rows + 127) / 128;
            const unsigned int wblk = min((((lt >> 1) ? tile.half1 : tile.half0) >> 7) + (lt & 1), wrb - 1);
            const float* wsrc = w_scale + ((unsigned long long)e * wrb + wblk) * kblocks + tile.kb0;
#endif
            for (unsigned int kt = 0; kt < tile.ktiles; ++kt, ++it) {
                const unsigned int s = it % STAGES, full_s = full0 + 8 * s;
                // Slot s last held step it - STAGES: wait until the MMA warps released it.
                if (it >= STAGES) mbar_wait(empty0 + 8 * s, ((it / STAGES) - 1) & 1);
                const unsigned int k0 = (tile.kb0 + kt) * BK, sb = bring + s * B_BYTES;
                if (lt == 0) {
                    mbar_arrive_expect_tx(full_s, W_BYTES);
                    const unsigned int sw = wring + s * W_BYTES;
                    tma_load_2d(sw, &b_map, (int)k0, row0 + (int)tile.half0, full_s);
                    tma_load_2d(sw + HALF_BYTES, &b_map, (int)k0, row0 + (int)tile.half1, full_s);
                }
#pragma unroll
                for (int i = 0; i < COPIES; ++i) {
                    const unsigned int c = lt + i * LOADERS, r = c >> 3, ch = c & 7, col = k0 + ch * (16 / sizeof(elem_t));
                    const bool ok = rows[i] != NO_ROW && col < kd;
                    cp_async16(sb + swz(r, ch), a + (ok ? (unsigned long long)rows[i] * kd + col : 0), ok);
                }
#if BLOCK_SCALED
                if (lt < BN) {
                    const bool ok = srow != NO_ROW;
                    cp_async4(static_cast<unsigned int>(__cvta_generic_to_shared(&a_sc[s][lt])),
                              a_scale + (ok ? (unsigned long long)srow * kblocks + tile.kb0 + kt : 0), ok);
                }
                if (lt < 4) cp_async4(static_cast<unsigned int>(__cvta_generic_to_shared(&w_sc[s][lt])), wsrc + kt, true);
#endif
                cp_async_mbar_arrive(full_s);
            }
        }
        return;
    }

    // MMA warpgroups: slabs wg (tile rows 64 wg ..) and 2 + wg (tile rows 128 + 64 wg ..).
#if SETMAXNREG
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
#endif
    const unsigned int rr = (warp & 3) * 16 + g;  // slab row of part[.. + 2h + ..] for h = 0 (+8 for h = 1)
    for (unsigned int claim = 0;; ++claim) {
#if DYNAMIC
        const unsigned int ti = tile_receive(claim, tile_ring, tfull0, tempty0, lane);
#else
        const unsigned int ti = first_tile + claim * tile_step;
#endif
        if (ti >= all_tiles) break;
        const SwapTile tile = swap_tile(ti, SWAPAB_TILE_SPACE_ARGS kblocks, n_out, busy);
        if (tile.idle) continue;
        const unsigned int e = block_experts[tile.rb];
        const unsigned int m0 = tile.m0, n0 = tile.n0, half0 = tile.half0, half1 = tile.half1;
#if ELEM_BF16
        float acc[2][NACC];
#else
        float acc[2][NACC], part[PARTS][NACC];
#endif
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int v = 0; v < NACC; ++v) acc[i][v] = 0.0f;
        }

#if BLOCK_SCALED
        // Weight-scale slot of expert row (i ? half1 : half0) + 64 wg + rr + 8h in the stage's
        // w_sc: its half's first or second block row (the loaders clamp both alike).
        unsigned int wsi[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned int first = i ? half1 : half0, row = first + 64 * wg + rr + 8 * h;
                wsi[i][h] = 2 * i + (row >> 7) - (first >> 7);
            }
        }
#endif

        for (unsigned int kt = 0; kt < tile.ktiles; ++kt, ++it) {
            const unsigned int s = it % STAGES;
            mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
#if BLOCK_SCALED
            const float w00 = w_sc[s][wsi[0][0]], w01 = w_sc[s][wsi[0][1]], w10 = w_sc[s][wsi[1][0]], w11 = w_sc[s][wsi[1][1]];
#endif
            fence_proxy_async_shared();  // the loader's cp.async writes, for the tensor cores
            const unsigned int sw = wring + s * W_BYTES;
            const unsigned long long db = smem_desc(bring + s * B_BYTES);
            const unsigned long long da0 = smem_desc(sw + wg * SLAB_BYTES);
            const unsigned long long da1 = smem_desc(sw + (2 + wg) * SLAB_BYTES);
            wgmma_fence();
#if ELEM_BF16
            // 16 bf16 along K = 32 bytes = 2 descriptor units.
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) WGMMA_BF16(acc[0], da0 + 2 * ks, db + 2 * ks, 1);
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) WGMMA_BF16(acc[1], da1 + 2 * ks, db + 2 * ks, 1);
            wgmma_commit();
#if BN >= 64
            // The previous stage's group retired: its slot goes back to the loader while this one's
            // MMAs run (the accumulators chain across groups; read only after the loop's wait).
            wgmma_wait<1>();
            if (kt > 0) warp_arrive(empty0 + 8 * ((it - 1) % STAGES), lane);
#else
            wgmma_wait<0>();
            wgmma_fence_operands<NACC>(acc[0]);
            wgmma_fence_operands<NACC>(acc[1]);
            // The stage's wgmma retired: the slot goes back to the loader.
            warp_arrive(empty0 + 8 * s, lane);
#endif
#else
#if BLOCK_SCALED && PARTS == 2
            float sa[NJ][2];  // [j][q]: the group scale of route column 8j + 2t + q
#endif
            // Promotes part[p] (slab i's sums of this K step) into acc[i].
            auto promote = [&](const int i, const int p) {
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
#pragma unroll
                        for (int q = 0; q < 2; ++q) {
                            const int v = 4 * j + 2 * h + q;
#if BLOCK_SCALED
                            const float ws = i ? (h ? w11 : w10) : (h ? w01 : w00);
#if PARTS == 2
                            acc[i][v] = fmaf(part[p][v], sa[j][q] * ws, acc[i][v]);
#else
                            // Read here, not held: 32 registers the BN = 128 promotion does not have
                            // (the slot stays this stage's until both slabs are promoted).
                            acc[i][v] = fmaf(part[p][v], a_sc[s][8 * j + 2 * t + q] * ws, acc[i][v]);
#endif
#else
                            acc[i][v] += part[p][v];
#endif
                        }
                    }
                }
            };
            // 32 fp8 elements along K = 32 bytes = 2 descriptor units; the first step overwrites.
#pragma unroll
            for (int ks = 0; ks < BK / 32; ++ks) WGMMA_E4M3(part[0], da0 + 2 * ks, db + 2 * ks, ks > 0);
#if PARTS == 2
#pragma unroll
            for (int ks = 0; ks < BK / 32; ++ks) WGMMA_E4M3(part[1], da1 + 2 * ks, db + 2 * ks, ks > 0);
#endif
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operands<NACC>(part[0]);
#if PARTS == 2
            wgmma_fence_operands<NACC>(part[1]);
#endif
#if BLOCK_SCALED && PARTS == 2
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
#pragma unroll
                for (int q = 0; q < 2; ++q) sa[j][q] = a_sc[s][8 * j + 2 * t + q];
            }
#endif
#if PARTS == 2
            // The stage's wgmma retired and its scales read: the slot goes back to the loader.
            warp_arrive(empty0 + 8 * s, lane);
            promote(0, 0);
            promote(1, 1);
#else
            // One partial: slab 0's sums are promoted before slab 1 reuses it.
            promote(0, 0);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 32; ++ks) WGMMA_E4M3(part[0], da1 + 2 * ks, db + 2 * ks, ks > 0);
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operands<NACC>(part[0]);
            promote(1, 0);
            // Both slabs promoted, the stage's group scales read: the slot goes back to the loader.
            warp_arrive(empty0 + 8 * s, lane);
#endif
#endif  // ELEM_BF16
        }
#if ELEM_BF16 && BN >= 64
        // The tile's last group, and its slot back to the loader (the next tile's steps reuse it).
        wgmma_wait<0>();
        wgmma_fence_operands<NACC>(acc[0]);
        wgmma_fence_operands<NACC>(acc[1]);
        warp_arrive(empty0 + 8 * ((it - 1) % STAGES), lane);
#endif

#if MODE == 1 && BLOCK_SCALED
        // h = silu(gate) * up at output column n0 + 64 wg + rr + 8h of route column 8j + 2t + q; then the
        // 1 x 128 group quantization of each route's 128 columns: max over h, the 8 row lanes g, the 8
        // MMA warps.
        __shared__ unsigned int red[8][BN];
#if PERSISTENT
        mma_threads_sync();  // every MMA warp has read the previous tile's red
#endif
        float hv[NACC];
        unsigned int m[NJ][2] = {};
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned int n = n0 + 64 * wg + rr + 8 * h;
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int v = 4 * j + 2 * h + q;
                    hv[v] = silu(acc[0][v]) * acc[1][v];
                    if (n < n_out) m[j][q] = max(m[j][q], __float_as_uint(hv[v]) & 0x7FFFFFFFu);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) m[j][q] = max(m[j][q], __shfl_xor_sync(0xffffffffu, m[j][q], o));
                if (g == 0) red[warp][8 * j + 2 * t + q] = m[j][q];
            }
        }
        mma_threads_sync();
        const unsigned int groups = (n_out + 127) / 128;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const unsigned int col = 8 * j + 2 * t + q, rt = sorted_routes[m0 + col];
                if (rt >= num_routes) continue;
                unsigned int ab = 0;
#pragma unroll
                for (int wi = 0; wi < 8; ++wi) ab = max(ab, red[wi][col]);
                const float s = scale_from_amax(__uint_as_float(ab));
                unsigned char* qrow = q_out + (unsigned long long)rt * n_out;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned int n = n0 + 64 * wg + rr + 8 * h;
                    if (n < n_out) qrow[n] = (unsigned char)(e4m3x2(__fdiv_rn(hv[4 * j + 2 * h + q], s), 0.0f) & 0xFFu);
                }
                if (warp == 0 && g == 0) {
                    // One thread per route column: warp 0's lanes 0..3 (t) over j and q.
                    s_out[(unsigned long long)rt * groups + tile.nt] = s;
                    if (ab >= 0x7F800000u) atomicExch(error_flag, 1u);
                }
            }
        }
#elif MODE == 1
#if ELEM_BF16
        const float sc = 1.0f;  // bf16: h = silu(gate) * up of the plain dot products
#else
        // Per-tensor scales, once per dot product.
        const float sc = a_scale[0] * w_scale[e];
        unsigned int hmax = 0;  // bits of max |h|
#endif
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const unsigned int rt = sorted_routes[m0 + 8 * j + 2 * t + q];
                if (rt >= num_routes) continue;
                __nv_bfloat16* hrow = h_out + (unsigned long long)rt * n_out;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const unsigned int n = n0 + 64 * wg + rr + 8 * h;
                    const int v = 4 * j + 2 * h + q;
                    if (n >= n_out) continue;
                    const __nv_bfloat16 hb = __float2bfloat16_rn(silu(acc[0][v] * sc) * (acc[1][v] * sc));
                    hrow[n] = hb;
#if !ELEM_BF16
                    hmax = max(hmax, __float_as_uint(fabsf(__bfloat162float(hb))));
#endif
                }
            }
        }
#if !ELEM_BF16
        if (h_amax != nullptr) {
            hmax = warp_max(hmax);
            if (lane == 0 && hmax != 0) atomicMax(h_amax, hmax);
        }
#endif
#else
#if BLOCK_SCALED || ELEM_BF16
        const float sc = 1.0f;  // fp8 block: the scales went in with the promotion; bf16: none
#else
        const float sc = a_scale[0] * w_scale[e];
#endif
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const unsigned int rt = sorted_routes[m0 + 8 * j + 2 * t + q];
                if (rt >= num_routes) continue;
                const float wt = topk_weights[rt];
                float* yrow = y32 + (unsigned long long)(rt / top_k) * n_out;
#pragma unroll
                for (int i = 0; i < 2; ++i) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const unsigned int c = (i ? half1 : half0) + 64 * wg + rr + 8 * h;
                        if (c < n_out) atomicAdd(yrow + c, wt * (acc[i][4 * j + 2 * h + q] * sc));
                    }
                }
            }
        }
#endif
    }  // tiles
}
