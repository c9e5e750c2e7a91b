// Hopper warpgroup MMA (wgmma; sm_90a only): the shared-memory operand layout, its matrix
// descriptor, the fences an asynchronous MMA needs, and the instruction wrappers for the shapes the
// grouped GEMMs use: bf16 m64n{16,32,64,128,192,256}k16 and e4m3 m64n{16,32,64,128,256}k32, f32 accumulators.
//
// Layout: both operands K-major (fp8 wgmma has no transpose, and one layout serves both dtypes),
// 128 bytes of K per row (one swizzle atom: 64 bf16 or 128 e4m3), 128-byte swizzle so that the
// loader's 16-byte chunks of 8 consecutive rows land in different banks; 8-row groups 1024 bytes
// apart, so tiles must be 1024-byte aligned. A K step of 32 bytes (k16 bf16 = k32 e4m3) adds 2 to a
// descriptor (its address is in 16-byte units).

#ifndef FMOE_COMMON_SM90_WGMMA_CUH
#define FMOE_COMMON_SM90_WGMMA_CUH

// Byte offset of 16-byte chunk `ch` of row `r` in a K-major tile with 128-byte swizzle: where the
// loader must put a chunk for the descriptor below to find it.
__device__ __forceinline__ unsigned int swz(unsigned int r, unsigned int ch) { return r * 128 + ((ch ^ (r & 7)) << 4); }

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ unsigned long long smem_desc(unsigned int addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// cp.async (and st.shared) write through the generic proxy, wgmma reads through the async proxy:
// without this fence after the copies land, the tensor cores may read stale shared memory.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Before the first wgmma of a batch: orders earlier accesses to the accumulator registers (zeroing,
// promotion) before the asynchronous MMAs that read and write them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the batch of wgmma issued since the last commit into one group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most N groups are in flight (N = 1 lets the next tile's copies overlap the MMAs).
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// The compiler does not know that wgmma writes the accumulators asynchronously: after the wait,
// this empty asm "redefines" each of them, so no read of an accumulator is moved above the wait.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float* acc) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// The wrappers' accumulator operands: FMOE_WGMMA_ACC_n lists d[0 .. n) as asm in-out operands,
// FMOE_WGMMA_REGS_n their PTX names (n = N / 2 f32 per thread for an m64nN shape).
#define FMOE_WGMMA_ACC_8 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define FMOE_WGMMA_REGS_8 "%0,%1,%2,%3,%4,%5,%6,%7"
#define FMOE_WGMMA_ACC_16 FMOE_WGMMA_ACC_8, "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define FMOE_WGMMA_REGS_16 FMOE_WGMMA_REGS_8 ",%8,%9,%10,%11,%12,%13,%14,%15"
#define FMOE_WGMMA_ACC_32 FMOE_WGMMA_ACC_16, "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FMOE_WGMMA_REGS_32 FMOE_WGMMA_REGS_16 ",%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define FMOE_WGMMA_ACC_64 FMOE_WGMMA_ACC_32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FMOE_WGMMA_REGS_64 FMOE_WGMMA_REGS_32 ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define FMOE_WGMMA_ACC_88 FMOE_WGMMA_ACC_64, "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define FMOE_WGMMA_REGS_88 FMOE_WGMMA_REGS_64 ",%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87"
#define FMOE_WGMMA_ACC_96 FMOE_WGMMA_ACC_64, "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define FMOE_WGMMA_REGS_96 FMOE_WGMMA_REGS_64 ",%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95"
#define FMOE_WGMMA_ACC_128 FMOE_WGMMA_ACC_96, "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define FMOE_WGMMA_REGS_128 FMOE_WGMMA_REGS_96 ",%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"

// One wrapper: D[64 x N] (+)= A[64 x K] * B[N x K]^T with A and B K-major in 128-byte-swizzled
// shared memory (descriptors da, db: operands IA and IA + 1 after the NACC accumulators; the
// predicate from scale_d, operand IA + 2); scale_d = 0 overwrites D (D = A * B), 1 accumulates.
// TAIL: bf16 takes the two transpose flags (0, 0: K-major); e4m3 has none (K-major only).
#define FMOE_WGMMA_WRAPPER(NAME, SHAPE, NACC, IA, IB, IS, TAIL)                                             \
    __device__ __forceinline__ void NAME(float* d, unsigned long long da, unsigned long long db, int scale_d) { \
        asm volatile("{\n"                                                                                  \
                     ".reg .pred p;\n"                                                                      \
                     "setp.ne.b32 p, %" #IS ", 0;\n"                                                        \
                     "wgmma.mma_async.sync.aligned." SHAPE " "                                              \
                     "{" FMOE_WGMMA_REGS_##NACC "}, %" #IA ", %" #IB ", p, 1, 1" TAIL ";\n"                 \
                     "}\n"                                                                                  \
                     : FMOE_WGMMA_ACC_##NACC                                                                \
                     : "l"(da), "l"(db), "r"(scale_d));                                                     \
    }

// bf16 x bf16 -> f32, N = 16 .. 256: the tile kernels (64 x 128 / 64 x 256 / 64 x 192 / 64 x 176
// slabs) and the swap-AB decode kernels (weights as A, 16-64 routes as B).
FMOE_WGMMA_WRAPPER(wgmma_m64n16k16_bf16, "m64n16k16.f32.bf16.bf16", 8, 8, 9, 10, ", 0, 0")
FMOE_WGMMA_WRAPPER(wgmma_m64n32k16_bf16, "m64n32k16.f32.bf16.bf16", 16, 16, 17, 18, ", 0, 0")
FMOE_WGMMA_WRAPPER(wgmma_m64n64k16_bf16, "m64n64k16.f32.bf16.bf16", 32, 32, 33, 34, ", 0, 0")
FMOE_WGMMA_WRAPPER(wgmma_m64n128k16_bf16, "m64n128k16.f32.bf16.bf16", 64, 64, 65, 66, ", 0, 0")
FMOE_WGMMA_WRAPPER(wgmma_m64n176k16_bf16, "m64n176k16.f32.bf16.bf16", 88, 88, 89, 90, ", 0, 0")
FMOE_WGMMA_WRAPPER(wgmma_m64n192k16_bf16, "m64n192k16.f32.bf16.bf16", 96, 96, 97, 98, ", 0, 0")
FMOE_WGMMA_WRAPPER(wgmma_m64n256k16_bf16, "m64n256k16.f32.bf16.bf16", 128, 128, 129, 130, ", 0, 0")

// e4m3 x e4m3 -> f32: the same kernels' fp8 forms; N = 64 also the block-scaled prefill GEMM's
// quarter partials (one promoted while the next one multiplies).
FMOE_WGMMA_WRAPPER(wgmma_m64n16k32_e4m3, "m64n16k32.f32.e4m3.e4m3", 8, 8, 9, 10, "")
FMOE_WGMMA_WRAPPER(wgmma_m64n32k32_e4m3, "m64n32k32.f32.e4m3.e4m3", 16, 16, 17, 18, "")
FMOE_WGMMA_WRAPPER(wgmma_m64n64k32_e4m3, "m64n64k32.f32.e4m3.e4m3", 32, 32, 33, 34, "")
FMOE_WGMMA_WRAPPER(wgmma_m64n128k32_e4m3, "m64n128k32.f32.e4m3.e4m3", 64, 64, 65, 66, "")
FMOE_WGMMA_WRAPPER(wgmma_m64n256k32_e4m3, "m64n256k32.f32.e4m3.e4m3", 128, 128, 129, 130, "")

#undef FMOE_WGMMA_WRAPPER
#undef FMOE_WGMMA_ACC_8
#undef FMOE_WGMMA_REGS_8
#undef FMOE_WGMMA_ACC_16
#undef FMOE_WGMMA_REGS_16
#undef FMOE_WGMMA_ACC_32
#undef FMOE_WGMMA_REGS_32
#undef FMOE_WGMMA_ACC_64
#undef FMOE_WGMMA_REGS_64
#undef FMOE_WGMMA_ACC_88
#undef FMOE_WGMMA_REGS_88
#undef FMOE_WGMMA_ACC_96
#undef FMOE_WGMMA_REGS_96
#undef FMOE_WGMMA_ACC_128
#undef FMOE_WGMMA_REGS_128

#endif  // FMOE_COMMON_SM90_WGMMA_CUH
