// Megatron's three SentencePiece tokenizers over the SentencePiece library (Debian's
// libsentencepiece): the library is the reference encoder, so the ids are its ids; what this file
// adds is Megatron's wrapping of it (which tokens are added, what EOD and BOS are, how special
// tokens in the text are split out and spelled back).
#include <sentencepiece_processor.h>

#include <map>

#include "dtk/data/error.hpp"
#include "tokenizers.hpp"

namespace dtk::text {
namespace {

using data::DataError;

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string type, const std::string& model_file) : type_(std::move(type)), file_(model_file) {
    const auto status = sp_.Load(model_file);
    if (!status.ok())
      throw DataError("tokenizer model '" + model_file + "': not a SentencePiece model (" + status.ToString() + ")");
    pieces_ = sp_.GetPieceSize();
    if (type_ == "SentencePieceTokenizer") {
      add_megatron_special_tokens();
    } else {
      eod_ = sp_.eos_id();
      bos_ = sp_.bos_id();
    }
    if (type_ == "Llama2Tokenizer") {
      if (bos_ < 0) throw DataError("tokenizer model '" + model_file + "' has no BOS piece, which Llama2Tokenizer puts first");
      prefix_ = {bos_};
    }
  }

  const std::string& type() const override { return type_; }
  const std::vector<int32_t>& text_prefix() const override { return prefix_; }

  void encode(std::string_view text, std::vector<int32_t>* out) const override {
    if (special_.empty()) return encode_plain(text, out);
    // Megatron's (NeMo's) loop: the earliest special token in the rest of the text (the first
    // added on a tie) is one id; the text between is encoded.
    size_t idx = 0;
    while (true) {
      size_t best = std::string_view::npos;
      const Special* next = nullptr;
      for (const Special& s : special_) {
        const size_t at = text.find(s.text, idx);
        if (at < best) best = at, next = &s;
      }
      if (next == nullptr) break;
      encode_plain(text.substr(idx, best - idx), out);
      out->push_back(next->id);
      idx = best + next->text.size();
    }
    encode_plain(text.substr(idx), out);
  }

  std::string decode(const int32_t* ids, size_t n) const override {
    std::string text;
    size_t last = 0;
    for (size_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= vocab_size())
        throw DataError("cannot decode token id " + std::to_string(ids[i]) + ": outside the vocabulary of " +
                        std::to_string(vocab_size()));
      auto sp = special_ids_.find(ids[i]);
      if (sp == special_ids_.end()) continue;
      // Megatron's SentencePieceTokenizer.detokenize spells a special token between spaces.
      text += decode_plain(ids + last, i - last) + " " + sp->second + " ";
      last = i + 1;
    }
    return text + decode_plain(ids + last, n - last);
  }

  int64_t vocab_size() const override { return pieces_ + static_cast<int64_t>(added_.size()); }
  int32_t eod() const override { return eod_; }
  int32_t bos() const override { return bos_; }
  std::vector<std::string> files() const override { return {file_}; }

 private:
  struct Special {
    std::string text;
    int32_t id;
  };

  void encode_plain(std::string_view text, std::vector<int32_t>* out) const {
    if (text.empty()) return;
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    if (!status.ok()) throw DataError("SentencePiece cannot encode the text: " + status.ToString());
    out->insert(out->end(), ids.begin(), ids.end());
  }
  std::string decode_plain(const int32_t* ids, size_t n) const {
    if (n == 0) return std::string();
    std::string text;
    const auto status = sp_.Decode(std::vector<int>(ids, ids + n), &text);
    if (!status.ok()) throw DataError("SentencePiece cannot decode: " + status.ToString());
    return text;
  }

  // Megatron's _SentencePieceTokenizer._initalize: <CLS> <SEP> <EOD> <MASK>, then the model's
  // pad, bos and eos pieces (or <PAD>/<BOS>/<EOS> when it has none), each given the next id
  // unless the model already has the piece. Text containing them encodes them as one id.
  void add_megatron_special_tokens() {
    const auto piece_or = [&](int id, const char* fallback) {
      return id >= 0 && id < pieces_ ? sp_.IdToPiece(id) : std::string(fallback);
    };
    const std::string names[] = {"<CLS>", "<SEP>", "<EOD>", "<MASK>", piece_or(sp_.pad_id(), "<PAD>"),
                                 piece_or(sp_.bos_id(), "<BOS>"), piece_or(sp_.eos_id(), "<EOS>")};
    std::vector<int32_t> ids;
    for (const std::string& t : names) {
      int32_t id = sp_.PieceToId(t);
      const bool known = id != sp_.unk_id() || t == sp_.IdToPiece(sp_.unk_id());
      if (!known) {
        auto added = added_.find(t);
        id = added != added_.end() ? added->second : static_cast<int32_t>(pieces_ + added_.size());
        added_.emplace(t, id);
      }
      if (special_ids_.emplace(id, t).second) special_.push_back({t, id});
      ids.push_back(id);
    }
    eod_ = ids[2];
    bos_ = ids[5];
  }

  std::string type_, file_;
  sentencepiece::SentencePieceProcessor sp_;
  int32_t pieces_ = 0;
  int32_t eod_ = -1, bos_ = -1;
  std::vector<int32_t> prefix_;
  std::map<std::string, int32_t> added_;      // SentencePieceTokenizer's tokens past the model's
  std::vector<Special> special_;              // in Megatron's insertion order
  std::map<int32_t, std::string> special_ids_;
};

