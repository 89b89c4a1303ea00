#!/usr/bin/env bash
# Run HERE (a Debian 12 machine with apt): downloads the Debian packages a dtk build needs that
# the GPU machine lacks (protobuf, glog, gflags, Boost headers, GoogleTest, nlohmann-json, liburing) into
# .gpu-bundle/ (git-ignored), plus the GPT-2 vocab, for tools/gpu_check.sh to unpack there.
#   tools/gpu_bundle.sh            then carry .gpu-bundle (and data/gpt2) to the GPU machine
# About 15 MB. The GPU machine has no network: everything it builds with travels in this folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(protobuf-compiler libprotoc32 libprotobuf32 libprotobuf-dev libgoogle-glog-dev libgoogle-glog0v6
  libgflags-dev libgflags2.2 libunwind8 libunwind-dev libboost1.74-dev libgtest-dev nlohmann-json3-dev zlib1g-dev
  libsimdjson-dev libsimdjson14 libtcmalloc-minimal4 libgloo-dev liburing-dev liburing2)
mkdir -p .gpu-bundle
cd .gpu-bundle
rm -f ./*.deb
# apt's sandbox user cannot write into a root-owned folder under /work: download as the caller.
apt-get -o APT::Sandbox::User="$(id -un)" download "${PACKAGES[@]}" >/dev/null
cd ..
[[ -f data/gpt2/encoder.json ]] || tools/setup.sh --vocab
echo "gpu_bundle.sh: $(ls .gpu-bundle/*.deb | wc -l) packages, $(du -sh .gpu-bundle | cut -f1) in .gpu-bundle/"
