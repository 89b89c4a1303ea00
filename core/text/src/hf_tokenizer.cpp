// HuggingFaceTokenizer: a tokenizer.json whose model is BPE, read and run without the Hugging Face
// library. Two families are implemented, and anything else in the file is refused by name:
//  * byte-level BPE (Llama 3, Qwen2/Qwen3, GPT-2 style): pre_tokenizer ByteLevel (GPT-2's regex)
//    or Sequence[Split(Llama 3's regex, Qwen2's, GPT-2's, or Megatron TikTokenizer's v1/v2,
//    Isolated), ByteLevel(use_regex false)] (what `dtk export hf` writes for a TikTokenizer),
//    optionally after an NFC normalizer (Qwen's; dtk/text/normalize.hpp);
//  * SentencePiece-style BPE (Llama 2, Mistral): normalizer Prepend("▁") + Replace(" ", "▁") or
//    pre_tokenizer Metaspace; byte_fallback for characters outside the vocabulary.
// Added tokens are split out of the text first (leftmost, longest), as Hugging Face does; merges
// apply lowest rank first, leftmost on ties (its priority-queue BPE); `ignore_merges` takes a
// whole piece that is itself in the vocabulary. A post_processor template (TemplateProcessing)
// gives the ids put around every text; tokenizer_config.json next to the file names BOS/EOS.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <queue>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "dtk/data/error.hpp"
#include "dtk/data/utf8.hpp"
#include "dtk/text/normalize.hpp"
#include "dtk/text/pre_tokenize.hpp"
#include "tokenizers.hpp"

namespace dtk::text {
namespace {

using data::DataError;
using nlohmann::json;
namespace fs = std::filesystem;

const char* const kMetaspace = "\xE2\x96\x81";  // U+2581 "▁", SentencePiece's space

json read_json(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw DataError("cannot open '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    throw DataError("'" + path + "': invalid JSON: " + e.what());
  }
}

// j[key], or null where j is not an object or has no such key. (The const operator[] of
// nlohmann::json does not check: a missing key reads past the map.)
const json& member(const json& j, const char* key) {
  static const json kNull;
  if (!j.is_object()) return kNull;
  const auto it = j.find(key);
  return it == j.end() ? kNull : *it;
}

std::string type_of(const json& j) {
  const json& t = member(j, "type");
  return t.is_string() ? t.get<std::string>() : "";
}

// A tokenizer_config.json token entry: "text" or {"content": "text", ...}.
std::string token_text(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) return j["content"].get<std::string>();
  return "";
}

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

struct AddedToken {
  std::string content;
  int32_t id;
  bool lstrip, rstrip;
};

class HfTokenizer final : public Tokenizer {
 public:
  explicit HfTokenizer(const std::string& path) {
    file_ = fs::is_directory(path) ? (fs::path(path) / "tokenizer.json").string() : path;
    if (!fs::is_regular_file(file_)) throw DataError("HuggingFaceTokenizer: no tokenizer.json at '" + path + "'");
    const json t = read_json(file_);
    where_ = "tokenizer.json '" + file_ + "'";
    check(t.is_object(), "not a JSON object");
    try {  // a field of the wrong JSON type anywhere: one line naming the file
      const json& added = member(t, "added_tokens");
      // Ids may leave holes (tiktoken conversions put their specials past a gap), but not by more
      // than 2^20: a huge id would size the tables by it (std::bad_alloc, or gigabytes).
      id_limit_ =
          static_cast<int64_t>(member(member(t, "model"), "vocab").size() + (added.is_array() ? added.size() : 0)) +
          (int64_t{1} << 20);
      read_model(member(t, "model"));
      read_added_tokens(added.is_null() ? json::array() : added);
      read_normalizer(member(t, "normalizer"));
      read_pre_tokenizer(member(t, "pre_tokenizer"));
      read_post_processor(member(t, "post_processor"));
      read_decoder(member(t, "decoder"));
    } catch (const json::exception& e) {
      throw DataError(where_ + ": a field has the wrong JSON type: " + e.what());
    }
    read_config(fs::path(file_).parent_path() / "tokenizer_config.json");
  }

