#!/usr/bin/env python3
"""Draws the curves of a DTK metrics file (logging.metrics_jsonl) as one SVG picture.

    python3 tools/plot_metrics.py run.jsonl -o run.svg [--loss "lm loss"]

Panels, against the iteration: the training loss (line) with validation losses (dots), the
learning rate, and tokens per second. Several files may be given: their curves share the axes,
one colour per file. Python 3 standard library only.
"""
import argparse, html, json, math, sys

p = argparse.ArgumentParser()
p.add_argument("files", nargs="+")
p.add_argument("-o", "--output", required=True)
p.add_argument("--loss", default="lm loss", help="the loss field to draw")
a = p.parse_args()

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
runs = []
for path in a.files:
    train, valid = [], []
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        sys.exit(f"plot_metrics: cannot read {path}: {e.strerror}")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            o = json.loads(line)
        except ValueError:
            sys.exit(f"plot_metrics: {path} line {n} is not JSON")
        kind = str(o.get("kind", ""))
        # eval.validation_sets report as "validation-NAME": each set's dots join the validation ones.
        validation = kind == "validation" or kind.startswith("validation-")
        (train if kind == "train" else valid if validation else []).append(o)
    runs.append((path, train, valid))

def series(rows, key):
    return [(r["iteration"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]

panels = [("%s (train: line, validation: dots)" % a.loss, a.loss, True),
          ("learning rate", "learning_rate", False), ("tokens per second", "tokens_per_second", False)]
W, H, left, top, gap = 900, 200, 80, 30, 60
out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">'
       % (W, top + len(panels) * (H + gap))]
for k, (title, key, with_valid) in enumerate(panels):
    y0 = top + k * (H + gap)
    pts = [s for _, tr, va in runs for s in series(tr, key) + (series(va, key) if with_valid else [])]
    out.append('<text x="%d" y="%d" font-weight="bold">%s</text>' % (left, y0 - 8, html.escape(title)))
    out.append('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#999"/>' % (left, y0, W - left - 20, H))
    if not pts:
        out.append('<text x="%d" y="%d">no data</text>' % (left + 10, y0 + 20))
        continue
    xmin, xmax = min(x for x, _ in pts), max(x for x, _ in pts)
    ymin, ymax = min(y for _, y in pts), max(y for _, y in pts)
    if xmax == xmin: xmax = xmin + 1
    if ymax == ymin: ymax, ymin = ymax + abs(ymax) * 0.05 + 1e-12, ymin - abs(ymin) * 0.05 - 1e-12
    sx = lambda x: left + (x - xmin) / (xmax - xmin) * (W - left - 20)
    sy = lambda y: y0 + H - (y - ymin) / (ymax - ymin) * H
    for v in (ymin, (ymin + ymax) / 2, ymax):
        out.append('<text x="%d" y="%.1f" text-anchor="end">%.6g</text>' % (left - 4, sy(v) + 4, v))
    for v in (xmin, (xmin + xmax) // 2, xmax):
        out.append('<text x="%.1f" y="%d" text-anchor="middle">%d</text>' % (sx(v), y0 + H + 14, v))
    for i, (path, tr, va) in enumerate(runs):
        c = COLOURS[i % len(COLOURS)]
        s = series(tr, key)
        if s:
            out.append('<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>'
                       % (c, " ".join("%.1f,%.1f" % (sx(x), sy(y)) for x, y in s)))
        if with_valid:
            for x, y in series(va, key):
                out.append('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>' % (sx(x), sy(y), c))
        if k == 0:
            out.append('<text x="%d" y="%d" fill="%s">%s</text>' % (W - 300, y0 + 14 + 13 * i, c, html.escape(path)))
out.append("</svg>")
open(a.output, "w").write("\n".join(out) + "\n")
print("wrote", a.output)
