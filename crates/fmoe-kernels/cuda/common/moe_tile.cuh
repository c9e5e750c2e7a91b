// The weight tile of the wgmma grouped MoE GEMMs, addressed the same way by the bf16 and fp8
// variants, so a fix to it lands in one place.

#ifndef FMOE_COMMON_MOE_TILE_CUH
#define FMOE_COMMON_MOE_TILE_CUH

#include "common/async_copy.cuh"
#include "common/k_split.cuh"
#include "common/sm90_wgmma.cuh"

// One 128-byte K slice of ROWS weight rows of one expert (`we`: [w_rows, kd]) into a swizzled
// tile. PAIRED (GEMM1): tile rows [0, ROWS/2) are gate rows n0 + r and [ROWS/2, ROWS) the matching
// up rows n_out + n0 + r, so one tile holds both halves of SiLU(gate) * up; otherwise (GEMM2) tile
// row r is weight row n0 + r. Rows past n_out and columns past kd are zero-filled.
template <typename T, int ROWS, int THREADS, bool PAIRED>
__device__ __forceinline__ void load_weight_tile(unsigned int dst, const T* we,
                                                 unsigned int n0, unsigned int n_out, unsigned int kd,
                                                 unsigned int k0, unsigned int tid) {
    constexpr unsigned int PER_CHUNK = 16 / sizeof(T);
#pragma unroll
    for (int i = 0; i < ROWS * 8 / THREADS; ++i) {
        const unsigned int c = tid + i * THREADS, r = c >> 3, ch = c & 7, col = k0 + ch * PER_CHUNK;
        const unsigned int n = PAIRED ? n0 + (r % (ROWS / 2)) : n0 + r;
        const unsigned long long wr =
            PAIRED ? (r < ROWS / 2 ? 0ull : (unsigned long long)n_out) + n : (unsigned long long)n;
        const bool ok = n < n_out && col < kd;
        cp_async16(dst + swz(r, ch), we + (ok ? wr * kd + col : 0), ok);
    }
}

// Grouped rasterization: the block's (N tile, M block) when blocks run in launch order over groups
// of `gm` M blocks, M fastest inside a group. Blocks resident together then share a few weight
// tiles and a few gathered A tiles instead of sweeping every N tile of one M block, which re-reads
// a whole expert's weights from DRAM for each M block (GEMM1 at prefill was DRAM-bound on it).
struct TileCoord {
    unsigned int n_tile, m_block;
};
__device__ __forceinline__ TileCoord raster_grouped(unsigned int gm) {
    const unsigned int n_tiles = gridDim.x, m_blocks = gridDim.y;
    const unsigned int lin = blockIdx.x + blockIdx.y * n_tiles;
    const unsigned int group = lin / (gm * n_tiles), rem = lin - group * (gm * n_tiles);
    const unsigned int m_first = group * gm, rows = min(gm, m_blocks - m_first);
    return {rem / rows, m_first + rem % rows};
}

// The same order over a tile space the kernel walks itself (the persistent GEMMs): tile t of
// (n_tiles x m_blocks x splits), groups of `gm` M blocks, M fastest inside a group, the K split
// slowest.
struct PipeTile {
    unsigned int n_tile, m_block, split;
};
__device__ __forceinline__ PipeTile pipe_tile(unsigned int t, unsigned int n_tiles, unsigned int m_blocks,
                                              unsigned int gm) {
    const unsigned int per_split = n_tiles * m_blocks;
    const unsigned int split = t / per_split, lin = t - split * per_split;
    const unsigned int group = lin / (gm * n_tiles), rem = lin - group * (gm * n_tiles);
    const unsigned int m_first = group * gm, rows = min(gm, m_blocks - m_first);
    return {rem / rows, m_first + rem % rows, split};
}

// A claimed tile of a persistent GEMM as its loaders and its MMA warps both decode it (they must
// agree on which tiles are idle, or the ring's phases part): coordinates, first route row, first K
// tile of its split and the K tiles to run; idle for an M block past the routes or a trailing
// split with no K left, which both sides skip.
struct TileWork {
    PipeTile tc;
    unsigned int m0, first, ktiles;
    bool idle;
};
__device__ __forceinline__ TileWork tile_work(unsigned int t, unsigned int n_tiles, unsigned int m_blocks,
                                              unsigned int gm, unsigned int bm, unsigned int m_total,
                                              unsigned int per_split, unsigned int all_ktiles) {
    const PipeTile tc = pipe_tile(t, n_tiles, m_blocks, gm);
    const unsigned int m0 = tc.m_block * bm, first = tc.split * per_split;
    const unsigned int ktiles = min(per_split, all_ktiles - min(all_ktiles, first));
    return {tc, m0, first, ktiles, m0 >= m_total || ktiles == 0};
}

// A claimed unit of a 2-block cluster (CLUSTER=2 GEMMs; pair_claim of sm90_pipeline.cuh): the
// pair's work over (n_tiles x m_pairs x splits) with 2 bm-row blocks per unit, and this rank's
// tile (M block 2p + rank) with its first route row m0 (at or past m_total: rank 1 past the routes).
struct PairTile {
    TileWork w;
    PipeTile tc;
    unsigned int m0;
};
__device__ __forceinline__ PairTile pair_tile(unsigned int t, unsigned int n_tiles, unsigned int m_pairs,
                                              unsigned int gm, unsigned int bm, unsigned int m_total,
                                              unsigned int per_split, unsigned int all_ktiles, unsigned int crank) {
    const TileWork w = tile_work(t, n_tiles, m_pairs, gm, 2 * bm, m_total, per_split, all_ktiles);
    const PipeTile tc = {w.tc.n_tile, 2 * w.tc.m_block + crank, w.tc.split};
    return {w, tc, tc.m_block * bm};
}
// Whether both blocks of the pair starting at M block pb hold routes of one expert (they then
// share the weight tile).
__device__ __forceinline__ bool pair_shares(unsigned int pb, unsigned int bm, unsigned int m_total,
                                            const unsigned int* block_experts) {
    return (pb + 1) * bm < m_total && block_experts[pb] == block_experts[pb + 1];
}

#endif  // FMOE_COMMON_MOE_TILE_CUH
