#!/usr/bin/env python3
"""Peer for fmoe's attention timing (crates/fmoe-kernels/tests/cuda_attention.rs, timing_vs_peer):
torch.nn.functional.scaled_dot_product_attention, bf16, flash backend, Mixtral's heads (32 q heads,
8 kv heads, d 128).

(a) prefill: 1 sequence x 4096 tokens, is_causal. FLOPs counted causal: 4 * T^2 / 2 * heads * d.
(b) decode: 8 sequences x context 4096, one query each (the last position sees every key, so no
    mask). Bytes: K and V read once, 2 * B * ctx * kv_heads * d * 2.

GQA through enable_gqa=True; if the flash backend refuses it, K/V are expanded to 32 heads before
timing (the expansion is not timed). Median of CUDA-event timings over 15 trials of N calls each.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, KVH, D = 32, 8, 128
dev = "cuda"


def median_s(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    times.sort()
    return times[len(times) // 2]


def sdpa(q, k, v, causal):
    """Times flash SDPA with native GQA, else with K/V expanded; returns (seconds, how)."""
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), "gqa"
        except RuntimeError as e:
            print(f"  enable_gqa refused ({str(e).splitlines()[0][:100]}); expanding K/V")
            ke = k.repeat_interleave(H // KVH, dim=1)
            ve = v.repeat_interleave(H // KVH, dim=1)
            return lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=causal), "expanded"


def main():
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    t = 4096
    q = torch.randn(1, H, t, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, KVH, t, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, KVH, t, D, device=dev, dtype=torch.bfloat16)
    fn, how = sdpa(q, k, v, True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        s = median_s(fn, 10)
    flops = 4 * t * t / 2 * H * D
    print(f"torch sdpa flash prefill T={t} h={H} kv={KVH} d={D} bf16 ({how}): {s * 1e3:.3f} ms, "
          f"{flops / s / 1e12:.1f} TFLOP/s ({flops / s / 790e12 * 100:.0f}% of 790)")

    b, ctx = 8, 4096
    q = torch.randn(b, H, 1, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, KVH, ctx, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(b, KVH, ctx, D, device=dev, dtype=torch.bfloat16)
    fn, how = sdpa(q, k, v, False)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        s = median_s(fn, 50)
    nbytes = 2 * b * ctx * KVH * D * 2
    print(f"torch sdpa flash decode B={b} ctx={ctx} h={H} kv={KVH} d={D} bf16 ({how}): {s * 1e6:.1f} us, "
          f"{nbytes / s / 1e12:.2f} TB/s ({nbytes / s / 4.8e12 * 100:.0f}% of 4.8; floor {nbytes / 4.8e12 * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
