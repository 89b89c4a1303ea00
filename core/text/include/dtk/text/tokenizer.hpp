// dtk::text::Tokenizer — the one interface `dtk preprocess`, `dtk generate`, `dtk export hf` and
// the run's vocabulary/EOD checks use, whatever the tokenizer. make_tokenizer() selects an
// implementation as Megatron-LM's build_tokenizer() does (--tokenizer-type, --tokenizer-model,
// --vocab-file, --merge-file, --vocab-size), and each one produces the ids its reference does:
//   GPT2BPETokenizer           encoder.json + vocab.bpe (gpt2_tokenizer.hpp)
//   SentencePieceTokenizer     a SentencePiece .model, plus Megatron's added <CLS> <SEP> <EOD>
//                              <MASK> (and pad/bos/eos when the model lacks them); EOD = <EOD>
//   GPTSentencePieceTokenizer  a SentencePiece .model as is; EOD = its </s>
//   Llama2Tokenizer            a SentencePiece .model; every text starts with <s>; EOD = </s>
//   HuggingFaceTokenizer       a tokenizer.json (or its folder): BPE, byte-level (Llama 3,
//                              GPT-2 style) or SentencePiece-style (Llama 2, Mistral)
//   TikTokenizer               a tiktoken vocabulary as Megatron's JSON list (Nemotron's), its
//                              special tokens first; the v1 or v2 regex; EOD = </s>
//   NullTokenizer              text is space-separated ids; EOD = vocab_size (the size is +1)
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtk::text {

struct TokenizerSpec {
  TokenizerSpec() = default;
  TokenizerSpec(std::string type_, std::string model_file_, std::string vocab_file_ = "", std::string merge_file_ = "",
                int64_t vocab_size_ = 0)
      : type(std::move(type_)),
        model_file(std::move(model_file_)),
        vocab_file(std::move(vocab_file_)),
        merge_file(std::move(merge_file_)),
        vocab_size(vocab_size_) {}

  std::string type;        // Megatron's --tokenizer-type; empty: GPT2BPETokenizer
  std::string model_file;  // --tokenizer-model: SentencePiece .model, tokenizer.json or its folder
  std::string vocab_file;  // --vocab-file (GPT-2 BPE)
  std::string merge_file;  // --merge-file (GPT-2 BPE)
  // --vocab-size: NullTokenizer's number of ids; TikTokenizer's size, special tokens included
  // (0: Megatron's 131072). The other tokenizers take their size from their files.
  int64_t vocab_size = 0;
  // TikTokenizer: --tiktoken-pattern (v1 or v2; empty: v2), --tiktoken-num-special-tokens (0:
  // Megatron's 1000), --tokenizer-special-tokens (empty: <unk> <s> </s> <mask> <pad> <cls> <sep>).
  std::string tiktoken_pattern;
  int64_t tiktoken_num_special_tokens = 0;
  std::vector<std::string> special_tokens;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Megatron's name of this tokenizer type ("Llama2Tokenizer", ...).
  virtual const std::string& type() const = 0;

  // The ids of `text` alone, without the tokens Megatron's tokenize() puts around every text.
  // Appends to `out`. Thread-safe. Throws data::DataError (invalid UTF-8, a NullTokenizer word
  // that is not an id, ...).
  virtual void encode(std::string_view text, std::vector<int32_t>* out) const = 0;
  // What Megatron's tokenize(text) adds before / after every text: Llama2Tokenizer's <s>, a
  // tokenizer.json post-processor's template. Usually empty.
  virtual const std::vector<int32_t>& text_prefix() const;
  virtual const std::vector<int32_t>& text_suffix() const;
  // Megatron's tokenize(): prefix + encode(text) + suffix.
  std::vector<int32_t> tokenize(std::string_view text) const;

  // The bytes the ids spell (Megatron's detokenize). Throws DataError for an id outside the
  // vocabulary. Decoding a prefix of ids need not give a prefix of the bytes (SentencePiece
  // drops the first space), so streaming callers decode the whole sequence and print the growth.
  virtual std::string decode(const int32_t* ids, size_t n) const = 0;
  std::string decode(const std::vector<int32_t>& ids) const { return decode(ids.data(), ids.size()); }

  // Megatron's vocab_size: the embedding rows the tokenizer needs before padding.
  virtual int64_t vocab_size() const = 0;
  // End of document (Megatron's eod: what --append-eod appends, what the step masks); -1: none.
  virtual int32_t eod() const = 0;
  virtual int32_t bos() const { return -1; }

  // For encoding one long text in parallel pieces: a byte offset p, from < p < text.size(), at
  // which encode(text) == encode(text[0, p)) + encode(text[p, end)), or npos when there is none
  // at or after `from` (or the tokenizer cannot tell).
  virtual size_t next_cut(std::string_view text, size_t from) const;

  // The files that define the tokenizer, for copying next to an exported model.
  virtual std::vector<std::string> files() const = 0;

  // A Hugging Face tokenizer.json that encodes as this tokenizer does, written for a tokenizer
  // whose own files are not one (TikTokenizer); "" for the others, whose files are copied.
  virtual std::string hf_tokenizer_json() const;
};

// Throws data::DataError with one line naming what is wrong (unknown type, a missing file, a
// tokenizer.json feature DTK does not implement, ...).
std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerSpec& spec);

// Megatron's --tokenizer-type values make_tokenizer() accepts, for error messages and docs.
const std::vector<std::string>& tokenizer_types();

}  // namespace dtk::text
