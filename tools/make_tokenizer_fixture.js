#!/usr/bin/env node
// Regenerates the GPT-2 tokenizer reference fixtures from the independent JavaScript encoder
// shipped in the npm package `gpt-3-encoder` (the reference the C++ tokenizer must match):
//
//   mkdir -p /tmp/jsref && cd /tmp/jsref && npm install gpt-3-encoder      # 1.1.4 when made
//   NODE_PATH=/tmp/jsref/node_modules node tools/make_tokenizer_fixture.js \
//       tests/data/fixtures/shakespeare_excerpt.txt tests/data/fixtures
//
// Writes, for TEXT = DIR/NAME.txt:
//   NAME_gpt2.u16  — the ids of the whole TEXT file, little-endian uint16
//   gpt2_cases.txt — one case per line: <utf-8 bytes in hex> TAB <ids separated by ' '>
//
// tests/data/fixtures/shakespeare_excerpt.txt is the first 119,994 bytes (cut at a line
// boundary) of tinyshakespeare (Karpathy's char-rnn input.txt, public-domain Shakespeare):
//   head -c 120000 tinyshakespeare.txt | sed '$d' > tests/data/fixtures/shakespeare_excerpt.txt
const fs = require('fs');
const path = require('path');
const { encode } = require('gpt-3-encoder');

const [input, outDir] = process.argv.slice(2);
if (!input || !outDir) {
  console.error('usage: make_tokenizer_fixture.js TEXT.txt OUT_DIR');
  process.exit(2);
}

// encode(text) concatenates bpe(match) over the regex matches of `text` with an O(n^2) array
// concat, far too slow for large texts. We encode match by match instead, asserting that every match
// re-tokenizes to itself, which makes the result identical to encode(text).
const pat = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu;
function encodeLarge(text) {
  const ids = [];
  for (const m of text.matchAll(pat)) {
    const again = Array.from(m[0].matchAll(pat)).map(x => x[0]);
    if (again.length !== 1 || again[0] !== m[0]) throw new Error('match does not re-tokenize');
    for (const id of encode(m[0])) ids.push(id);
  }
  return ids;
}

const text = fs.readFileSync(input, 'utf-8');
const ids = encodeLarge(text);
const buf = Buffer.alloc(ids.length * 2);
ids.forEach((id, i) => buf.writeUInt16LE(id, i * 2));
const idsFile = path.basename(input).replace(/\.txt$/, '') + '_gpt2.u16';
fs.writeFileSync(path.join(outDir, idsFile), buf);

const cases = [
  '', ' ', '  ', '\n', '\n\n', 'a', ' a', '  a', '   a', 'a ', 'a  ', 'a\n', 'a \n b',
  'Hello world', 'Hello, world!', "I'm you're we've they'll she'd it's don't", "'s's'S 'RE",
  "JOHN'S O'Neil rock'n'roll ''quoted''", 'tabs\tand\t\ttabs', 'CRLF\r\nline\r\n\r\nend',
  'spaces     between', 'trailing   ', '   leading', '\n\n\nX\n\n', ' \t \n ', '\u00a0nbsp\u00a0 x',
  '\u3000ideographic space', '\u2028line sep\u2029para', 'zero\u200bwidth', '\ufeffBOM',
  'numbers 123 4567 89.01 1,000,000', 'mixed a1b2 3c ٣٤٥ ١٢ ०१२ 一二三 Ⅻ ½ ²³',
  'café naïve résumé', 'e\u0301 combining a\u0308\u0301 marks', 'Ελληνικά Русский עברית العربية',
  'हिन्दी বাংলা ไทย 日本語のテキスト 中文 한국어', 'emoji 😀😃 👩‍👩‍👧 🇫🇷 👍🏽', 'symbols @#$%^&*()_+-=[]{}|;:",.<>/?`~',
  '<|endoftext|>', 'end<|endoftext|>start', 'µ ß ẞ ﬁ Å Ω', '𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛', 'ı İ ǅ ʰ ˆ',
  '   \n   \n', 'a\u0085b', 'x\u000by\u000cz', '\u0000null\u0001ctl', '""quotes"" \'single\'',
  '{"json": ["a","b"], "k":1},', '"],"' + "','" + '.","', 'https://example.com/path?q=1&r=2#frag',
  'ALLCAPS lowercase MiXeD', 'The quick brown fox jumps over the lazy dog.',
  'ﾊﾝｶｸ ｶﾀｶﾅ', 'Ⓐⓑⓒ', '𐍈𐌰𐌹', 'a'.repeat(200), ' '.repeat(50) + 'b', '!'.repeat(40),
];
// Seeded random strings over a tricky alphabet (xorshift32, reproducible).
let s = 0x12345678;
const rnd = n => { s ^= s << 13; s >>>= 0; s ^= s >>> 17; s ^= s << 5; s >>>= 0; return s % n; };
const alphabet = Array.from("aZ '09 \n\t\r.,!?sdmtlrev-_é漢ß٣😀\u00a0\u3000\u0301\u200b\"{}[]");
for (let k = 0; k < 300; k++) {
  let t = '';
  const len = 1 + rnd(40);
  for (let i = 0; i < len; i++) t += alphabet[rnd(alphabet.length)];
  cases.push(t);
}
const lines = cases.map(c => Buffer.from(c, 'utf-8').toString('hex') + '\t' + encode(c).join(' '));
fs.writeFileSync(path.join(outDir, 'gpt2_cases.txt'), lines.join('\n') + '\n');
console.error(`wrote ${ids.length} ids of ${input} (${idsFile}) and ${cases.length} cases to ${outDir}`);
