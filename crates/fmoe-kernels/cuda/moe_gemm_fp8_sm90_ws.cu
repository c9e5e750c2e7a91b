// moe_gemm_fp8_sm90_ws: the prefill-sized fp8 grouped expert GEMMs, warp-specialized and
// persistent like moe_gemm_bf16_sm90_pipe.cu (its default: PERSIST=1, DYNAMIC=1). Same MODEs,
// epilogues and contract as the kernels they replace at large M (moe_gemm_fp8_sm90.cu,
// moe_gemm_fp8_block_sm90.cu; read those for the operands and epilogues), plus trailing arguments:
// the weights' tensor map `b_map`, the tile space (n_tiles, m_blocks, splits) and the tile counter
// (a u32 zeroed by the host). Compiled for sm_90a only. BLOCK_SCALED=0: per-tensor scales (entry
// fmoe_moe_gemm_fp8); BLOCK_SCALED=1: 1x128 / 128x128 block scales (entry fmoe_moe_gemm_fp8_block).
//
// Tile: BM = 128 routes x NB = 256 weight rows, BK = 128 fp8 bytes (one 128-byte swizzle row =
// one scale block along K). Three warpgroups: warpgroup 0 only loads (A rows gathered by route
// with cp.async; the weight tile as two TMA boxes of 128 rows x 128 bytes, 128-byte swizzle, from
// the tensor map over w viewed as [E * w_rows, kd]: MODE 1 gate rows n0.. and up rows n_out + n0..,
// MODE 2 rows n0.. and n0 + 128..), warpgroups 1 and 2 only multiply, 64 rows x 256 weight rows
// each. A STAGES-deep mbarrier ring (full: every loader thread's copies landed, through
// `cp.async.mbarrier.arrive.noinc`, and the TMA bytes; empty: the 8 MMA warps are done with the
// stage), so all STAGES stages are in flight; the MMA warps fence the async proxy after full[s]
// (cp.async writes through the generic proxy, wgmma reads through the async one). Weight rows past
// n_out read the next rows of w (finite codes of columns the epilogue drops); past the last expert
// and past kd the copy engine fills zeros; A past kd is zero-filled.
//
// Schedule: gridDim.x blocks (one per SM) walk the tile space in grouped order (pipe_tile of
// moe_tile.cuh, RASTER_GM M blocks per group); block b takes tile b first, then the next one of the
// global counter (tile ids from gridDim.x on). Loader thread 0 claims each tile and hands its id to
// the other loaders (named barrier 1) and to the MMA warps (a two-slot ring of ids with its own
// mbarriers). The ring and its phases continue across tiles, so the loaders fill the next tile's
// stages while the MMA warps run this tile's epilogue. Tiles past *total or with no K steps (a
// trailing split) are skipped by both sides alike.
//
// BLOCK_SCALED=0: wgmma.m64n256k32 into one 128-register accumulator, one group in flight, the
//   whole reduction unpromoted (as FP8_TENSOR_LARGE always was); per-tensor scales in the epilogue.
// BLOCK_SCALED=1: per K block, each MMA warpgroup multiplies the two 128-row halves of the weight
//   tile in turn into a 64-register partial accumulator (wgmma.m64n128k32, 4 per half), waits, and
//   promotes on the CUDA cores: acc += partial * (a_scale[row, kb] * w_scale[e, block(row'), kb]),
//   the order of moe_gemm/cpu.rs. acc (128) + partial (64) do not fit the 168 registers of 384
//   threads: setmaxnreg gives the loaders 40 and the MMA warpgroups 232 (the warpgroup that is
//   promoting leaves the tensor cores to the other).
//   ORDER_MMA=1 (the default, halves only): the two MMA warpgroups take turns at issuing their
//   halves (named barriers 2 and 3), so one's MMAs run while the other waits for and promotes its
//   own; a half all in one weight block (always when N % 128 == 0) takes one scale per row. H200
//   (decisions D-049, D-050): GEMM1 as fast as the quarters below with 6 % fewer
//   instructions, 1.02-1.10x the unordered halves per layer; passing the turn only once the
//   warpgroup's MMAs are done (strict alternation on the tensor cores) is 0.92-0.98x.
//   PIPE_PROMOTE = p > 0 (1, 2 or 4): the partial is split into two
//   32-register quarters (wgmma.m64n64k32, weight-tile rows 64q .. 64q + 63): quarter q + 1 is
//   issued before quarter q is waited for (wgmma.wait_group 1) and promoted, so the warpgroup's
//   own MMAs run under its promotion; same products, same fmaf, same order (bit-identical to
//   PIPE_PROMOTE=0, tests/cuda_fp8_promotion.rs). ptxas serializes every wgmma (C7514) when a
//   group is in flight across a loop's back edge, so the K loop takes p K blocks per iteration
//   and drains once per iteration (the last quarter is promoted alone). H200 (decision
//   D-030): 1.03-1.08x the unordered halves per layer at
//   M >= 2048 (it was GEMM1's default before ORDER_MMA); ncu: the wgmma waits leave the stall
//   samples, the wgmma issue (A re-read per quarter) and the promotion's issue slots stay.
//   The loaders bring A's group scales of the stage's K block (cp.async, 4 bytes per row, under
//   the same arrival) into the stage, and the expert's four weight-block scales of the K block the
//   tile's halves may touch (loader threads 0-3); the MMA warps read both from shared memory (7 %
//   fewer instructions than four global loads per K block there). A half (or quarter) whose rows
//   straddle two weight blocks (the up rows when N % 128 != 0) picks the scale per column (a
//   quarter all in one block takes one scale per row); MODE 1's 128 output columns are one 1 x 128
//   group of h, whole in each thread's row, so the group quantization needs only quad shuffles.
//
// SKIP_PAD_WG=1 (halves or per-tensor): a tile whose rows 64.. are all padding (an expert's last
//   block of <= 64 routes) is multiplied by MMA warpgroup 1 alone; warpgroup 2 hands its stages
//   back and takes its turns without multiplying (H200, DeepSeek-V3 fp8-block M = 2048: 1.05x).
//
// CLUSTER=2 (per-tensor's default where experts span blocks: cuda_fp8::Fp8GemmConfig::pairs):
//   2-block clusters; a claimed unit is (N tile, a pair of M blocks 2p, 2p + 1, split), rank r
//   taking block 2p + r. When both blocks are one expert's, each copies one 128-row half of the
//   weight tile into both by TMA multicast, so a block reads 32 KB per K step from L2 instead of
//   48; otherwise each loads its own, and a rank 1 past the routes passes its K steps through the
//   ring without data (the pair's rings move in step: every empty barrier takes both blocks' 16
//   MMA warps). Rank 0 claims the units and hands them to rank 1 (remote store + cluster-scope
//   arrival); its tile-empty barriers count both blocks' readers. Slots go back by remote arrivals
//   at CTA scope: a cluster-scope release there costs a GPU-wide MEMBAR per stage and warp.
//   H200 (decision D-077): a third less L2 traffic, a tie to 1.04x.
//
// ROUTE_ROWS=1 (MODE 2, one K split): y32 points at bf16 [num_routes, n_out] and each route's
// weighted row is stored there (common/moe_epilogue.cuh gemm2_row) for moe_finalize.cu's top-k sum.
//
// Launch: grid (min(tiles, SMs), 1, 1) (CLUSTER=2: 2 x min(units, SMs / 2)) with tiles =
// ceil(n_out / (MODE 1 ? 128 : 256)) x capacity / 128 x (MODE 1 ? 1 : splits), 384 threads,
// dynamic shared memory STAGES * (128 + 256) * 128 + 1024 bytes.