  const std::string& type() const override { return type_; }
  const std::vector<int32_t>& text_prefix() const override { return prefix_; }
  const std::vector<int32_t>& text_suffix() const override { return suffix_; }
  int64_t vocab_size() const override { return vocab_size_; }
  int32_t eod() const override { return eos_; }
  int32_t bos() const override { return bos_; }
  std::vector<std::string> files() const override {
    std::vector<std::string> f{file_};
    if (!config_file_.empty()) f.push_back(config_file_);
    return f;
  }

  void encode(std::string_view text, std::vector<int32_t>* out) const override {
    const size_t bad = data::find_invalid_utf8(text);
    if (bad != std::string_view::npos) throw DataError("invalid UTF-8 at byte " + std::to_string(bad));
    size_t pos = 0;
    bool first = true;
    while (pos <= text.size()) {
      size_t at = text.size(), len = 0;
      const AddedToken* tok = find_added(text, pos, &at, &len);
      size_t seg_end = at;
      if (tok && tok->lstrip) seg_end = strip_back(text, pos, at);
      encode_segment(text.substr(pos, seg_end - pos), first && pos == 0, out);
      first = false;
      if (!tok) break;
      out->push_back(tok->id);
      pos = at + len;
      if (tok->rstrip) pos = strip_front(text, pos);
    }
  }

  std::string decode(const int32_t* ids, size_t n) const override {
    std::string text;
    for (size_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= vocab_size_)
        throw DataError("cannot decode token id " + std::to_string(ids[i]) + ": outside the vocabulary of " +
                        std::to_string(vocab_size_));
      text += token_bytes_[static_cast<size_t>(ids[i])];
    }
    // The SentencePiece-style decoder ends with Strip(" ", 1, 0): one leading space goes.
    if (metaspace_ && prepend_metaspace_ && !text.empty() && text[0] == ' ') text.erase(0, 1);
    return text;
  }

  size_t next_cut(std::string_view text, size_t from) const override {
    if (metaspace_ || add_prefix_space_ || added_newline_) return std::string_view::npos;
    for (size_t k = from; k + 1 < text.size(); ++k) {
      const void* nl = std::memchr(text.data() + k, '\n', text.size() - k - 1);
      if (nl == nullptr) break;
      k = static_cast<size_t>(static_cast<const char*>(nl) - text.data());
      const unsigned char next = static_cast<unsigned char>(text[k + 1]);
      // GPT-2's regex: before a '\n' followed by printable ASCII. Llama 3's and TikTokenizer's:
      // after a '\n' followed by an ASCII letter (no alternative takes a letter after a newline,
      // and every piece holding the newline ends there).
      if (pre_ == Pre::kGpt2 && next >= 0x21 && next <= 0x7e && k > from) return k;
      const bool letter = (next >= 'a' && next <= 'z') || (next >= 'A' && next <= 'Z');
      if (pre_ != Pre::kGpt2 && letter) return k + 1;
    }
    return std::string_view::npos;
  }

 private:
  enum class Pre { kNone, kGpt2, kLlama3, kQwen2, kTiktokenV1, kTiktokenV2 };

  [[noreturn]] void refuse(const std::string& what) const {
    throw DataError(where_ + ": " + what + " is not implemented by DTK's HuggingFaceTokenizer");
  }
  void check(bool ok, const std::string& what) const {
    if (!ok) throw DataError(where_ + ": " + what);
  }

