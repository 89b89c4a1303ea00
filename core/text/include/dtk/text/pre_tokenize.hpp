// dtk::text — the pre-tokenizers of byte-level BPE tokenizers: the regexes that cut text into
// pieces before BPE merges within each piece, written by hand over UTF-8 (no regex library).
// \p{L}, \p{N}, \s (and v2's letter cases and \p{M}) come from tables generated from node's regex engine
// (tools/gen_unicode_tables.js), so they mean what they mean to the JavaScript reference
// encoders the tests compare against. Malformed UTF-8 throws DataError "invalid UTF-8 at byte N".
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace dtk::text {

// GPT-2's:  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
void gpt2_pre_tokenize(std::string_view text, std::vector<std::string_view>* pieces);

// Llama 3's (tiktoken cl100k's):
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
void llama3_pre_tokenize(std::string_view text, std::vector<std::string_view>* pieces);

// Qwen2's and Qwen3's (Llama 3's with one digit per piece):
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
void qwen2_pre_tokenize(std::string_view text, std::vector<std::string_view>* pieces);

// Megatron's TikTokenizer, --tiktoken-pattern v1:
//   [^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+
// and v2 (its default; tiktoken o200k's without the contractions):
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|
//    ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// tiktoken runs them in Rust, so here \s is Unicode's White_Space (U+0085 is whitespace, U+FEFF
// is not), where the two above keep JavaScript's \s.
void tiktoken_v1_pre_tokenize(std::string_view text, std::vector<std::string_view>* pieces);
void tiktoken_v2_pre_tokenize(std::string_view text, std::vector<std::string_view>* pieces);

// The regex source of each pre-tokenizer above, as tokenizer.json (or Megatron) spells it.
extern const char* const kGpt2PreTokenizePattern;
extern const char* const kLlama3PreTokenizePattern;
extern const char* const kQwen2PreTokenizePattern;
extern const char* const kTiktokenV1Pattern;
extern const char* const kTiktokenV2Pattern;

// GPT-2's bytes_to_unicode(): byte b is spelled as the code point table[b] in byte-level vocabularies.
const uint32_t* byte_level_alphabet();

}  // namespace dtk::text
