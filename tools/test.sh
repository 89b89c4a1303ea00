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
  rm -rf build-install build-templates
  cmake --install build --prefix "$PWD/build-install" >/dev/null || return
  local dtk=build-install/bin/dtk kind
  # Every template (sdk/templates/<kind>) is a project of its own, built as a plugin author builds
  # it: against the install, nothing else.
  for kind in optimizer model dataset step strategy; do
    echo "-- sdk/templates/$kind"
    cmake -S "sdk/templates/$kind" -B "build-templates/$kind" -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build-install" \
      >/dev/null || return
    cmake --build "build-templates/$kind" || return
  done
  local short=(--set train.train_iters=4 --set lr.lr_warmup_iters=1 --set logging.log_interval=2 --set eval.eval_iters=1)
  local T=build-templates
  $dtk plugins describe template_scaled_sgd --plugin_path $T/optimizer || return
  $dtk train --config configs/gpt-tiny.pbtxt --optimizer template_scaled_sgd --set optimizer.scale=0.5 \
    --dataset synthetic "${short[@]}" --plugin_path $T/optimizer || return
  # The model template on its own config; the dataset template on a text file every Debian has
  # (any text works); the step and the strategy templates with the shipped model, the strategy
  # across two processes. Then all four templates together.
  $dtk train --config sdk/templates/model/train.pbtxt "${short[@]}" --plugin_path $T/model || return
  # The decoder-LM template (the SDK's decoder_lm.hpp base), alone and in two pipeline stages.
  $dtk train --config sdk/templates/model/tiny_decoder.pbtxt "${short[@]}" --plugin_path $T/model || return
  $dtk launch --nproc_per_node 2 train --config sdk/templates/model/tiny_decoder.pbtxt \
    --set distributed.pipeline_model_parallel_size=2 "${short[@]}" --plugin_path $T/model || return
  $dtk train --config sdk/templates/dataset/train.pbtxt --set dataset.data_path=/usr/share/common-licenses/GPL-3 \
    "${short[@]}" --plugin_path $T/dataset || return
  $dtk train --config configs/gpt-tiny.pbtxt --dataset synthetic --step template_lm_step \
    --set step.loss_skip_tokens=8 "${short[@]}" --plugin_path $T/step || return
  $dtk launch --nproc_per_node 2 train --config configs/gpt-tiny.pbtxt --dataset synthetic \
    --strategy template_flat_allreduce --set train.micro_batch_size=4 "${short[@]}" --plugin_path $T/strategy || return
  $dtk launch --nproc_per_node 2 train --config sdk/templates/model/train.pbtxt --dataset template_char_text \
    --set dataset.data_path=/usr/share/common-licenses/GPL-3 --set model.vocab_size=256 --step template_lm_step \
    --strategy template_flat_allreduce --optimizer template_scaled_sgd --set train.micro_batch_size=4 "${short[@]}" \
    --plugin_path $T/model:$T/dataset:$T/step:$T/strategy:$T/optimizer || return
  # The llama model plugin is built like a third party's: its folder alone, against the install
  # (find_package(DTK), dtk::layers). The installed copy steps aside so the names do not clash.
  rm -rf build-llama
  cmake -S plugins/models/llama -B build-llama -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build-install" >/dev/null || return
  cmake --build build-llama || return
  rm -f build-install/lib/dtk/plugins/dtk_plugin_llama.so
  $dtk train --config configs/llama-tiny.pbtxt --dataset synthetic "${short[@]}" --plugin_path build-llama
}

stage "ctest" run_ctest
stage "ASan/UBSan: loader, ABI and data (fuzz) tests" run_sanitizers
stage "SDK: install, build every sdk/templates project and the llama plugin out of tree, train with them on the installed dtk" run_sdk_template

if ((${#failed[@]})); then
  printf 'test.sh: FAILED stage: %s\n' "${failed[@]}"
  exit 1
fi
echo "test.sh: every stage passed (ctest, sanitizers, SDK template)"
