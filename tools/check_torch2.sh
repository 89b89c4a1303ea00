#!/usr/bin/env bash
# Does the tree compile against LibTorch 2.x? CI builds against Debian 12's LibTorch 1.13, and the
# GPU machine's LibTorch is 2.x (docs/cuda.md): an API that changed between them (c10d's
# ProcessGroup/Backend split, c10::Allocator's signature, headers that stopped including each
# other) would otherwise first fail there, on borrowed GPU time. This compiles every C++ source of
# build/compile_commands.json for syntax only against the libtorch-dev 2.x headers of one Debian
# suite (downloaded once into .torch2-headers/SUITE/, a few MB, git-ignored; nothing linked).
# trixie has 2.6, sid a newer 2.x (2.14 in 2026-11): the GPU machine's 2.11 lies between, and an
# API removed before 2.11 fails at least one of the two.
#   tools/check_torch2.sh [--suite trixie|sid] [-j N] [FILTER]   FILTER: a substring of the paths
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=$(nproc)
FILTER=""
SUITE=trixie
usage() { echo "usage: tools/check_torch2.sh [--suite trixie|sid] [-j N] [FILTER]" >&2; exit 2; }
while (($#)); do
  case "$1" in
    -j) JOBS=$2; shift 2 ;;
    --suite) [[ ${2:-} =~ ^(trixie|sid|forky)$ ]] || usage; SUITE=$2; shift 2 ;;
    -*) usage ;;
    *) FILTER=$1; shift ;;
  esac
done
[[ -f build/compile_commands.json ]] || { echo "check_torch2.sh: no build/compile_commands.json (build first)" >&2; exit 2; }
HEADERS=$PWD/.torch2-headers/$SUITE
if [[ ! -d $HEADERS/usr/include/ATen ]]; then
  mirror=http://deb.debian.org/debian
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  curl -fsSL "$mirror/dists/$SUITE/main/binary-amd64/Packages.xz" -o "$tmp/Packages.xz"
  deb=$(xz -dc "$tmp/Packages.xz" | awk '/^Package: libtorch-dev$/,/^$/' | sed -n 's/^Filename: //p' | head -1)
  [[ -n $deb ]] || { echo "check_torch2.sh: no libtorch-dev in Debian $SUITE's index" >&2; exit 1; }
  curl -fsSL "$mirror/$deb" -o "$tmp/libtorch-dev.deb"
  rm -rf "$HEADERS" && mkdir -p "$HEADERS"
  dpkg-deb -x "$tmp/libtorch-dev.deb" "$HEADERS"
  # c10/cuda's one generated header belongs to CUDA builds: an empty stand-in compiles the glue.
  mkdir -p "$HEADERS/shim/c10/cuda/impl" && echo "#pragma once" >"$HEADERS/shim/c10/cuda/impl/cuda_cmake_macros.h"
  echo "check_torch2.sh: $(basename "$deb") unpacked into .torch2-headers/$SUITE/"
fi
# The version macros moved to torch/headeronly/ in 2.8.
VERSION=$(awk '/define TORCH_VERSION_(MAJOR|MINOR|PATCH) / && !seen[$2]++ {v = v (v == "" ? "" : ".") $3} END {print v}' \
  $(ls "$HEADERS"/usr/include/torch/{headeronly,csrc/api/include/torch}/version.h 2>/dev/null))
# LibTorch 2.12 and later refuse C++17 (ATen.h's guard); DTK's CMakeLists.txt then builds as C++20.
STD=""
[[ $(printf '%s\n' 2.12 "$VERSION" | sort -V | head -1) == 2.12 ]] && STD=-std=c++20
LOGS=$(mktemp -d)
python3 - "$HEADERS" "$FILTER" "$LOGS" "$STD" >"$LOGS/commands" <<'PY'
import json, shlex, sys
headers, flt, logs, std = sys.argv[1:5]
for e in json.load(open("build/compile_commands.json")):
    f = e["file"]
    if not f.endswith(".cpp") or flt not in f:
        continue
    args, out, skip = shlex.split(e["command"]), [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "-MF", "-MT"):
            skip = True
        elif a not in ("-MD", "-c") and not a.endswith("ccache"):
            out.append(a)
    # LibTorch 2.x's headers first; the CUDA glue with DTK_TORCH_CUDA=1 (as on the GPU machine).
    extra = [f"-I{headers}/usr/include", f"-I{headers}/usr/include/torch/csrc/api/include", f"-I{headers}/shim",
             "-I/usr/local/cuda/include", "-fsyntax-only", "-w"] + ([std] if std else [])
    if "DTK_HAVE_CUDA=1" in e["command"]:
        extra += ["-UDTK_TORCH_CUDA", "-DDTK_TORCH_CUDA=1"]
    log = f"{logs}/{f.replace('/', '_')}.log"
    cmd = " ".join(shlex.quote(x) for x in [out[0]] + out[1:] + extra)
    print(f"cd {shlex.quote(e['directory'])} && {cmd} >{shlex.quote(log)} 2>&1 || echo {shlex.quote(f)}")
PY
total=$(wc -l <"$LOGS/commands")
echo "check_torch2.sh: $total sources against LibTorch $VERSION headers, $JOBS at a time"
failed=$(tr '\n' '\0' <"$LOGS/commands" | xargs -0 -P "$JOBS" -I{} bash -c '{}' | sort)
if [[ -n $failed ]]; then
  for f in $failed; do
    echo "FAIL $f"
    grep -m3 "error" "$LOGS/${f//\//_}.log" | sed 's/^/    /'
  done
  echo "check_torch2.sh: $(wc -w <<<"$failed") of $total do not compile against LibTorch $VERSION (logs in $LOGS)"
  exit 1
fi
rm -rf "$LOGS"
echo "check_torch2.sh: all $total compile against LibTorch $VERSION"
