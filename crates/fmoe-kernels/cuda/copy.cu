// copy: the strided row copy behind elementwise::{gather_rows, narrow_cols, concat_heads} (see
// src/elementwise/copy.rs). Every index is in words of WORD bytes (1, 2, 4, 8 or 16), the widest
// the host found to divide every offset and length, so a bf16 row of 4096 moves as 512 16-byte
// words.
//
//   dst[r·dst_stride + dst_offset + h·dst_block_stride + c] =
//       src[row(r)·src_stride + src_offset + h·block_stride + c]
//   for r < rows, h < blocks, c < width; row(r) = use_ids ? ids[r] : first_row + r.
//
// Blocks stride over rows, threads over (h, c) of a row.

#if WORD == 16
typedef uint4 W;
#elif WORD == 8
typedef uint2 W;
#elif WORD == 4
typedef unsigned int W;
#elif WORD == 2
typedef unsigned short W;
#else
typedef unsigned char W;
#endif

extern "C" __global__ void fmoe_copy_rows(const W* __restrict__ src, W* __restrict__ dst,
                                          const unsigned int* __restrict__ ids, unsigned int use_ids,
                                          unsigned long long rows, unsigned long long first_row,
                                          unsigned long long src_stride, unsigned long long src_offset,
                                          unsigned long long blocks, unsigned long long block_stride,
                                          unsigned long long width, unsigned long long dst_stride,
                                          unsigned long long dst_offset,
                                          unsigned long long dst_block_stride) {
    const unsigned long long per_row = blocks * width;
    for (unsigned long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned long long sr = use_ids ? (unsigned long long)ids[r] : first_row + r;
        const W* s = src + sr * src_stride + src_offset;
        W* d = dst + r * dst_stride + dst_offset;
        for (unsigned long long j = threadIdx.x; j < per_row; j += blockDim.x) {
            const unsigned long long h = j / width, c = j - h * width;
            d[h * dst_block_stride + c] = s[h * block_stride + c];
        }
    }
}
