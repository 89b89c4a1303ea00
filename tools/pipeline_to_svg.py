#!/usr/bin/env python3
"""Draws the pipeline schedule of one iteration from the per-rank timelines of a pipeline-parallel
run (logging.trace_file writes trace.rank<R>.json per rank; ranks of one machine share a clock).

    python3 tools/pipeline_to_svg.py picture.svg trace.rank0.json trace.rank1.json [...] [--iteration N]

One row per stage (the files in stage order): forward k (blue) and backward k (green) spans of the
training step, the waits for activations or gradients (red). With the interleaved schedule the
spans name their model chunk ("forward 3 chunk 1"): chunk 0 is drawn dark, later chunks lighter,
and labelled F3.1. Python 3 standard library only.
"""
import argparse, html, json

p = argparse.ArgumentParser()
p.add_argument("svg"); p.add_argument("traces", nargs="+")
p.add_argument("--iteration", type=int, default=0, help="which traced iteration (0: the first)")
p.add_argument("--title", default="")
a = p.parse_args()

rows = []
for path in a.traces:
    events = json.load(open(path))["traceEvents"]
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"], e["cat"]) for e in events if e.get("ph") == "X" and e["tid"] == 0]
    steps = sorted(s for s in spans if s[3] == "step")
    # Iterations: an optimizer step ends each one.
    ends = [s[1] for s in steps if s[2] == "optimizer step"]
    begin = ends[a.iteration - 1] if a.iteration > 0 else min(s[0] for s in steps)
    end = ends[a.iteration] if a.iteration < len(ends) else max(s[1] for s in steps)
    keep = lambda s: s[0] >= begin and s[1] <= end
    rows.append(([s for s in steps if keep(s) and s[2].split()[0] in ("forward", "backward")],
                 [s for s in spans if keep(s) and s[3] == "wait" and s[2].startswith("receive")]))
t0 = min(s[0] for r in rows for s in r[0])
t1 = max(s[1] for r in rows for s in r[0])
W, left, row_h = 1000, 70, 26
scale = (W - left - 10) / (t1 - t0)
H = 30 + row_h * len(rows) + 30
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="10">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<text x="{left}" y="16" font-size="12">{html.escape(a.title or "1F1B, one iteration per stage")}</text>']
for i, (steps, waits) in enumerate(rows):
    y = 30 + i * row_h
    out.append(f'<text x="4" y="{y + 15}">stage {i}</text>')
    for s in waits:
        x, w = left + (s[0] - t0) * scale, max(1, (s[1] - s[0]) * scale)
        out.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row_h - 6}" fill="#e66"/>')
    for s in steps:
        x, w = left + (s[0] - t0) * scale, max(1, (s[1] - s[0]) * scale)
        words = s[2].split()  # "forward 3" or "forward 3 chunk 1"
        chunk = int(words[3]) if len(words) >= 4 and words[2] == "chunk" else None
        dark = chunk is None or chunk % 2 == 0
        colour = ("#69c" if dark else "#9bd") if words[0] == "forward" else ("#6b6" if dark else "#9d9")
        out.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row_h - 6}" fill="{colour}" stroke="white"/>')
        label = ("F" if words[0] == "forward" else "B") + words[1] + ("" if chunk is None else f".{chunk}")
        if w > 6 * len(label):
            out.append(f'<text x="{x + w / 2:.1f}" y="{y + 15}" text-anchor="middle" fill="white">{label}</text>')
ms = (t1 - t0) / 1000
out.append(f'<text x="{left}" y="{H - 10}">0 ms</text><text x="{W - 10}" y="{H - 10}" text-anchor="end">{ms:.0f} ms</text>')
out.append(f'<text x="{left + 80}" y="{H - 10}"><tspan fill="#69c">F forward</tspan>  <tspan fill="#6b6">B backward</tspan>'
           '  <tspan fill="#e66">waiting for activations / gradients</tspan></text>')
out.append("</svg>")
open(a.svg, "w").write("\n".join(out))
print(f"{a.svg}: {len(rows)} stages, {ms:.0f} ms")