#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "common/atomics.cuh"
#include "common/fp8.cuh"
#include "common/math.cuh"
#include "common/moe_epilogue.cuh"
#include "common/moe_tile.cuh"
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
#define STAGES 4
#endif
#ifndef PIPE_PROMOTE
#define PIPE_PROMOTE 0
#endif
static_assert(PIPE_PROMOTE == 0 || PIPE_PROMOTE == 1 || PIPE_PROMOTE == 2 || PIPE_PROMOTE == 4, "K blocks per drain");
#ifndef ORDER_MMA
#define ORDER_MMA 0
#endif
static_assert(!ORDER_MMA || (BLOCK_SCALED && !PIPE_PROMOTE), "ordered issue is for the promoted halves");
#ifndef RASTER_GM
#define RASTER_GM 16
#endif
#ifndef SKIP_PAD_WG
#define SKIP_PAD_WG 0
#endif
#ifndef CLUSTER
#define CLUSTER 1
#endif
static_assert(CLUSTER == 1 || CLUSTER == 2, "blocks per cluster");
#if CLUSTER == 2
#define CLUSTER_DIMS __cluster_dims__(2, 1, 1)
#define PAIR_GM ((RASTER_GM + 1) / 2)  // pairs per raster group (RASTER_GM = 1: one pair)
#else
#define CLUSTER_DIMS
#endif
static_assert(!SKIP_PAD_WG || !PIPE_PROMOTE, "a lone warpgroup is for one accumulator chain per half or tile");
#define BM 128
#define BK 128  // fp8 elements (= bytes): one 128-byte swizzle row, one scale block along K
#define NB 256  // weight rows per tile: two TMA boxes of 128
#define NTHREADS 384
#define LOADERS 128
#define A_BYTES (BM * BK)
#define HALF_BYTES (NB / 2 * BK)
#define B_BYTES (NB * BK)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define NO_ROW 0xFFFFFFFFu
#define A_PER_THREAD (BM * 8 / LOADERS)  // 16-byte A chunks per loader thread and stage

