#include "dtk/text/gpt2_tokenizer.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dtk/data/error.hpp"
#include "dtk/data/utf8.hpp"
#include "dtk/text/pre_tokenize.hpp"

namespace dtk::text {

using data::DataError;
using data::append_utf8;
using data::decode_utf8;
namespace {

std::string read_whole_file(const std::string& path, const char* what) {
  if (std::filesystem::is_directory(path)) throw DataError(std::string(what) + " '" + path + "' is a directory");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw DataError("cannot open '" + path + "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw DataError("read error on '" + path + "'");
  return ss.str();
}

}  // namespace

struct Gpt2Tokenizer::Impl {
  std::unordered_map<std::string, int32_t> encoder;  // token string (UTF-8) -> id
  std::vector<std::string> id_bytes;                 // id -> raw bytes
  int32_t byte_id[256];                              // single byte -> id of its unicode char
  // (first id << 32 | second id) -> (rank << 32 | merged id)
  std::unordered_map<uint64_t, uint64_t> merges;
  int32_t eod = -1;
};

Gpt2Tokenizer::~Gpt2Tokenizer() = default;

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& vocab_file, const std::string& merges_file)
    : impl_(std::make_unique<Impl>()) {
  load_vocabulary(vocab_file, impl_.get());
  load_merges(merges_file, impl_.get());
}

// encoder.json: token (byte-level unicode) -> id; the byte table and the end-of-document id.
void Gpt2Tokenizer::load_vocabulary(const std::string& vocab_file, Impl* impl) {
  Impl& m = *impl;
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(read_whole_file(vocab_file, "vocab file"));  // strict RFC 8259 + UTF-8
  } catch (const nlohmann::json::exception& e) {
    throw DataError("vocab file '" + vocab_file + "': invalid JSON: " + e.what());
  }
  if (!vocab.is_object() || vocab.empty()) {
    throw DataError("vocab file '" + vocab_file + "': expected a non-empty JSON object of token -> id");
  }
  int64_t max_id = -1;
  for (auto it = vocab.cbegin(); it != vocab.cend(); ++it) {  // of a repeated token, the last id is kept
    const double v = it.value().is_number() ? it.value().get<double>() : -1;
    if (v < 0 || v > 1e8 || v != static_cast<int64_t>(v)) {
      throw DataError("vocab file '" + vocab_file + "': token '" + it.key() +
                      "' has an id that is not a non-negative integer < 1e8");
    }
    m.encoder[it.key()] = static_cast<int32_t>(v);
    max_id = std::max<int64_t>(max_id, static_cast<int64_t>(v));
  }
  // The ids number the tokens 0..N-1, each once (Megatron's vocab_size is len(encoder)): two tokens
  // with one id would encode one text as another's ids, and an id past N lies outside the vocabulary.
  if (max_id >= static_cast<int64_t>(m.encoder.size()))
    throw DataError("vocab file '" + vocab_file + "': id " + std::to_string(max_id) + " is beyond its " +
                    std::to_string(m.encoder.size()) + " tokens (the ids must number the tokens 0..N-1)");
  {
    std::vector<const std::string*> owner(m.encoder.size(), nullptr);
    for (const auto& kv : m.encoder) {
      const std::string*& first = owner[static_cast<size_t>(kv.second)];
      if (first)
        throw DataError("vocab file '" + vocab_file + "': tokens '" + std::min(*first, kv.first) + "' and '" +
                        std::max(*first, kv.first) + "' share id " + std::to_string(kv.second));
      first = &kv.first;
    }
  }
  const uint32_t* byte_char = byte_level_alphabet();
  std::unordered_map<uint32_t, uint8_t> char_byte;
  for (int b = 0; b < 256; ++b) char_byte[byte_char[b]] = static_cast<uint8_t>(b);
  m.id_bytes.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& kv : m.encoder) {
    std::string bytes;
    const std::string& t = kv.first;
    for (size_t i = 0; i < t.size();) {
      uint32_t cp = 0;
      const size_t len = decode_utf8(t, i, &cp);
      auto it = char_byte.find(cp);
      if (len == 0 || it == char_byte.end()) {  // e.g. a special token: keep its text
        bytes = t;
        break;
      }
      bytes.push_back(static_cast<char>(it->second));
      i += len;
    }
    m.id_bytes[static_cast<size_t>(kv.second)] = bytes;
  }
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    append_utf8(byte_char[b], &ch);
    auto it = m.encoder.find(ch);
    if (it == m.encoder.end()) {
      throw DataError("vocab file '" + vocab_file + "': byte " + std::to_string(b) +
                      " has no token (not a byte-level BPE vocabulary)");
    }
    m.byte_id[b] = it->second;
  }
  auto eod = m.encoder.find("<|endoftext|>");
  m.eod = eod == m.encoder.end() ? -1 : eod->second;
}

