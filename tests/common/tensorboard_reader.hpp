// Reads a TensorBoard event file back (tests): checks every record's two CRC-32Cs and returns the
// scalars. Needs dtk_tensorboard (the masked CRC, the generated tensorboard.pb.h).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "dtk/core/logging/tensorboard.hpp"
#include "tensorboard.pb.h"

namespace dtk_test {

struct Record {
  std::string tag;
  int64_t step;
  float value;
};

// The scalars of an event file, in file order; *version receives the file_version record.
inline std::vector<Record> read_events(const std::string& path, std::string* version) {
  std::ifstream in(path, std::ios::binary);
  std::vector<Record> out;
  while (true) {
    uint64_t len = 0;
    uint32_t len_crc = 0, data_crc = 0;
    if (!in.read(reinterpret_cast<char*>(&len), 8)) break;
    EXPECT_TRUE(in.read(reinterpret_cast<char*>(&len_crc), 4));
    EXPECT_EQ(len_crc, dtk::core::masked_crc32c(&len, 8));
    std::string data(len, '\0');
    EXPECT_TRUE(in.read(data.data(), static_cast<std::streamsize>(len)));
    EXPECT_TRUE(in.read(reinterpret_cast<char*>(&data_crc), 4));
    EXPECT_EQ(data_crc, dtk::core::masked_crc32c(data.data(), data.size()));
    dtk::tensorboard::Event e;
    EXPECT_TRUE(e.ParseFromString(data));
    EXPECT_GT(e.wall_time(), 1.6e9);
    if (e.has_file_version() && version) *version = e.file_version();
    if (e.has_summary())
      for (const auto& v : e.summary().value()) out.push_back({v.tag(), e.step(), v.simple_value()});
  }
  return out;
}

// tag -> step -> value of the one event file in `dir` (empty when there is none).
inline std::map<std::string, std::map<int64_t, float>> read_scalars(const std::string& dir) {
  std::map<std::string, std::map<int64_t, float>> out;
  std::error_code ec;
  for (const auto& de : std::filesystem::directory_iterator(dir, ec))
    for (const Record& r : read_events(de.path().string(), nullptr)) out[r.tag][r.step] = r.value;
  return out;
}

}  // namespace dtk_test
