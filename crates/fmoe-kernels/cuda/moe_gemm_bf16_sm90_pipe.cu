// moe_gemm_bf16_sm90_pipe: the warp-specialized wgmma grouped expert GEMM (one loader warpgroup,
// two MMA warpgroups, weights through TMA), optionally persistent. Same MODEs, arguments and
// contract as moe_gemm_bf16_sm90.cu, plus the weights' tensor map `b_map`, three u32 (n_tiles,
// m_blocks, splits: the tile space) and the tile counter (DYNAMIC). sm_90a only; WG_N = 256 with
// BM = 128 or 64, or WG_N = 192 or 176 with BM = 192 (three MMA warpgroups, 512 threads).
//
// Loader (warpgroup 0): each thread gathers its A chunks with cp.async and ends every stage with
// `cp.async.mbarrier.arrive.noinc`, which arrives on `full[s]` once the copies have landed, so all
// STAGES stages can be in flight (a loader that waits for stage s-1 before issuing s+1 keeps two in
// flight, and the gather's L2 latency showed through). Thread 0 adds the weight tile by TMA. The
// MMA warpgroups fence the async proxy after `full[s]` (cp.async writes through the generic proxy).
//
// PERSIST=1: gridDim.x blocks walk the tiles (of the M blocks up to *total only) in the same grouped order (RASTER_GM M blocks per
// group, M fastest: pipe_tile of moe_tile.cuh); the ring and its phases continue across tiles, so
// the loader fills the next tile's stages while the MMA warps run the epilogue of this one, and no
// block launch or pipeline fill sits between tiles. Block b takes tile b first, then t = b + i * gridDim.x (DYNAMIC=0), or
// (DYNAMIC=1) the next tile of a global counter (`tile_counter`, zeroed by the host; tile ids from
// gridDim.x on), which keeps the SMs balanced like the hardware's block scheduler does: loader
// thread 0 claims it and hands it to the other loaders (named barrier) and to the MMA warps (a
// two-slot ring of tile ids with its own mbarriers). PERSIST=0: one tile per block, the grid is
// (n_tiles, m_blocks, splits).
//
// Tiles: BM = 128: MMA warpgroup w takes rows 64w of the tile, all 256 weight rows (m64n256);
// BM = 192: the same with three warpgroups and 192 weight rows (m64n192; 512 threads leave 128
// registers each, which ptxas will not exceed for setmaxnreg, so not 256), or 176 (m64n176): the
// host takes the narrower tile when its tile count fills the last wave of SMs better (cuda.rs).
// BM = 64: both take the 64 rows, warpgroup w the weight rows 128w.. (m64n128); GEMM1's tile is
// then gate|up of columns n0..n0+63 followed by gate|up of n0+64..n0+127, four TMA boxes.
// Padding rows are multiplied like the others, except with SKIP_PAD_WG=1 (below; uniform 192-row
// tiles over few experts only). Letting the warpgroup whose 64 rows are all padding skip its
// wgmma everywhere was measured slower on the H200 (DeepSeek-V3 GEMM1 at M = 8192 +22 % with
// 128-row tiles, M = 4096 0.93x with 192-row ones; D-020, D-041), probably because the faster
// tiles fall out of step with those that share their weight tiles in L2.
//
// CLUSTER=2 (BM = 128, DYNAMIC; cuda.rs decides): 2-block clusters as in moe_gemm_fp8_sm90_ws.cu
// (read there): a unit is (N tile, M blocks 2p and 2p + 1, split), rank r taking block 2p + r;
// when both are one expert's, each copies one 128-row half of the weight tile (MODE 1: the gate
// or the up rows; MODE 2: rows 128r.., the tensor map's box is 128 rows) into both by TMA multicast.
//
// ROUTE_ROWS=1 (MODE 2, one K split): y32 points at bf16 [num_routes, n_out] and each route's
// weighted row is stored there (common/moe_epilogue.cuh gemm2_row) for moe_finalize.cu's top-k sum.
//
// Shared memory (dynamic): STAGES * (BM + WG_N) * BK * 2 bytes + 1024 for alignment.

#include <cuda_bf16.h>