static_assert(STAGES >= 2, "a ring");
static_assert(STAGE_BYTES % 1024 == 0, "swizzle atoms are 1024-byte aligned");

#if BLOCK_SCALED
// acc[i] += part[i] * its scale, for a partial of NJ 8-column groups (i = 4j + 2h + qq: tile row
// r0 + 8h, column c0 + 8j + 2t + qq of its 128-row half of the weight tile; acc points at the
// partial's own accumulators): columns of the half below thr take the scale of its first weight
// block (wlo), the others the next one's (whi). Every schedule (halves, quarters) promotes through
// this, with the same scale products and fmaf in the same order: their sums are bit-identical.
template <int NJ>
__device__ __forceinline__ void promote(float* acc, const float* part, int c0, float sa0, float sa1, float wlo,
                                        float whi, int thr, unsigned int t) {
    if (thr >= c0 + 8 * NJ) {
        // The whole partial in the first block (always, when N % 128 == 0): no per-column choice.
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float sc = (h ? sa1 : sa0) * wlo;
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int qq = 0; qq < 2; ++qq) {
                    const int i = 4 * j + 2 * h + qq;
                    acc[i] = fmaf(part[i], sc, acc[i]);
                }
        }
    } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float s_a = h ? sa1 : sa0;
            const float slo = s_a * wlo, shi = s_a * whi;
#pragma unroll
            for (int j = 0; j < NJ; ++j)
#pragma unroll
                for (int qq = 0; qq < 2; ++qq) {
                    const int i = 4 * j + 2 * h + qq;
                    acc[i] = fmaf(part[i], (c0 + 8 * j + 2 * (int)t + qq) < thr ? slo : shi, acc[i]);
                }
        }
    }
}

#if PIPE_PROMOTE
// Quarter q4 (weight-tile columns 64 q4 ..) into acc[32 q4 ..].
__device__ __forceinline__ void promote_quarter(float* acc, const float* part, int q4, float sa0, float sa1, float wlo,
                                                float whi, int thr, unsigned int t) {
    promote<8>(acc + 32 * q4, part, 64 * (q4 & 1), sa0, sa1, wlo, whi, thr, t);
}
#endif
#endif

#if ORDER_MMA
// The two MMA warpgroups take turns at issuing (named barrier 2 + w: "warpgroup w may issue"), so
// one's wgmma runs while the other waits for and promotes its own: with both issuing at once they
// finish together and promote together, the tensor cores idle meanwhile.
__device__ __forceinline__ void mma_turn_wait(unsigned int cw) {
    asm volatile("bar.sync %0, 256;\n" ::"r"(2 + cw) : "memory");
}
__device__ __forceinline__ void mma_turn_pass(unsigned int cw) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(3 - cw) : "memory");
}
#endif

// An MMA warp's release of ring slot s (CLUSTER=2: to both blocks' loaders).
#if CLUSTER == 2
#define RELEASE_STAGE(s) pair_release(empty0 + 8 * (s), peer_empty0 + 8 * (s), lane)
#else
#define RELEASE_STAGE(s) warp_arrive(empty0 + 8 * (s), lane)
#endif

