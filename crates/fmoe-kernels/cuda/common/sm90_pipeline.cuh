// Hopper pipeline primitives shared by the warp-specialized grouped GEMMs: mbarriers (the stage
// handover between loader and MMA warps) and the bulk tensor copy (TMA) of a 2-D tile.

#ifndef FMOE_COMMON_SM90_PIPELINE_CUH
#define FMOE_COMMON_SM90_PIPELINE_CUH

// CUtensorMap (cuda.h is not available under NVRTC): 128 opaque bytes, 64-byte aligned.
struct __align__(64) TmaDesc {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void mbar_init(unsigned int bar, unsigned int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned int bar) {
    asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// One MMA warp's release of a ring slot: the empty barriers count one arrival per warp, after every
// lane is done with the slot.
__device__ __forceinline__ void warp_arrive(unsigned int bar, unsigned int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
}
// Spins until the phase with parity `parity` of the barrier has completed (labels are local to
// the braces, so each inlined copy has its own).
__device__ __forceinline__ void mbar_wait(unsigned int bar, unsigned int parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "MBAR_WAIT:\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra MBAR_WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// The current phase of `bar` also waits for `bytes` more bytes of bulk copies.
__device__ __forceinline__ void mbar_expect_tx(unsigned int bar, unsigned int bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One arrival that also raises the current phase's expected bulk-copy bytes (before the copies
// are issued, so the phase cannot complete without them).
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned int bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// An arrival on `bar` once every cp.async this thread issued so far has landed (.noinc: the
// barrier's expected count already includes it), so a loader never waits on its own copies.
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned int bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Box (x = k0, y = row0) of the tensor map into shared memory at dst; completes bytes on bar.
__device__ __forceinline__ void tma_load_2d(unsigned int dst, const TmaDesc* map, int x, int y, unsigned int bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}

// Clusters (the 2-block pairs of moe_gemm_fp8_sm90_ws.cu with CLUSTER=2): the block's rank, a
// shared address of this block mapped into block `rank`'s window (for remote stores and
// arrivals), arrivals and waits at cluster scope, the cluster-wide barrier, and the TMA copy that
// lands the same box at the same offset of every block in `mask` (each block's barrier at that
// offset gets the bytes that reached it).
__device__ __forceinline__ unsigned int cluster_rank() {
    unsigned int r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned int cluster_map(unsigned int addr, unsigned int rank) {
    unsigned int r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ void st_cluster_u32(unsigned int cluster_addr, unsigned int v) {
    asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(cluster_addr), "r"(v) : "memory");
}
// Release at cluster scope (SASS: MEMBAR.ALL.GPU first): for a handoff of data the peer reads.
__device__ __forceinline__ void mbar_arrive_cluster(unsigned int cluster_addr) {
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}
// A remote arrival at the default (CTA) scope, no fence: "done reading this slot", as CUTLASS's
// cluster barriers hand ring slots back (the cluster-scope release costs a GPU-wide MEMBAR).
__device__ __forceinline__ void mbar_arrive_remote(unsigned int cluster_addr) {
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_addr) : "memory");
}
// Acquire at cluster scope (SASS: an L1 invalidation after it): for data the peer wrote here.
__device__ __forceinline__ void mbar_wait_cluster(unsigned int bar, unsigned int parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "MBAR_WAIT_CL:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra MBAR_WAIT_CL;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}
// Barrier inits visible to the peer's remote arrivals and copies (before the first cluster_sync).
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Every thread of both blocks (non-aligned: the loader and MMA warps reach it at different places).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ void tma_load_2d_multicast(unsigned int dst, const TmaDesc* map, int x, int y, unsigned int bar,
                                                      unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar), "h"(mask)
        : "memory");
}

// The claimed-tile schedule of the persistent GEMMs: one thread claims the block's tiles (the
// first is blockIdx.x, then gridDim.x + the next value of a global counter the host zeroed) and
// hands each id to the MMA warps through a two-slot ring of ids with a full barrier (count 1) and
// an empty one (one arrival per MMA warp) per slot, so it can claim the next tile while they run
// this one. tfull0 / tempty0: the shared addresses of the two full / empty barriers.
// The claiming thread: the block's claim-th id into slot claim & 1, once the MMA warps read what
// that slot held two claims before.
__device__ __forceinline__ void tile_claim(unsigned int claim, unsigned int* ring, unsigned int tfull0,
                                           unsigned int tempty0, unsigned int* counter) {
    const unsigned int slot = claim & 1;
    if (claim >= 2) mbar_wait(tempty0 + 8 * slot, ((claim >> 1) - 1) & 1);
    ring[slot] = claim == 0 ? blockIdx.x : gridDim.x + atomicAdd(counter, 1u);
    mbar_arrive(tfull0 + 8 * slot);
}
// An MMA warp: the block's claim-th id, its slot handed back.
__device__ __forceinline__ unsigned int tile_receive(unsigned int claim, const unsigned int* ring,
                                                     unsigned int tfull0, unsigned int tempty0, unsigned int lane) {
    mbar_wait(tfull0 + 8 * (claim & 1), (claim >> 1) & 1);
    const unsigned int t = ring[claim & 1];
    warp_arrive(tempty0 + 8 * (claim & 1), lane);
    return t;
}

// The claimed-unit schedule of a 2-block cluster (CLUSTER=2 GEMMs): rank 0's claiming thread
// takes each unit from the counter (the first: the cluster's index) and writes it into both
// blocks' rings, rank 1's receives it; rank 0's tile-empty barriers count both blocks' 8 MMA warps
// and rank 1's claimer (17), so neither ring slot is refilled before all of them read it. The
// claiming thread of either rank: the cluster's claim-th unit.
__device__ __forceinline__ unsigned int pair_claim(unsigned int claim, unsigned int* ring, unsigned int tfull0,
                                                   unsigned int tempty0, unsigned int* counter, unsigned int crank) {
    const unsigned int slot = claim & 1;
    if (crank == 1) {
        mbar_wait_cluster(tfull0 + 8 * slot, (claim >> 1) & 1);
        const unsigned int id = ring[slot];
        mbar_arrive_remote(cluster_map(tempty0 + 8 * slot, 0));
        return id;
    }
    if (claim >= 2) mbar_wait(tempty0 + 8 * slot, ((claim >> 1) - 1) & 1);
    const unsigned int id = claim == 0 ? blockIdx.x >> 1 : (gridDim.x >> 1) + atomicAdd(counter, 1u);
    ring[slot] = id;
    st_cluster_u32(cluster_map(static_cast<unsigned int>(__cvta_generic_to_shared(&ring[slot])), 1), id);
    mbar_arrive(tfull0 + 8 * slot);
    mbar_arrive_cluster(cluster_map(tfull0 + 8 * slot, 1));  // orders the remote store before it
    return id;
}
// An MMA warp of either rank: the claim-th unit, its slot handed back to rank 0.
__device__ __forceinline__ unsigned int pair_receive(unsigned int claim, const unsigned int* ring, unsigned int tfull0,
                                                     unsigned int tempty0, unsigned int lane) {
    mbar_wait_cluster(tfull0 + 8 * (claim & 1), (claim >> 1) & 1);
    const unsigned int t = ring[claim & 1];
    __syncwarp();
    if (lane == 0) mbar_arrive_remote(cluster_map(tempty0 + 8 * (claim & 1), 0));
    return t;
}

// An MMA warp of a pair hands ring slot `bar` back to its own loaders and the peer's (`peer_bar`,
// the same slot mapped into the peer's window): the peer's multicast fills this block's slot too.
__device__ __forceinline__ void pair_release(unsigned int bar, unsigned int peer_bar, unsigned int lane) {
    __syncwarp();
    if (lane == 0) {
        mbar_arrive(bar);
        mbar_arrive_remote(peer_bar);
    }
}

// A rank past the routes keeps its pair's rings in step through the unit's ktiles K steps (its
// peer loads its own tile): the loaders arrive on each stage without data once it is empty, the
// MMA warps hand each stage back to both blocks once it is full. `it` as the kernels count it.
template <int STAGES_>
__device__ __forceinline__ void pair_idle_loads(unsigned int& it, unsigned int ktiles, unsigned int full0,
                                                unsigned int empty0) {
    for (unsigned int kt = 0; kt < ktiles; ++kt, ++it) {
        const unsigned int s = it % STAGES_;
        if (it >= STAGES_) mbar_wait(empty0 + 8 * s, ((it / STAGES_) - 1) & 1);
        cp_async_arrive_noinc(full0 + 8 * s);
    }
}
template <int STAGES_>
__device__ __forceinline__ void pair_idle_mma(unsigned int& it, unsigned int ktiles, unsigned int full0,
                                              unsigned int empty0, unsigned int peer_empty0, unsigned int lane) {
    for (unsigned int kt = 0; kt < ktiles; ++kt, ++it) {
        const unsigned int s = it % STAGES_;
        mbar_wait(full0 + 8 * s, (it / STAGES_) & 1);
        pair_release(empty0 + 8 * s, peer_empty0 + 8 * s, lane);
    }
}

#endif  // FMOE_COMMON_SM90_PIPELINE_CUH
