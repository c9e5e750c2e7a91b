#!/usr/bin/env python3
"""SVG plots for BENCHMARKS.md, standard library only.

    python3 scripts/plots.py [--benchmarks BENCHMARKS.md] [--jsonl fused.jsonl] [--out docs/plots]

Writes
  moe_xfloor.svg     ×floor vs M per method, one panel per shape: from the `fmoe bench moe --json`
                     rows of --jsonl (the fused rows' `x_floor`), else from BENCHMARKS.md's
                     "×floor, every row" table
  tpot_vs_batch.svg  TPOT vs batch, fused vs portable: from BENCHMARKS.md's `bench model` table
                     (`| kernel | B | TTFT ms | TPOT ms | ×floor |`)
"""
import argparse
import json
import math
import os
import re
import sys

METHODS = ["unquantized", "fp8-tensor", "fp8-block"]
COLORS = {"unquantized": "#1f77b4", "fp8-tensor": "#d62728", "fp8-block": "#2ca02c",
          "fused": "#d62728", "portable": "#1f77b4"}


def md_tables(text):
    """Every markdown table of `text` as (header cells, rows of cells)."""
    out, cur = [], None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("|") and s.endswith("|"):
            cells = [c.strip() for c in s.strip("|").split("|")]
            if cur is None:
                cur = (cells, [])
            elif not all(re.fullmatch(r":?-+:?", c) for c in cells):
                cur[1].append(cells)
        elif cur is not None:
            out.append(cur)
            cur = None
    if cur is not None:
        out.append(cur)
    return out


def xfloor_from_md(text):
    """{shape: {method: [(M, ×floor)]}} from the table whose header is shape | method | 1 | 2 | …"""
    for head, rows in md_tables(text):
        if head[:3] == ["shape", "method", "1"]:
            ms = [int(h) for h in head[2:]]
            data = {}
            for r in rows:
                pts = [(m, float(v)) for m, v in zip(ms, r[2:]) if re.fullmatch(r"[0-9.]+", v)]
                data.setdefault(r[0], {})[r[1]] = pts
            return data
    sys.exit("no ×floor table (| shape | method | 1 | 2 | … |) found")


