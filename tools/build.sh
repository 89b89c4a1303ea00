#!/usr/bin/env bash
# Configures and builds DTK into ./build (Release-with-debug-info, Ninja, ccache when present).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build build -j "$JOBS"
