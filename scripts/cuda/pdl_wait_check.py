"""Checks, without a GPU, that every kernel launched with Programmatic Dependent Launch
(src/launch.rs PdlLaunch, cuda/common/pdl.cuh) waits (SASS ACQBULK = griddepcontrol.wait) before
its first global memory instruction: compiles the PDL build (`-D PDL=1`, last) of every program of
fmoe's kernel catalog (the chain's kernels, which src/launch.rs load_chain builds so) with NVRTC as
cubin_fingerprint.py does, catalog options included (--catalog FILE / --fmoe BIN, else
target/release/fmoe), and reads their SASS with cuobjdump (needs nvdisasm on PATH).

    FMOE_NVRTC_LIB=... CUOBJDUMP=cuobjdump python3 scripts/cuda/pdl_wait_check.py OUT_DIR

CUBINs already in OUT_DIR are reused (use a fresh folder after changing the sources). Prints one
line per kernel; kernels without a wait are listed (those not launched with PDL have none) and any
global memory op before the wait is an error (exit status 1), as is a build that fails to compile:
only weights could safely be read there (common/pdl.cuh), and no kernel does so yet.
"""
import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cubin_fingerprint as cf  # noqa: E402

PDL = ("PDL", "1")
GMEM = re.compile(r'\b(LDG|STG|ATOMG|REDG|RED|LDGSTS|UTMALDG|UBLKCP|ATOM|LD|ST|UTMAPF)\.')


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="/tmp/pdl_wait_check", metavar="OUT_DIR")
    cf.add_catalog_args(ap)
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    lib = cf.find_nvrtc(None)
    inc = cf.find_include(None, lib)
    os.makedirs(a.out, exist_ok=True)
    cuobjdump = os.environ.get("CUOBJDUMP", "cuobjdump")
    # The plain builds have no wait (cubin_fingerprint.py keeps them identical to the code before PDL).
    want = [(p["family"], p["source"], p["defines"]) for p in cf.load_catalog(a.catalog, a.fmoe)
            if p["defines"][-1:] == [PDL]]
    if not want:
        sys.exit("no PDL build (-D PDL=1) in the kernel catalog")
    path = {(fam, tuple(d)): f'{a.out}/{fam}_{"_".join(k + v for k, v in d)}.cubin' for fam, _, d in want}
    todo = [(lib, inc, fam, file, d) for fam, file, d in want if not os.path.exists(path[fam, tuple(d)])]
    failed = 0
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        for fam, d, cubin, log in ex.map(cf.compile_one, todo):
            if cubin is None:
                print('FAIL', fam, d, log[:500])
                failed += 1
                continue
            with open(path[fam, tuple(d)], 'wb') as f:
                f.write(cubin)
    tot = bad = 0
    for fam, _, d in want:
        p = path[fam, tuple(d)]
        if not os.path.exists(p):
            continue
        out = subprocess.run([cuobjdump, '-sass', p], capture_output=True, text=True).stdout
        for fn in re.split(r'\n\s*Function : ', out)[1:]:
            name = fn.split('\n', 1)[0].strip()
            lines = [ln for ln in fn.split('\n') if '/*' in ln and ';' in ln]
            acq = [i for i, ln in enumerate(lines) if 'ACQBULK' in ln or 'griddep' in ln.lower()]
            tot += 1
            if not acq:
                print('no wait (not a PDL kernel?)', fam, d, name)
                continue
            pre = [ln.split(';')[0].split('*/')[-1].strip() for ln in lines[:acq[0]]]
            mem = [x for x in pre if GMEM.search(x + ' ')]
            print(f'{fam} {d} {name}: wait at instr {acq[0]}, pre-wait memory ops: {mem}')
            if mem:
                bad += 1
    print(f'{tot} kernels, {bad} with a global memory op before griddepcontrol.wait'
          + (f', {failed} builds failed to compile' if failed else ''))
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
