// The constructors behind make_tokenizer(), one per implementation file.
#pragma once

#include <memory>
#include <string>

#include "dtk/text/tokenizer.hpp"

namespace dtk::text {

std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file, const std::string& merge_file);
// type: SentencePieceTokenizer, GPTSentencePieceTokenizer or Llama2Tokenizer.
std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& type, const std::string& model_file);
// path: a tokenizer.json, or a folder holding one (and maybe tokenizer_config.json).
std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path);
std::unique_ptr<Tokenizer> make_null_tokenizer(int64_t vocab_size);
std::unique_ptr<Tokenizer> make_tiktoken_tokenizer(const TokenizerSpec& spec);

// A process-unique number per tokenizer, for per-thread caches keyed by tokenizer.
uint64_t next_tokenizer_serial();

}  // namespace dtk::text
