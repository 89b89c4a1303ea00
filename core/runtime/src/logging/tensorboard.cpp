#include "dtk/core/logging/tensorboard.hpp"

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>

#include "dtk/host/error.hpp"
#include "tensorboard.pb.h"

namespace dtk::core {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

const uint32_t* crc_table() {
  static uint32_t table[256];
  static const bool ready = [] {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli
      table[i] = c;
    }
    return true;
  }();
  (void)ready;
  return table;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const uint32_t* table = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw host::HostError("tensorboard: cannot create directory '" + dir + "': " + ec.message());
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(now_seconds())) + "." + host;
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) throw host::HostError("tensorboard: cannot create '" + path_ + "': " + std::strerror(errno));
  tensorboard::Event version;
  version.set_wall_time(now_seconds());
  version.set_file_version("brain.Event:2");
  write_record(version.SerializeAsString());
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  tensorboard::Event e;
  e.set_wall_time(now_seconds());
  e.set_step(step);
  auto* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  write_record(e.SerializeAsString());
}

void TensorBoardWriter::write_record(const std::string& bytes) {
  // Little-endian framing, as TensorFlow's record writer (x86-64 and aarch64 are little-endian).
  const uint64_t len = bytes.size();
  const uint32_t len_crc = masked_crc32c(&len, sizeof len);
  const uint32_t data_crc = masked_crc32c(bytes.data(), bytes.size());
  const bool ok = std::fwrite(&len, sizeof len, 1, file_) == 1 &&
                  std::fwrite(&len_crc, sizeof len_crc, 1, file_) == 1 &&
                  (bytes.empty() || std::fwrite(bytes.data(), bytes.size(), 1, file_) == 1) &&
                  std::fwrite(&data_crc, sizeof data_crc, 1, file_) == 1;
  if (!ok) throw host::HostError("tensorboard: writing '" + path_ + "' failed: " + std::strerror(errno));
}

void TensorBoardWriter::flush() {
  if (std::fflush(file_) != 0)
    throw host::HostError("tensorboard: flushing '" + path_ + "' failed: " + std::strerror(errno));
}

}  // namespace dtk::core
