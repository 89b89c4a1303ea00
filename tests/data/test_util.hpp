// Helpers shared by the data tests.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace dtk::data::test {

inline std::string SharedDataDir() {
  const char* env = std::getenv("DTK_SHARED_DATA");
  return env != nullptr && *env ? std::string(env) : std::string(DTK_SHARED_DATA_DIR);
}
inline std::string FixturesDir() { return DTK_DATA_FIXTURES_DIR; }

inline std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}
inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
inline bool FileExists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

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
