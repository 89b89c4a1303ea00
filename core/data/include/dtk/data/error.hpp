// dtk::data — error type shared by the whole data tier.
#pragma once

#include <stdexcept>
#include <string>

namespace dtk::data {

// Every failure of the data tier (bad file, bad option, bad input text) is reported as a
// DataError whose what() is ONE line naming the file or input and what is wrong with it.
class DataError : public std::runtime_error {
 public:
  explicit DataError(const std::string& message) : std::runtime_error(message) {}
};

// A non-owning, read-only view of `size` elements (C++17 has no std::span).
template <typename T>
struct Span {
  const T* data = nullptr;
  size_t size = 0;
  const T* begin() const { return data; }
  const T* end() const { return data + size; }
  const T& operator[](size_t i) const { return data[i]; }
  bool empty() const { return size == 0; }
};

}  // namespace dtk::data
