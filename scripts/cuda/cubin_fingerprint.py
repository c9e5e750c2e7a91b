#!/usr/bin/env python3
"""SHA-256 fingerprints of every CUDA kernel variant fmoe compiles, for sm_90a, without a GPU.

Compiles each program of fmoe's kernel catalog (`crates/fmoe-kernels/src/catalog.rs`, printed by
`fmoe kernels --catalog-json`: every `crates/fmoe-kernels/cuda/*.cu` with every `-D` set the launch
code builds), plus a few variants outside it (`extras()`: the CuPy bring-up harnesses'
`bench/gpu/*_cupy.py` configs and experiments no longer built), through NVRTC loaded with ctypes, with the
options of `src/nvrtc.rs` (`--gpu-architecture=sm_90a -std=c++17 -I<cuda>/include`, the defines in
the Rust order) plus `-I crates/fmoe-kernels/cuda` so that `#include "common/....cuh"` resolves
from the files (nvrtc.rs hands NVRTC the same headers from memory instead). The catalog comes from
`--catalog FILE` (that command's output), else from running `--fmoe BIN`, `$FMOE_BIN` or this
tree's `target/release/fmoe` (build it first: a stale binary prints a stale catalog).

One line per variant:

    <sha256 of the CUBIN>  <sha256 of the SASS>  <family> <defines>

where "SASS" is the concatenation (by section name) of the CUBIN's `.text.*` sections, the
machine code alone: if the whole-file hash ever differs for a reason outside the code (a file name
or a path baked into some note), the second column says whether the instructions changed.

Use it to prove that a refactor of the sources (moving helpers into headers, renaming, comments)
changes no generated code:

    cargo build --release -p fmoe-cli   # in each tree: its fmoe prints its catalog
    python3 scripts/cuda/cubin_fingerprint.py > /tmp/before.txt     # on the old tree
    python3 scripts/cuda/cubin_fingerprint.py --compare /tmp/before.txt   # on the new tree

`--compare` prints one status per variant (identical / SASS-identical / DIFFERENT / new / missing)
and a summary, and exits 1 unless every earlier variant is there and identical in at least its
SASS ("new": a variant the earlier file lacks, e.g. the catalog grew; listed, not a failure).

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
import json
import os
import struct
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_DIR = os.path.join(ROOT, "crates", "fmoe-kernels", "cuda")
ARCH = "sm_90a"


def load_catalog(catalog=None, fmoe=None):
    """fmoe's kernel catalog (`crates/fmoe-kernels/src/catalog.rs`), one dict a program: family,
    source (file under cuda/), entries, defines ([name, value] in -D order). Read from `catalog`
    (the output of `fmoe kernels --catalog-json`; "-" = stdin), else printed by the `fmoe` binary
    `fmoe`, $FMOE_BIN, or this tree's target/release/fmoe (then target/debug/fmoe)."""
    if catalog:
        text = sys.stdin.read() if catalog == "-" else open(catalog).read()
        where = catalog
    else:
        fmoe = fmoe or os.environ.get("FMOE_BIN")
        if not fmoe:
            built = [os.path.join(ROOT, "target", t, "fmoe") for t in ("release", "debug")]
            fmoe = next((b for b in built if os.path.exists(b)), None)
            if fmoe:
                warn_if_stale(fmoe)
        if not fmoe:
            sys.exit("no kernel catalog: pass --catalog FILE (from `fmoe kernels --catalog-json`) or "
                     "--fmoe BIN, or build fmoe (cargo build --release -p fmoe-cli)")
        run = subprocess.run([fmoe, "kernels", "--catalog-json"], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"{fmoe} kernels --catalog-json failed ({run.returncode}):\n{run.stderr}")
        text, where = run.stdout, f"{fmoe} kernels --catalog-json"
    programs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            p = json.loads(line)
            programs.append({"family": p["family"], "source": p["source"], "entries": list(p["entries"]),
                             "defines": [(str(k), str(x)) for k, x in p["defines"]]})
        except (ValueError, KeyError, TypeError) as e:
            sys.exit(f"{where}:{n}: not a catalog line ({e!r}): {line[:200]}")
    if not programs:
        sys.exit(f"{where}: empty kernel catalog")
    print(f"# kernel catalog: {len(programs)} programs from {where}", file=sys.stderr)
    return programs


def warn_if_stale(binary):
    """Warns when a Rust source of fmoe-kernels is newer than `binary` (its catalog may be old)."""
    src = os.path.join(ROOT, "crates", "fmoe-kernels", "src")
    newest = max((os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs), default=0)
    if newest > os.path.getmtime(binary):
        print(f"warning: {binary} is older than crates/fmoe-kernels/src: its catalog may be stale "
              "(cargo build --release -p fmoe-cli)", file=sys.stderr)


