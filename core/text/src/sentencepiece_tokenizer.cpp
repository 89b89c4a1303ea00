// Megatron's three SentencePiece tokenizers over the SentencePiece library (Debian's
// libsentencepiece): the library is the reference encoder, so the ids are its ids; what this file
// adds is Megatron's wrapping of it (which tokens are added, what EOD and BOS are, how special
// tokens in the text are split out and spelled back). The library is reached through the
// dtk_sentencepiece shim, loaded apart from dtk's own protobuf (sentencepiece_shim.h says why).
#include <dlfcn.h>
#include <unistd.h>

#include <filesystem>
#include <map>

#include "../sentencepiece_shim/sentencepiece_shim.h"
#include "dtk/data/error.hpp"
#include "tokenizers.hpp"

namespace dtk::text {
namespace {

using data::DataError;

// The shim's functions, resolved once per process.
struct SpApi {
  decltype(&dtk_sp_load) load;
  decltype(&dtk_sp_free) free;
  decltype(&dtk_sp_info) info;
  decltype(&dtk_sp_piece_to_id) piece_to_id;
  decltype(&dtk_sp_id_to_piece) id_to_piece;
  decltype(&dtk_sp_encode) encode;
  decltype(&dtk_sp_decode) decode;
  decltype(&dtk_sp_free_buffer) free_buffer;
};

// Where the shim is: $DTK_SENTENCEPIECE_SHIM, else lib/dtk/ beside the executable's bin/ (the
// build tree and an install alike), else where this build put it.
std::string shim_path() {
  if (const char* env = std::getenv("DTK_SENTENCEPIECE_SHIM"); env && *env) return env;
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto beside = exe.parent_path().parent_path() / "lib" / "dtk" / "libdtk_sentencepiece.so";
    if (std::filesystem::exists(beside, ec)) return beside.string();
  }
  return DTK_SENTENCEPIECE_SHIM_BUILD_PATH;
}

const SpApi& sp_api() {
  static const SpApi api = [] {
    // RTLD_DEEPBIND keeps SentencePiece's protobuf apart from dtk's; sanitizer runtimes refuse
    // the flag, and a sanitized test binary links no protobuf of its own anyway.
#if defined(__SANITIZE_ADDRESS__)
    const int flags = RTLD_NOW | RTLD_LOCAL;
#else
    const int flags = RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND;
#endif
    const std::string path = shim_path();
    void* lib = dlopen(path.c_str(), flags);
    if (lib == nullptr) throw DataError("cannot load the SentencePiece shim " + path + ": " + dlerror());
    const auto sym = [&](const char* name) {
      void* f = dlsym(lib, name);
      if (f == nullptr) throw DataError("the SentencePiece shim " + path + " lacks " + name);
      return f;
    };
    SpApi a;
    a.load = reinterpret_cast<decltype(a.load)>(sym("dtk_sp_load"));
    a.free = reinterpret_cast<decltype(a.free)>(sym("dtk_sp_free"));
    a.info = reinterpret_cast<decltype(a.info)>(sym("dtk_sp_info"));
    a.piece_to_id = reinterpret_cast<decltype(a.piece_to_id)>(sym("dtk_sp_piece_to_id"));
    a.id_to_piece = reinterpret_cast<decltype(a.id_to_piece)>(sym("dtk_sp_id_to_piece"));
    a.encode = reinterpret_cast<decltype(a.encode)>(sym("dtk_sp_encode"));
    a.decode = reinterpret_cast<decltype(a.decode)>(sym("dtk_sp_decode"));
    a.free_buffer = reinterpret_cast<decltype(a.free_buffer)>(sym("dtk_sp_free_buffer"));
    return a;
  }();
  return api;
}

// One loaded model: the C++ face the tokenizer below uses.
class SpModel {
 public:
  explicit SpModel(const std::string& file) : api_(sp_api()) {
    char err[512] = "";
    if (api_.load(file.c_str(), &sp_, err, sizeof err) != 0)
      throw DataError("tokenizer model '" + file + "': not a SentencePiece model (" + err + ")");
    api_.info(sp_, &pieces_, &bos_, &eos_, &pad_, &unk_);
  }
  ~SpModel() { api_.free(sp_); }
  SpModel(const SpModel&) = delete;
  SpModel& operator=(const SpModel&) = delete;

  int GetPieceSize() const { return pieces_; }
  int bos_id() const { return bos_; }
  int eos_id() const { return eos_; }
  int pad_id() const { return pad_; }
  int unk_id() const { return unk_; }
  int PieceToId(const std::string& piece) const { return api_.piece_to_id(sp_, piece.data(), piece.size()); }
  std::string IdToPiece(int id) const {
    char buf[256];
    const size_t n = api_.id_to_piece(sp_, id, buf, sizeof buf);
    if (n < sizeof buf) return std::string(buf, n);
    std::string big(n + 1, '\0');
    api_.id_to_piece(sp_, id, &big[0], big.size());
    big.resize(n);
    return big;
  }
  void Encode(std::string_view text, std::vector<int32_t>* out) const {
    int* ids = nullptr;
    size_t count = 0;
    char err[512] = "";
    if (api_.encode(sp_, text.data(), text.size(), &ids, &count, err, sizeof err) != 0)
      throw DataError(std::string("SentencePiece cannot encode the text: ") + err);
    out->insert(out->end(), ids, ids + count);
    api_.free_buffer(ids);
  }
  std::string Decode(const int32_t* ids, size_t n) const {
    char* text = nullptr;
    size_t len = 0;
    char err[512] = "";
    if (api_.decode(sp_, reinterpret_cast<const int*>(ids), n, &text, &len, err, sizeof err) != 0)
      throw DataError(std::string("SentencePiece cannot decode: ") + err);
    std::string s(text, len);
    api_.free_buffer(text);
    return s;
  }

 private:
  const SpApi& api_;
  dtk_sp* sp_ = nullptr;
  int pieces_ = 0, bos_ = -1, eos_ = -1, pad_ = -1, unk_ = 0;
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string type, const std::string& model_file)
      : type_(std::move(type)), file_(model_file), sp_(model_file) {
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
    if (!text.empty()) sp_.Encode(text, out);
  }
  std::string decode_plain(const int32_t* ids, size_t n) const { return n == 0 ? std::string() : sp_.Decode(ids, n); }

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
  SpModel sp_;
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
  if (std::filesystem::is_directory(model_file))
    throw DataError("tokenizer model '" + model_file + "' is a directory: " + type +
                    " needs a SentencePiece .model file");
  return std::make_unique<SentencePieceTokenizer>(type, model_file);
}

std::unique_ptr<Tokenizer> make_null_tokenizer(int64_t vocab_size) {
  if (vocab_size <= 0 || vocab_size >= (int64_t{1} << 31) - 1)
    throw DataError("NullTokenizer: --vocab-size " + std::to_string(vocab_size) + " is not in [1, 2^31 - 2]");
  return std::make_unique<NullTokenizer>(vocab_size);
}

}  // namespace dtk::text
