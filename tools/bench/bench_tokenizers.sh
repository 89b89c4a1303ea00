#!/usr/bin/env bash
# Tokenizer throughput next to the reference encoders, same text, same run (prints; asserts nothing).
#   tools/bench/bench_tokenizers.sh [MB]     (default 8)
# The text: CORPUS (jsonl with "text"), by default the main job's data/fortunes.jsonl when it is
# there (varied text: the encoders' piece caches do not flatter them), else the GPL-3 of Debian's
# base-files, one jsonl document per paragraph, repeated to MB.
# DTK: `dtk preprocess` (encode + write .bin/.idx) with --workers 1 and 2, per tokenizer.
# Peers, 1 thread: @lenml/tokenizers (JavaScript port of Hugging Face's tokenizers, the ids'
# reference; data/tokenizers/reference) on the tokenizer.json files, js-tiktoken (the
# JavaScript port of tiktoken, npm-installed here) given what Megatron's TikTokenizer gives
# tiktoken, SentencePiece's Python binding on the committed SentencePiece model. Needs
# tools/setup.sh --vocab, node (and npm for js-tiktoken) and python3-sentencepiece for the peers.
set -euo pipefail
cd "$(dirname "$0")/../.."
MB=${1:-8}
DTK=${DTK:-build/bin/dtk}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
CORPUS=${CORPUS:-data/fortunes.jsonl}
if [[ -s "$CORPUS" ]]; then
  cp "$CORPUS" "$tmp/corpus.jsonl"
else /usr/bin/python3 - "$MB" "$tmp/corpus.jsonl" <<'PY'
import json, sys
paras = [p for p in open('/usr/share/common-licenses/GPL-3', encoding='utf-8').read().split('\n\n') if p.strip()]
out, size, target = open(sys.argv[2], 'w'), 0, float(sys.argv[1]) * 1e6
while size < target:
    for p in paras:
        line = json.dumps({'text': p}) + '\n'
        out.write(line); size += len(line.encode())
PY
fi
echo "corpus: $(wc -c <"$tmp/corpus.jsonl") bytes of jsonl ($CORPUS or GPL-3 paragraphs), $(nproc) hardware threads"
dtk_mbs() {  # label, tokenizer flags...
  local label=$1; shift
  for w in 1 2; do
    rm -f "$tmp"/out_*
    local line
    line=$("$DTK" preprocess --input "$tmp/corpus.jsonl" --output_prefix "$tmp/out" "$@" --workers $w --skip_bad_lines 2>&1 | grep "done:")
    echo "  dtk preprocess, $label, workers $w: ${line#*done: }"
  done
}
dtk_mbs "GPT2BPETokenizer" --vocab_file data/gpt2/encoder.json --merge_file data/gpt2/vocab.bpe
dtk_mbs "HuggingFaceTokenizer llama3" --tokenizer_type HuggingFaceTokenizer --tokenizer_model data/tokenizers/llama3
dtk_mbs "HuggingFaceTokenizer sp-bpe" --tokenizer_type HuggingFaceTokenizer --tokenizer_model data/tokenizers/sp-bpe
dtk_mbs "Llama2Tokenizer (SentencePiece)" --tokenizer_type Llama2Tokenizer \
  --tokenizer_model tests/data/fixtures/tokenizers/gpl3_bpe.model
dtk_mbs "TikTokenizer o200k_base, v2" --tokenizer_type TikTokenizer \
  --tokenizer_model data/tokenizers/tiktoken/o200k_base.json --tiktoken_pattern v2
if command -v node >/dev/null; then
  for t in llama3 sp-bpe; do
    node - "$(pwd)/data/tokenizers/reference/dist/main.js" "data/tokenizers/$t" "$tmp/corpus.jsonl" <<'JS'
const fs = require('fs');
const [lib, dir, corpus] = process.argv.slice(2);
const { TokenizerLoader } = require(lib);
const config = fs.existsSync(dir + '/tokenizer_config.json') ? JSON.parse(fs.readFileSync(dir + '/tokenizer_config.json')) : {};
const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON: JSON.parse(fs.readFileSync(dir + '/tokenizer.json')), tokenizerConfig: config });
const lines = fs.readFileSync(corpus, 'utf8').split('\n').filter(l => l).flatMap(l => { try { return [JSON.parse(l).text]; } catch (e) { return []; } });
const t0 = process.hrtime.bigint();
let tokens = 0, bytes = 0;
for (const text of lines) { tokens += tok.encode(text).length; bytes += Buffer.byteLength(text); }
const s = Number(process.hrtime.bigint() - t0) / 1e9;
console.log(`  @lenml/tokenizers (node), ${dir.split('/').pop()}, 1 thread: ${tokens} tokens, ${(bytes / 1e6 / s).toFixed(1)} MB/s of text`);
JS
  done
  if (cd "$tmp" && npm install --silent --no-save --no-package-lock js-tiktoken@1.0.21 >/dev/null 2>&1); then
    node - "$tmp/node_modules/js-tiktoken/dist/index.cjs" data/tokenizers/tiktoken/o200k_base.json "$tmp/corpus.jsonl" <<'JS'
const fs = require('fs');
const [lib, vocabFile, corpus] = process.argv.slice(2);
const { Tiktoken } = require(lib);
const specials = ['<unk>', '<s>', '</s>', '<mask>', '<pad>', '<cls>', '<sep>'];
for (let k = specials.length; k < 1000; k++) specials.push(`<SPECIAL_${k}>`);
const vocab = JSON.parse(fs.readFileSync(vocabFile, 'utf8')).slice(0, 131072 - 1000);
const tok = new Tiktoken({
  pat_str: String.raw`[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`,
  special_tokens: Object.fromEntries(specials.map((t, i) => [t, i])),
  bpe_ranks: '! 1000 ' + vocab.map((e) => e.token_bytes).join(' '),
});
const lines = fs.readFileSync(corpus, 'utf8').split('\n').filter(l => l).flatMap(l => { try { return [JSON.parse(l).text]; } catch (e) { return []; } });
const t0 = process.hrtime.bigint();
let tokens = 0, bytes = 0;
for (const text of lines) { tokens += tok.encode(text, 'all').length; bytes += Buffer.byteLength(text); }
const s = Number(process.hrtime.bigint() - t0) / 1e9;
console.log(`  js-tiktoken (node), TikTokenizer o200k_base v2, 1 thread: ${tokens} tokens, ${(bytes / 1e6 / s).toFixed(1)} MB/s of text`);
JS
  else
    echo "  (npm could not install js-tiktoken: TikTokenizer peer not timed)"
  fi
fi
/usr/bin/python3 - "$tmp/corpus.jsonl" <<'PY' || echo "  (python3-sentencepiece missing: SentencePiece peer not timed)"
import json, sys, time
import sentencepiece as spm
sp = spm.SentencePieceProcessor(model_file='tests/data/fixtures/tokenizers/gpl3_bpe.model')
texts = []
for l in open(sys.argv[1], encoding='utf-8', errors='replace'):
    try:
        texts.append(json.loads(l)['text'])
    except ValueError:
        pass  # the lines dtk skips with --skip_bad_lines
t0 = time.perf_counter(); n = sum(len(sp.encode(t)) + 1 for t in texts); s = time.perf_counter() - t0
mb = sum(len(t.encode()) for t in texts) / 1e6
print(f"  sentencepiece (python binding), Llama2Tokenizer's encode, 1 thread: {n} tokens, {mb / s:.1f} MB/s of text")
PY
