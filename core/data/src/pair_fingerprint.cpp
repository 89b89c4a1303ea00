#include "dtk/data/pair_fingerprint.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "dtk/data/error.hpp"
#include "dtk/data/indexed_dataset.hpp"

namespace dtk::data {

namespace {

constexpr size_t kSampleBytes = size_t{64} << 10;
constexpr const char* kHead = "dtk pair fingerprint 1:";

void fnv1a(const uint8_t* p, size_t n, uint64_t* h) {
  for (size_t i = 0; i < n; ++i) *h = (*h ^ p[i]) * 0x100000001b3ULL;
}

// The first and last kSampleBytes of a file (the whole file when it is shorter than both).
void hash_ends(const MappedFile& f, uint64_t* h) {
  const size_t n = f.size();
  if (n <= 2 * kSampleBytes) return fnv1a(f.data(), n, h);
  fnv1a(f.data(), kSampleBytes, h);
  fnv1a(f.data() + n - kSampleBytes, kSampleBytes, h);
}

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw DataError("cannot read '" + path + "': " + std::strerror(errno));
  std::string line;
  std::getline(in, line);
  if (line.size() > 120) line = line.substr(0, 120) + "...";
  return line;
}

}  // namespace

std::string pair_fingerprint(const MappedFile& bin, const MappedFile& idx) {
  uint64_t h = 0xcbf29ce484222325ULL;
  hash_ends(bin, &h);
  hash_ends(idx, &h);
  char text[160];
  std::snprintf(text, sizeof text, "%s bin %llu bytes, idx %llu bytes, ends %016llx", kHead,
                static_cast<unsigned long long>(bin.size()), static_cast<unsigned long long>(idx.size()),
                static_cast<unsigned long long>(h));
  return text;
}

void write_pair_fingerprint(const std::string& prefix) {
  const std::string line = pair_fingerprint(MappedFile(bin_path(prefix)), MappedFile(idx_path(prefix)));
  const std::string path = fingerprint_path(prefix), tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) throw DataError("cannot create '" + tmp + "': " + std::strerror(errno));
  const bool ok = std::fprintf(f, "%s\n", line.c_str()) > 0;
  if (std::fclose(f) != 0 || !ok) throw DataError("write error on '" + tmp + "': " + std::strerror(errno));
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw DataError("cannot move '" + tmp + "' to '" + path + "': " + ec.message());
}

void remove_pair_fingerprint(const std::string& prefix) {
  std::error_code ec;
  std::filesystem::remove(fingerprint_path(prefix), ec);
  if (ec) throw DataError("cannot remove '" + fingerprint_path(prefix) + "': " + ec.message());
}

void check_pair_fingerprint(const std::string& prefix, const MappedFile& bin, const MappedFile& idx) {
  const std::string path = fingerprint_path(prefix);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return;  // not written by dtk preprocess: nothing to compare
  const std::string recorded = read_first_line(path);
  if (recorded.rfind(kHead, 0) != 0)
    throw DataError("'" + path + "' is not a dtk pair fingerprint (it reads '" + recorded +
                    "'): delete it, or run dtk preprocess again to write the pair and its fingerprint");
  const std::string now = pair_fingerprint(bin, idx);
  if (recorded == now) return;
  const size_t at = std::strlen(kHead) + 1;
  throw DataError("'" + bin_path(prefix) + "' and '" + idx_path(prefix) +
                  "' are not the pair dtk preprocess wrote together: '" + path + "' records " +
                  recorded.substr(at) + ", the files give " + now.substr(at) +
                  " (one was replaced: another corpus's file, or a cut or extended copy). Run dtk preprocess "
                  "again, or delete the fingerprint if both files were replaced on purpose");
}

}  // namespace dtk::data
