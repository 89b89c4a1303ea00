// TikTokenizer: Megatron-LM's tokenizer of tiktoken vocabularies (megatron/core/tokenizers/text/
// libraries/tiktoken_tokenizer.py), the one Megatron's Nemotron and Llama 3 recipes name with
// --tokenizer-type TikTokenizer --tokenizer-model VOCAB.json --tiktoken-pattern v2.
//
// The vocabulary file is a JSON list [{"rank": i, "token_bytes": base64, "token_str": ...}, ...]
// whose first 256 entries are the single bytes in order. Megatron keeps its first
// vocab_size - num_special_tokens entries and shifts every rank up by num_special_tokens: ids
// 0 .. num_special_tokens-1 are the special tokens (<unk> <s> </s> <mask> <pad> <cls> <sep>, then
// <SPECIAL_7> ...), the rest are the kept ranks. Encoding is tiktoken's encode(text,
// allowed_special="all"): special tokens written in the text become their ids; the text between
// them is cut by the v1 or v2 regex (pre_tokenize.hpp) and each piece is one token if it is in
// the vocabulary, else byte-pair merged by rank (the adjacent pair whose bytes have the lowest
// rank first, the leftmost on a tie). EOD is </s>, BOS <s>.
#include <simdjson.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <queue>
#include <set>
#include <tuple>
#include <unordered_map>

#include "dtk/data/error.hpp"
#include "dtk/data/utf8.hpp"
#include "dtk/text/pre_tokenize.hpp"
#include "tokenizers.hpp"

