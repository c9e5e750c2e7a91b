#!/usr/bin/env python3
"""Registers, spills and the instruction mix of each MMA loop of fmoe's kernel variants, for
sm_90a, without a GPU: what a kernel change costs in the hot loop before any device time is spent.

Compiles the catalog's variants (as cubin_fingerprint.py: `fmoe kernels --catalog-json`, NVRTC
through ctypes, the options of src/nvrtc.rs) whose label matches `--match REGEX` (label =
`family[NAME=value,...]`), with `--ptxas-options=-v`, disassembles each CUBIN with nvdisasm and
prints, per variant: ptxas's registers / stack / spill line, any wgmma serialization warning
(C7514, C7519, ...), and for every loop (a label and the backward branch to it) that holds a
wgmma (`HGMMA` / `QGMMA`): its static instruction count and the most frequent opcodes. One
variant of a source can also be compiled from another file (`--file PATH`, e.g. an older copy)
to compare a change side by side.

    python3 scripts/cuda/sass_stats.py --match 'moe_gemm_fp8_sm90_ws.*BLOCK_SCALED=1'

nvdisasm: `--nvdisasm PATH`, `$FMOE_NVDISASM`, beside the NVRTC library (`<lib>/../bin`, the pip
wheel `nvidia-cuda-nvdisasm`), else `$CUDA_HOME/bin`. NVRTC and the headers as cubin_fingerprint.py.
Static counts: a loop's code is counted once, whatever its trip count (ncu's source counters give
the dynamic ones on a GPU).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cubin_fingerprint import (CUDA_DIR, add_catalog_args, compile_one, find_include, find_nvrtc,  # noqa: E402
                               label, load_catalog, variants)

NOTEWORTHY = re.compile(r"registers|spill|stack frame|C75\d\d|error")


def find_nvdisasm(arg, lib):
    cands = [arg, os.environ.get("FMOE_NVDISASM"),
             os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(lib))), "bin", "nvdisasm"),
             os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvdisasm")]
    for c in cands:
        if c and os.path.exists(c):
            return c
    sys.exit("nvdisasm not found: pass --nvdisasm or set FMOE_NVDISASM (pip install nvidia-cuda-nvdisasm)")


def mma_loops(sass):
    """(label, instruction count, Counter of opcodes) of each innermost loop that holds a wgmma
    (the K loops, not the tile loops around them)."""
    ins = []  # (label or None, opcode)
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            ins.append((m.group(1), None, line))
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ins.append((None, m.group(1), line))
    at = {lab: i for i, (lab, _, _) in enumerate(ins) if lab}
    loops = []
    for i, (_, op, line) in enumerate(ins):
        if not op or not op.startswith("BRA"):
            continue
        t = re.search(r"`\((\.L_x_\d+)\)", line)
        if t and t.group(1) in at and at[t.group(1)] < i:
            body = [o for _, o, _ in ins[at[t.group(1)]:i + 1] if o]
            if any(o.startswith(("HGMMA", "QGMMA")) for o in body):
                loops.append((at[t.group(1)], i, t.group(1), len(body),
                              collections.Counter(o.split(".")[0] for o in body)))
    inner = [lp for lp in loops if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    return [lp[2:] for lp in inner]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", required=True, metavar="REGEX", help="variants whose label matches")
    ap.add_argument("--file", metavar="PATH", help="compile this source instead of the catalog's file")
    ap.add_argument("--nvrtc-lib")
    ap.add_argument("--cuda-include")
    ap.add_argument("--nvdisasm")
    ap.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    add_catalog_args(ap)
    a = ap.parse_args()
    lib = find_nvrtc(a.nvrtc_lib)
    include = find_include(a.cuda_include, lib)
    nvdisasm = find_nvdisasm(a.nvdisasm, lib)
    picked = [v for v in variants(load_catalog(a.catalog, a.fmoe)) if re.search(a.match, label(v[0], v[2]))]
    if not picked:
        sys.exit(f"no catalog variant matches {a.match!r}")
    failed = 0
    for family, file, defines in picked:
        if a.file:
            file = os.path.relpath(os.path.abspath(a.file), CUDA_DIR)
        _, _, cubin, log = compile_one((lib, include, family, file, defines, ["--ptxas-options=-v"]))
        print(f"== {label(family, defines)}")
        for line in log.splitlines():
            if NOTEWORTHY.search(line):
                print("   " + line.strip())
        if cubin is None:
            failed += 1
            continue
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
        for lab, n, ops in mma_loops(sass):
            print(f"   loop {lab}: {n} instructions: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(a.top)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