#if BLOCK_SCALED
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) CLUSTER_DIMS
fmoe_moe_gemm_fp8_block(const unsigned char* __restrict__ a, const float* __restrict__ a_scale,
                        const unsigned char* __restrict__ w, const float* __restrict__ w_scale,
                        const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                        const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                        unsigned char* __restrict__ q_out, float* __restrict__ s_out, float* __restrict__ y32,
                        unsigned int* __restrict__ error_flag, unsigned int num_routes, unsigned int top_k,
                        unsigned int kd, unsigned int n_out, const __grid_constant__ TmaDesc b_map,
                        unsigned int n_tiles, unsigned int m_blocks, unsigned int splits, unsigned int* tile_counter) {
#if PDL
    FMOE_PDL_ENTER_GEMM_FP8_BLOCK();  // first: see common/pdl.cuh
    tile_counter = fmoe_pdl_fresh(tile_counter);
#endif
#else
extern "C" __global__ void __launch_bounds__(NTHREADS, 1) CLUSTER_DIMS
fmoe_moe_gemm_fp8(const unsigned char* __restrict__ a, const unsigned char* __restrict__ w,
                  const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                  const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                  const float* __restrict__ a_scale, const float* __restrict__ w_scale,
                  __nv_bfloat16* __restrict__ h_out, unsigned int* __restrict__ h_amax, float* __restrict__ y32,
                  unsigned int num_routes, unsigned int top_k, unsigned int kd, unsigned int n_out,
                  const __grid_constant__ TmaDesc b_map, unsigned int n_tiles, unsigned int m_blocks,
                  unsigned int splits, unsigned int* tile_counter) {
#if PDL
    FMOE_PDL_ENTER_GEMM_FP8();  // first: see common/pdl.cuh
    tile_counter = fmoe_pdl_fresh(tile_counter);
#endif
#endif
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];
    // Tile ids from the loader to the MMA warps: slot c % 2 holds the block's c-th claimed tile.
    __shared__ __align__(8) unsigned long long tile_full[2], tile_empty[2];
    __shared__ unsigned int tile_ring[2];
#if CLUSTER == 2
    __shared__ unsigned int loader_ring[2];  // thread 0's unit ids for the other loaders
#endif
    __shared__ unsigned int a_row[BM];  // the loaders' gathered A row of each tile row
#if BLOCK_SCALED
    __shared__ float a_sc[STAGES][BM];  // A's group scale of each tile row for the stage's K block
    // The expert's weight-block scales of the stage's K block: the two blocks each 128-row half of
    // the weight tile may touch ([b0, b0 + 1, b1, b1 + 1], clamped to the last block).
    __shared__ float w_sc[STAGES][4];
#endif

    const unsigned int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned int g = lane >> 2, t = lane & 3, wg = tid >> 7;
    const unsigned int raw = static_cast<unsigned int>(__cvta_generic_to_shared(smem_raw));
    const unsigned int ring = (raw + 1023) & ~1023u;
    const unsigned int full0 = static_cast<unsigned int>(__cvta_generic_to_shared(full_bar));
    const unsigned int empty0 = static_cast<unsigned int>(__cvta_generic_to_shared(empty_bar));
    const unsigned int tfull0 = static_cast<unsigned int>(__cvta_generic_to_shared(tile_full));
    const unsigned int tempty0 = static_cast<unsigned int>(__cvta_generic_to_shared(tile_empty));
    const unsigned int kblocks = (kd + BK - 1) / BK, per_split = (kblocks + splits - 1) / splits;
    const unsigned int m_total = *total;
#if CLUSTER == 2
    const unsigned int crank = cluster_rank();
    const unsigned int m_pairs = (m_blocks + 1) / 2;
    const unsigned int tiles = n_tiles * m_pairs * splits;  // units of a pair
    const unsigned int peer_empty0 = cluster_map(empty0, crank ^ 1);
#else
    const unsigned int tiles = n_tiles * m_blocks * splits;
#endif
#if MODE == 1
    const unsigned int w_rows = 2 * n_out;
#else
    const unsigned int w_rows = n_out;
#endif

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, LOADERS);  // one cp.async arrival per loader thread
            mbar_init(empty0 + 8 * s, 8 * CLUSTER);  // one arrival per MMA warp (of both blocks)
        }
        for (int j = 0; j < 2; ++j) {
            mbar_init(tfull0 + 8 * j, 1);
#if CLUSTER == 2
            mbar_init(tempty0 + 8 * j, 17);  // rank 0's: both blocks' MMA warps and rank 1's claimer
#else
            mbar_init(tempty0 + 8 * j, 8);
#endif
        }
#if CLUSTER == 2
        fence_mbarrier_init_cluster();
#endif
    }
#if CLUSTER == 2
    cluster_sync();  // the peer's barriers exist before any remote arrival or multicast
#else
    __syncthreads();