#include "common/async_copy.cuh"
#include "common/atomics.cuh"
#include "common/math.cuh"
#include "common/moe_epilogue.cuh"
#include "common/moe_tile.cuh"
#include "common/sm90_pipeline.cuh"
#include "common/sm90_wgmma.cuh"
#include "common/pdl.cuh"

#ifndef MODE
#define MODE 1
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef RASTER_GM
#define RASTER_GM 16
#endif
#ifndef BM
#define BM 128
#endif
#ifndef PERSIST
#define PERSIST 0
#endif
#ifndef DYNAMIC
#define DYNAMIC 0
#endif
#ifndef WG_N
#define WG_N 256  // weight rows per tile (BM = 192: 192)
#endif
// SKIP_PAD_WG=1 (BM = 192): a warpgroup whose 64 rows of the tile are all padding hands the
// tile's stages back without multiplying them (the host sets it where few experts each fill one
// 192-row block only partly: Mixtral at 128-175 routes per expert).
#ifndef SKIP_PAD_WG
#define SKIP_PAD_WG 0
#endif
// N_OUT_EVEN=1: n_out is even (the host checks), so the epilogue stores column pairs only.
#ifndef N_OUT_EVEN
#define N_OUT_EVEN 0
#endif
#ifndef CLUSTER
#define CLUSTER 1
#endif
#if CLUSTER == 2
#define CLUSTER_DIMS __cluster_dims__(2, 1, 1)
#define PAIR_GM ((RASTER_GM + 1) / 2)  // pairs per raster group
#else
#define CLUSTER_DIMS
#endif
#define BK 64
// MMA warpgroups: two (BM = 128: 64 rows each; BM = 64: 128 weight rows each) or, for BM = 192,
// three of 64 rows each.
#define MMA_WGS (BM == 192 ? 3 : 2)
#define NTHREADS (128 * (1 + MMA_WGS))
// BM = 192: 512 threads, so at most 128 registers each (ptxas compiles every warp to the launch
// bound; setmaxnreg does not raise it): 192 weight rows (96 accumulators) per tile, not 256.
static_assert(BM != 192 || WG_N == 192 || WG_N == 176, "512 threads fit 64 x 192 accumulator slabs, not 64 x 256");
static_assert(BM == 192 || WG_N == 256, "the 64- and 128-row tiles read 256 weight rows");
#define LOADERS 128
#define A_BYTES (BM * BK * 2)
#define B_BYTES (WG_N * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
#define NO_ROW 0xFFFFFFFFu
// Weight rows each MMA warpgroup multiplies.
#define CW_N (BM == 64 ? WG_N / 2 : WG_N)
#define A_PER_THREAD (BM * 8 / LOADERS)

static_assert(BM == 64 || BM == 128 || BM == 192, "MMA warpgroups of 64 rows, or 64 rows x 2 halves of N");
static_assert(!DYNAMIC || PERSIST, "the dynamic schedule is a persistent grid's");
static_assert(!SKIP_PAD_WG || BM == 192, "padding warpgroups skip 192-row tiles only");
static_assert(CLUSTER == 1 || (CLUSTER == 2 && BM == 128 && DYNAMIC), "pairs of claimed 128-row tiles");

// An MMA warp's release of ring slot s (CLUSTER=2: to both blocks' loaders).
#if CLUSTER == 2
#define RELEASE_STAGE(s) pair_release(empty0 + 8 * (s), peer_empty0 + 8 * (s), lane)
#else
#define RELEASE_STAGE(s) warp_arrive(empty0 + 8 * (s), lane)
#endif

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) CLUSTER_DIMS
fmoe_moe_gemm_bf16(const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ w,
                   const unsigned int* __restrict__ sorted_routes, const unsigned int* __restrict__ block_experts,
                   const unsigned int* __restrict__ total, const float* __restrict__ topk_weights,
                   __nv_bfloat16* __restrict__ h_out, float* __restrict__ y32, unsigned int num_routes,
                   unsigned int top_k, unsigned int kd, unsigned int n_out, const __grid_constant__ TmaDesc b_map,
                   unsigned int n_tiles, unsigned int m_blocks, unsigned int splits, unsigned int* tile_counter) {
#if PDL
    FMOE_PDL_ENTER_GEMM_BF16();  // first: see common/pdl.cuh
    tile_counter = fmoe_pdl_fresh(tile_counter);
#endif
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) unsigned long long full_bar[STAGES], empty_bar[STAGES];
#if DYNAMIC
    // Tile ids from the loader to the MMA warps: slot j % 2 holds the block's j-th tile.
    __shared__ __align__(8) unsigned long long tile_full[2], tile_empty[2];
    __shared__ unsigned int tile_ring[2];
