// dtk::data::Gpt2Tokenizer — GPT-2 byte-level BPE, id-for-id identical to the reference
// JavaScript encoder of the npm package `gpt-3-encoder` (itself a port of openai/gpt-2).
//
//  * Pre-tokenization implements the regex
//      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//    by hand over UTF-8, with \p{L}, \p{N} and \s tables generated from node's own regex engine
//    (tools/gen_unicode_tables.js), so "letter" and "whitespace" mean what they mean there.
//  * Each piece is mapped byte -> printable unicode char (bytes_to_unicode) and merged by BPE
//    rank. Merge ranks are looked up by the key "first,second" exactly as the JS encoder does,
//    which reproduces its (observable) aliasing for pairs containing commas, e.g. ('",', '"').
//  * Invalid UTF-8 input raises DataError; no ICU, no regex library.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dtk::text {

// Splits `text` into pre-tokens (views into `text`) like the GPT-2 regex. Throws DataError
// "invalid UTF-8 at byte N" on malformed input.
void gpt2_pre_tokenize(std::string_view text, std::vector<std::string_view>* pieces);

class Gpt2Tokenizer {
 public:
  // vocab_file: encoder.json / vocab.json (token string -> id); merges_file: vocab.bpe /
  // merges.txt (first line is a version comment). Throws DataError naming the file.
  Gpt2Tokenizer(const std::string& vocab_file, const std::string& merges_file);
  ~Gpt2Tokenizer();

  // Per-thread memo of piece -> ids (the JS encoder's cache). Not thread-safe itself.
  class Cache {
   public:
    explicit Cache(size_t max_entries = 1 << 20) : max_entries_(max_entries) {}

   private:
    friend class Gpt2Tokenizer;
    std::unordered_map<std::string, std::vector<int32_t>> map_;
    size_t max_entries_;
  };

  // Appends the ids of `text` to `out`. Thread-safe for concurrent calls with distinct caches.
  void encode(std::string_view text, std::vector<int32_t>* out, Cache* cache) const;
  std::vector<int32_t> encode(std::string_view text) const;

  // Concatenated bytes of the tokens (may be invalid UTF-8 if cut mid-character).
  // Throws DataError for an id outside the vocabulary.
  std::string decode(const int64_t* ids, size_t n) const;
  std::string decode(const std::vector<int32_t>& ids) const;

  size_t vocab_size() const;
  // Id of "<|endoftext|>" (50256 for GPT-2); -1 if the vocabulary lacks it.
  int32_t eod() const;
  // Id of a token string as spelled in encoder.json, or -1.
  int32_t token_to_id(const std::string& token) const;

 private:
  struct Impl;
  static void load_vocabulary(const std::string& vocab_file, Impl* impl);
  static void load_merges(const std::string& merges_file, Impl* impl);
  void bpe(std::string_view piece, std::vector<int32_t>* out) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtk::text
