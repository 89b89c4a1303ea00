#!/usr/bin/env bash
# The main job: a real GPT training run on a real text corpus with the default plugins.
#   1. installs what is missing (Debian packages, the GPT-2 vocab, the Llama tokenizer files) and
#      builds dtk
#   2. makes a corpus: every fortune cookie of Debian's `fortunes` package, one document each
#      (jsonl), or CORPUS=path/to/file.txt|.jsonl for your own text
#   3. `dtk preprocess` -> Megatron .bin/.idx with GPT-2 BPE
#   4. `dtk train` of configs/gpt-tiny.pbtxt on it (override with CONFIG=..., extra flags pass through;
#      the data is the script's, so not --data_path, which dtk takes once)
# MODEL=llama: the same corpus through a 32000-piece SentencePiece-style BPE tokenizer.json
# (HuggingFaceTokenizer) into a Llama (configs/llama-main.pbtxt), saved to runs/llama/checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh --vocab
tools/build.sh
mkdir -p data
DTK=build/bin/dtk

CORPUS=${CORPUS:-}
if [[ -z "$CORPUS" ]]; then
  if ! dpkg-query -W -f='${Status}' fortunes 2>/dev/null | grep -q "install ok installed"; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq fortunes >/dev/null
  fi
  CORPUS=data/fortunes.jsonl
  if [[ ! -s $CORPUS ]]; then
    # Fortune files hold cookies separated by lines of "%": one JSON document per cookie.
    echo "train_main: building the corpus $CORPUS from Debian's fortune cookies"
    for f in /usr/share/games/fortunes/*; do
      if [[ -f $f && $f != *.dat && $f != *.u8 && ! -L $f ]]; then cat "$f"; printf '\n%%\n'; fi
    done | awk 'BEGIN { doc = "" }
      function flush() { if (doc != "") { printf "{\"text\": \"%s\"}\n", doc }; doc = "" }
      /^%$/ { flush(); next }
      { line = $0; gsub(/\\/, "\\\\", line); gsub(/"/, "\\\"", line); gsub(/\t/, "\\t", line);
        gsub(/[\001-\010\013-\037\177]/, "", line);
        doc = (doc == "" ? line : doc "\\n" line) }
      END { flush() }' | shuf --random-source=<(yes) > "$CORPUS.tmp"
    # Shuffled (deterministically) because Megatron's split is contiguous: unshuffled, the
    # validation and test documents would all come from the last fortune files.
    mv "$CORPUS.tmp" "$CORPUS"
  fi
fi
name=$(basename "${CORPUS%.*}")
if [[ "${MODEL:-gpt}" == llama ]]; then
  PREFIX=data/${name}_llama
  if [[ ! -s ${PREFIX}_text_document.idx ]]; then
    $DTK preprocess --input "$CORPUS" --output_prefix "$PREFIX" --tokenizer_type HuggingFaceTokenizer \
      --tokenizer_model data/tokenizers/sp-bpe --append_eod --skip_bad_lines
  fi
  # The run records its tokenizer: `dtk generate --load runs/llama/checkpoints` needs no flags.
  # Each run replaces the previous one's checkpoints, as below.
  exec $DTK train --config "${CONFIG:-configs/llama-main.pbtxt}" --data_path "${PREFIX}_text_document" \
    --set checkpoint.overwrite_other_run=true "$@"
fi
PREFIX=data/${name}
if [[ ! -s ${PREFIX}_text_document.idx ]]; then
  $DTK preprocess --input "$CORPUS" --output_prefix "$PREFIX" --vocab_file data/gpt2/encoder.json \
    --merge_file data/gpt2/vocab.bpe --append_eod --skip_bad_lines
fi
# The trained model is saved to runs/main/checkpoints (`dtk generate --load runs/main/checkpoints`
# continues text with it; README). Each run of this job starts afresh and replaces the previous
# one's checkpoints there (a shorter rerun would otherwise be refused: its saves would take the
# tracker back past the longer run's).
$DTK train --config "${CONFIG:-configs/gpt-tiny.pbtxt}" --dataset gpt_indexed \
  --data_path "${PREFIX}_text_document" --set dataset.vocab_size=50257 \
  --set checkpoint.save=runs/main/checkpoints --set checkpoint.overwrite_other_run=true "$@"
