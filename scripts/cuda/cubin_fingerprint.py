#!/usr/bin/env python3
"""SHA-256 fingerprints of every CUDA kernel variant fmoe compiles, for sm_90a, without a GPU.

Compiles each `crates/fmoe-kernels/cuda/*.cu` with every `-D` combination that the Rust launch code
(`crates/fmoe-kernels/src/*/cuda*.rs`) and the CuPy bring-up harnesses (`bench/gpu/*_cupy.py`)
use, through NVRTC loaded with ctypes, with the options of `src/nvrtc.rs` (`--gpu-architecture=
sm_90a -std=c++17 -I<cuda>/include`, the defines in the Rust order) plus `-I crates/fmoe-kernels/cuda`
so that `#include "common/....cuh"` resolves from the files (nvrtc.rs hands NVRTC the same headers
from memory instead). One line per variant:

    <sha256 of the CUBIN>  <sha256 of the SASS>  <family> <defines>

where "SASS" is the concatenation (by section name) of the CUBIN's `.text.*` sections, the
machine code alone: if the whole-file hash ever differs for a reason outside the code (a file name
or a path baked into some note), the second column says whether the instructions changed.

Use it to prove that a refactor of the sources (moving helpers into headers, renaming, comments)
changes no generated code:

    python3 scripts/cuda/cubin_fingerprint.py > /tmp/before.txt     # on the old tree
    python3 scripts/cuda/cubin_fingerprint.py --compare /tmp/before.txt   # on the new tree

`--compare` prints one status per variant (identical / SASS-identical / DIFFERENT / missing) and a
summary, and exits 1 unless every variant is identical in at least its SASS.

NVRTC: `--nvrtc-lib PATH` or `$FMOE_NVRTC_LIB` (e.g. the pip wheel `nvidia-cuda-nvrtc`:
`<site>/nvidia/cu13/lib/libnvrtc.so.13`), else `$CUDA_HOME/lib64/libnvrtc.so*`, else the copy .ci/run
installs under `.ci/nvrtc`. CUDA headers (`cuda_bf16.h`): `--cuda-include DIR`, else the `include`
folder beside the library's `lib` folder (the wheel layout, with `nvidia-cuda-runtime` installed
next to it), else `$CUDA_HOME/include`.
"""
import argparse
import ctypes
import glob
import hashlib
import os
import struct
import sys
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_DIR = os.path.join(ROOT, "crates", "fmoe-kernels", "cuda")
ARCH = "sm_90a"