def xfloor_from_jsonl(path):
    data = {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("kernel") == "fused" and r.get("x_floor"):
                data.setdefault(r["shape"], {}).setdefault(r["method"], []).append(
                    (int(r["tokens"]), float(r["x_floor"])))
    for per in data.values():
        for m in per:
            per[m].sort()
    return data


def tpot_from_md(text):
    """{kernel: [(B, TPOT ms, ×floor)]} from the `bench model` table."""
    for head, rows in md_tables(text):
        if head[:4] == ["kernel", "B", "TTFT ms", "TPOT ms"]:
            data, kernel = {}, None
            for r in rows:
                name = r[0].split()[0] if r[0] else kernel
                kernel = name
                data.setdefault(kernel, []).append((int(r[1]), float(r[3]), float(r[4])))
            return data
    sys.exit("no bench model table (| kernel | B | TTFT ms | TPOT ms | ... |) found")


class Svg:
    def __init__(self, w, h):
        self.w, self.h, self.items = w, h, []

    def add(self, s):
        self.items.append(s)

    def line(self, x1, y1, x2, y2, color="#000", width=1, dash=None):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.add(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                 f'stroke="{color}" stroke-width="{width}"{d}/>')

    def text(self, x, y, s, size=11, anchor="middle", color="#000", weight="normal"):
        s = s.replace("&", "&amp;").replace("<", "&lt;")
        self.add(f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
                 f'fill="{color}" font-weight="{weight}">{s}</text>')

    def polyline(self, pts, color, width=2):
        p = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        self.add(f'<polyline points="{p}" fill="none" stroke="{color}" stroke-width="{width}"/>')
        for x, y in pts:
            self.add(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>')

    def save(self, path):
        with open(path, "w") as f:
            f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
                    f'viewBox="0 0 {self.w} {self.h}" font-family="sans-serif">\n')
            f.write(f'<rect width="{self.w}" height="{self.h}" fill="#fff"/>\n')
            f.write("\n".join(self.items) + "\n</svg>\n")


def panel(svg, x0, y0, w, h, title, series, xs, ylo, yhi, ystep, xlabel, ylabel, hlines=()):
    """One plot: series = [(label, color, [(x, y)])], x on a log2 axis over xs."""
    lx0, lx1 = math.log2(xs[0]), math.log2(xs[-1])
    fx = lambda v: x0 + (math.log2(v) - lx0) / (lx1 - lx0) * w
    fy = lambda v: y0 + h - (v - ylo) / (yhi - ylo) * h
    svg.text(x0 + w / 2, y0 - 10, title, size=13, weight="bold")
    y = ylo
    while y <= yhi + 1e-9:
        svg.line(x0, fy(y), x0 + w, fy(y), "#ddd")
        svg.text(x0 - 6, fy(y) + 4, f"{y:g}", anchor="end", size=10)
        y = round(y + ystep, 6)
    for v in xs:
        svg.line(fx(v), y0 + h, fx(v), y0 + h + 4)
        if len(xs) <= 8 or math.log2(v) % 2 == 0:  # every other power of two when crowded
            svg.text(fx(v), y0 + h + 16, f"{v}", size=9)
    for v, label, color in hlines:
        svg.line(x0, fy(v), x0 + w, fy(v), color, 1, "5,4")
        svg.text(x0 + w - 2, fy(v) - 3, label, anchor="end", size=9, color=color)
    svg.line(x0, y0 + h, x0 + w, y0 + h)
    svg.line(x0, y0, x0, y0 + h)
    svg.text(x0 + w / 2, y0 + h + 32, xlabel, size=11)
    svg.add(f'<text x="{x0 - 38:.1f}" y="{y0 + h / 2:.1f}" font-size="11" text-anchor="middle" '
            f'transform="rotate(-90 {x0 - 38:.1f} {y0 + h / 2:.1f})">{ylabel}</text>')
    for label, color, pts in series:
        svg.polyline([(fx(a), fy(b)) for a, b in pts if ylo <= b <= yhi], color)


def legend(svg, x, y, entries):
    for i, (label, color) in enumerate(entries):
        svg.line(x + i * 150, y, x + i * 150 + 24, y, color, 3)
        svg.text(x + i * 150 + 30, y + 4, label, anchor="start", size=11)


def plot_xfloor(data, path):
    shapes = [s for s in ["mixtral-8x7b", "mixtral-8x22b", "deepseek-v3"] if s in data] + \
             sorted(s for s in data if s not in ("mixtral-8x7b", "mixtral-8x22b", "deepseek-v3"))
    allx = sorted({m for per in data.values() for pts in per.values() for m, _ in pts})
    ally = [v for per in data.values() for pts in per.values() for _, v in pts]
    ylo = math.floor(min(ally + [1.0]) * 10) / 10
    yhi = math.ceil(max(ally) * 10) / 10
    pw, ph, left, top = 300, 260, 70, 60
    svg = Svg(left + len(shapes) * (pw + 60), top + ph + 90)
    for i, s in enumerate(shapes):
        series = [(m, COLORS.get(m, "#555"), data[s][m]) for m in METHODS if m in data[s]]
        panel(svg, left + i * (pw + 60), top, pw, ph, s, series, allx, ylo, yhi, 0.1,
              "tokens M (log scale)", "× floor", hlines=[(1.0, "floor", "#000"), (1.3, "1.3×", "#888")])
    legend(svg, left, top + ph + 70, [(m, COLORS[m]) for m in METHODS])
    svg.save(path)


def plot_tpot(data, path):
    allx = sorted({b for pts in data.values() for b, _, _ in pts})
    ally = [t for pts in data.values() for _, t, _ in pts]
    yhi = math.ceil(max(ally) / 5) * 5
    pw, ph, left, top = 420, 260, 70, 60
    svg = Svg(left + pw + 40, top + ph + 90)
    series = [(k, COLORS.get(k, "#555"), [(b, t) for b, t, _ in pts]) for k, pts in data.items()]
    panel(svg, left, top, pw, ph, "Mixtral-8x7B bf16 decode: TPOT vs batch", series, allx, 0, yhi,
          5, "batch B (log scale)", "TPOT ms")
    lx0, lx1 = math.log2(allx[0]), math.log2(allx[-1])
    for k, pts in data.items():
        for b, t, xf in pts:
            x = left + (math.log2(b) - lx0) / (lx1 - lx0) * pw
            y = top + ph - t / yhi * ph
            svg.text(x + 4, y + (-8 if k == "fused" else 16), f"{xf:g}× floor", anchor="start",
                     size=9, color=COLORS.get(k, "#555"))
    legend(svg, left, top + ph + 70, [(k, COLORS.get(k, "#555")) for k in data])
    svg.save(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmarks", default="BENCHMARKS.md")
    ap.add_argument("--jsonl", help="fmoe bench moe --json rows for the ×floor plot")
    ap.add_argument("--out", default="docs/plots")
    a = ap.parse_args()
    text = open(a.benchmarks).read()
    os.makedirs(a.out, exist_ok=True)
    xf = xfloor_from_jsonl(a.jsonl) if a.jsonl else xfloor_from_md(text)
    plot_xfloor(xf, os.path.join(a.out, "moe_xfloor.svg"))
    plot_tpot(tpot_from_md(text), os.path.join(a.out, "tpot_vs_batch.svg"))
    print(f"wrote {a.out}/moe_xfloor.svg, {a.out}/tpot_vs_batch.svg")


if __name__ == "__main__":
    main()