def extras():
    """Variants outside the catalog (fmoe never builds them), kept so that their CUBINs stay covered
    and older fingerprint files still compare: the CuPy bring-up harnesses' configs
    (bench/gpu/*_cupy.py) and experiments the launch code no longer builds. (family, file, [(name, value)])."""
    v = []

    def add(family, file, *defs):
        for d in defs:
            v.append((family, file, list(d)))

    # The harnesses pass moe_align's BLOCK_M as a bare number (the Rust code: "64u", "128u").
    add("moe_align", "moe_align.cu", *[[("BLOCK_M", str(bm))] for bm in (64, 128)])
    # The bf16 harness's default Mma config.
    add("moe_gemm_bf16", "moe_gemm_bf16.cu", *[[("MODE", str(m)), ("BK", "32"), ("STAGES", "3")] for m in (1, 2)])
    # The bf16 harness's Sm90 SWEEP and its --kind sm90 defaults: WG_N, STAGES, BM.
    sm90 = [(128, 5, 64), (256, 4, 64), (128, 4, 128), (256, 3, 128), (256, 3, 64)]
    add("moe_gemm_bf16_sm90", "moe_gemm_bf16_sm90.cu",
        *[[("MODE", str(m)), ("WG_N", str(n)), ("STAGES", str(st)), ("BM", str(bm))] for m in (1, 2) for n, st, bm in sm90])
    # The fp8 harness's per-tensor TENSOR_PROMOTED and SWEEP_T: WG_N, STAGES, BM, PROMOTE.
    fp8 = [(128, 4, 64, 0), (128, 4, 128, 1), (128, 3, 64, 0), (256, 4, 64, 0)]
    add("moe_gemm_fp8_sm90", "moe_gemm_fp8_sm90.cu",
        *[[("MODE", str(m)), ("WG_N", str(n)), ("STAGES", str(st)), ("BM", str(bm)), ("PROMOTE", str(p))]
          for m in (1, 2) for n, st, bm, p in fp8])
    # The fp8 harness's block-scaled checks (3) and sweep (4).
    add("moe_gemm_fp8_block_sm90", "moe_gemm_fp8_block_sm90.cu",
        *[[("MODE", str(m)), ("STAGES", str(st))] for m in (1, 2) for st in (3, 4)])
    # Sm90Pipe at BM 64 with 4 stages (the launch code now builds BM 64 with 5): RASTER_GM, PERSIST, DYNAMIC.
    add("moe_gemm_bf16_sm90_pipe", "moe_gemm_bf16_sm90_pipe.cu",
        *[[("MODE", str(m)), ("STAGES", "4"), ("RASTER_GM", str(g)), ("BM", "64"), ("PERSIST", str(p)),
           ("DYNAMIC", str(d))]
          for m in (1, 2) for g, p, d in ((16, 0, 0), (16, 1, 0), (16, 1, 1), (8, 1, 1))])
    # Promote-drain experiments of the block-scaled warp-specialized GEMMs no longer built (PIPE_PROMOTE 1, 4).
    add("moe_gemm_fp8_sm90_ws", "moe_gemm_fp8_sm90_ws.cu",
        *[[("MODE", str(m)), ("BLOCK_SCALED", "1"), ("STAGES", "4"), ("RASTER_GM", "16"), ("PIPE_PROMOTE", str(p))] + rr
          for m in (1, 2) for p in (1, 4) for rr in ([[]] + ([[("ROUTE_ROWS", "1")]] if m == 2 else []))])
    # Swap-AB ring depths 4 and 6 at BN 16 (a dev experiment no longer built).
    add("moe_gemm_fp8_swapab_sm90", "moe_gemm_swapab_sm90.cu",
        *[[("MODE", str(m)), ("BLOCK_SCALED", str(b)), ("STAGES", str(st)), ("BN", "16")]
          for m in (1, 2) for b in (0, 1) for st in (4, 6)])
    add("moe_gemm_bf16_swapab_sm90", "moe_gemm_swapab_sm90.cu",
        *[[("MODE", str(m)), ("ELEM_BF16", "1"), ("STAGES", str(st)), ("BN", "16")] for m in (1, 2) for st in (4, 6)])
    return v


def variants(programs):
    """(family, file, [(name, value)]) of every catalog program, then the extras it lacks."""
    v = [(p["family"], p["source"], p["defines"]) for p in programs]
    seen = {label(f, d) for f, _, d in v}
    v += [x for x in extras() if label(x[0], x[2]) not in seen]
    return v


def label(family, defines):
    return family + ("[" + ",".join(f"{k}={x}" for k, x in defines) + "]" if defines else "")


def add_catalog_args(ap):
    ap.add_argument("--catalog", metavar="FILE", help="the output of `fmoe kernels --catalog-json` (- = stdin)")
    ap.add_argument("--fmoe", metavar="BIN", help="the fmoe binary to ask for the catalog (default: $FMOE_BIN, "
                    "else target/release/fmoe)")


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
    """NVRTC-compile one variant: job = (lib, include, family, file, defines[, extra options]).
    Returns (family, defines, cubin or None, log)."""
    lib_path, include, family, file, defines = job[:5]
    extra = job[5] if len(job) > 5 else []
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
    opts += [f"-D{k}={x}" for k, x in defines] + [f"-I{CUDA_DIR}"] + list(extra)
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
    add_catalog_args(ap)
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    lib = find_nvrtc(a.nvrtc_lib)
    include = find_include(a.cuda_include, lib)
    jobs = [(lib, include, f, file, d) for f, file, d in variants(load_catalog(a.catalog, a.fmoe))]
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
    bad = counts["DIFFERENT"] or missing or failed
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
