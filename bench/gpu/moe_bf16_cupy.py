#!/usr/bin/env python3
"""Kernel bring-up harness for fmoe's fused bf16 MoE CUDA kernels, run on the GPU machine.

Compiles crates/fmoe-kernels/cuda/{moe_align,moe_gemm_bf16}.cu with NVRTC through CuPy (the same
sources and options the Rust backend uses), checks them against an f32 reference on fresh random
data with poisoned outputs, and times them beside the PyTorch peers of ../shared/peers (copied to
.peers/) in the same process, with the measured roofline floor.

Usage: python3 bench/gpu/moe_bf16_cupy.py [--check-only] [--shapes ...] [--tokens ...] [--json PATH]
"""
import argparse, glob, hashlib, json, math, os, sys
import numpy as np
import torch
import cupy as cp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".peers"))
import moe_peers as P  # noqa: E402

BM = 64
CUDA_INC = os.environ.get("CUDA_HOME", "/usr/local/cuda") + "/include"
# The kernels' shared headers (#include "common/....cuh"); the Rust side hands NVRTC the same files
# from memory (nvrtc.rs HEADERS).
KERNEL_INC = os.path.join(ROOT, "crates/fmoe-kernels/cuda")


def source(name):
    """A kernel source, plus a comment with the hash of the shared headers: CuPy's kernel cache keys
    on the source text and options only, so without it an edited header would reuse stale binaries."""
    h = hashlib.sha256()
    for p in sorted(glob.glob(os.path.join(KERNEL_INC, "common", "*.cuh"))):
        h.update(open(p, "rb").read())
    return open(os.path.join(KERNEL_INC, name)).read() + f"\n// common headers: sha256 {h.hexdigest()}\n"


def load(name, entry, defines):
    src = source(name)
    opts = ("-std=c++17", "--gpu-architecture=sm_90a", "-I" + CUDA_INC, "-I" + KERNEL_INC) + tuple(
        f"-D{k}={v}" for k, v in defines)
    return cp.RawModule(code=src, options=opts).get_function(entry)


ALIGNS = {}


def align_fn(bm):
    if bm not in ALIGNS:
        ALIGNS[bm] = load("moe_align.cu", "fmoe_moe_align", [("BLOCK_M", bm)])
    return ALIGNS[bm]
SMS = torch.cuda.get_device_properties(0).multi_processor_count


class Gemm:
    """One compiled variant (tunables are compile-time constants).

    kind "mma": moe_gemm_bf16.cu (mma.sync, sm_80+), tile 64 x 128 B-rows, BK in {32, 64}.
    kind "sm90": moe_gemm_bf16_sm90.cu (wgmma), tile 64 x WG_N B-rows, BK 64.
    `n_tile` is how many output columns one CTA covers (GEMM1: half its B rows).
    """

    def __init__(self, mode, kind, bk, stages, wg_n, bm):
        if kind == "mma":
            self.fn = load("moe_gemm_bf16.cu", "fmoe_moe_gemm_bf16", [("MODE", mode), ("BK", bk), ("STAGES", stages)])
            self.bk, self.smem, rows, self.bm, self.threads = bk, stages * (64 + 128) * (bk + 8) * 2, 128, 64, 128
        else:
            self.fn = load("moe_gemm_bf16_sm90.cu", "fmoe_moe_gemm_bf16",
                           [("MODE", mode), ("WG_N", wg_n), ("STAGES", stages), ("BM", bm)])
            self.bk, self.smem, rows, self.bm = 64, stages * (bm + wg_n) * 64 * 2 + 1024, wg_n, bm
            self.threads = bm // 64 * 128
        self.n_tile = rows // 2 if mode == 1 else rows
        self.fn.max_dynamic_shared_size_bytes = self.smem


VARIANTS = {}


def gemm(mode, kind, bk, stages, wg_n, bm):
    key = (mode, kind, bk, stages, wg_n, bm)
    if key not in VARIANTS:
        VARIANTS[key] = Gemm(*key)
    return VARIANTS[key]


CONFIG = {"kind": "mma", "bk": 32, "stages": 3, "wg_n": 256, "bm": 64, "split": True}