#endif

    // it: K steps this block has run through the ring so far (slot it % STAGES, phase it / STAGES),
    // counted alike by the loaders and the MMA warps, which see the same tiles in the same order.
    unsigned int it = 0;
    if (wg == 0) {
        // Loader warpgroup: chunk ch = tid & 7 (16 bytes) of the rows (tid >> 3) + 16 i of each A tile.
#if BLOCK_SCALED
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
#endif
        const unsigned int ch = tid & 7;
        unsigned int my_row;  // the gathered A row of tile row tid
        for (unsigned int claim = 0;; ++claim) {
            // Claim the block's claim-th tile and publish it to the loaders and the MMA warps.
#if CLUSTER == 2
            if (tid == 0) loader_ring[claim & 1] = pair_claim(claim, tile_ring, tfull0, tempty0, tile_counter, crank);
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
            const unsigned int tl = loader_ring[claim & 1];
#else
            if (tid == 0) tile_claim(claim, tile_ring, tfull0, tempty0, tile_counter);
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
            const unsigned int tl = tile_ring[claim & 1];
#endif
            // Every loader has read slot claim & 1 before thread 0 may refill it (two claims later,
            // after another bar.sync).
            if (tl >= tiles) break;
#if CLUSTER == 2
            const PairTile pt = pair_tile(tl, n_tiles, m_pairs, PAIR_GM, BM, m_total, per_split, kblocks, crank);
            const TileWork w = pt.w;
            if (w.idle) continue;
            const PipeTile tc = pt.tc;
            const unsigned int m0 = pt.m0, first = w.first, ktiles = w.ktiles;
            if (m0 >= m_total) {
                pair_idle_loads<STAGES>(it, ktiles, full0, empty0);  // rank 0 loads its own tile
                continue;
            }
            const bool shared = pair_shares(2 * w.tc.m_block, BM, m_total, block_experts);
#else
            const TileWork w = tile_work(tl, n_tiles, m_blocks, RASTER_GM, BM, m_total, per_split, kblocks);
            if (w.idle) continue;
            const PipeTile tc = w.tc;
            const unsigned int m0 = w.m0, first = w.first, ktiles = w.ktiles;
#endif
            const unsigned int e = block_experts[tc.m_block];
            // First weight row (within the expert) of each 128-row half of the tile.
#if MODE == 1
            const unsigned int half0 = tc.n_tile * (NB / 2), half1 = n_out + half0;  // gate rows, up rows
#else
            const unsigned int half0 = tc.n_tile * NB, half1 = half0 + NB / 2;
#endif
            const int row0 = (int)(e * w_rows);
#if BLOCK_SCALED
            // Threads 0-3 copy the weight-block scales w_sc[.][tid] of each stage (the MMA warps
            // read them from shared memory instead of computing four addresses per K block).
            const float* my_ws = w_scale;
            if (tid < 4) {
                const unsigned int wrb = (w_rows + 127) / 128, hb = (tid < 2 ? half0 : half1) >> 7;
                my_ws += ((unsigned long long)e * wrb + min(hb + (tid & 1), wrb - 1)) * kblocks;
            }
#endif
            // The gathered A row of each tile row (NO_ROW for padding), through shared memory.
            // Per-tensor: the rows this thread copies in registers for the whole tile (a shared
            // read per copy stalled each copy on it: ncu's top loader stall; H200 1.14-1.17x per
            // layer). Block scales: the loaders have 40 registers, and 8 more spill, for no gain
            // there (its MMA warps bound it), so each copy reads its row from shared memory.
#if !BLOCK_SCALED
            unsigned int rows[A_PER_THREAD];
#endif
            {
                const unsigned int rt = sorted_routes[m0 + tid];
#if MODE == 1
                my_row = rt < num_routes ? rt / top_k : NO_ROW;
#else
                my_row = rt < num_routes ? rt : NO_ROW;
#endif
                a_row[tid] = my_row;
            }
            // The claim's bar.sync above ordered every loader's reads of the previous tile's rows
            // before these writes; this one orders the writes before the reads.
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
#if !BLOCK_SCALED
#pragma unroll
            for (int i = 0; i < A_PER_THREAD; ++i) rows[i] = a_row[(tid >> 3) + 16 * i];
#endif
            for (unsigned int kt = 0; kt < ktiles; ++kt, ++it) {
                const unsigned int s = it % STAGES;
                // Slot s last held K step it - STAGES: wait until the MMA warps released it.
                // (CLUSTER=2: both blocks' MMA warps released it; the multicast writes both.)
                if (it >= STAGES) mbar_wait(empty0 + 8 * s, ((it / STAGES) - 1) & 1);
                const unsigned int sa = ring + s * STAGE_BYTES, k0 = (first + kt) * BK, full_s = full0 + 8 * s;
                if (tid == 0) {
                    // Expected before this thread's own arrival, so the phase cannot complete
                    // without these bytes.
                    mbar_expect_tx(full_s, B_BYTES);
#if CLUSTER == 2
                    if (shared) {
                        // This rank's half into both blocks; the peer's half lands here likewise.
                        tma_load_2d_multicast(sa + A_BYTES + crank * HALF_BYTES, &b_map, (int)k0,
                                              row0 + (int)(crank ? half1 : half0), full_s, 3);
                    } else {
                        tma_load_2d(sa + A_BYTES, &b_map, (int)k0, row0 + (int)half0, full_s);
                        tma_load_2d(sa + A_BYTES + HALF_BYTES, &b_map, (int)k0, row0 + (int)half1, full_s);
                    }
#else
                    tma_load_2d(sa + A_BYTES, &b_map, (int)k0, row0 + (int)half0, full_s);
                    tma_load_2d(sa + A_BYTES + HALF_BYTES, &b_map, (int)k0, row0 + (int)half1, full_s);
#endif
                }
                const unsigned int col = k0 + ch * 16;
#pragma unroll
                for (int i = 0; i < A_PER_THREAD; ++i) {
                    const unsigned int r = (tid >> 3) + 16 * i;
#if BLOCK_SCALED
                    const unsigned int row = a_row[r];
#else
                    const unsigned int row = rows[i];
#endif
                    const bool ok = row != NO_ROW && col < kd;
                    cp_async16(sa + swz(r, ch), a + (ok ? (unsigned long long)row * kd + col : 0), ok);
                }
#if BLOCK_SCALED
                {
                    // The group scale of this thread's own tile row.
                    const bool ok = my_row != NO_ROW;
                    cp_async4(static_cast<unsigned int>(__cvta_generic_to_shared(&a_sc[s][tid])),
                              a_scale + (ok ? (unsigned long long)my_row * kblocks + first + kt : 0), ok);
                }
                if (tid < 4)
                    cp_async4(static_cast<unsigned int>(__cvta_generic_to_shared(&w_sc[s][tid])), my_ws + first + kt,
                              true);
#endif
                // full[s] completes once all 128 threads' copies (and the TMA bytes) landed.
                cp_async_arrive_noinc(full_s);
            }
        }
        // The last stages' arrivals are tied to these copies; let them land before the warps exit.
        asm volatile("cp.async.wait_all;\n" ::: "memory");
#if CLUSTER == 2
        cluster_sync();  // neither block leaves while the peer may still write or arrive here
#endif
        return;
    }

    // MMA warpgroups 1 and 2: tile rows 64 * cw .. 64 * cw + 63.
