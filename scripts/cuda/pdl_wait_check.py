"""Checks, without a GPU, that every kernel launched with Programmatic Dependent Launch
(src/launch.rs PdlLaunch, cuda/common/pdl.cuh) waits (SASS ACQBULK = griddepcontrol.wait) before
its first global memory instruction: compiles the decode chain's variants with NVRTC as
cubin_fingerprint.py does and reads their SASS with cuobjdump (needs nvdisasm on PATH).

    FMOE_NVRTC_LIB=... CUOBJDUMP=cuobjdump python3 scripts/cuda/pdl_wait_check.py OUT_DIR

Prints one line per kernel; kernels without a wait are listed (those not launched with PDL have
none) and any global memory op before the wait is an error (exit status 1): only weights could
safely be read there (common/pdl.cuh), and no kernel does so yet.
"""
import os, re, subprocess, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cubin_fingerprint as cf
lib = cf.find_nvrtc(None)
inc = cf.find_include(None, lib)
OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/pdl_wait_check"
os.makedirs(OUT, exist_ok=True)
CUOBJDUMP = os.environ.get("CUOBJDUMP", "cuobjdump")
want = [
 ("moe_align","moe_align.cu",[("BLOCK_M","64u")]),
 ("elementwise","elementwise.cu",[("SRC_DT","0"),("DST_DT","1")]),
 ("elementwise","elementwise.cu",[]),
 ("quant_fp8","quant_fp8.cu",[]),
 ("moe_finalize","moe_finalize.cu",[("OUT_F32","0")]),
]
want += [("swapab","moe_gemm_swapab_sm90.cu",[("MODE",str(m)),("BLOCK_SCALED",str(b)),("STAGES","3")]) for m in (1,2) for b in (0,1)]
want += [("swapab_bf16","moe_gemm_swapab_sm90.cu",[("MODE",str(m)),("ELEM_BF16","1"),("STAGES","3")]) for m in (1,2)]
want += [("ws","moe_gemm_fp8_sm90_ws.cu",[("MODE",str(m)),("BLOCK_SCALED",str(b)),("STAGES","4"),("RASTER_GM","16")]) for m in (1,2) for b in (0,1)]
want += [("blk","moe_gemm_fp8_block_sm90.cu",[("MODE",str(m)),("STAGES","5")]) for m in (1,2)]
want += [("fp8","moe_gemm_fp8_sm90.cu",[("MODE",str(m)),("WG_N","128"),("STAGES","4"),("BM","64"),("PROMOTE","1")]) for m in (1,2)]
want += [("pipe","moe_gemm_bf16_sm90_pipe.cu",[("MODE",str(m)),("STAGES","4"),("RASTER_GM","16"),("BM","128"),("PERSIST","1"),("DYNAMIC","1")]) for m in (1,2)]
want += [("sm90","moe_gemm_bf16_sm90.cu",[("MODE",str(m)),("WG_N","128"),("STAGES","4"),("BM","64")]) for m in (1,2)]
want += [("mma","moe_gemm_bf16.cu",[("MODE",str(m)),("BK","64"),("STAGES","4")]) for m in (1,2)]
# The PDL build (-D PDL=1) of each: the host compiles it only for the chain's PDL launches
# (src/launch.rs load_chain); the plain builds have no wait (cubin_fingerprint.py keeps them
# identical to the code before PDL).
want = [(fam, file, d + [("PDL", "1")]) for fam, file, d in want]
gmem = re.compile(r'\b(LDG|STG|ATOMG|REDG|RED|LDGSTS|UTMALDG|UBLKCP|ATOM|LD|ST|UTMAPF)\.')
tot=0; bad=0
for fam, file, d in want:
    p=f'{OUT}/{fam}_{"_".join(k+v for k,v in d)}.cubin'
    if not os.path.exists(p):
        f, dd, cubin, log = cf.compile_one((lib, inc, fam, file, d))
        if cubin is None: print('FAIL', fam, d, log[:500]); continue
        open(p,'wb').write(cubin)
    out=subprocess.run([CUOBJDUMP, '-sass', p],capture_output=True,text=True).stdout
    for fn in re.split(r'\n\s*Function : ', out)[1:]:
        name=fn.split('\n',1)[0].strip(); lines=[l for l in fn.split('\n') if '/*' in l and ';' in l]
        acq=[i for i,l in enumerate(lines) if 'ACQBULK' in l or 'griddep' in l.lower()]
        tot+=1
        if not acq:
            print('no wait (not a PDL kernel?)', fam, d, name); continue
        pre=[l.split(';')[0].split('*/')[-1].strip() for l in lines[:acq[0]]]
        mem=[x for x in pre if gmem.search(x+' ')]
        print(f'{fam} {d} {name}: wait at instr {acq[0]}, pre-wait memory ops: {mem}')
        if mem: bad+=1
print(f'{tot} kernels, {bad} with a global memory op before griddepcontrol.wait')
sys.exit(1 if bad else 0)