class NullTokenizer final : public Tokenizer {
 public:
  explicit NullTokenizer(int64_t n) : n_(n) {}
  const std::string& type() const override { return type_; }
  // Megatron: [int(x) for x in text.split(' ')]; an empty text has no ids here (int('') fails there).
  void encode(std::string_view text, std::vector<int32_t>* out) const override {
    if (text.empty()) return;
    size_t pos = 0;
    while (true) {
      const size_t sp = text.find(' ', pos);
      const std::string_view word = text.substr(pos, sp == std::string_view::npos ? std::string_view::npos : sp - pos);
      out->push_back(parse(word));
      if (sp == std::string_view::npos) break;
      pos = sp + 1;
    }
  }
  std::string decode(const int32_t* ids, size_t n) const override {
    std::string text;
    for (size_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] > n_)
        throw DataError("cannot decode token id " + std::to_string(ids[i]) + ": outside the vocabulary of " +
                        std::to_string(n_ + 1));
      text += (i ? " " : "") + std::to_string(ids[i]);
    }
    return text;
  }
  int64_t vocab_size() const override { return n_ + 1; }
  int32_t eod() const override { return static_cast<int32_t>(n_); }
  std::vector<std::string> files() const override { return {}; }

 private:
  // A decimal id with optional surrounding whitespace (Python's int()), at most the EOD id.
  int32_t parse(std::string_view word) const {
    const auto space = [](char c) { return c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; };
    std::string_view w = word;
    while (!w.empty() && space(w.front())) w.remove_prefix(1);
    while (!w.empty() && space(w.back())) w.remove_suffix(1);
    int64_t v = 0;
    bool ok = !w.empty() && w.size() <= 10;
    for (char c : w) ok = ok && c >= '0' && c <= '9', v = v * 10 + (c - '0');
    if (!ok || v > n_)
      throw DataError("NullTokenizer: '" + std::string(word.substr(0, 40)) + "' is not a token id in [0, " +
                      std::to_string(n_) + "]");
    return static_cast<int32_t>(v);
  }
  const std::string type_ = "NullTokenizer";
  int64_t n_;
};

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece_tokenizer(const std::string& type, const std::string& model_file) {
  return std::make_unique<SentencePieceTokenizer>(type, model_file);
}

std::unique_ptr<Tokenizer> make_null_tokenizer(int64_t vocab_size) {
  if (vocab_size <= 0 || vocab_size >= (int64_t{1} << 31) - 1)
    throw DataError("NullTokenizer: --vocab-size " + std::to_string(vocab_size) + " is not in [1, 2^31 - 2]");
  return std::make_unique<NullTokenizer>(vocab_size);
}

}  // namespace dtk::text
