// Split-K over gridDim.z, as every grouped MoE GEMM does it: GEMM2 may split its reduction so that
// decode-sized batches still spread the weight stream over every SM.

#ifndef FMOE_COMMON_K_SPLIT_CUH
#define FMOE_COMMON_K_SPLIT_CUH

// This block's share of a reduction of `all_tiles` K tiles split over gridDim.z: `first` is its
// first tile, `count` how many (0 for a trailing split with nothing left).
struct KSplit {
    unsigned int first, count;
};
// Split `split` of `splits` (persistent kernels, which walk their splits in a loop).
__device__ __forceinline__ KSplit k_split_of(unsigned int all_tiles, unsigned int split, unsigned int splits) {
    const unsigned int per_split = (all_tiles + splits - 1) / splits;
    const unsigned int first = split * per_split;
    return {first, min(per_split, all_tiles - min(all_tiles, first))};
}
__device__ __forceinline__ KSplit k_split(unsigned int all_tiles) { return k_split_of(all_tiles, blockIdx.z, gridDim.z); }

#endif  // FMOE_COMMON_K_SPLIT_CUH
