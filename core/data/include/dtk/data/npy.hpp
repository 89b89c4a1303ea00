// dtk::data::NpyArray — 1-D/2-D integer arrays in NumPy's .npy format (v1/v2, little endian,
// C order), the on-disk form of Megatron's cached GPT dataset indices.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtk/data/mapped_file.hpp"

namespace dtk::data {

class NpyArray {
 public:
  NpyArray() = default;
  // '|u1', '|i1', '<i2', '<u2', '<i4', '<u4', '<i8' or '<u8' elements. Owns a copy of the data.
  static NpyArray from_int32(std::vector<int32_t> v, std::vector<size_t> shape);
  static NpyArray from_int64(const std::vector<int64_t>& v, std::vector<size_t> shape,
                             const std::string& descr);  // descr: any of the above
  // Memory-maps `path`; throws DataError naming the file when it is not a valid integer .npy.
  static NpyArray load(const std::string& path);
  // Writes atomically: a temporary file in the same directory, then rename().
  void save(const std::string& path) const;

  const std::string& descr() const { return descr_; }
  const std::vector<size_t>& shape() const { return shape_; }
  size_t size() const { return count_; }
  int64_t operator[](size_t i) const;

 private:
  std::string descr_;
  std::vector<size_t> shape_;
  size_t count_ = 0;
  size_t itemsize_ = 0;
  bool is_unsigned_ = false;
  const uint8_t* data_ = nullptr;
  std::vector<uint8_t> owned_;
  std::shared_ptr<MappedFile> mapped_;
};

}  // namespace dtk::data
