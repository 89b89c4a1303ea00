#!/usr/bin/env bash
# The whole test suite: installs what is missing (packages and the GPT-2 vocab, which the data
# and CLI tests read from data/gpt2), builds, runs ctest; then the sanitizer build of the
# torch-free loader/ABI/data tests, and the SDK templates and every first-party plugin built out
# of tree against an install.
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

# The out-of-tree builds below compile as a third party would, through ccache when it is there
# (as tools/build.sh does): a compiler launcher changes nothing a plugin author relies on.
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

run_sdk_template() {
  rm -rf build-install build-templates
  cmake --install build --prefix "$PWD/build-install" >/dev/null || return
  local dtk=build-install/bin/dtk kind
  # Every template (sdk/templates/<kind>) is a project of its own, built as a plugin author builds
  # it: against the install, nothing else.
  for kind in optimizer model dataset step strategy; do
    echo "-- sdk/templates/$kind"
    cmake -S "sdk/templates/$kind" -B "build-templates/$kind" -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build-install" \
      "${launcher[@]}" >/dev/null || return
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
  # A third-party dataset read whole (ABI 2.17; a 2.16 one or one ignoring it is refused), the
  # host's loss mask on its padding rows.
  $dtk train --config sdk/templates/dataset/train.pbtxt --set dataset.data_path=/usr/share/common-licenses/GPL-3 \
    "${short[@]}" --set eval.full_validation=true --plugin_path $T/dataset || return
  $dtk train --config configs/gpt-tiny.pbtxt --dataset synthetic --step template_lm_step \
    --set step.loss_skip_tokens=8 "${short[@]}" --plugin_path $T/step || return
  $dtk launch --nproc_per_node 2 train --config configs/gpt-tiny.pbtxt --dataset synthetic \
    --strategy template_flat_allreduce --set train.micro_batch_size=4 "${short[@]}" --plugin_path $T/strategy || return
  $dtk launch --nproc_per_node 2 train --config sdk/templates/model/train.pbtxt --dataset template_char_text \
    --set dataset.data_path=/usr/share/common-licenses/GPL-3 --set model.vocab_size=256 --step template_lm_step \
    --strategy template_flat_allreduce --optimizer template_scaled_sgd --set train.micro_batch_size=4 "${short[@]}" \
    --plugin_path $T/model:$T/dataset:$T/step:$T/strategy:$T/optimizer || return
  run_plugins_out_of_tree
}

# Every first-party plugin (plugins/CMakeLists.txt's list) is built as a third party builds it: its
# folder alone, against the install (find_package(DTK): dtk::sdk, dtk::layers, dtk::kernels,
# dtk::data, dtk::cuda). The installed copies then step aside, and runs that load every one of them
# train: gpt on real text (gpt_indexed, adamw, ddp, causal_lm), llama on ZeRO-2 with cpu_adam
# offloaded across two processes, gpt with sgd.
run_plugins_out_of_tree() {
  local dtk=build-install/bin/dtk B=build-plugins dir path=()
  rm -rf $B
  for dir in $(sed -n '/set(DTK_FIRST_PARTY_PLUGINS/,/)/s/^ *\([a-z_]*\/[a-z_]*\):.*/\1/p' plugins/CMakeLists.txt); do
    echo "-- plugins/$dir"
    cmake -S "plugins/$dir" -B "$B/$dir" -G Ninja -DCMAKE_PREFIX_PATH="$PWD/build-install" "${launcher[@]}" \
      >/dev/null || return
    cmake --build "$B/$dir" || return
    path+=("$B/$dir")
  done
  local folders
  folders=$(ls plugins/*/*/CMakeLists.txt | wc -l)
  ((${#path[@]} == folders)) || { echo "plugins/CMakeLists.txt lists ${#path[@]} plugins, plugins/ has $folders"; return 1; }
  rm -rf build-install/lib/dtk/plugins
  local plugin_path
  plugin_path=$(IFS=:; echo "${path[*]}")
  $dtk plugins list --plugin_path "$plugin_path" || return
  # A corpus every Debian has: the GPL's paragraphs, one jsonl document each.
  /usr/bin/python3 -c 'import json; [print(json.dumps({"text": p})) for p in open("/usr/share/common-licenses/GPL-3").read().split("\n\n") if p.strip()]' \
    >$B/gpl.jsonl || return
  $dtk preprocess --input $B/gpl.jsonl --output_prefix $B/gpl --vocab_file data/gpt2/encoder.json \
    --merge_file data/gpt2/vocab.bpe --append_eod || return
  local short=(--set train.train_iters=4 --set lr.lr_warmup_iters=1 --set logging.log_interval=2 --set eval.eval_iters=1)
  $dtk train --config configs/gpt-tiny.pbtxt --data_path $B/gpl_text_document --set dataset.split=90,10,0 \
    "${short[@]}" --plugin_path "$plugin_path" || return
  $dtk launch --nproc_per_node 2 train --config configs/llama-tiny.pbtxt --dataset synthetic --strategy zero \
    --set strategy.stage=2 --set strategy.offload_optimizer=cpu --optimizer cpu_adam --set train.micro_batch_size=4 \
    "${short[@]}" --plugin_path "$plugin_path" || return
  $dtk train --config configs/gpt-tiny.pbtxt --dataset synthetic --optimizer sgd "${short[@]}" --plugin_path "$plugin_path"
}

stage "ctest" run_ctest
stage "ASan/UBSan: loader, ABI and data (fuzz) tests" run_sanitizers
stage "SDK: install, build every sdk/templates project and every first-party plugin out of tree, train with them on the installed dtk" run_sdk_template

if ((${#failed[@]})); then
  printf 'test.sh: FAILED stage: %s\n' "${failed[@]}"
  exit 1
fi
echo "test.sh: every stage passed (ctest, sanitizers, SDK template)"
