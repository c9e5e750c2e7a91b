#!/usr/bin/env python3
"""Markdown tables for BENCHMARKS.md from a device call's JSON lines (`fmoe bench moe --json`,
`moe_peers.py --json`).

    tables.py full DIR          every shape × method × M of DIR/fused.jsonl beside the peers
                                (DIR/peers.jsonl), fused vs portable (DIR/portable.jsonl), the
                                fp8 / bf16 ratio, the DeepSeek-V3 fp8-block and bf16 large-M rounds
                                (DIR/ratio.jsonl): what scripts/device/full_table.sh writes
    tables.py ab DIR a,b,...    A/B medians of DIR/bench_<name>_r<k>.jsonl per (shape, method, M):
                                each setting's rounds, median, TFLOP/s and ×floor, and the ratios
                                first / other (below 1: the first is faster)
"""
import collections
import glob
import json
import statistics
import sys

SHAPES = ["mixtral-8x7b", "mixtral-8x22b", "deepseek-v3"]
METHODS = ["unquantized", "fp8-tensor", "fp8-block"]


def rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def full(d):
    fused = [r for r in rows(f"{d}/fused.jsonl") if r["kernel"] == "fused"]
    port, ratio, peers = rows(f"{d}/portable.jsonl"), rows(f"{d}/ratio.jsonl"), rows(f"{d}/peers.jsonl")
    peer_ms = {(p["shape"], p["mode"], p["impl"], p["M"]): p.get("ms") for p in peers}
    vs_port = {(r["shape"], r["method"], r["tokens"]): r["speedup_vs_portable"]
               for r in port if r["kernel"] == "fused" and r.get("speedup_vs_portable")}
    by = {(r["shape"], r["method"], r["tokens"]): r for r in fused}
    ms = sorted({r["tokens"] for r in fused})
    print("×floor, every row:\n")
    print("| shape | method | " + " | ".join(map(str, ms)) + " |")
    print("|---|---|" + "---:|" * len(ms))
    for s in SHAPES:
        for m in METHODS:
            cells = [f"{by[(s, m, n)]['x_floor']:.2f}" if by.get((s, m, n), {}).get("x_floor") else "—" for n in ms]
            print(f"| {s} | {m} | " + " | ".join(cells) + " |")
    least = collections.defaultdict(lambda: [float("inf"), float("inf")])
    for s in SHAPES:
        for m in METHODS:
            mode = "bf16" if m == "unquantized" else "fp8-tensor"
            note = " (peers: per-tensor fp8, the closest they offer)" if m == "fp8-block" else ""
            print(f"\n**{s}, {m}**{note}\n")
            print("| M | experts | timing | floor ms | fused ms | ×floor | TFLOP/s | torch-grouped ms | "
                  "torch-loop ms | fused vs grouped | fused vs loop | fused vs portable |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for n in ms:
                r = by.get((s, m, n))
                if not r:
                    continue
                g, lp = peer_ms.get((s, mode, "torch-grouped", n)), peer_ms.get((s, mode, "torch-loop", n))
                vg, vl = (g / r["ms"] if g else None), (lp / r["ms"] if lp else None)
                if vg:
                    least[(s, m)][0] = min(least[(s, m)][0], vg)
                if vl:
                    least[(s, m)][1] = min(least[(s, m)][1], vl)
                sp = vs_port.get((s, m, n))
                fmt = lambda v, spec: format(v, spec) if v else ""
                print(f"| {n} | {r['experts_touched']} | {r['timing']} | {r['floor_ms']:.3f} | {r['ms']:.3f} | "
                      f"{r['x_floor']:.2f} | {r['flops'] / r['ms'] / 1e9:.0f} | {fmt(g, '.3f')} | {fmt(lp, '.3f')} | "
                      f"{fmt(vg, '.2f')}× | {fmt(vl, '.2f')}× | " + (f"{sp:.2f}×" if sp else "") + " |")
    print("\nleast fused-vs-peer margins (torch-grouped, torch-loop):",
          {f"{s}/{m}": [round(x, 2) for x in v] for (s, m), v in least.items()})
    rounds = collections.defaultdict(list)
    for r in fused + ratio:
        rounds[(r["shape"], r["method"], r["tokens"])].append(r)
    print("\nMixtral-8x7B fp8-tensor / unquantized (medians over the rounds):\n")
    print("| M | unquantized ms (rounds) | fp8-tensor ms (rounds) | ratio of medians |")
    print("|---|---|---|---|")
    for n in [1, 2, 4, 8, 16, 32, 64, 128, 256]:
        a = [r["ms"] for r in rounds[("mixtral-8x7b", "unquantized", n)]]
        b = [r["ms"] for r in rounds[("mixtral-8x7b", "fp8-tensor", n)]]
        if a and b:
            print(f"| {n} | {', '.join(f'{x:.4f}' for x in a)} | {', '.join(f'{x:.4f}' for x in b)} | "
                  f"{statistics.median(b) / statistics.median(a):.3f} |")
    print("\nDeepSeek-V3 fp8-block rounds:\n")
    print("| M | floor ms | ms (rounds) | median ×floor |")
    print("|---|---|---|---|")
    for n in [1, 1024, 1536, 2048]:
        v = rounds[("deepseek-v3", "fp8-block", n)]
        if v:
            fl = v[0]["floor_ms"]
            t = [r["ms"] for r in v]
            print(f"| {n} | {fl:.3f} | {', '.join(f'{x:.3f}' for x in t)} | {statistics.median(t) / fl:.2f} |")
    print("\nbf16 large-M rounds (floors of the full table's run):\n")
    print("| shape | M | floor ms | ms (rounds) | median ×floor |")
    print("|---|---|---|---|---|")
    for s in ["mixtral-8x7b", "deepseek-v3"]:
        for n in [512, 1024, 4096, 8192, 16384]:
            v = rounds[(s, "unquantized", n)]
            if len(v) > 1:
                fl = v[0]["floor_ms"]
                t = [r["ms"] for r in v]
                print(f"| {s} | {n} | {fl:.3f} | {', '.join(f'{x:.3f}' for x in t)} | {statistics.median(t) / fl:.2f} |")


def ab(d, names):
    ms = collections.defaultdict(lambda: collections.defaultdict(list))
    floor, flops = {}, {}
    for n in names:
        for f in sorted(glob.glob(f"{d}/bench_{n}_r*.jsonl")):
            for r in rows(f):
                if r.get("kernel") != "fused":
                    continue
                k = (r["shape"], r["method"], r["tokens"])
                ms[k][n].append(r["ms"])
                floor[k], flops[k] = r.get("floor_ms"), r["flops"]
    print("| shape | method | M | floor ms | "
          + " | ".join(f"{n} ms (rounds) → median (TFLOP/s, ×floor)" for n in names) + " | "
          + " | ".join(f"{names[0]} / {n}" for n in names[1:]) + " |")
    print("|" + "---|" * (4 + 2 * len(names) - 1))
    for k in sorted(ms):
        fl, cells, med = floor[k], [], {}
        for n in names:
            v = ms[k].get(n, [])
            if not v:
                cells.append("—")
                continue
            med[n] = statistics.median(v)
            tail = f" ({flops[k] / med[n] / 1e9:.0f}, {med[n] / fl:.2f})" if fl else ""
            cells.append(", ".join(f"{x:.3f}" for x in v) + f" → **{med[n]:.3f}**" + tail)
        ratios = [f"{med[names[0]] / med[n]:.3f}" if n in med and names[0] in med else "—" for n in names[1:]]
        print(f"| {k[0]} | {k[1]} | {k[2]} | " + (f"{fl:.3f}" if fl else "—") + " | "
              + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "full":
        full(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "ab":
        ab(sys.argv[2], sys.argv[3].split(","))
    else:
        sys.exit(__doc__)