  void read_model(const json& m) {
    check(m.is_object(), "no \"model\"");
    if (type_of(m) != "BPE") refuse("model type '" + type_of(m) + "'");
    if (!m.value("dropout", json()).is_null()) refuse("BPE dropout");
    // "" (what Qwen's tokenizer.json writes) is no affix.
    const auto affix = [&](const char* key) {
      const json a = m.value(key, json());
      return !a.is_null() && !(a.is_string() && a.get<std::string>().empty());
    };
    if (affix("continuing_subword_prefix") || affix("end_of_word_suffix"))
      refuse("a continuing_subword_prefix / end_of_word_suffix");
    byte_fallback_ = m.value("byte_fallback", false);
    ignore_merges_ = m.value("ignore_merges", false);
    fuse_unk_ = m.value("fuse_unk", false);
    const json& vocab = member(m, "vocab");
    check(vocab.is_object() && !vocab.empty(), "model.vocab is not a non-empty object");
    int64_t max_id = -1;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      check(it.value().is_number_integer() && it.value().get<int64_t>() >= 0 && it.value().get<int64_t>() < id_limit_,
            "model.vocab['" + it.key() + "'] is not an id below " + std::to_string(id_limit_) +
                " (the number of vocabulary and added tokens, plus 2^20)");
      const int32_t id = it.value().get<int32_t>();
      vocab_[it.key()] = id;
      max_id = std::max<int64_t>(max_id, id);
    }
    token_text_.assign(static_cast<size_t>(max_id + 1), std::string());
    for (const auto& kv : vocab_) token_text_[static_cast<size_t>(kv.second)] = kv.first;
    if (member(m, "unk_token").is_string()) {
      auto it = vocab_.find(member(m, "unk_token").get<std::string>());
      unk_ = it == vocab_.end() ? -1 : it->second;
    }
    read_merges(member(m, "merges").is_null() ? json::array() : member(m, "merges"));
    if (byte_fallback_) {
      for (int b = 0; b < 256; ++b) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", b);
        auto it = vocab_.find(name);
        check(it != vocab_.end(), std::string("byte_fallback without the byte token ") + name);
        byte_token_[b] = it->second;
      }
    }
  }

  // "a b" strings (tokenizers < 0.20) or ["a", "b"] pairs; the line number is the rank.
  void read_merges(const json& merges) {
    check(merges.is_array(), "model.merges is not a list");
    int32_t rank = 0;
    for (const json& mg : merges) {
      std::string a, b;
      if (mg.is_string()) {
        const std::string s = mg.get<std::string>();
        const size_t sp = s.find(' ', 1);
        check(sp != std::string::npos, "merge '" + s + "' is not two tokens");
        a = s.substr(0, sp), b = s.substr(sp + 1);
      } else {
        check(mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string(), "a merge is not two tokens");
        a = mg[0].get<std::string>(), b = mg[1].get<std::string>();
      }
      auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
      check(ia != vocab_.end() && ib != vocab_.end() && iab != vocab_.end(),
            "merge '" + a + " " + b + "' has a token outside the vocabulary");
      merges_.emplace(pair_key(ia->second, ib->second), std::make_pair(rank++, iab->second));
    }
  }

  void read_added_tokens(const json& added) {
    check(added.is_array(), "added_tokens is not a list");
    vocab_size_ = static_cast<int64_t>(token_text_.size());
    for (const json& a : added) {
      check(a.is_object(), "an added token is not an object: " + a.dump().substr(0, 80));
      const json& id = member(a, "id");
      check(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < id_limit_,
            "added token " + a.dump().substr(0, 80) + " has no id below " + std::to_string(id_limit_) +
                " (the number of vocabulary and added tokens, plus 2^20)");
      AddedToken t{a.value("content", std::string()), id.get<int32_t>(), a.value("lstrip", false),
                   a.value("rstrip", false)};
      check(!t.content.empty(), "an added token without content");
      if (a.value("single_word", false)) refuse("added token '" + t.content + "' with single_word");
      if (a.value("normalized", false) && !a.value("special", false))
        refuse("normalized added token '" + t.content + "'");
      added_newline_ = added_newline_ || t.content.find('\n') != std::string::npos;
      vocab_size_ = std::max<int64_t>(vocab_size_, t.id + 1);
      added_.push_back(t);
      added_by_text_[t.content] = t.id;
    }
    // Longest first, so that the earliest occurrence of the longest token wins.
    std::stable_sort(added_.begin(), added_.end(),
                     [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
    for (const AddedToken& t : added_) added_first_bytes_[static_cast<uint8_t>(t.content[0])] = true;
    // What each id spells when decoding.
    const uint32_t* alphabet = byte_level_alphabet();
    for (int b = 0; b < 256; ++b) byte_of_char_[alphabet[b]] = static_cast<uint8_t>(b);
    token_bytes_.assign(static_cast<size_t>(vocab_size_), std::string());
    for (size_t id = 0; id < token_text_.size(); ++id) token_bytes_[id] = token_text_[id];
    for (const AddedToken& t : added_) token_bytes_[static_cast<size_t>(t.id)] = t.content;
  }

  void read_normalizer(const json& n) {
    if (n.is_null()) return;
    // Llama 2's: Sequence[Prepend("▁"), Replace(" ", "▁")].
    const json parts = type_of(n) == "Sequence" ? member(n, "normalizers") : json::array({n});
    for (const json& p : parts) {
      const std::string ty = type_of(p);
      if (ty == "NFC") {
        nfc_ = true;
      } else if (ty == "Prepend" && p.value("prepend", std::string()) == kMetaspace) {
        prepend_metaspace_ = true;
      } else if (ty == "Replace" && member(member(p, "pattern"), "String") == " " &&
                 p.value("content", std::string()) == kMetaspace) {
        metaspace_ = true;
      } else {
        refuse("normalizer '" + p.dump().substr(0, 80) + "'");
      }
    }
    if (prepend_metaspace_ && !metaspace_) refuse("a Prepend normalizer without Replace(' ', '▁')");
  }

  void read_pre_tokenizer(const json& p) {
    if (p.is_null()) {
      if (!metaspace_) refuse("a BPE without a pre_tokenizer or a SentencePiece-style normalizer");
      return;
    }
    const std::string ty = type_of(p);
    if (ty == "ByteLevel") {
      if (!p.value("use_regex", true)) refuse("ByteLevel pre_tokenizer without its regex and without a Split");
      pre_ = Pre::kGpt2;
      add_prefix_space_ = p.value("add_prefix_space", false);
      return;
    }
    if (ty == "Metaspace") {
      if (p.value("replacement", std::string(kMetaspace)) != kMetaspace) refuse("a Metaspace replacement other than ▁");
      if (p.value("split", false)) refuse("Metaspace with split: true");
      const std::string scheme = p.value("prepend_scheme", std::string(p.value("add_prefix_space", true) ? "always" : "never"));
      if (scheme != "always" && scheme != "first" && scheme != "never") refuse("Metaspace prepend_scheme '" + scheme + "'");
      metaspace_ = true;
      prepend_metaspace_ = scheme != "never";
      prepend_first_only_ = scheme == "first";
      return;
    }
    const json steps = ty == "Sequence" ? member(p, "pretokenizers") : json::array();
    const bool split_then_bytes = steps.is_array() && steps.size() == 2 && type_of(steps[0]) == "Split" &&
                                  type_of(steps[1]) == "ByteLevel" && !steps[1].value("use_regex", true) &&
                                  !steps[1].value("add_prefix_space", false);
    if (!split_then_bytes) refuse("pre_tokenizer '" + p.dump().substr(0, 120) + "'");
    const json& split = steps[0];
    const json& regex = member(member(split, "pattern"), "Regex");
    const std::string pattern = regex.is_string() ? regex.get<std::string>() : "";
    if (split.value("behavior", std::string()) != "Isolated" || split.value("invert", false))
      refuse("a Split pre_tokenizer that is not Isolated");
    if (pattern == kLlama3PreTokenizePattern)
      pre_ = Pre::kLlama3;
    else if (pattern == kQwen2PreTokenizePattern)
      pre_ = Pre::kQwen2;
    else if (pattern == kGpt2PreTokenizePattern)
      pre_ = Pre::kGpt2;
    else if (pattern == kTiktokenV1Pattern)
      pre_ = Pre::kTiktokenV1;
    else if (pattern == kTiktokenV2Pattern)
      pre_ = Pre::kTiktokenV2;
    else
      refuse("the Split regex " + pattern +
             " (DTK has Llama 3's, Qwen2's, GPT-2's and Megatron TikTokenizer's v1 and v2)");
  }

  // TemplateProcessing's "single": special tokens before and after the text ($A).
  void read_post_processor(const json& p) {
    if (p.is_null()) return;
    const std::string ty = type_of(p);
    if (ty == "Sequence") {
      for (const json& step : member(p, "processors")) read_post_processor(step);
      return;
    }
    if (ty == "ByteLevel") return;  // offsets only
    if (ty != "TemplateProcessing") refuse("post_processor '" + ty + "'");
    bool after = false;
    const json& single = member(p, "single");
    check(single.is_array(), "post_processor TemplateProcessing has no \"single\" template");
    for (const json& item : single) {
      if (item.contains("Sequence")) {
        after = true;
        continue;
      }
      const json& token = member(member(item, "SpecialToken"), "id");
      check(token.is_string(), "post_processor template item " + item.dump().substr(0, 80) + " is not a SpecialToken");
      const std::string name = token.get<std::string>();
      const json& ids = member(member(member(p, "special_tokens"), name.c_str()), "ids");
      check(ids.is_array(), "post_processor special token '" + name + "' has no ids");
      for (const json& id : ids) {
        // Put around every document: an id outside the vocabulary would be written into each one.
        check(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < vocab_size_,
              "post_processor special token '" + name + "' has id " + id.dump() + ", outside the vocabulary of " +
                  std::to_string(vocab_size_));
        (after ? suffix_ : prefix_).push_back(id.get<int32_t>());
      }
    }
  }

  void read_decoder(const json& d) {
    const std::string ty = type_of(d);
    if (ty == "ByteLevel" && !metaspace_) {
      for (auto& text : token_bytes_) text = from_byte_level(text);
      for (const AddedToken& t : added_) token_bytes_[static_cast<size_t>(t.id)] = t.content;
      return;
    }
    if (metaspace_ && (ty == "Sequence" || ty == "Metaspace")) {  // ▁ -> ' ', <0xNN> -> byte
      for (size_t id = 0; id < token_text_.size(); ++id) {
        std::string& text = token_bytes_[id];
        for (size_t at = text.find(kMetaspace); at != std::string::npos; at = text.find(kMetaspace, at + 1))
          text.replace(at, 3, " ");
      }
      if (byte_fallback_)
        for (int b = 0; b < 256; ++b) token_bytes_[static_cast<size_t>(byte_token_[b])] = std::string(1, static_cast<char>(b));
      for (const AddedToken& t : added_) token_bytes_[static_cast<size_t>(t.id)] = t.content;
      return;
    }
    refuse("decoder '" + d.dump().substr(0, 80) + "'");
  }

  // tokenizer_config.json: bos_token / eos_token by name (Megatron's eod is eos_token_id).
  void read_config(const fs::path& path) {
    if (fs::is_regular_file(path)) {
      config_file_ = path.string();
      const json c = read_json(config_file_);
      bos_ = id_of(token_text(member(c, "bos_token")));
      eos_ = id_of(token_text(member(c, "eos_token")));
    }
    // Without a config: the usual names of the end-of-text token.
    for (const char* name : {"<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"})
      if (eos_ < 0) eos_ = id_of(name);
    for (const char* name : {"<|begin_of_text|>", "<s>", "<bos>"})
      if (bos_ < 0) bos_ = id_of(name);
  }
  int32_t id_of(const std::string& text) const {
    if (text.empty()) return -1;
    auto a = added_by_text_.find(text);
    if (a != added_by_text_.end()) return a->second;
    auto v = vocab_.find(text);
    return v == vocab_.end() ? -1 : v->second;
  }

  std::string from_byte_level(const std::string& token) const {
    std::string bytes;
    for (size_t i = 0; i < token.size();) {
      uint32_t cp = 0;
      const size_t len = data::decode_utf8(token, i, &cp);
      auto it = len ? byte_of_char_.find(cp) : byte_of_char_.end();
      if (it == byte_of_char_.end()) return token;  // not byte-level: spell as is
      bytes.push_back(static_cast<char>(it->second));
      i += len;
    }
    return bytes;
  }

  // The leftmost added token at or after pos (longest at that place).
  const AddedToken* find_added(std::string_view text, size_t pos, size_t* at, size_t* len) const {
    if (added_.empty()) return nullptr;
    for (size_t i = pos; i < text.size(); ++i) {
      if (!added_first_bytes_[static_cast<uint8_t>(text[i])]) continue;
      for (const AddedToken& t : added_) {
        if (text.compare(i, t.content.size(), t.content) == 0) {
          *at = i, *len = t.content.size();
          return &t;
        }
      }
    }
    return nullptr;
  }
  static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }
  static size_t strip_back(std::string_view s, size_t lo, size_t at) {
    while (at > lo && is_space(s[at - 1])) --at;
    return at;
  }
  static size_t strip_front(std::string_view s, size_t pos) {
    while (pos < s.size() && is_space(s[pos])) ++pos;
    return pos;
  }

  // One stretch of text between added tokens: normalize, pre-tokenize, BPE each piece.
  void encode_segment(std::string_view seg, bool at_text_start, std::vector<int32_t>* out) const {
    if (seg.empty()) return;
    std::string normalized;
    if (nfc_) seg = nfc(seg, &normalized);
    if (metaspace_) {
      std::string s;
      if (prepend_metaspace_ && (!prepend_first_only_ || at_text_start)) s = kMetaspace;
      for (char c : seg) c == ' ' ? s += kMetaspace : s += c;
      return bpe_chars(s, out);
    }
    std::string spaced;
    if (add_prefix_space_ && seg[0] != ' ') seg = spaced = " " + std::string(seg);
    std::vector<std::string_view> pieces;
    pre_tokenize(seg, &pieces);
    std::string mapped;
    const uint32_t* alphabet = byte_level_alphabet();
    for (std::string_view p : pieces) {
      mapped.clear();
      for (char c : p) data::append_utf8(alphabet[static_cast<uint8_t>(c)], &mapped);
      bpe_cached(mapped, out);
    }
  }

  void pre_tokenize(std::string_view seg, std::vector<std::string_view>* pieces) const {
    switch (pre_) {
      case Pre::kLlama3:
        return llama3_pre_tokenize(seg, pieces);
      case Pre::kQwen2:
        return qwen2_pre_tokenize(seg, pieces);
      case Pre::kTiktokenV1:
        return tiktoken_v1_pre_tokenize(seg, pieces);
      case Pre::kTiktokenV2:
        return tiktoken_v2_pre_tokenize(seg, pieces);
      default:
        return gpt2_pre_tokenize(seg, pieces);
    }
  }

  void bpe_cached(const std::string& word, std::vector<int32_t>* out) const {
    thread_local uint64_t owner = 0;
    thread_local std::unordered_map<std::string, std::vector<int32_t>> cache;
    if (owner != serial_) cache.clear(), owner = serial_;
    auto it = cache.find(word);
    if (it != cache.end()) return out->insert(out->end(), it->second.begin(), it->second.end()), void();
    std::vector<int32_t> ids;
    bpe_chars(word, &ids);
    out->insert(out->end(), ids.begin(), ids.end());
    if (word.size() < 256) {
      if (cache.size() >= (1u << 20)) cache.clear();
      cache.emplace(word, std::move(ids));
    }
  }

  // BPE over the characters of `word`: Hugging Face's Word::merge_all (a min-heap of
  // (rank, position), stale entries skipped) after the whole-word lookup of ignore_merges.
  void bpe_chars(const std::string& word, std::vector<int32_t>* out) const {
    if (ignore_merges_) {
      auto it = vocab_.find(word);
      if (it != vocab_.end()) return out->push_back(it->second);
    }
    std::vector<int32_t> sym;
    for (size_t i = 0; i < word.size();) {
      uint32_t cp = 0;
      size_t len = data::decode_utf8(word, i, &cp);
      if (len == 0) len = 1;
      auto it = vocab_.find(word.substr(i, len));
      if (it != vocab_.end()) {
        sym.push_back(it->second);
      } else if (byte_fallback_) {
        for (size_t k = 0; k < len; ++k) sym.push_back(byte_token_[static_cast<uint8_t>(word[i + k])]);
      } else if (unk_ >= 0) {
        if (!(fuse_unk_ && !sym.empty() && sym.back() == unk_)) sym.push_back(unk_);
      } else {
        throw DataError(where_ + ": the character at byte " + std::to_string(i) + " of a piece has no token");
      }
      i += len;
    }
    merge_all(&sym);
    out->insert(out->end(), sym.begin(), sym.end());
  }

  void merge_all(std::vector<int32_t>* symbols) const {
    std::vector<int32_t>& s = *symbols;
    const size_t n = s.size();
    if (n < 2) return;
    std::vector<int64_t> prev(n), next(n);
    for (size_t i = 0; i < n; ++i) prev[i] = static_cast<int64_t>(i) - 1, next[i] = i + 1 < n ? static_cast<int64_t>(i + 1) : -1;
    std::vector<bool> alive(n, true);
    using Entry = std::tuple<int32_t, int64_t, int32_t, int32_t>;  // rank, left position, left id, right id
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    const auto push = [&](int64_t i) {
      if (i < 0 || next[i] < 0) return;
      auto m = merges_.find(pair_key(s[i], s[next[i]]));
      if (m != merges_.end()) heap.emplace(m->second.first, i, s[i], s[next[i]]);
    };
    for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int64_t>(i));
    while (!heap.empty()) {
      const auto [rank, i, left, right] = heap.top();
      heap.pop();
      const int64_t j = next[i];
      if (!alive[i] || j < 0 || s[i] != left || s[j] != right) continue;  // stale
      s[i] = merges_.at(pair_key(left, right)).second;
      alive[j] = false;
      next[i] = next[j];
      if (next[j] >= 0) prev[next[j]] = i;
      push(prev[i]);
      push(i);
      (void)rank;
    }
    std::vector<int32_t> merged;
    for (int64_t i = 0; i >= 0; i = next[i]) merged.push_back(s[i]);
    s.swap(merged);
  }

  const std::string type_ = "HuggingFaceTokenizer";
  const uint64_t serial_ = next_tokenizer_serial();
  std::string file_, config_file_, where_;
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> token_text_;   // id -> its vocabulary spelling
  std::vector<std::string> token_bytes_;  // id -> the bytes it decodes to
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // (left, right) -> (rank, merged)
  std::unordered_map<uint32_t, uint8_t> byte_of_char_;
  std::vector<AddedToken> added_;
  std::unordered_map<std::string, int32_t> added_by_text_;
  bool added_first_bytes_[256] = {};
  bool added_newline_ = false;
  int64_t vocab_size_ = 0;
  int64_t id_limit_ = 0;  // no id is this large: the number of vocabulary and added tokens, plus 2^20
  bool byte_fallback_ = false, ignore_merges_ = false, fuse_unk_ = false;
  int32_t unk_ = -1;
  int32_t byte_token_[256] = {};
  Pre pre_ = Pre::kNone;
  bool nfc_ = false;  // the NFC normalizer (Qwen's) before everything else
  bool add_prefix_space_ = false;
  bool metaspace_ = false, prepend_metaspace_ = false, prepend_first_only_ = false;
  std::vector<int32_t> prefix_, suffix_;
  int32_t bos_ = -1, eos_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> make_hf_tokenizer(const std::string& path) { return std::make_unique<HfTokenizer>(path); }

}  // namespace dtk::text