def variants():
    """(family, file, [(name, value)]) for every instantiation, families named as in the Rust code."""
    v = []

    def add(family, file, *defs):
        for d in defs:
            v.append((family, file, list(d)))

    # moe_align/cuda.rs: BLOCK_M = "{block_m}u" for the GEMM configs' bm (64, 128); the harnesses
    # pass the bare number.
    add("moe_align", "moe_align.cu", *[[("BLOCK_M", f"{bm}{u}")] for bm in (64, 128) for u in ("u", "")])
    # routing/cuda.rs TopKSoftmaxConfig: dtype code 0/1/2 (f32/bf16/f16), EXPERTS_PER_LANE a power
    # of two in 1..=32 (E <= 1024), WARPS_PER_BLOCK 4.
    add("topk_softmax", "topk_softmax.cu",
        *[[("FMOE_LOGITS_DTYPE", str(dt)), ("EXPERTS_PER_LANE", str(epl)), ("WARPS_PER_BLOCK", "4")]
          for dt in (0, 1, 2) for epl in (1, 2, 4, 8, 16, 32)])
    # elementwise/cuda.rs: fmoe_cast (SRC_DT, DST_DT), fmoe_add / fmoe_randn (DT), fmoe_sum_bf16 (none).
    add("elementwise", "elementwise.cu",
        *[[("SRC_DT", str(s)), ("DST_DT", str(d))] for s in (0, 1, 2) for d in (0, 1, 2)],
        *[[("DT", str(d))] for d in (0, 1, 2)], [])
    # quant_fp8/cuda.rs input_defines: bf16 input (none), f32 input (QUANT_IN_F32=1); the fp8 harness too.
    add("quant_fp8", "quant_fp8.cu", [], [("QUANT_IN_F32", "1")])
    # moe_gemm/cuda.rs GLUE_SRC and cuda_fp8.rs: no defines.
    add("moe_unfused", "moe_unfused.cu", [])
    # moe_gemm/cuda.rs GemmConfig::defines, kind Mma: MODE, BK, STAGES. MMA = (64, 4); the bf16
    # harness's default and the unit test's config = (32, 3).
    add("moe_gemm_bf16", "moe_gemm_bf16.cu",
        *[[("MODE", str(m)), ("BK", str(bk)), ("STAGES", str(st))] for m in (1, 2) for bk, st in ((64, 4), (32, 3))])
    # kind Sm90: MODE, WG_N, STAGES, BM. SM90_SMALL (128, 4, 64), SM90_SYNC (256, 4, 128); the bf16
    # harness's SWEEP and its --kind sm90 defaults (256, 3, 64).
    sm90 = [(128, 4, 64), (256, 4, 128), (128, 5, 64), (256, 4, 64), (128, 4, 128), (256, 3, 128), (256, 3, 64)]
    add("moe_gemm_bf16_sm90", "moe_gemm_bf16_sm90.cu",
        *[[("MODE", str(m)), ("WG_N", str(n)), ("STAGES", str(st)), ("BM", str(bm))] for m in (1, 2) for n, st, bm in sm90])
    # The SM90_LARGE experiments (FMOE_DEV_SM90_LARGE): "raster" = SM90_SYNC + RASTER_GM=16;
    add("moe_gemm_bf16_sm90", "moe_gemm_bf16_sm90.cu",
        *[[("MODE", str(m)), ("WG_N", "256"), ("STAGES", "4"), ("BM", "128"), ("RASTER_GM", "16")] for m in (1, 2)])
    # moe_gemm/cuda_fp8.rs Fp8GemmConfig::defines, per-tensor: MODE, WG_N, STAGES, BM, PROMOTE.
    # FP8_TENSOR_SMALL (128, 4, 64, 1), FP8_TENSOR_LARGE (256, 4, 128, 0); the fp8 harness's
    # TENSOR_SMALL, TENSOR_PROMOTED and SWEEP_T.
    fp8 = [(128, 4, 64, 1), (256, 4, 128, 0), (128, 4, 64, 0), (128, 4, 128, 1), (128, 3, 64, 0), (256, 4, 64, 0)]
    add("moe_gemm_fp8_sm90", "moe_gemm_fp8_sm90.cu",
        *[[("MODE", str(m)), ("WG_N", str(n)), ("STAGES", str(st)), ("BM", str(bm)), ("PROMOTE", str(p))]
          for m in (1, 2) for n, st, bm, p in fp8])
    # Block-scaled: MODE, STAGES. FP8_BLOCK_SCALED 5; the fp8 harness's checks (3) and sweep (4, 5).
    add("moe_gemm_fp8_block_sm90", "moe_gemm_fp8_block_sm90.cu",
        *[[("MODE", str(m)), ("STAGES", str(st))] for m in (1, 2) for st in (5, 3, 4)])
    # Sm90Pipe (SM90_LARGE and its experiments "pipe", "persist", "dyn", "dyn_gm8"; SM90_MID with
    # BM 64): MODE, STAGES, RASTER_GM, BM, PERSIST, DYNAMIC.
    add("moe_gemm_bf16_sm90_pipe", "moe_gemm_bf16_sm90_pipe.cu",
        *[[("MODE", str(m)), ("STAGES", "4"), ("RASTER_GM", str(g)), ("BM", str(bm)), ("PERSIST", str(p)),
           ("DYNAMIC", str(d))]
          for m in (1, 2) for bm in (128, 64) for g, p, d in ((16, 0, 0), (16, 1, 0), (16, 1, 1), (8, 1, 1))])
    # GEMM2 of SM90_LARGE with per-route rows (ROUTE_ROWS=1).
    add("moe_gemm_bf16_sm90_pipe", "moe_gemm_bf16_sm90_pipe.cu",
        [("MODE", "2"), ("STAGES", "4"), ("RASTER_GM", "16"), ("BM", "128"), ("PERSIST", "1"), ("DYNAMIC", "1"),
         ("ROUTE_ROWS", "1")])
    # moe_gemm/cuda_fp8 Fp8GemmConfig::defines, warp-specialized (FP8_TENSOR_LARGE, FP8_BLOCK_LARGE):
    # MODE, BLOCK_SCALED, STAGES, RASTER_GM.
    # Block-scaled adds PIPE_PROMOTE (FP8_BLOCK_LARGE 2; FP8_BLOCK_LARGE_HALVES none; the dev
    # promote-drain 1 and 4); GEMM2 also with ROUTE_ROWS=1 (per-route rows, moe_finalize).
    add("moe_gemm_fp8_sm90_ws", "moe_gemm_fp8_sm90_ws.cu",
        *[[("MODE", str(m)), ("BLOCK_SCALED", str(b)), ("STAGES", "4"), ("RASTER_GM", "16")] + pp + rr
          for m in (1, 2) for b in (0, 1)
          for pp in ([[]] + ([[("PIPE_PROMOTE", str(p))] for p in (1, 2, 4)] if b else []))
          for rr in ([[]] + ([[("ROUTE_ROWS", "1")]] if m == 2 else []))])
    add("moe_finalize", "moe_finalize.cu", *[[("OUT_F32", o)] for o in ("0", "1")])
    # Swap-AB GEMMs (FP8_TENSOR_SWAPAB, FP8_BLOCK_SWAPAB, the 32/64/128-route blocks): MODE,
    # BLOCK_SCALED, STAGES, BN (route block, with swapab_stages(bn); 16 also at the ring depths 4
    # and 6 of FMOE_DEV_SWAPAB).
    SWAPAB_BN_STAGES = [(16, 3), (16, 4), (16, 6), (32, 3), (64, 5), (128, 4)]
    add("moe_gemm_fp8_swapab_sm90", "moe_gemm_swapab_sm90.cu",
        *[[("MODE", str(m)), ("BLOCK_SCALED", str(b)), ("STAGES", str(st)), ("BN", str(bn))]
          for m in (1, 2) for b in (0, 1) for bn, st in SWAPAB_BN_STAGES])
    # moe_gemm/cuda.rs SM90_SWAPAB, the same source for bf16: MODE, ELEM_BF16, STAGES.
    add("moe_gemm_bf16_swapab_sm90", "moe_gemm_swapab_sm90.cu",
        *[[("MODE", str(m)), ("ELEM_BF16", "1"), ("STAGES", str(st)), ("BN", str(bn))]
          for m in (1, 2) for bn, st in SWAPAB_BN_STAGES])
    return v