// vocab.bpe: key "first,second" -> rank (later duplicates win, as in the JS dict).
void Gpt2Tokenizer::load_merges(const std::string& merges_file, Impl* impl) {
  Impl& m = *impl;
  const std::string text = read_whole_file(merges_file, "merges file");
  std::vector<std::string_view> lines;
  for (size_t pos = 0;;) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) {
      lines.push_back(std::string_view(text).substr(pos));
      break;
    }
    lines.push_back(std::string_view(text).substr(pos, nl - pos));
    pos = nl + 1;
  }
  // Like the reference: drop the first line (version) and the last (empty after the final \n).
  std::unordered_map<std::string, int32_t> key_rank;
  for (size_t ln = 1; ln + 1 < lines.size(); ++ln) {
    std::string_view l = lines[ln];
    std::vector<std::string_view> parts;
    size_t i = 0;
    const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; };
    while (i < l.size()) {
      while (i < l.size() && ws(l[i])) ++i;
      const size_t st = i;
      while (i < l.size() && !ws(l[i])) ++i;
      if (i > st) parts.push_back(l.substr(st, i - st));
    }
    if (parts.size() != 2) {
      throw DataError("merges file '" + merges_file + "' line " + std::to_string(ln + 1) +
                      ": expected two tokens separated by a space");
    }
    // Every merge of GPT-2's files joins two vocabulary tokens into a third; one that does not
    // is another tokenizer's merges (or a damaged file) and would silently never apply.
    const std::string a(parts[0]), b(parts[1]);
    for (const std::string& token : {a, b, a + b}) {
      if (m.encoder.count(token) == 0)
        throw DataError("merges file '" + merges_file + "' line " + std::to_string(ln + 1) + ": '" + token +
                        "' is not in the vocabulary file (are the two files of one tokenizer?)");
    }
    key_rank[a + "," + b] = static_cast<int32_t>(ln - 1);
  }
  // And every multi-character token of the vocabulary comes from a merge: a merges file cut short
  // (or another tokenizer's) leaves some unreachable, and the ids would silently differ.
  // Special tokens (<|...|>) are whole strings, never merged.
  {
    std::unordered_map<std::string, bool> made;
    for (const auto& kr : key_rank) {
      const std::string& key = kr.first;
      for (size_t c = key.find(','); c != std::string::npos; c = key.find(',', c + 1))
        if (c > 0 && c + 1 < key.size()) made[key.substr(0, c) + key.substr(c + 1)] = true;
    }
    int64_t unreachable = 0;
    std::string example;
    for (const auto& kv : m.encoder) {
      const std::string& t = kv.first;
      uint32_t cp = 0;
      const bool one_char = decode_utf8(t, 0, &cp) == t.size();
      const bool special = t.size() > 4 && t.compare(0, 2, "<|") == 0 && t.compare(t.size() - 2, 2, "|>") == 0;
      if (one_char || special || made.count(t)) continue;
      if (unreachable++ == 0 || t < example) example = t;
    }
    if (unreachable > 0)
      throw DataError("merges file '" + merges_file + "' (" + std::to_string(key_rank.size()) +
                      " merges) does not make " + std::to_string(unreachable) +
                      " token(s) of the vocabulary file, e.g. '" + example +
                      "' (cut short, or another tokenizer's merges?" +
                      (!text.empty() && text.back() != '\n'
                           ? " It does not end with a newline: its last line is not read, as in Megatron's reader)"
                           : ")"));
  }
  // Every way of splitting a key at a comma into two vocabulary tokens is a pair the JS
  // encoder would merge at that rank.
  for (const auto& kr : key_rank) {
    const std::string& key = kr.first;
    for (size_t c = key.find(','); c != std::string::npos; c = key.find(',', c + 1)) {
      if (c == 0 || c + 1 == key.size()) continue;
      const std::string a = key.substr(0, c), b = key.substr(c + 1);
      auto ia = m.encoder.find(a), ib = m.encoder.find(b), iab = m.encoder.find(a + b);
      if (ia == m.encoder.end() || ib == m.encoder.end() || iab == m.encoder.end()) continue;
      const uint64_t k =
          (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) | static_cast<uint32_t>(ib->second);
      const uint64_t v =
          (static_cast<uint64_t>(static_cast<uint32_t>(kr.second)) << 32) | static_cast<uint32_t>(iab->second);
      m.merges[k] = v;
    }
  }
}

