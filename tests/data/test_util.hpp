// Helpers shared by the data tests.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace dtk::data::test {

inline bool file_exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// The GPT-2 vocab (encoder.json, vocab.bpe): $DTK_GPT2_VOCAB_DIR when set, else <repo>/data/gpt2,
// where `tools/setup.sh --vocab` puts it.
inline std::string gpt2_vocab_dir() {
  const char* env = std::getenv("DTK_GPT2_VOCAB_DIR");
  return env != nullptr && *env ? std::string(env) : std::string(DTK_GPT2_VOCAB_DIR);
}
// The path of one GPT-2 vocab file. A missing file fails the calling test (never skips it).
inline std::string gpt2_file(const std::string& name) {
  const std::string path = gpt2_vocab_dir() + "/" + name;
  if (!file_exists(path)) {
    ADD_FAILURE() << "GPT-2 vocab file " << path
                  << " is missing: run tools/setup.sh --vocab (or set DTK_GPT2_VOCAB_DIR)";
  }
  return path;
}
inline std::string encoder_json() { return gpt2_file("encoder.json"); }
inline std::string vocab_bpe() { return gpt2_file("vocab.bpe"); }

// Committed fixtures: tests/data/fixtures (see tools/make_tokenizer_fixture.js for how they were made).
inline std::string fixtures_dir() { return DTK_DATA_FIXTURES_DIR; }
// Real text: the first 119,994 bytes of tinyshakespeare (public-domain Shakespeare).
inline std::string shakespeare_text() { return fixtures_dir() + "/shakespeare_excerpt.txt"; }

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
// The reference GPT-2 ids of shakespeare_text(), made by the npm `gpt-3-encoder`.
inline std::vector<int32_t> shakespeare_reference_ids() {
  const std::string raw = read_file(fixtures_dir() + "/shakespeare_excerpt_gpt2.u16");
  std::vector<int32_t> ids(raw.size() / 2);
  for (size_t i = 0; i < ids.size(); ++i) {
    uint16_t v;
    std::memcpy(&v, raw.data() + 2 * i, 2);
    ids[i] = v;
  }
  return ids;
}
inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
// A fresh temporary directory per test, removed at the end.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = "/tmp/dtk_data_test_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    char* p = ::mkdtemp(buf.data());
    path_ = p ? p : "/tmp";
  }
  ~TempDir() {
    if (path_ != "/tmp") {
      std::error_code ec;  // best effort: a leftover temp dir must not fail a test
      std::filesystem::remove_all(path_, ec);
    }
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace dtk::data::test