#if BLOCK_SCALED
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
#endif
    const unsigned int cw = wg - 1;
    // acc[4j + 2h + q]: tile row r0 + 8h, weight-tile column 8j + 2t + q (j < 32: the first half's
    // 128 rows for j < 16, the second half's beyond).
    const unsigned int r0 = cw * 64 + (warp & 3) * 16 + g;
#if !BLOCK_SCALED && MODE == 1
    unsigned int hmax = 0;  // bits of max |h| over the block's tiles
#endif
#if ORDER_MMA
    if (cw == 1) mma_turn_pass(cw);  // warpgroup 0 issues first
#endif
    for (unsigned int claim = 0;; ++claim) {
#if CLUSTER == 2
        const unsigned int tl = pair_receive(claim, tile_ring, tfull0, tempty0, lane);
#else
        const unsigned int tl = tile_receive(claim, tile_ring, tfull0, tempty0, lane);
#endif
        if (tl >= tiles) {
#if ORDER_MMA
            if (cw == 0) mma_turn_wait(cw);  // warpgroup 1's last pass: every arrival is waited for
#endif
            break;
        }
#if CLUSTER == 2
        const PairTile pt = pair_tile(tl, n_tiles, m_pairs, PAIR_GM, BM, m_total, per_split, kblocks, crank);
        const TileWork w = pt.w;
        if (w.idle) continue;
        const PipeTile tc = pt.tc;
        const unsigned int m0 = pt.m0, first = w.first, ktiles = w.ktiles;
        if (m0 >= m_total) {
            pair_idle_mma<STAGES>(it, ktiles, full0, empty0, peer_empty0, lane);  // rank 0's tile alone
            continue;
        }
#else
        const TileWork w = tile_work(tl, n_tiles, m_blocks, RASTER_GM, BM, m_total, per_split, kblocks);
        if (w.idle) continue;
        const PipeTile tc = w.tc;
        const unsigned int m0 = w.m0, first = w.first, ktiles = w.ktiles;
#endif
        const unsigned int e = block_experts[tc.m_block];
#if MODE == 1
        const unsigned int n0 = tc.n_tile * (NB / 2);  // output columns n0 .. n0 + 127
#else
        const unsigned int n0 = tc.n_tile * NB;  // output columns n0 .. n0 + 255
#endif
#if SKIP_PAD_WG
        // Tile rows 64.. all padding (an expert's last block of <= 64 routes): the second MMA
        // warpgroup (cw = 1) skips the tile. It hands each stage back once it is full (so its
        // arrivals count toward the right phase) and, with ORDER_MMA, takes and passes each of its
        // turns at once, so the first runs its usual loop (its SASS unchanged) and multiplies alone.
        // (A vote, so ptxas knows the branch is warp-uniform and keeps the loop's descriptors in
        // uniform registers.)
        if (__all_sync(0xffffffffu, cw == 1 && sorted_routes[m0 + 64] >= num_routes)) {
            for (unsigned int kt = 0; kt < ktiles; ++kt, ++it) {
                const unsigned int s = it % STAGES;
                mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
#if ORDER_MMA
                for (int hf = 0; hf < 2; ++hf) {
                    mma_turn_wait(cw);
                    mma_turn_pass(cw);
                }
#endif
                RELEASE_STAGE(s);
            }
            continue;
        }
#endif
        float acc[NB / 2];
#pragma unroll
        for (int i = 0; i < NB / 2; ++i) acc[i] = 0.0f;

#if BLOCK_SCALED
#if MODE == 1
        const unsigned int half0 = n0, half1 = n_out + n0;
#else
        const unsigned int half0 = n0, half1 = n0 + NB / 2;
#endif
        // Weight-scale blocks of each half: rows half_h + c lie in block b_h for c < thr_h, b_h + 1
        // beyond (their scales: the stage's w_sc, which the loaders clamp to the expert's last block).
        const int thr0 = 128 - (int)(half0 & 127), thr1 = 128 - (int)(half1 & 127);
#if PIPE_PROMOTE
        // Quarter q4 of a K block: weight-tile rows 64 q4 .. 64 q4 + 63 (half q4 >> 1) into
        // part[q4 & 1], promoted into acc[32 q4 ..] while quarter q4 + 1 multiplies. ptxas keeps
        // wgmma asynchronous only while no group is in flight across the loop's back edge, so each
        // loop iteration drains: the last quarter of its last K block is promoted alone. An
        // iteration takes PIPE_PROMOTE (1, 2 or 4) K blocks.
        float part[2][32];
        // The scales of the previous K block, whose quarter 3 is in flight at a `lead = false` block.
        float psa0 = 0.0f, psa1 = 0.0f, pw10 = 0.0f, pw11 = 0.0f;
        auto kblock = [&](unsigned int kt, bool lead, bool drain) {
            const unsigned int s = it % STAGES;
            mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
            const float w00 = w_sc[s][0], w01 = w_sc[s][1], w10 = w_sc[s][2], w11 = w_sc[s][3];
            // A and its scales were written by cp.async (generic proxy); wgmma reads through the
            // async proxy.
            fence_proxy_async_shared();
            const unsigned int st = ring + s * STAGE_BYTES;
            const unsigned long long da = smem_desc(st + cw * (64 * 128));
            const float sa0 = a_sc[s][r0], sa1 = a_sc[s][r0 + 8];
#pragma unroll
            for (int q4 = 0; q4 < 4; ++q4) {
                const unsigned long long db = smem_desc(st + A_BYTES + q4 * (64 * 128));
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < BK / 32; ++ks)
                    // 32 fp8 elements along K = 32 bytes = 2 descriptor units; the first step overwrites.
                    wgmma_m64n64k32_e4m3(part[q4 & 1], da + 2 * ks, db + 2 * ks, ks > 0);
                wgmma_commit();
                if (q4 == 0 && lead) continue;
                // The previous quarter has retired (this one stays in flight): promote it.
                wgmma_wait<1>();
                wgmma_fence_operands<32>(part[(q4 + 1) & 1]);
                if (q4 == 0) {
                    promote_quarter(acc, part[1], 3, psa0, psa1, pw10, pw11, thr1, t);
                    // The previous K block's wgmma all retired and its scales read: its slot goes
                    // back to the loaders.
                    RELEASE_STAGE(((it - 1) % STAGES));
                } else if (q4 < 3) {
                    promote_quarter(acc, part[(q4 - 1) & 1], q4 - 1, sa0, sa1, w00, w01, thr0, t);
                } else {
                    promote_quarter(acc, part[0], 2, sa0, sa1, w10, w11, thr1, t);
                }
            }
            if (drain) {
                wgmma_wait<0>();
                wgmma_fence_operands<32>(part[1]);
                promote_quarter(acc, part[1], 3, sa0, sa1, w10, w11, thr1, t);
                RELEASE_STAGE(s);
            } else {
                psa0 = sa0;
                psa1 = sa1;
                pw10 = w10;
                pw11 = w11;
            }
            ++it;
        };
        // PIPE_PROMOTE K blocks per iteration, one drain each; the remainder drains per block.
        unsigned int kt = 0;
        for (; kt + PIPE_PROMOTE <= ktiles; kt += PIPE_PROMOTE) {
#pragma unroll
            for (int u = 0; u < PIPE_PROMOTE; ++u) kblock(kt + u, u == 0, u == PIPE_PROMOTE - 1);
        }
        for (; kt < ktiles; ++kt) kblock(kt, true, true);