#endif
#if CLUSTER == 2
    __shared__ unsigned int loader_ring[2];  // thread 0's unit ids for the other loaders
#endif

    const unsigned int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned int g = lane >> 2, t4 = lane & 3, wg = tid >> 7;
    const unsigned int raw = static_cast<unsigned int>(__cvta_generic_to_shared(smem_raw));
    const unsigned int ring = (raw + 1023) & ~1023u;
    const unsigned int full0 = static_cast<unsigned int>(__cvta_generic_to_shared(full_bar));
    const unsigned int empty0 = static_cast<unsigned int>(__cvta_generic_to_shared(empty_bar));
    const unsigned int all_ktiles = (kd + BK - 1) / BK, per_split = (all_ktiles + splits - 1) / splits;
    const unsigned int m_total = *total;
#if PERSIST
    // The host sizes m_blocks for the worst case; walk only the blocks the routes fill (a tall
    // segment of mixed tiles is sized as if every route were in it).
    m_blocks = min(m_blocks, (m_total + BM - 1) / BM);
#endif
#if CLUSTER == 2
    const unsigned int crank = cluster_rank();
    const unsigned int m_pairs = (m_blocks + 1) / 2;
    const unsigned int tiles = n_tiles * m_pairs * splits;  // units of a pair
    const unsigned int peer_empty0 = cluster_map(empty0, crank ^ 1);
#else
    const unsigned int tiles = n_tiles * m_blocks * splits;
#endif
#if DYNAMIC
#elif PERSIST
    const unsigned int t_first = blockIdx.x, t_step = gridDim.x;
#else
    const unsigned int t_first = blockIdx.x + n_tiles * (blockIdx.y + m_blocks * blockIdx.z), t_step = tiles;
#endif
#if MODE == 1
    const unsigned long long w_rows = 2ull * n_out;
#else
    const unsigned long long w_rows = n_out;
#endif

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, LOADERS);
            mbar_init(empty0 + 8 * s, 4 * MMA_WGS * CLUSTER);  // one arrival per MMA warp (of both blocks)
        }
#if DYNAMIC
        for (int j = 0; j < 2; ++j) {
            mbar_init(static_cast<unsigned int>(__cvta_generic_to_shared(&tile_full[j])), 1);
            // CLUSTER=2 (rank 0's): both blocks' MMA warps and rank 1's claimer.
            mbar_init(static_cast<unsigned int>(__cvta_generic_to_shared(&tile_empty[j])),
                      CLUSTER == 2 ? 8 * MMA_WGS + 1 : 4 * MMA_WGS);
        }
#endif
#if CLUSTER == 2
        fence_mbarrier_init_cluster();
#endif
    }
#if CLUSTER == 2
    cluster_sync();  // the peer's barriers exist before any remote arrival or multicast
#else
    __syncthreads();
#endif
#if DYNAMIC
    const unsigned int tfull0 = static_cast<unsigned int>(__cvta_generic_to_shared(tile_full));
    const unsigned int tempty0 = static_cast<unsigned int>(__cvta_generic_to_shared(tile_empty));
