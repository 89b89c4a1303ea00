#!/usr/bin/env node
// Times the npm reference GPT-2 encoders on a text file, single thread (node is single-threaded):
//   NODE_PATH=/tmp/jsref/node_modules node tools/bench/bench_tokenizer.js FILE [MAX_MB]
// Prints one line per encoder: "<name> <MB> MB <seconds> s <MB/s> MB/s <tokens> tokens".
// gpt-3-encoder's encode() is O(n^2) in the number of pieces (array concat), so it is fed one
// line at a time, which is how a preprocessor would call it anyway; js-tiktoken gets 64 KB blocks.
const fs = require('fs');
const [file, maxMb] = process.argv.slice(2);
let text = fs.readFileSync(file, 'utf-8');
if (maxMb) text = text.slice(0, Math.floor(parseFloat(maxMb) * 1e6));
const mb = Buffer.byteLength(text, 'utf-8') / 1e6;
function time(name, fn) {
  const t0 = process.hrtime.bigint();
  const n = fn();
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  console.log(`${name} ${mb.toFixed(1)} MB ${s.toFixed(2)} s ${(mb / s).toFixed(2)} MB/s ${n} tokens`);
}
try {
  const { encode } = require('gpt-3-encoder');
  time('gpt-3-encoder', () => {
    let n = 0;
    for (const line of text.split(/(?<=\n)/)) n += encode(line).length;
    return n;
  });
} catch (e) { console.log('gpt-3-encoder unavailable: ' + e.message); }
try {
  const { getEncoding } = require('js-tiktoken');
  const enc = getEncoding('gpt2');
  time('js-tiktoken', () => {
    let n = 0;
    for (let i = 0; i < text.length; i += 65536) n += enc.encode(text.slice(i, i + 65536)).length;
    return n;
  });
} catch (e) { console.log('js-tiktoken unavailable: ' + e.message); }