#else
        float part[64];

        for (unsigned int kt = 0; kt < ktiles; ++kt, ++it) {
            const unsigned int s = it % STAGES;
            mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
            const float w00 = w_sc[s][0], w01 = w_sc[s][1], w10 = w_sc[s][2], w11 = w_sc[s][3];
            // A and its scales were written by cp.async (generic proxy); wgmma reads through the
            // async proxy.
            fence_proxy_async_shared();
            const unsigned int st = ring + s * STAGE_BYTES;
            const unsigned long long da = smem_desc(st + cw * (64 * 128));
            const float sa0 = a_sc[s][r0], sa1 = a_sc[s][r0 + 8];
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const unsigned long long db = smem_desc(st + A_BYTES + hf * HALF_BYTES);
#if ORDER_MMA
                mma_turn_wait(cw);
#endif
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < BK / 32; ++ks)
                    // 32 fp8 elements along K = 32 bytes = 2 descriptor units; the first step overwrites.
                    wgmma_m64n128k32_e4m3(part, da + 2 * ks, db + 2 * ks, ks > 0);
                wgmma_commit();
#if ORDER_MMA
                mma_turn_pass(cw);
#endif
                wgmma_wait<0>();
                wgmma_fence_operands<64>(part);
                promote<16>(acc + 64 * hf, part, 0, sa0, sa1, hf ? w10 : w00, hf ? w11 : w01, hf ? thr1 : thr0, t);
            }
            // Both halves' wgmma retired and the stage's scales read: the slot goes back to the loaders.
            RELEASE_STAGE(s);
        }