def label(family, defines):
    return family + ("[" + ",".join(f"{k}={x}" for k, x in defines) + "]" if defines else "")


def find_nvrtc(arg):
    if arg:
        return arg
    if os.environ.get("FMOE_NVRTC_LIB"):
        return os.environ["FMOE_NVRTC_LIB"]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for pattern in (os.path.join(home, "lib64", "libnvrtc.so*"), os.path.join(home, "lib", "libnvrtc.so*"),
                    os.path.join(ROOT, ".ci", "nvrtc", "nvidia", "*", "lib", "libnvrtc.so.*")):
        hits = sorted(p for p in glob.glob(pattern) if "builtins" not in p)
        if hits:
            return hits[0]
    sys.exit("NVRTC not found: pass --nvrtc-lib or set FMOE_NVRTC_LIB (pip install nvidia-cuda-nvrtc)")


def find_include(arg, lib):
    if arg:
        return arg
    beside = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(lib))), "include")
    if os.path.exists(os.path.join(beside, "cuda_bf16.h")):
        return beside
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return os.path.join(home, "include")


def text_sections(cubin):
    """sha256 over the `.text.*` sections of an ELF64 little-endian image, in name order."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return "not-elf64"
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = secs[shstrndx]
    names = cubin[strtab[4]:strtab[4] + strtab[5]]

    def name(off):
        return names[off:names.index(b"\0", off)].decode()

    h = hashlib.sha256()
    for n, s in sorted((name(s[0]), s) for s in secs if name(s[0]).startswith(".text.")):
        h.update(n.encode() + b"\0" + cubin[s[4]:s[4] + s[5]])
    return h.hexdigest()


_LIB = None


def compile_one(job):
    lib_path, include, family, file, defines = job
    global _LIB
    if _LIB is None:
        _LIB = ctypes.CDLL(lib_path)
    lib = _LIB
    src = open(os.path.join(CUDA_DIR, file), "rb").read()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{family}.cu".encode(), 0, None, None)
    if rc != 0:
        return family, defines, None, f"nvrtcCreateProgram failed: {rc}"
    # nvrtc.rs's options, in its order, then the folder of the common headers.
    opts = [f"--gpu-architecture={ARCH}", "-std=c++17", f"-I{include}"]
    opts += [f"-D{k}={x}" for k, x in defines] + [f"-I{CUDA_DIR}"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    cubin = None
    if rc == 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        cubin = buf.raw[:size.value]
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return family, defines, cubin, log.value.decode(errors="replace").strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvrtc-lib")
    ap.add_argument("--cuda-include")
    ap.add_argument("--compare", metavar="FILE", help="compare with an earlier run's output")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    lib = find_nvrtc(a.nvrtc_lib)
    include = find_include(a.cuda_include, lib)
    jobs = [(lib, include, f, file, d) for f, file, d in variants()]
    lines, failed = [], 0
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        for family, defines, cubin, log in ex.map(compile_one, jobs):
            if cubin is None:
                failed += 1
                print(f"FAILED {label(family, defines)}:\n{log}", file=sys.stderr)
                continue
            lines.append(f"{hashlib.sha256(cubin).hexdigest()}  {text_sections(cubin)}  {label(family, defines)}")
    if not a.compare:
        print("\n".join(lines))
        print(f"# {len(lines)} variants compiled for {ARCH}, {failed} failed", file=sys.stderr)
        return 1 if failed else 0
    old = {}
    for line in open(a.compare):
        if line.strip() and not line.startswith("#"):
            whole, sass, name = line.split()
            old[name] = (whole, sass)
    counts = {"identical": 0, "SASS-identical": 0, "DIFFERENT": 0, "new": 0}
    seen = set()
    for line in lines:
        whole, sass, name = line.split()
        seen.add(name)
        if name not in old:
            status = "new"
        elif old[name][0] == whole:
            status = "identical"
        elif old[name][1] == sass:
            status = "SASS-identical"
        else:
            status = "DIFFERENT"
        counts[status] += 1
        print(f"{status:15} {name}")
    missing = sorted(set(old) - seen)
    for name in missing:
        print(f"{'missing':15} {name}")
    print(f"# {len(lines)} variants: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f", {len(missing)} missing, {failed} failed to compile")
    bad = counts["DIFFERENT"] or counts["new"] or missing or failed
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