size_t Gpt2Tokenizer::vocab_size() const { return impl_->id_bytes.size(); }
int32_t Gpt2Tokenizer::eod() const { return impl_->eod; }
int32_t Gpt2Tokenizer::token_to_id(const std::string& token) const {
  auto it = impl_->encoder.find(token);
  return it == impl_->encoder.end() ? -1 : it->second;
}

void Gpt2Tokenizer::bpe(std::string_view piece, std::vector<int32_t>* out) const {
  const Impl& m = *impl_;
  std::vector<int32_t> word;
  word.reserve(piece.size());
  for (char ch : piece) word.push_back(m.byte_id[static_cast<uint8_t>(ch)]);
  std::vector<int32_t> next;
  while (word.size() > 1) {
    // The lowest-ranked pair; on ties the LAST one (JS object key overwrite).
    uint32_t best_rank = std::numeric_limits<uint32_t>::max();
    int32_t first = -1, second = -1, merged = -1;
    for (size_t k = 0; k + 1 < word.size(); ++k) {
      const uint64_t key =
          (static_cast<uint64_t>(static_cast<uint32_t>(word[k])) << 32) | static_cast<uint32_t>(word[k + 1]);
      auto it = m.merges.find(key);
      if (it == m.merges.end()) continue;
      const uint32_t rank = static_cast<uint32_t>(it->second >> 32);
      if (rank <= best_rank) {
        best_rank = rank;
        first = word[k];
        second = word[k + 1];
        merged = static_cast<int32_t>(it->second & 0xffffffffu);
      }
    }
    if (first < 0) break;
    next.clear();
    for (size_t k = 0; k < word.size();) {
      if (k + 1 < word.size() && word[k] == first && word[k + 1] == second) {
        next.push_back(merged);
        k += 2;
      } else {
        next.push_back(word[k]);
        ++k;
      }
    }
    word.swap(next);
  }
  out->insert(out->end(), word.begin(), word.end());
}

void Gpt2Tokenizer::encode(std::string_view text, std::vector<int32_t>* out, Cache* cache) const {
  std::vector<std::string_view> pieces;
  gpt2_pre_tokenize(text, &pieces);
  std::string key;
  for (std::string_view p : pieces) {
    if (p.size() == 1) {
      out->push_back(impl_->byte_id[static_cast<uint8_t>(p[0])]);
      continue;
    }
    key.assign(p.data(), p.size());
    auto it = cache->map_.find(key);
    if (it != cache->map_.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      continue;
    }
    std::vector<int32_t> ids;
    bpe(p, &ids);
    out->insert(out->end(), ids.begin(), ids.end());
    if (cache->map_.size() >= cache->max_entries_) cache->map_.clear();
    cache->map_.emplace(key, std::move(ids));
  }
}

std::vector<int32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  Cache cache;
  std::vector<int32_t> out;
  encode(text, &out, &cache);
  return out;
}

std::string Gpt2Tokenizer::decode(const int64_t* ids, size_t n) const {
  std::string out;
  for (size_t k = 0; k < n; ++k) {
    if (ids[k] < 0 || static_cast<uint64_t>(ids[k]) >= impl_->id_bytes.size()) {
      throw DataError("cannot decode token id " + std::to_string(ids[k]) + ": outside the vocabulary of " +
                      std::to_string(impl_->id_bytes.size()));
    }
    out += impl_->id_bytes[static_cast<size_t>(ids[k])];
  }
  return out;
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::vector<int64_t> wide(ids.begin(), ids.end());
  return decode(wide.data(), wide.size());
}

}  // namespace dtk::text
