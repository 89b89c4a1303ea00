#!/usr/bin/env python3
"""Draws a DTK timeline (logging.trace_file, Chrome trace format) as an SVG picture for docs.

    python3 tools/trace_to_svg.py trace.rank0.json picture.svg [--title T] [--ms MAX]

Rows: the training thread (compute spans; waits for collectives in red) and, per process group,
its collectives from issue to completion (overlapping ones in lanes). --ms fixes the time axis so
several pictures share one scale. Python 3 standard library only.
"""
import argparse, json, html

p = argparse.ArgumentParser()
p.add_argument("trace"); p.add_argument("svg")
p.add_argument("--title", default=""); p.add_argument("--ms", type=float, default=0)
a = p.parse_args()
events = json.load(open(a.trace))["traceEvents"]
names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
spans, opened = [], {}
for e in events:
    if e.get("ph") == "X":
        spans.append((e["tid"], e["ts"], e["ts"] + e["dur"], e["name"], e["cat"]))
    elif e.get("ph") == "b":
        opened[e["id"]] = e
    elif e.get("ph") == "e":
        b = opened.pop(e["id"])
        spans.append((b["tid"], b["ts"], e["ts"], b["name"], "comm"))
t0 = min(s[1] for s in spans)
t1 = t0 + a.ms * 1000 if a.ms else max(s[2] for s in spans)
W, left, lane_h = 1100, 170, 14
scale = (W - left - 10) / (t1 - t0)
rows = []  # (label, [(start, end, name, cat)]) with lanes for overlapping collectives
compute = [s for s in spans if s[0] == 0]
rows.append(("training step", [s[1:] for s in compute if s[4] == "step"]))
rows.append(("training thread", [s[1:] for s in compute if s[4] != "step"]))
for tid in sorted({s[0] for s in spans if s[0] != 0}):
    lanes = []
    for s in sorted((s for s in spans if s[0] == tid), key=lambda s: s[1]):
        for lane in lanes:
            if lane[-1][1] <= s[1]:
                lane.append(s[1:]); break
        else:
            lanes.append([s[1:]])
    for i, lane in enumerate(lanes):
        rows.append((names.get(tid, str(tid)) if i == 0 else "", lane))
colors = {"compute": "#4e79a7", "wait": "#e15759", "comm": "#59a14f", "step": "#d4d4d4"}
H = 40 + len(rows) * (lane_h + 6) + 30
out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
       f'<rect width="{W}" height="{H}" fill="white"/>',
       f'<text x="10" y="18" font-size="13" font-weight="bold">{html.escape(a.title)}</text>']
y = 34
for label, items in rows:
    out.append(f'<text x="10" y="{y + 11}">{html.escape(label)}</text>')
    for start, end, name, cat in items:
        if start > t1:
            continue
        x = left + (start - t0) * scale
        w = max(0.8, (min(end, t1) - start) * scale)
        fill = colors.get(cat, "#bab0ac")
        if cat == "compute" and "backward" in name:
            fill = "#76b7b2"
        out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{lane_h}" fill="{fill}" stroke="white" '
                   f'stroke-width="0.3"><title>{html.escape(name)} ({(end - start) / 1000:.2f} ms)</title></rect>')
        if cat == "step" and w > 60:
            out.append(f'<text x="{x + 3:.1f}" y="{y + 11}" font-size="10">{html.escape(name)}</text>')
    y += lane_h + 6
for i in range(11):  # time axis
    x = left + i * (W - left - 10) / 10
    out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="black"/>')
    out.append(f'<text x="{x:.1f}" y="{y + 16}" text-anchor="middle">{(t1 - t0) / 1000 * i / 10:.0f} ms</text>')
legend = [("forward compute", "#4e79a7"), ("backward compute", "#76b7b2"), ("wait (exposed)", "#e15759"),
          ("collective in flight", "#59a14f")]
for i, (text, c) in enumerate(legend):
    out.append(f'<rect x="{W - 560 + i * 140}" y="6" width="10" height="10" fill="{c}"/>'
               f'<text x="{W - 546 + i * 140}" y="15">{text}</text>')
out.append("</svg>")
open(a.svg, "w").write("\n".join(out))
