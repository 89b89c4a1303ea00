// make_tokenizer(): Megatron's build_tokenizer() selection and its checks, one error line each;
// and GPT2BPETokenizer, the Gpt2Tokenizer behind the common interface.
#include "dtk/text/tokenizer.hpp"
#include <algorithm>

#include <atomic>
#include <cstring>
#include <unordered_map>

#include "dtk/data/error.hpp"
#include "dtk/text/gpt2_tokenizer.hpp"
#include "tokenizers.hpp"

namespace dtk::text {

using data::DataError;

namespace {
const std::vector<int32_t> kNoIds;
}  // namespace

const std::vector<int32_t>& Tokenizer::text_prefix() const { return kNoIds; }
const std::vector<int32_t>& Tokenizer::text_suffix() const { return kNoIds; }
size_t Tokenizer::next_cut(std::string_view, size_t) const { return std::string_view::npos; }
std::string Tokenizer::hf_tokenizer_json() const { return ""; }

std::vector<int32_t> Tokenizer::tokenize(std::string_view text) const {
  std::vector<int32_t> ids = text_prefix();
  encode(text, &ids);
  const std::vector<int32_t>& suffix = text_suffix();
  ids.insert(ids.end(), suffix.begin(), suffix.end());
  return ids;
}

uint64_t next_tokenizer_serial() {
  static std::atomic<uint64_t> next{1};
  return next++;
}

namespace {

class Gpt2BpeTokenizer final : public Tokenizer {
 public:
  Gpt2BpeTokenizer(const std::string& vocab_file, const std::string& merge_file)
      : bpe_(vocab_file, merge_file), files_{vocab_file, merge_file} {
    // Megatron's _GPT2BPETokenizer reads encoder['<|endoftext|>'] at construction.
    if (bpe_.eod() < 0) throw DataError("vocab file '" + vocab_file + "' has no <|endoftext|> token");
  }
  const std::string& type() const override { return type_; }
  void encode(std::string_view text, std::vector<int32_t>* out) const override {
    // The piece cache is per thread and per tokenizer: encode() stays const and thread-safe.
    // Keyed by a serial number, not the address: a new tokenizer may reuse a freed one's.
    thread_local uint64_t owner = 0;
    thread_local std::unique_ptr<Gpt2Tokenizer::Cache> cache;
    if (owner != serial_ || !cache) {
      cache = std::make_unique<Gpt2Tokenizer::Cache>();
      owner = serial_;
    }
    bpe_.encode(text, out, cache.get());
  }
  std::string decode(const int32_t* ids, size_t n) const override {
    std::vector<int64_t> wide(ids, ids + n);
    return bpe_.decode(wide.data(), wide.size());
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(bpe_.vocab_size()); }
  int32_t eod() const override { return bpe_.eod(); }
  // Before a '\n' followed by printable ASCII: GPT-2's regex never joins across it (a '\n' is
  // whitespace, the next piece starts at the printable character or at the '\n').
  size_t next_cut(std::string_view text, size_t from) const override {
    for (size_t k = from; k + 1 < text.size(); ++k) {
      const void* nl = std::memchr(text.data() + k, '\n', text.size() - k - 1);
      if (nl == nullptr) break;
      k = static_cast<size_t>(static_cast<const char*>(nl) - text.data());
      const unsigned char next = static_cast<unsigned char>(text[k + 1]);
      if (next >= 0x21 && next <= 0x7e && k > 0) return k;
    }
    return std::string_view::npos;
  }
  std::vector<std::string> files() const override { return files_; }

