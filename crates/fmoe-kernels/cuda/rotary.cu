// rotary: rotary position embeddings (see src/rotary/mod.rs), DT = x's dtype (-D DT: 0 = f32,
// 1 = bf16, 2 = f16).
//
//   y = x, except in every head the pairs of dims rot_offset..rot_offset + rot_dim:
//   (a, b) -> (DT(a c - b s), DT(b c + a s)), c/s = cos/sin[t, i] (f32) for pair i;
//   pair i = (i, i + rot_dim/2) (interleaved = 0, half-split) or (2i, 2i + 1) (interleaved = 1).
//
// One block per token row (blocks stride over rows): threads first copy the head dims outside the
// rotated slice, then rotate one pair each. Reads and writes of a warp are contiguous runs
// (half-split: consecutive i; interleaved: consecutive pairs); rows are short (a few KiB), so the
// loads stay scalar.

#include "common/elem.cuh"

typedef Elem<DT> E;

extern "C" __global__ void fmoe_rotary(const E::T* __restrict__ x, const float* __restrict__ cosv,
                                       const float* __restrict__ sinv, E::T* __restrict__ y,
                                       unsigned long long tokens, unsigned int heads,
                                       unsigned int head_dim, unsigned int rot_offset,
                                       unsigned int rot_dim, unsigned int interleaved) {
    const unsigned int half = rot_dim / 2, width = heads * head_dim, rot_end = rot_offset + rot_dim;
    for (unsigned long long t = blockIdx.x; t < tokens; t += gridDim.x) {
        const E::T* xr = x + t * width;
        E::T* yr = y + t * width;
        const float* c = cosv + t * half;
        const float* s = sinv + t * half;
        for (unsigned int j = threadIdx.x; j < width; j += blockDim.x) {
            const unsigned int d = j % head_dim;
            if (d < rot_offset || d >= rot_end) yr[j] = xr[j];
        }
        for (unsigned int p = threadIdx.x; p < heads * half; p += blockDim.x) {
            const unsigned int h = p / half, i = p - h * half;
            const unsigned int base = h * head_dim + rot_offset;
            const unsigned int ia = base + (interleaved ? 2 * i : i);
            const unsigned int ib = base + (interleaved ? 2 * i + 1 : i + half);
            const float a = E::load(xr[ia]), b = E::load(xr[ib]);
            yr[ia] = E::store(a * c[i] - b * s[i]);
            yr[ib] = E::store(b * c[i] + a * s[i]);
        }
    }
}
