#!/usr/bin/env python3
"""Kernel bring-up harness for fmoe's fused bf16 MoE CUDA kernels, run on the GPU machine.

Compiles crates/fmoe-kernels/cuda/{moe_align,moe_gemm_bf16}.cu with NVRTC through CuPy (the same
sources and options the Rust backend uses), checks them against an f32 reference on fresh random
data with poisoned outputs, and times them beside the PyTorch peers of ../shared/peers (copied to
.peers/) in the same process, with the measured roofline floor.

Usage: python3 bench/gpu/moe_bf16_cupy.py [--check-only] [--shapes ...] [--tokens ...] [--json PATH]
"""
import argparse, json, math, os, sys
import numpy as np
import torch
import cupy as cp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, ".peers"))
import moe_peers as P  # noqa: E402

BM = 64
CUDA_INC = os.environ.get("CUDA_HOME", "/usr/local/cuda") + "/include"


def load(name, entry, defines):
    src = open(os.path.join(ROOT, "crates/fmoe-kernels/cuda", name)).read()
    opts = ("-std=c++17", "--gpu-architecture=sm_90a", "-I" + CUDA_INC) + tuple(f"-D{k}={v}" for k, v in defines)
    return cp.RawModule(code=src, options=opts).get_function(entry)


ALIGN = load("moe_align.cu", "fmoe_moe_align", [("BLOCK_M", BM)])
GEMM1 = load("moe_gemm_bf16.cu", "fmoe_moe_gemm_bf16", [("MODE", 1)])
GEMM2 = load("moe_gemm_bf16.cu", "fmoe_moe_gemm_bf16", [("MODE", 2)])


def ptr(t):
    return np.uint64(t.data_ptr() if t is not None else 0)


def fused_moe(x, w13, w2, w, ids, poison=False):
    """y = sum_j w_j W2_e(silu(W1_e x) * W3_e x) with fmoe's kernels; x bf16 [M, K]."""
    M, topk = ids.shape
    E, two_n, K = w13.shape
    N = two_n // 2
    R = M * topk
    cap = (R + E * (BM - 1) + BM - 1) // BM * BM
    u32 = torch.int32
    ids32 = ids.to(u32).contiguous()
    sorted_routes = torch.empty(cap, dtype=u32, device="cuda")
    block_experts = torch.empty(cap // BM, dtype=u32, device="cuda")
    offsets = torch.empty(E + 1, dtype=u32, device="cuda")
    counts = torch.empty(E, dtype=u32, device="cuda")
    total = torch.empty(1, dtype=u32, device="cuda")
    err = torch.zeros(1, dtype=u32, device="cuda")
    ALIGN((1,), (1024,), (ptr(ids32), np.uint32(R), np.uint32(E), ptr(sorted_routes), ptr(block_experts),
                          ptr(offsets), ptr(counts), ptr(total), ptr(err), np.uint32(cap)),
          shared_mem=4 * (3 * E + 1))
    h = (torch.full if poison else torch.empty)((R, N), *( (float("nan"),) if poison else ()),
                                                 dtype=torch.bfloat16, device="cuda")
    if cap:
        GEMM1((math.ceil(N / 64), cap // BM), (128,),
              (ptr(x), ptr(w13), ptr(sorted_routes), ptr(block_experts), ptr(total), ptr(None), ptr(h), ptr(None),
               np.uint32(R), np.uint32(topk), np.uint32(K), np.uint32(N)))
    y32 = torch.zeros(M, K, dtype=torch.float32, device="cuda")
    wflat = w.reshape(-1).float().contiguous()
    if cap:
        GEMM2((math.ceil(K / 128), cap // BM), (128,),
              (ptr(h), ptr(w2), ptr(sorted_routes), ptr(block_experts), ptr(total), ptr(wflat), ptr(None), ptr(y32),
               np.uint32(R), np.uint32(topk), np.uint32(N), np.uint32(K)))
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--shapes", default="mixtral-8x7b,deepseek-v3")
    ap.add_argument("--tokens", default="1,16,64,256,1024,4096")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ok = check([(0, 8, 256, 128, 2), (1, 8, 256, 128, 2), (5, 1, 256, 200, 1), (33, 8, 136, 72, 8),
                (100, 256, 512, 256, 8), (300, 8, 1024, 1000, 2), (2048, 16, 512, 384, 4)])
    if not ok:
        print("correctness check FAILED", flush=True)
        sys.exit(1)
    if a.check_only:
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