def splits_for(R, E, cap, ntiles, kd, bk, BM):
    """Split-K for GEMM2 so that decode batches still launch a few waves of CTAs."""
    if not CONFIG["split"]:
        return 1
    blocks = min(cap // BM, -(-R // BM) + min(E, R))
    want = -(-4 * SMS // max(1, ntiles * blocks))
    return max(1, min(want, (kd // bk) // 8 or 1))


def ptr(t):
    return np.uint64(t.data_ptr() if t is not None else 0)


def fused_moe(x, w13, w2, w, ids, poison=False, events=None):
    """y = sum_j w_j W2_e(silu(W1_e x) * W3_e x) with fmoe's kernels; x bf16 [M, K]."""
    M, topk = ids.shape
    E, two_n, K = w13.shape
    N = two_n // 2
    R = M * topk
    cfg = (CONFIG["kind"], CONFIG["bk"], CONFIG["stages"], CONFIG["wg_n"], CONFIG["bm"])
    g1, g2 = gemm(1, *cfg), gemm(2, *cfg)
    BM = g1.bm
    cap = (R + E * (BM - 1) + BM - 1) // BM * BM
    u32 = torch.int32
    ids32 = ids.to(u32).contiguous()
    sorted_routes = torch.empty(cap, dtype=u32, device="cuda")
    block_experts = torch.empty(cap // BM, dtype=u32, device="cuda")
    offsets = torch.empty(E + 1, dtype=u32, device="cuda")
    counts = torch.empty(E, dtype=u32, device="cuda")
    total = torch.empty(1, dtype=u32, device="cuda")
    err = torch.zeros(1, dtype=u32, device="cuda")
    align_fn(BM)((1,), (1024,), (ptr(ids32), np.uint32(R), np.uint32(E), ptr(sorted_routes), ptr(block_experts),
                          ptr(offsets), ptr(counts), ptr(total), ptr(err), np.uint32(cap)),
          shared_mem=4 * (3 * E + 1))
    h = (torch.full if poison else torch.empty)((R, N), *( (float("nan"),) if poison else ()),
                                                 dtype=torch.bfloat16, device="cuda")
    if events:
        events[0].record()
    if cap:
        g1.fn((math.ceil(N / g1.n_tile), cap // BM), (g1.threads,),
              (ptr(x), ptr(w13), ptr(sorted_routes), ptr(block_experts), ptr(total), ptr(None), ptr(h), ptr(None),
               np.uint32(R), np.uint32(topk), np.uint32(K), np.uint32(N)), shared_mem=g1.smem)
    if events:
        events[1].record()
    y32 = torch.zeros(M, K, dtype=torch.float32, device="cuda")
    wflat = w.reshape(-1).float().contiguous()
    if cap:
        nt = math.ceil(K / g2.n_tile)
        g2.fn((nt, cap // BM, splits_for(R, E, cap, nt, N, g2.bk, BM)), (g2.threads,),
              (ptr(h), ptr(w2), ptr(sorted_routes), ptr(block_experts), ptr(total), ptr(wflat), ptr(None), ptr(y32),
               np.uint32(R), np.uint32(topk), np.uint32(N), np.uint32(K)), shared_mem=g2.smem)
    if events:
        events[2].record()
    return y32.to(torch.bfloat16), err


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def check(cases):
    ok = True
    for (M, E, K, N, topk) in cases:
        g = torch.Generator(device="cuda").manual_seed(M * 7 + E)
        x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
        w13 = (torch.randn(E, 2 * N, K, device="cuda", generator=g) / math.sqrt(K)).to(torch.bfloat16)
        w2 = (torch.randn(E, K, N, device="cuda", generator=g) / math.sqrt(N)).to(torch.bfloat16)
        w, ids = P.route(M, E, topk) if M else (torch.empty(0, topk, device="cuda"), torch.empty(0, topk, dtype=torch.long, device="cuda"))
        y, err = fused_moe(x, w13, w2, w, ids, poison=True)
        torch.cuda.synchronize()
        ref = P.reference(x, w13, w2, w, ids) if M else torch.zeros(0, K, device="cuda")
        e = rel(y, ref) if M else 0.0
        good = err.item() == 0 and torch.isfinite(y.float()).all().item() and e <= 1e-2
        ok &= good
        print(f"check M={M} E={E} K={K} N={N} top{topk}: rel_err {e:.2e} {'ok' if good else 'FAIL'}", flush=True)
    return ok


SWEEP = [("sm90", 64, 4, 128, 64), ("sm90", 64, 5, 128, 64), ("sm90", 64, 4, 256, 64),
         ("sm90", 64, 4, 128, 128), ("sm90", 64, 3, 256, 128), ("sm90", 64, 4, 256, 128)]


def sweep(a):
    """Per-kernel CUDA-event times (median of 20) for each variant: where the time goes."""
    for name in a.shapes.split(","):
        E, K, N, topk = P.SHAPES[name]
        L = P.make_layer(E, K, N, [])
        for M in [int(t) for t in a.tokens.split(",")]:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            w, ids = P.route(M, E, topk)
            for kind, bk, st, wg_n, bm in SWEEP:
                CONFIG.update(kind=kind, bk=bk, stages=st, wg_n=wg_n, bm=bm)
                split = True
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                t1, t2, tt = [], [], []
                for i in range(23):
                    s0 = torch.cuda.Event(enable_timing=True); s0.record()
                    fused_moe(x, L["w13"], L["w2"], w, ids, events=ev)
                    e0 = torch.cuda.Event(enable_timing=True); e0.record()
                    torch.cuda.synchronize()
                    if i >= 3:
                        t1.append(ev[0].elapsed_time(ev[1])); t2.append(ev[1].elapsed_time(ev[2])); tt.append(s0.elapsed_time(e0))
                med = lambda v: sorted(v)[len(v) // 2]
                print(f"sweep {name:13} M={M:5} {kind} BM{bm} S{st} N{wg_n}: gemm1 {med(t1):.3f} gemm2 {med(t2):.3f} total {med(tt):.3f} ms", flush=True)
        del L
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--shapes", default="mixtral-8x7b,deepseek-v3")
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="time GEMM1/GEMM2 per tile variant and split-K")
    ap.add_argument("--bk", type=int, default=32)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--kind", default="mma", choices=["mma", "sm90"])
    ap.add_argument("--wg-n", type=int, default=256)
    ap.add_argument("--bm", type=int, default=64)
    a = ap.parse_args()
    CONFIG.update(kind=a.kind, bk=a.bk, stages=a.stages, wg_n=a.wg_n, bm=a.bm)
    ok = check([(0, 8, 256, 128, 2), (1, 8, 256, 128, 2), (5, 1, 256, 200, 1), (33, 8, 136, 72, 8),
                (100, 256, 512, 256, 8), (300, 8, 1024, 1000, 2), (2048, 16, 512, 384, 4)])
    if not ok:
        print("correctness check FAILED", flush=True)
        sys.exit(1)
    if a.check_only:
        return
    if a.sweep:
        sweep(a)
        return
    c = P.ceilings()
    print("ceilings:", json.dumps(c), flush=True)
    out = open(a.json, "a") if a.json else None
    for name in a.shapes.split(","):
        E, K, N, topk = P.SHAPES[name]
        L = P.make_layer(E, K, N, ["bf16"])
        for M in [int(t) for t in a.tokens.split(",")]:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            w, ids = P.route(M, E, topk)
            touched = torch.unique(ids).numel()
            bytes_ = touched * 3 * N * K * 2 + 2 * M * K * 2
            flops = 2 * M * topk * 3 * N * K
            floor = max(bytes_ / (c["bw_TBps"] * 1e12), flops / (c["bf16_TFLOPs"] * 1e12)) * 1e3
            y, _ = fused_moe(x, L["w13"], L["w2"], w, ids)
            ref = P.reference(x, L["w13"], L["w2"], w, ids)
            row = {"shape": name, "method": "unquantized", "tokens": M, "experts_touched": touched,
                   "floor_ms": floor, "rel_err": rel(y, ref), **c}
            iters = 10 if M >= 1024 else 20
            row["fused_ms"] = P.median_ms(lambda: fused_moe(x, L["w13"], L["w2"], w, ids), iters)
            row["torch_grouped_ms"] = P.median_ms(lambda: P.torch_grouped_bf16(x, L, w, ids), iters)
            row["torch_loop_ms"] = P.median_ms(lambda: P.torch_loop_bf16(x, L, w, ids), 5 if E > 8 else iters)
            row["x_floor"] = row["fused_ms"] / floor
            print(f"{name:13} M={M:5} exp={touched:3} floor {floor:.3f} ms | fused {row['fused_ms']:.3f} "
                  f"({row['x_floor']:.2f}x floor) | grouped {row['torch_grouped_ms']:.3f} | loop {row['torch_loop_ms']:.3f} "
                  f"| rel_err {row['rel_err']:.1e}", flush=True)
            if out:
                out.write(json.dumps(row) + "\n"); out.flush()
        del L
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
