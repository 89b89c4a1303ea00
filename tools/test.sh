#!/usr/bin/env bash
# The whole test suite: installs what is missing (packages and the GPT-2 vocab, which the data
# and CLI tests read from data/gpt2), builds, runs ctest; then the sanitizer build of the
# torch-free loader/ABI/data tests, and the out-of-tree SDK template against an install.
# Every stage runs even when an earlier one failed (a red ctest must not hide a red sanitizer
# run); the script exits non-zero when any stage failed and names them at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh --vocab
tools/build.sh

failed=()
stage() {  # stage NAME COMMAND...: runs a stage, records its failure
  local name=$1
  shift
  echo "== $name"
  if ! "$@"; then
    echo "== $name: FAILED"
    failed+=("$name")
  fi
}

run_ctest() { (cd build && ctest --output-on-failure --timeout 600 -j "$(nproc)"); }

# Stages run inside `if`, where bash ignores `set -e`: every command is chained with || return.
run_sanitizers() {
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DDTK_SANITIZE=ON >/dev/null || return
  cmake --build build-asan -j "$(nproc)" --target dtk_host_tests dtk_abi_tests dtk_data_tests || return
  # detect_leaks=0: plugins and their registry entries are deliberately never freed (never unloaded).
  export ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  build-asan/bin/dtk_host_tests || return
  build-asan/bin/dtk_abi_tests || return
  build-asan/bin/dtk_data_tests
}

run_sdk_template() {
  rm -rf build-install build-template
  cmake --install build --prefix "$PWD/build-install" >/dev/null || return
  cmake -S sdk/template -B build-template -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build-install" >/dev/null || return
  cmake --build build-template || return
  build-install/bin/dtk plugins describe template_scaled_sgd --plugin_path build-template || return
  build-install/bin/dtk train --config configs/gpt-tiny.pbtxt --optimizer template_scaled_sgd \
    --set optimizer.scale=0.5 --dataset synthetic --set train.train_iters=4 --set lr.lr_warmup_iters=1 \
    --set logging.log_interval=2 --set eval.eval_iters=1 --plugin_path build-template || return
  # The llama model plugin is built like a third party's: its folder alone, against the install
  # (find_package(DTK), dtk::layers). The installed copy steps aside so the names do not clash.
  rm -rf build-llama
  cmake -S plugins/models/llama -B build-llama -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build-install" >/dev/null || return
  cmake --build build-llama || return
  rm -f build-install/lib/dtk/plugins/dtk_plugin_llama.so
  build-install/bin/dtk train --config configs/llama-tiny.pbtxt --dataset synthetic --set train.train_iters=4 \
    --set lr.lr_warmup_iters=1 --set logging.log_interval=2 --set eval.eval_iters=1 --plugin_path build-llama
}

stage "ctest" run_ctest
stage "ASan/UBSan: loader, ABI and data (fuzz) tests" run_sanitizers
stage "SDK: install, build sdk/template and the llama plugin out of tree, train with them on the installed dtk" run_sdk_template

if ((${#failed[@]})); then
  printf 'test.sh: FAILED stage: %s\n' "${failed[@]}"
  exit 1
fi
echo "test.sh: every stage passed (ctest, sanitizers, SDK template)"
