// Split-K over gridDim.z, as every grouped MoE GEMM does it: GEMM2 may split its reduction so that
// decode-sized batches still spread the weight stream over every SM.

#ifndef FMOE_COMMON_K_SPLIT_CUH
#define FMOE_COMMON_K_SPLIT_CUH

// This block's share of a reduction of `all_tiles` K tiles split over gridDim.z: `first` is its
// first tile, `count` how many (0 for a trailing split with nothing left).
struct KSplit {
    unsigned int first, count;
};
__device__ __forceinline__ KSplit k_split(unsigned int all_tiles) {
    const unsigned int per_split = (all_tiles + gridDim.z - 1) / gridDim.z;
    const unsigned int first = blockIdx.z * per_split;
    return {first, min(per_split, all_tiles - min(all_tiles, first))};
}

#endif  // FMOE_COMMON_K_SPLIT_CUH
