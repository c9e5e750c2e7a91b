// Warp-level tensor-core MMA (mma.sync, sm_80+) and its shared-memory fragment loader: the
// portable grouped GEMM's engine on every device without wgmma.

#ifndef FMOE_COMMON_MMA_SM80_CUH
#define FMOE_COMMON_MMA_SM80_CUH

// C[16 x 8] += A[16 x 16] * B[16 x 8], bf16 in, f32 accumulate, in place. Fragments as ldmatrix
// leaves them: a = 4 registers (row-major A), b = 2 (column-major B), c = 4 floats.
__device__ __forceinline__ void mma_m16n8k16_bf16(float* c, const unsigned int* a, const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 b16 matrices from shared memory into the mma fragment layout; lane l supplies the
// address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, const void* smem) {
    unsigned int s = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

#endif  // FMOE_COMMON_MMA_SM80_CUH