 private:
  const std::string type_ = "GPT2BPETokenizer";
  const uint64_t serial_ = next_tokenizer_serial();
  Gpt2Tokenizer bpe_;
  std::vector<std::string> files_;
};

void require(bool ok, const std::string& what) {
  if (!ok) throw DataError(what);
}

}  // namespace

std::unique_ptr<Tokenizer> make_gpt2_bpe_tokenizer(const std::string& vocab_file, const std::string& merge_file) {
  return std::make_unique<Gpt2BpeTokenizer>(vocab_file, merge_file);
}

const std::vector<std::string>& tokenizer_types() {
  static const std::vector<std::string> types{"GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                                              "Llama2Tokenizer",  "HuggingFaceTokenizer",   "TikTokenizer",
                                              "NullTokenizer"};
  return types;
}

std::unique_ptr<Tokenizer> make_tokenizer(const TokenizerSpec& s) {
  const std::string type = s.type.empty() ? "GPT2BPETokenizer" : s.type;
  const std::string with = "--tokenizer-type " + type;
  // An unknown type first: its other flags cannot be judged (a case typo is not a misplaced flag).
  const std::vector<std::string>& types = tokenizer_types();
  if (std::find(types.begin(), types.end(), type) == types.end()) {
    std::string known;
    for (const std::string& t : types) known += (known.empty() ? "" : ", ") + t;
    throw DataError("unknown --tokenizer-type '" + type + "' (DTK has " + known + "; the names are case-sensitive)");
  }
  require(s.vocab_size == 0 || type == "NullTokenizer" || type == "TikTokenizer",
          with +
              " takes no --vocab-size (that is NullTokenizer's and TikTokenizer's; the size comes from the "
              "tokenizer's files)");
  require((s.tiktoken_pattern.empty() && s.tiktoken_num_special_tokens == 0) || type == "TikTokenizer",
          with + " takes no --tiktoken-pattern or --tiktoken-num-special-tokens (those are TikTokenizer's)");
  require(s.special_tokens.empty() || type == "TikTokenizer",
          with + " takes no --tokenizer-special-tokens (DTK reads them for TikTokenizer only)");
  if (type == "GPT2BPETokenizer") {
    require(!s.vocab_file.empty() && !s.merge_file.empty(),
            with + " needs --vocab-file (encoder.json) and --merge-file (vocab.bpe)");
    require(s.model_file.empty(), with + " takes --vocab-file and --merge-file, not --tokenizer-model");
    return make_gpt2_bpe_tokenizer(s.vocab_file, s.merge_file);
  }
  require(s.vocab_file.empty() && s.merge_file.empty(),
          with + " takes no --vocab-file/--merge-file (those are GPT2BPETokenizer's)");
  if (type == "SentencePieceTokenizer" || type == "GPTSentencePieceTokenizer" || type == "Llama2Tokenizer") {
    require(!s.model_file.empty(), with + " needs --tokenizer-model (a SentencePiece tokenizer.model)");
    return make_sentencepiece_tokenizer(type, s.model_file);
  }
  if (type == "HuggingFaceTokenizer") {
    require(!s.model_file.empty(), with + " needs --tokenizer-model (a tokenizer.json or the folder holding it)");
    return make_hf_tokenizer(s.model_file);
  }
  if (type == "TikTokenizer") {
    require(!s.model_file.empty(), with + " needs --tokenizer-model (the tiktoken vocabulary, a .json list)");
    require(s.vocab_size >= 0, with + ": --vocab-size must be positive, got " + std::to_string(s.vocab_size));
    require(s.tiktoken_num_special_tokens >= 0, with + ": --tiktoken-num-special-tokens must be positive, got " +
                                                    std::to_string(s.tiktoken_num_special_tokens));
    return make_tiktoken_tokenizer(s);
  }
  if (type == "NullTokenizer") {
    require(s.vocab_size >= 0, with + ": --vocab-size must be positive, got " + std::to_string(s.vocab_size));
    require(s.vocab_size > 0, with + " needs --vocab-size (the number of ids, without the EOD it adds)");
    require(s.model_file.empty(), with + " takes no --tokenizer-model");
    return make_null_tokenizer(s.vocab_size);
  }
  // Every listed type returned above.
  throw DataError("--tokenizer-type '" + type + "' is listed but has no constructor");
}

}  // namespace dtk::text