#endif

    // it: K tiles this block has run through the ring so far (slot it % STAGES, phase it / STAGES).
    unsigned int it = 0;
    if (wg == 0) {
        // Loader warpgroup: chunk (tid & 7) of rows (tid >> 3) + 16 i of every A tile.
        const unsigned int ch = tid & 7;
#if DYNAMIC
        for (unsigned int j = 0;; ++j) {
            // Claim the block's j-th tile and publish it to the loaders and the MMA warps.
#if CLUSTER == 2
            if (tid == 0) loader_ring[j & 1] = pair_claim(j, tile_ring, tfull0, tempty0, tile_counter, crank);
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
            const unsigned int t = loader_ring[j & 1];
#else
            if (tid == 0) tile_claim(j, tile_ring, tfull0, tempty0, tile_counter);
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
            const unsigned int t = tile_ring[j & 1];
#endif
            // The loaders have read slot j & 1 before thread 0 may refill it (two claims later,
            // after another bar.sync).
            if (t >= tiles) break;
#else
        for (unsigned int t = t_first; t < tiles; t += t_step) {
#endif
#if CLUSTER == 2
            const PairTile pt = pair_tile(t, n_tiles, m_pairs, PAIR_GM, BM, m_total, per_split, all_ktiles, crank);
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
            const TileWork w = tile_work(t, n_tiles, m_blocks, RASTER_GM, BM, m_total, per_split, all_ktiles);
            if (w.idle) continue;
            const PipeTile tc = w.tc;
            const unsigned int m0 = w.m0, first = w.first, ktiles = w.ktiles;
#endif
            const unsigned int e = block_experts[tc.m_block];
#if MODE == 1
            const int row0 = (int)((unsigned long long)e * w_rows) + (int)(tc.n_tile * (WG_N / 2));
#else
            const int row0 = (int)((unsigned long long)e * w_rows) + (int)(tc.n_tile * WG_N);
#endif
            unsigned int a_row[A_PER_THREAD];
#pragma unroll
            for (int i = 0; i < A_PER_THREAD; ++i) {
                const unsigned int rt = sorted_routes[m0 + (tid >> 3) + 16 * i];
#if MODE == 1
                a_row[i] = rt < num_routes ? rt / top_k : NO_ROW;
#else
                a_row[i] = rt < num_routes ? rt : NO_ROW;
#endif
            }
            for (unsigned int kt = 0; kt < ktiles; ++kt, ++it) {
                const unsigned int s = it % STAGES;
                // Slot s last held K tile it - STAGES: wait until the MMA warps released it.
                if (it >= STAGES) mbar_wait(empty0 + 8 * s, ((it / STAGES) - 1) & 1);
                const unsigned int sa = ring + s * STAGE_BYTES, k0 = (first + kt) * BK, full_s = full0 + 8 * s;
                if (tid == 0) {
                    // Expected before this thread's own arrival, so the phase cannot complete
                    // without these bytes.
                    mbar_expect_tx(full_s, B_BYTES);
#if CLUSTER == 2
                    // Two 128-row boxes (MODE 1: gate rows, up rows; MODE 2: rows 0.., 128..);
                    // a pair of one expert's blocks copies one each into both.
#if MODE == 1
                    const int box1 = row0 + (int)n_out;
#else
                    const int box1 = row0 + 128;
#endif
                    if (shared) {
                        tma_load_2d_multicast(sa + A_BYTES + crank * (128 * 128), &b_map, (int)k0, crank ? box1 : row0,
                                              full_s, 3);
                    } else {
                        tma_load_2d(sa + A_BYTES, &b_map, (int)k0, row0, full_s);
                        tma_load_2d(sa + A_BYTES + 128 * 128, &b_map, (int)k0, box1, full_s);
                    }
#elif MODE == 1
#pragma unroll
                    for (int h = 0; h < WG_N / CW_N; ++h) {
                        const unsigned int dst = sa + A_BYTES + h * CW_N * 128;
                        tma_load_2d(dst, &b_map, (int)k0, row0 + h * (CW_N / 2), full_s);
                        tma_load_2d(dst + (CW_N / 2) * 128, &b_map, (int)k0, row0 + (int)n_out + h * (CW_N / 2),
                                    full_s);
                    }
#else
                    tma_load_2d(sa + A_BYTES, &b_map, (int)k0, row0, full_s);
#endif
                }
                const unsigned int col = k0 + ch * 8;
#pragma unroll
                for (int i = 0; i < A_PER_THREAD; ++i) {
                    const unsigned int r = (tid >> 3) + 16 * i;
                    const unsigned int row = a_row[i];
                    const bool ok = row != NO_ROW && col < kd;
                    cp_async16(sa + swz(r, ch), a + (ok ? (unsigned long long)row * kd + col : 0), ok);
                }
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

    // MMA warpgroups 1 .. MMA_WGS.
    const unsigned int cw = wg - 1;
    const unsigned int cm = BM == 64 ? 0 : cw, cn = BM == 64 ? cw : 0;
#if DYNAMIC
    for (unsigned int j = 0;; ++j) {
#if CLUSTER == 2
        const unsigned int t = pair_receive(j, tile_ring, tfull0, tempty0, lane);
#else
        const unsigned int t = tile_receive(j, tile_ring, tfull0, tempty0, lane);
#endif
        if (t >= tiles) break;
#else
    for (unsigned int t = t_first; t < tiles; t += t_step) {
#endif
#if CLUSTER == 2
        const PairTile pt = pair_tile(t, n_tiles, m_pairs, PAIR_GM, BM, m_total, per_split, all_ktiles, crank);
        const TileWork w = pt.w;
        if (w.idle) continue;
        const PipeTile tc = pt.tc;
        const unsigned int m0 = pt.m0, first = w.first, ktiles = w.ktiles;
        if (m0 >= m_total) {
            pair_idle_mma<STAGES>(it, ktiles, full0, empty0, peer_empty0, lane);  // rank 0's tile alone
            continue;
        }
#else
        const TileWork w = tile_work(t, n_tiles, m_blocks, RASTER_GM, BM, m_total, per_split, all_ktiles);
        if (w.idle) continue;
        const PipeTile tc = w.tc;
        const unsigned int m0 = w.m0, first = w.first, ktiles = w.ktiles;
#endif
#if SKIP_PAD_WG
        // All 64 rows padding (the first is: routes fill a block from its start): hand each stage
        // back once it is full, so the arrivals count toward its phase, and multiply nothing. (A
        // vote, so ptxas knows the branch is warp-uniform.)
        if (__all_sync(0xffffffffu, cm > 0 && sorted_routes[m0 + 64 * cm] >= num_routes)) {
            for (unsigned int kt = 0; kt < ktiles; ++kt, ++it) {
                const unsigned int s = it % STAGES;
                mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
                RELEASE_STAGE(s);
            }
            continue;
        }
#endif

        float acc[CW_N / 2];
#pragma unroll
        for (int i = 0; i < CW_N / 2; ++i) acc[i] = 0.0f;
        for (unsigned int kt = 0; kt < ktiles; ++kt, ++it) {
            const unsigned int s = it % STAGES;
            mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
            fence_proxy_async_shared();
            const unsigned int sa = ring + s * STAGE_BYTES + cm * (64 * 128);
            const unsigned int sb = ring + s * STAGE_BYTES + A_BYTES + cn * (CW_N * 128);
            const unsigned long long da = smem_desc(sa), db = smem_desc(sb);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks) {
#if CW_N == 256
                wgmma_m64n256k16_bf16(acc, da + 2 * ks, db + 2 * ks, 1);
#elif CW_N == 192
                wgmma_m64n192k16_bf16(acc, da + 2 * ks, db + 2 * ks, 1);
#elif CW_N == 176
                wgmma_m64n176k16_bf16(acc, da + 2 * ks, db + 2 * ks, 1);
#else
                wgmma_m64n128k16_bf16(acc, da + 2 * ks, db + 2 * ks, 1);
#endif
            }
            wgmma_commit();
            // The group of the previous K tile has retired: its slot goes back to the loader.
            wgmma_wait<1>();
            if (kt > 0) {
                RELEASE_STAGE(((it - 1) % STAGES));
            }
        }
        wgmma_wait<0>();
        wgmma_fence_operands<CW_N / 2>(acc);
        // The last K tile's slot too: the loader may already be filling the next tile's stages.
        RELEASE_STAGE(((it - 1) % STAGES));

        // Epilogue. acc[4j + q]: row 64 cm + 16 (warp % 4) + g (+8 for q >= 2), column 8j + 2t + (q & 1)
        // of this warpgroup's CW_N weight rows.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const unsigned int rt = sorted_routes[m0 + cm * 64 + (warp & 3) * 16 + g + half * 8];
            if (rt >= num_routes) continue;
#if MODE == 1
            silu_mul_row<CW_N, N_OUT_EVEN>(acc, half, t4, 1.0f, h_out + (unsigned long long)rt * n_out,
                               tc.n_tile * (WG_N / 2) + cn * (CW_N / 2), n_out, 0);
#else
            gemm2_row<CW_N, N_OUT_EVEN>(acc, half, t4, 1.0f, topk_weights[rt], y32, rt, top_k, tc.n_tile * WG_N + cn * CW_N,
                                   n_out);
#endif
        }
    }
#if CLUSTER == 2
    cluster_sync();
#endif
}
