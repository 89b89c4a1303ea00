// dtk/core/logging/tensorboard.hpp — TensorBoard event files (scalars), written the way TensorFlow's
// EventsWriter does: events.out.tfevents.<time>.<host>, a sequence of records
//   uint64 length | uint32 masked_crc32c(length) | Event bytes | uint32 masked_crc32c(bytes)
// The first event carries file_version "brain.Event:2".
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace dtk::core {

// CRC-32C (Castagnoli), and TensorFlow's masking of it for record framing.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

class TensorBoardWriter {
 public:
  // Creates `dir` if needed and a new event file in it. Throws HostError naming the path.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void add_scalar(const std::string& tag, double value, int64_t step);
  void flush();  // makes the records written so far visible to TensorBoard
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& bytes);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace dtk::core