namespace dtk::text {

using data::DataError;

namespace {

// Megatron's SPECIAL_TOKENS (which a custom list must include), DEFAULT_TIKTOKEN_MAX_VOCAB and
// --tiktoken-num-special-tokens's default.
const std::vector<std::string> kRequiredSpecials{"<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"};
constexpr int64_t kDefaultVocabSize = 131072;
constexpr int64_t kDefaultNumSpecialTokens = 1000;

// Standard base64 (what Python's b64decode reads from these files): the bytes, or false.
bool decode_base64(std::string_view in, std::string* out) {
  static const struct Table {
    int8_t v[256];
    Table() {
      std::memset(v, -1, sizeof v);
      const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
      for (int i = 0; i < 64; ++i) v[static_cast<uint8_t>(a[i])] = static_cast<int8_t>(i);
    }
  } table;
  if (in.size() % 4 != 0) return false;
  out->clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t pad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const char c = in[i];
    if (c == '=') {
      if (i + 2 < in.size()) return false;  // '=' only in the last two places
      ++pad;
      continue;
    }
    const int8_t d = table.v[static_cast<uint8_t>(c)];
    if (d < 0 || pad > 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(d);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return true;
}

std::string json_type_name(const simdjson::dom::element& e) {
  switch (e.type()) {
    case simdjson::dom::element_type::ARRAY:
      return "list";
    case simdjson::dom::element_type::OBJECT:
      return "object";
    case simdjson::dom::element_type::STRING:
      return "string";
    case simdjson::dom::element_type::BOOL:
      return "boolean";
    case simdjson::dom::element_type::NULL_VALUE:
      return "null";
    default:
      return "number";
  }
}

class TikTokenizer final : public Tokenizer {
 public:
  explicit TikTokenizer(const TokenizerSpec& spec) : file_(spec.model_file) {
    const std::string pattern = spec.tiktoken_pattern.empty() ? "v2" : spec.tiktoken_pattern;
    if (pattern != "v1" && pattern != "v2")
      throw DataError("TikTokenizer: --tiktoken-pattern must be v1 or v2, got '" + pattern + "'");
    v1_ = pattern == "v1";
    vocab_size_ = spec.vocab_size > 0 ? spec.vocab_size : kDefaultVocabSize;
    num_special_ = spec.tiktoken_num_special_tokens > 0 ? spec.tiktoken_num_special_tokens : kDefaultNumSpecialTokens;
    if (vocab_size_ > std::numeric_limits<int32_t>::max())
      throw DataError("TikTokenizer: --vocab-size " + std::to_string(vocab_size_) +
                      " is above 2^31 - 1 (ids are int32)");
    // Each special id is a string held in memory (<SPECIAL_k>): a million is far past any recipe.
    if (num_special_ > (int64_t{1} << 20))
      throw DataError("TikTokenizer: --tiktoken-num-special-tokens " + std::to_string(num_special_) +
                      " is more than the 2^20 DTK builds (Megatron's default is 1000)");
    check_special_tokens(spec.special_tokens);
    read_vocabulary();  // before the <SPECIAL_k> fillers: the file bounds how many there can be
    set_special_tokens(spec.special_tokens);
  }

  const std::string& type() const override { return type_; }

  void encode(std::string_view text, std::vector<int32_t>* out) const override {
    const size_t bad = data::find_invalid_utf8(text);
    if (bad != std::string_view::npos) throw DataError("invalid UTF-8 at byte " + std::to_string(bad));
    size_t start = 0;
    while (start < text.size()) {
      size_t len = 0;
      int32_t special = -1;
      const size_t at = find_special(text, start, &len, &special);
      const size_t end = at == std::string_view::npos ? text.size() : at;
      encode_ordinary(text.substr(start, end - start), out);
      if (at == std::string_view::npos) break;
      out->push_back(special);
      start = end + len;
    }
  }

  std::string decode(const int32_t* ids, size_t n) const override {
    std::string out;
    for (size_t k = 0; k < n; ++k) {
      const int32_t id = ids[k];
      if (id < 0 || id >= vocab_size_)
        throw DataError("TikTokenizer: id " + std::to_string(id) + " is outside the vocabulary (0.." +
                        std::to_string(vocab_size_ - 1) + ")");
      out += id < num_special_ ? specials_[id] : token_bytes_[id - num_special_];
    }
    return out;
  }

  int64_t vocab_size() const override { return vocab_size_; }
  int32_t eod() const override { return eos_; }
  int32_t bos() const override { return bos_; }

  // After a '\n' followed by an ASCII letter or digit: no piece of either pattern spans that
  // place (the whitespace and punctuation pieces end at the newline run, the letter pieces'
  // optional first code point is never a newline), and no special token does (none has a '\n').
  size_t next_cut(std::string_view text, size_t from) const override {
    if (special_newline_) return std::string_view::npos;
    for (size_t k = from; k + 1 < text.size(); ++k) {
      const void* nl = std::memchr(text.data() + k, '\n', text.size() - k - 1);
      if (nl == nullptr) break;
      k = static_cast<size_t>(static_cast<const char*>(nl) - text.data());
      const char next = text[k + 1];
      const bool alnum = (next >= 'a' && next <= 'z') || (next >= 'A' && next <= 'Z') || (next >= '0' && next <= '9');
      if (alnum && k + 1 > from) return k + 1;
    }
    return std::string_view::npos;
  }

  std::vector<std::string> files() const override { return {file_}; }

  // A tokenizer.json as transformers' TikTokenConverter builds one: the ranks' byte-level
  // spellings as the vocabulary; as merges, for each token in rank order, every split of it into
  // two tokens (ordered by the halves' ranks); the regex as a Split before ByteLevel. Where the
  // converter appends the special tokens after the ranks, here they keep Megatron's ids (first),
  // both in the vocabulary and as added tokens: Hugging Face gives an added token the id the
  // vocabulary has for it, else the next free one. No BOS is added, as Megatron adds none.
  std::string hf_tokenizer_json() const override {
    const uint32_t* alphabet = byte_level_alphabet();
    const auto spelled = [&](std::string_view bytes) {
      std::string s;
      for (char c : bytes) data::append_utf8(alphabet[static_cast<uint8_t>(c)], &s);
      return s;
    };
    const auto quoted = [](const std::string& s) { return nlohmann::json(s).dump(); };
    std::string added, vocab, merges;
    for (size_t id = 0; id < specials_.size(); ++id) {
      const std::string text = quoted(specials_[id]);
      added += std::string(id ? ",\n    " : "") + "{\"id\": " + std::to_string(id) + ", \"content\": " + text +
               ", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, "
               "\"special\": true}";
      vocab += std::string(id ? ",\n      " : "") + text + ": " + std::to_string(id);
    }
    std::vector<std::pair<int32_t, int32_t>> splits;
    for (size_t rank = 0; rank < token_bytes_.size(); ++rank) {
      const std::string& t = token_bytes_[rank];
      const std::string spelling = spelled(t);
      // A rank spelled as a special token is left out: encoding never reaches it (the special
      // token is split out of the text first), and a vocabulary key cannot hold two ids.
      if (special_ids_.count(spelling) == 0)
        vocab += ",\n      " + quoted(spelling) + ": " + std::to_string(rank + num_special_);
      splits.clear();
      for (size_t k = 1; k < t.size(); ++k) {
        const int32_t left = rank_of(std::string_view(t).substr(0, k)), right = rank_of(std::string_view(t).substr(k));
        if (left >= 0 && right >= 0) splits.emplace_back(left, right);
      }
      std::sort(splits.begin(), splits.end());
      for (const auto& [left, right] : splits) {
        // "A B": byte-level spellings hold no space.
        const std::string merge =
            spelled(token_bytes_[left - num_special_]) + " " + spelled(token_bytes_[right - num_special_]);
        merges += std::string(merges.empty() ? "" : ",\n      ") + quoted(merge);
      }
    }
    const std::string pattern = nlohmann::json(v1_ ? kTiktokenV1Pattern : kTiktokenV2Pattern).dump();
    return "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [\n    " +
           added +
           "\n  ],\n  \"normalizer\": null,\n  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [\n"
           "    {\"type\": \"Split\", \"pattern\": {\"Regex\": " +
           pattern +
           "}, \"behavior\": \"Isolated\", \"invert\": false},\n"
           "    {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": "
           "false}]},\n"
           "  \"post_processor\": null,\n"
           "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, "
           "\"use_regex\": true},\n"
           "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": "
           "null, \"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": "
           "true,\n    \"vocab\": {\n      " +
           vocab + "\n    },\n    \"merges\": [\n      " + merges + "\n    ]\n  }\n}\n";
  }

 private:
  // Megatron's special tokens: the given list (or its default seven), then <SPECIAL_k> fillers
  // up to num_special_tokens, each id its place in that list.
  void check_special_tokens(const std::vector<std::string>& given) const {
    const std::vector<std::string>& base = given.empty() ? kRequiredSpecials : given;
    for (const std::string& t : kRequiredSpecials)
      if (std::find(base.begin(), base.end(), t) == base.end())
        throw DataError("TikTokenizer: --tokenizer-special-tokens must include " + t +
                        " (Megatron requires <unk> <s> </s> <mask> <pad> <cls> <sep>)");
    if (static_cast<int64_t>(base.size()) > num_special_ || num_special_ >= vocab_size_)
      throw DataError("TikTokenizer: needs len(special tokens) " + std::to_string(base.size()) +
                      " <= --tiktoken-num-special-tokens " + std::to_string(num_special_) + " < --vocab-size " +
                      std::to_string(vocab_size_) + " (Megatron asserts the same)");
    for (const std::string& t : base) {
      if (t.empty()) throw DataError("TikTokenizer: a special token is empty");
      if (data::find_invalid_utf8(t) != std::string::npos)
        throw DataError("TikTokenizer: a special token is not valid UTF-8");
    }
  }

  void set_special_tokens(const std::vector<std::string>& given) {
    specials_ = given.empty() ? kRequiredSpecials : given;
    for (int64_t k = static_cast<int64_t>(specials_.size()); k < num_special_; ++k)
      specials_.push_back("<SPECIAL_" + std::to_string(k) + ">");
    for (size_t id = 0; id < specials_.size(); ++id) {
      const std::string& t = specials_[id];
      if (!special_ids_.emplace(t, static_cast<int32_t>(id)).second)
        throw DataError("TikTokenizer: special token '" + t + "' is given twice (they must be unique)");
      special_first_byte_[static_cast<uint8_t>(t[0])] = true;
      special_lengths_.insert(t.size());
      special_newline_ = special_newline_ || t.find('\n') != std::string::npos;
    }
    auto index = [&](const char* t) { return special_ids_.at(t); };
    bos_ = index("<s>");
    eos_ = index("</s>");
  }

  // Megatron's reload_mergeable_ranks(), with its assertions as one-line errors.
  void read_vocabulary() {
    const std::string where = "TikTokenizer: '" + file_ + "'";
    std::error_code ec;
    if (file_.empty()) throw DataError("TikTokenizer needs --tokenizer-model (the vocabulary's .json file)");
    if (!std::filesystem::is_regular_file(file_, ec)) throw DataError(where + " is not a file");
    if (std::filesystem::path(file_).extension() != ".json")
      throw DataError(where + ": the vocabulary must be a .json file (Megatron asserts the name ends in .json)");
    // simdjson: a 13 MB vocabulary (o200k_base) loads in a tenth of nlohmann::json's time.
    simdjson::dom::parser parser;
    simdjson::dom::element root;
    if (const auto err = parser.load(file_).get(root))
      throw DataError(where + " is not valid JSON: " + simdjson::error_message(err));
    simdjson::dom::array list;
    if (root.get_array().get(list))
      throw DataError(where + " holds a JSON " + json_type_name(root) + ", not a list of tokens");
    const int64_t kept = vocab_size_ - num_special_;
    if (kept < 256)
      throw DataError("TikTokenizer: --vocab-size " + std::to_string(vocab_size_) + " leaves " + std::to_string(kept) +
                      " tokens beside " + std::to_string(num_special_) +
                      " special ones; the 256 single bytes at least are needed");
    // Each entry first (as Megatron asserts them), then the count.
    const int64_t size = static_cast<int64_t>(list.size());
    const int64_t read = std::min<int64_t>(kept, size);
    token_bytes_.resize(static_cast<size_t>(read));
    ranks_.reserve(static_cast<size_t>(read) * 2);
    std::string bytes;
    int64_t i = 0;
    for (simdjson::dom::element e : list) {
      if (i == read) break;
      const std::string entry = where + ": entry " + std::to_string(i);
      simdjson::dom::object o;
      if (e.get_object().get(o) || o.size() != 3 || o["rank"].error() || o["token_bytes"].error() ||
          o["token_str"].error())
        throw DataError(entry + " is not {\"rank\", \"token_bytes\", \"token_str\"}");
      int64_t rank = -1;
      if (o["rank"].get_int64().get(rank) || rank != i)
        throw DataError(entry + " has rank " + simdjson::minify(o["rank"].value_unsafe()) +
                        " (the ranks must be 0, 1, 2, ... in order)");
      std::string_view b64;
      if (o["token_bytes"].get_string().get(b64) || !decode_base64(b64, &bytes) || bytes.empty())
        throw DataError(entry + ": token_bytes is not a non-empty base64 string");
      if (i < 256 && (bytes.size() != 1 || static_cast<uint8_t>(bytes[0]) != i))
        throw DataError(entry + " must be the single byte " + std::to_string(i) +
                        " (the first 256 tokens are the bytes in order)");
      if (!ranks_.emplace(bytes, static_cast<int32_t>(i + num_special_)).second)
        throw DataError(entry + " repeats the bytes of an earlier token");
      token_bytes_[static_cast<size_t>(i)] = bytes;
      ++i;
    }
    if (read < kept)
      throw DataError(where + " has " + std::to_string(size) + " tokens; --vocab-size " + std::to_string(vocab_size_) +
                      " with " + std::to_string(num_special_) + " special tokens needs " + std::to_string(kept) +
                      " (give a smaller --vocab-size)");
  }

  // The first special token at or after byte `from`: its position (npos: none), its length and
  // id. At one position the longest special token wins (tiktoken's choice there follows a hash
  // order; Megatron's default tokens never overlap so).
  size_t find_special(std::string_view text, size_t from, size_t* len, int32_t* id) const {
    *len = 0;
    for (size_t p = from; p < text.size(); ++p) {
      if (!special_first_byte_[static_cast<uint8_t>(text[p])]) continue;
      for (auto l = special_lengths_.rbegin(); l != special_lengths_.rend(); ++l) {
        if (*l > text.size() - p) continue;
        auto it = special_ids_.find(std::string(text.substr(p, *l)));
        if (it != special_ids_.end()) {
          *len = *l;
          *id = it->second;
          return p;
        }
      }
    }
    return std::string_view::npos;
  }

  void encode_ordinary(std::string_view text, std::vector<int32_t>* out) const {
    if (text.empty()) return;
    std::vector<std::string_view> pieces;
    v1_ ? tiktoken_v1_pre_tokenize(text, &pieces) : tiktoken_v2_pre_tokenize(text, &pieces);
    for (std::string_view p : pieces) encode_piece(p, out);
  }

  // tiktoken: a piece that is a token is that token; else its byte-pair merge. Cached per thread
  // and per tokenizer (encode() stays const and thread-safe).
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
    // The per-thread cache first: it is small and hot, where the vocabulary's table is not.
    thread_local std::string key;
    thread_local uint64_t owner = 0;
    thread_local std::unordered_map<std::string, std::vector<int32_t>> cache;
    if (owner != serial_) cache.clear(), owner = serial_;
    key.assign(piece.data(), piece.size());
    if (auto it = cache.find(key); it != cache.end())
      return out->insert(out->end(), it->second.begin(), it->second.end()), void();
    std::vector<int32_t> ids;
    if (auto it = ranks_.find(key); it != ranks_.end())
      ids.push_back(it->second);
    else
      byte_pair_merge(piece, &ids);
    out->insert(out->end(), ids.begin(), ids.end());
    if (piece.size() < 256) {
      if (cache.size() >= (1u << 20)) cache.clear();
      cache.emplace(key, std::move(ids));
    }
  }

  int32_t rank_of(std::string_view bytes) const {
    thread_local std::string key;
    key.assign(bytes.data(), bytes.size());
    auto it = ranks_.find(key);
    return it == ranks_.end() ? -1 : it->second;
  }

  // tiktoken's byte_pair_merge: while some adjacent pair of parts is a token, merge the pair with
  // the lowest rank (the leftmost of equal ranks). A min-heap of (rank, left start, pair end);
  // an entry whose parts have changed since is skipped.
  void byte_pair_merge(std::string_view piece, std::vector<int32_t>* out) const {
    const size_t n = piece.size();
    std::vector<size_t> next(n + 1), prev(n + 1);
    std::vector<bool> alive(n + 1, true);
    for (size_t i = 0; i <= n; ++i) next[i] = i + 1, prev[i] = i == 0 ? 0 : i - 1;
    using Entry = std::tuple<int32_t, size_t, size_t>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    const auto push = [&](size_t i) {
      if (i >= n || next[i] >= n) return;
      const size_t end = next[next[i]];
      const int32_t r = rank_of(piece.substr(i, end - i));
      if (r >= 0) heap.emplace(r, i, end);
    };
    for (size_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const auto [rank, i, end] = heap.top();
      heap.pop();
      if (!alive[i] || next[i] >= n || next[next[i]] != end) continue;  // stale
      const size_t right = next[i];
      alive[right] = false;
      next[i] = next[right];
      if (next[i] <= n) prev[next[i]] = i;
      if (i > 0) push(prev[i]);
      push(i);
      (void)rank;
    }
    for (size_t i = 0; i < n; i = next[i]) out->push_back(rank_of(piece.substr(i, next[i] - i)));
  }

  const std::string type_ = "TikTokenizer";
  const uint64_t serial_ = next_tokenizer_serial();
  std::string file_;
  bool v1_ = false;
  int64_t vocab_size_ = 0, num_special_ = 0;
  std::vector<std::string> specials_;
  std::unordered_map<std::string, int32_t> special_ids_;
  bool special_first_byte_[256] = {};
  std::set<size_t> special_lengths_;
  bool special_newline_ = false;
  int32_t bos_ = -1, eos_ = -1;
  std::unordered_map<std::string, int32_t> ranks_;  // token bytes -> id (rank + num_special)
  std::vector<std::string> token_bytes_;            // rank -> token bytes
};

}  // namespace

std::unique_ptr<Tokenizer> make_tiktoken_tokenizer(const TokenizerSpec& spec) {
  return std::make_unique<TikTokenizer>(spec);
}

}  // namespace dtk::text