#endif  // PIPE_PROMOTE
#else
        for (unsigned int kt = 0; kt < ktiles; ++kt, ++it) {
            const unsigned int s = it % STAGES;
            mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
            // A was written by cp.async (generic proxy); wgmma reads through the async proxy.
            fence_proxy_async_shared();
            const unsigned int st = ring + s * STAGE_BYTES;
            const unsigned long long da = smem_desc(st + cw * (64 * 128)), db = smem_desc(st + A_BYTES);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 32; ++ks) wgmma_m64n256k32_e4m3(acc, da + 2 * ks, db + 2 * ks, 1);
            wgmma_commit();
            // The group of the previous K step has retired: its slot goes back to the loaders.
            wgmma_wait<1>();
            if (kt > 0) {
                RELEASE_STAGE(((it - 1) % STAGES));
            }
        }
        wgmma_wait<0>();
        wgmma_fence_operands<NB / 2>(acc);
        // The last K step's slot too: the loaders may already be filling the next tile's stages.
        RELEASE_STAGE(((it - 1) % STAGES));
#endif

        // Epilogue. acc[4j + 2h + q]: tile row r0 + 8h, weight-tile column 8j + 2t + q.
#if BLOCK_SCALED && MODE == 1
        // h = silu(gate) * up for output columns n0 + 8j + 2t + q (j < 16), into the gate slots; then
        // the 1 x 128 group quantization of each row (the row's 128 columns are this quad's).
        const unsigned int groups = (n_out + 127) / 128;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned int rt = sorted_routes[m0 + r0 + 8 * h];
            const bool valid = rt < num_routes;
            unsigned int m = 0;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int i = 4 * j + 2 * h + q;
                    const float v = silu(acc[i]) * acc[64 + i];
                    acc[i] = v;
                    const unsigned int n = n0 + 8 * j + 2 * t + q;
                    if (valid && n < n_out) m = max(m, __float_as_uint(v) & 0x7FFFFFFFu);
                }
            }
            m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = max(m, __shfl_xor_sync(0xffffffffu, m, 2));
            if (!valid) continue;
            const float s = scale_from_amax(__uint_as_float(m));
            unsigned char* qrow = q_out + (unsigned long long)rt * n_out;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const unsigned int n = n0 + 8 * j + 2 * t;  // even; n_out even
                const int i = 4 * j + 2 * h;
                if (n < n_out)
                    *reinterpret_cast<unsigned short*>(qrow + n) = e4m3x2(__fdiv_rn(acc[i], s), __fdiv_rn(acc[i + 1], s));
            }
            if (t == 0) {
                s_out[(unsigned long long)rt * groups + tc.n_tile] = s;
                if (m >= 0x7F800000u) atomicExch(error_flag, 1u);
            }
        }
#elif BLOCK_SCALED
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned int rt = sorted_routes[m0 + r0 + 8 * h];
            if (rt >= num_routes) continue;
            gemm2_row<NB, true>(acc, h, t, 1.0f, topk_weights[rt], y32, rt, top_k, n0, n_out);
        }
#else
        // Per-tensor scales, once per dot product.
        const float sc = a_scale[0] * w_scale[e];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const unsigned int rt = sorted_routes[m0 + r0 + 8 * h];
            if (rt >= num_routes) continue;
#if MODE == 1
            hmax = silu_mul_row<NB, true>(acc, h, t, sc, h_out + (unsigned long long)rt * n_out, n0, n_out, hmax);
#else
            gemm2_row<NB, true>(acc, h, t, sc, topk_weights[rt], y32, rt, top_k, n0, n_out);
#endif
        }
#endif
    }
#if !BLOCK_SCALED && MODE == 1
    if (h_amax != nullptr) {
        hmax = warp_max(hmax);
        if (lane == 0 && hmax != 0) atomicMax(h_amax, hmax);
    }
#endif
#if CLUSTER == 2
    cluster_sync();
#endif
}
