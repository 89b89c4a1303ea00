#!/usr/bin/env python3
"""Checks the layering of core/runtime: each folder (a concern) may include only the folders
below it in LAYERS, bottom first, so the arrows between concerns all point one way. A header
under include/dtk/core/<folder>/ and a source under src/<folder>/ belong to <folder>. Prints each
include that points up (a back-arrow) and exits 1 if there is any; run by ctest (check_layers).

    python3 tools/check_layers.py [REPO]
"""
import os
import re
import sys

# Bottom first. Keep in step with core/runtime/src/README.md.
LAYERS = ["memory", "timeline", "device", "comm", "launch", "config", "optim", "logging", "perf",
          "components", "checkpoint", "export", "train"]


def folder_of(path, root):
    rel = os.path.relpath(path, root)
    return rel.split(os.sep)[0] if os.sep in rel else None


def main():
    repo = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    rt = os.path.join(repo, "core", "runtime")
    roots = [os.path.join(rt, "include", "dtk", "core"), os.path.join(rt, "src")]
    rank = {name: i for i, name in enumerate(LAYERS)}
    problems, checked = [], 0
    for root in roots:
        for d, _, files in os.walk(root):
            for f in sorted(files):
                path = os.path.join(d, f)
                here = folder_of(path, root)
                if here is None:
                    if f.endswith((".cpp", ".hpp")):
                        problems.append(f"{os.path.relpath(path, repo)}: outside every concern's folder")
                    continue
                if here not in rank:
                    problems.append(f"{os.path.relpath(path, repo)}: folder '{here}' is not in LAYERS")
                    continue
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    m = re.match(r'\s*#include "([^"]+)"', line)
                    if not m:
                        continue
                    target = m.group(1)
                    if target.startswith("dtk/core/"):
                        there = target.split("/")[2] if target.count("/") >= 3 else None
                    elif target.startswith("dtk/") or target.endswith(".pb.h"):
                        continue
                    else:  # a private header, relative to this file
                        there = folder_of(os.path.normpath(os.path.join(d, target)), roots[1])
                    checked += 1
                    if there is None or there not in rank:
                        problems.append(f"{os.path.relpath(path, repo)}:{n}: includes {target}, outside every concern")
                    elif rank[there] > rank[here]:
                        problems.append(f"{os.path.relpath(path, repo)}:{n}: {here}/ includes {target} "
                                        f"({there}/ is above it)")
    for p in problems:
        print(p)
    print(f"check_layers: {checked} includes between core/runtime files, {len(problems)} against the layering")
    return 1 if problems or checked == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
