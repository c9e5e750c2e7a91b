// kv_append: a batch's new key/value rows into preallocated KV-cache slabs, in place (see
// src/kv_cache/). vLLM's reshape_and_cache with a slot mapping: token t's row of each source goes
// to row slots[t] of that stream's slab, for up to two streams (a layer's K and V, or MLA's latent
// and rope key) in one launch: blockIdx.y picks the stream.
//
//   dst_s[slots[t]·width_s + c] = src_s[t·src_stride_s + src_offset_s + c],  c < width_s
//
// Every index is in words of WORD bytes (1, 2, 4, 8 or 16), the widest the host found to divide
// every offset, stride and width, so a bf16 row of 1024 moves as 128 16-byte words. Elements move
// unchanged (any dtype). The host checked every slot against its slab's rows; slots are distinct
// (two tokens to one slot would race). Blocks stride over tokens, threads over a row's words.

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

extern "C" __global__ void fmoe_kv_append(const unsigned int* __restrict__ slots,
                                          unsigned long long tokens,
                                          const W* src0, unsigned long long src0_stride,
                                          unsigned long long src0_offset, W* dst0,
                                          unsigned long long width0,
                                          const W* src1, unsigned long long src1_stride,
                                          unsigned long long src1_offset, W* dst1,
                                          unsigned long long width1) {
    // Uniform per block: the second stream's arguments are read only when it exists.
    const bool second = blockIdx.y == 1;
    const W* src = second ? src1 : src0;
    W* dst = second ? dst1 : dst0;
    const unsigned long long stride = second ? src1_stride : src0_stride;
    const unsigned long long offset = second ? src1_offset : src0_offset;
    const unsigned long long width = second ? width1 : width0;
    for (unsigned long long t = blockIdx.x; t < tokens; t += gridDim.x) {
        const W* s = src + t * stride + offset;
        W* d = dst + (unsigned long long)slots[t] * width;
        for (unsigned long long c = threadIdx.x; c < width; c += blockDim.x) d[c] = s[c];
    }
}
