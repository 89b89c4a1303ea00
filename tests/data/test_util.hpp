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

inline bool FileExists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// The GPT-2 vocab (encoder.json, vocab.bpe): $DTK_GPT2_VOCAB_DIR when set, else <repo>/data/gpt2,
// where `tools/setup.sh --vocab` puts it.
inline std::string Gpt2VocabDir() {
  const char* env = std::getenv("DTK_GPT2_VOCAB_DIR");
  return env != nullptr && *env ? std::string(env) : std::string(DTK_GPT2_VOCAB_DIR);
}
// The path of one GPT-2 vocab file. A missing file fails the calling test (never skips it).
inline std::string Gpt2File(const std::string& name) {
  const std::string path = Gpt2VocabDir() + "/" + name;
  if (!FileExists(path)) {
    ADD_FAILURE() << "GPT-2 vocab file " << path
                  << " is missing: run tools/setup.sh --vocab (or set DTK_GPT2_VOCAB_DIR)";
  }
  return path;
}
inline std::string EncoderJson() { return Gpt2File("encoder.json"); }
inline std::string VocabBpe() { return Gpt2File("vocab.bpe"); }

// Committed fixtures: tests/data/fixtures (see tools/make_tokenizer_fixture.js for how they were made).
inline std::string FixturesDir() { return DTK_DATA_FIXTURES_DIR; }
// Real text: the first 119,994 bytes of tinyshakespeare (public-domain Shakespeare).
inline std::string ShakespeareText() { return FixturesDir() + "/shakespeare_excerpt.txt"; }

inline std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
// The reference GPT-2 ids of ShakespeareText(), made by the npm `gpt-3-encoder`.
inline std::vector<int32_t> ShakespeareReferenceIds() {
  const std::string raw = ReadFile(FixturesDir() + "/shakespeare_excerpt_gpt2.u16");
  std::vector<int32_t> ids(raw.size() / 2);
  for (size_t i = 0; i < ids.size(); ++i) {
    uint16_t v;
    std::memcpy(&v, raw.data() + 2 * i, 2);
    ids[i] = v;
  }
  return ids;
}
inline void WriteFile(const std::string& path, const std::string& bytes) {
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
