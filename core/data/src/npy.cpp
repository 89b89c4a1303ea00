#include "dtk/data/npy.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "dtk/data/error.hpp"

namespace dtk::data {
namespace {

bool descr_info(const std::string& d, size_t* itemsize, bool* is_unsigned) {
  if (d == "|u1" || d == "|i1") {
    *itemsize = 1;
    *is_unsigned = d[1] == 'u';
    return true;
  }
  if (d == "<i2" || d == "<u2") {
    *itemsize = 2;
    *is_unsigned = d[1] == 'u';
    return true;
  }
  if (d == "<i4") {
    *itemsize = 4;
    *is_unsigned = false;
    return true;
  }
  if (d == "<u4") {
    *itemsize = 4;
    *is_unsigned = true;
    return true;
  }
  if (d == "<i8") {
    *itemsize = 8;
    *is_unsigned = false;
    return true;
  }
  if (d == "<u8") {
    *itemsize = 8;
    *is_unsigned = true;
    return true;
  }
  return false;
}

std::string header_for(const std::string& descr, const std::vector<size_t>& shape) {
  std::string s = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (";
  for (size_t k = 0; k < shape.size(); ++k) {
    if (k) s += ", ";
    s += std::to_string(shape[k]);
  }
  if (shape.size() == 1) s += ",";
  s += "), }";
  // Pad with spaces so that magic(6) + version(2) + len(2) + header + '\n' is a multiple of 64.
  while ((10 + s.size() + 1) % 64 != 0) s += ' ';
  s += '\n';
  return s;
}

}  // namespace

NpyArray NpyArray::from_int32(std::vector<int32_t> v, std::vector<size_t> shape) {
  NpyArray a;
  a.descr_ = "<i4";
  a.itemsize_ = 4;
  a.shape_ = std::move(shape);
  a.count_ = v.size();
  a.owned_.resize(v.size() * 4);
  if (!v.empty()) std::memcpy(a.owned_.data(), v.data(), a.owned_.size());
  a.data_ = a.owned_.data();
  return a;
}

NpyArray NpyArray::from_int64(const std::vector<int64_t>& v, std::vector<size_t> shape, const std::string& descr) {
  NpyArray a;
  if (!descr_info(descr, &a.itemsize_, &a.is_unsigned_)) throw DataError("unsupported npy dtype " + descr);
  a.descr_ = descr;
  a.shape_ = std::move(shape);
  a.count_ = v.size();
  a.owned_.resize(v.size() * a.itemsize_);
  for (size_t i = 0; i < v.size(); ++i) {
    if (a.itemsize_ == 1) {
      a.owned_[i] = static_cast<uint8_t>(v[i]);
    } else if (a.itemsize_ == 2) {
      const uint16_t x = static_cast<uint16_t>(v[i]);
      std::memcpy(a.owned_.data() + 2 * i, &x, 2);
    } else if (a.itemsize_ == 4) {
      const uint32_t x = static_cast<uint32_t>(v[i]);
      std::memcpy(a.owned_.data() + 4 * i, &x, 4);
    } else {
      std::memcpy(a.owned_.data() + 8 * i, &v[i], 8);
    }
  }
  a.data_ = a.owned_.data();
  return a;
}

int64_t NpyArray::operator[](size_t i) const {
  if (itemsize_ == 1) return is_unsigned_ ? static_cast<int64_t>(data_[i]) : static_cast<int8_t>(data_[i]);
  if (itemsize_ == 2) {
    uint16_t x;
    std::memcpy(&x, data_ + 2 * i, 2);
    return is_unsigned_ ? static_cast<int64_t>(x) : static_cast<int16_t>(x);
  }
  if (itemsize_ == 4) {
    if (is_unsigned_) {
      uint32_t x;
      std::memcpy(&x, data_ + 4 * i, 4);
      return x;
    }
    int32_t x;
    std::memcpy(&x, data_ + 4 * i, 4);
    return x;
  }
  int64_t x;
  std::memcpy(&x, data_ + 8 * i, 8);
  return x;
}

NpyArray NpyArray::load(const std::string& path) {
  auto file = std::make_shared<MappedFile>(path);
  const uint8_t* p = file->data();
  const size_t n = file->size();
  auto bad = [&](const std::string& why) { return DataError("corrupt npy file '" + path + "': " + why); };
  if (n < 10 || std::memcmp(p, "\x93NUMPY", 6) != 0) throw bad("missing \\x93NUMPY magic");
  size_t header_len, header_start;
  if (p[6] == 1) {
    header_len = static_cast<size_t>(p[8]) | (static_cast<size_t>(p[9]) << 8);
    header_start = 10;
  } else if (p[6] == 2 || p[6] == 3) {
    if (n < 12) throw bad("truncated header");
    header_len = static_cast<size_t>(p[8]) | (static_cast<size_t>(p[9]) << 8) | (static_cast<size_t>(p[10]) << 16) |
                 (static_cast<size_t>(p[11]) << 24);
    header_start = 12;
  } else {
    throw bad("unsupported format version " + std::to_string(p[6]));
  }
  if (header_len > n - header_start) throw bad("header longer than the file");
  const std::string h(reinterpret_cast<const char*>(p + header_start), header_len);
  NpyArray a;
  auto value_after = [&](const std::string& key) -> std::string {
    const size_t k = h.find("'" + key + "'");
    if (k == std::string::npos) throw bad("header lacks '" + key + "'");
    size_t v = h.find(':', k);
    if (v == std::string::npos) throw bad("malformed header");
    ++v;
    while (v < h.size() && h[v] == ' ') ++v;
    return h.substr(v);
  };
  std::string d = value_after("descr");
  if (d.size() < 5 || d[0] != '\'' || d[4] != '\'') throw bad("malformed descr");
  a.descr_ = d.substr(1, 3);
  if (!descr_info(a.descr_, &a.itemsize_, &a.is_unsigned_)) {
    throw bad("dtype " + a.descr_ + " is not one of |u1 |i1 <i2 <u2 <i4 <u4 <i8 <u8");
  }
  if (value_after("fortran_order").compare(0, 5, "False") != 0) throw bad("fortran_order arrays are not supported");
  std::string s = value_after("shape");
  if (s.empty() || s[0] != '(') throw bad("malformed shape");
  size_t i = 1;
  size_t count = 1;
  while (i < s.size() && s[i] != ')') {
    if (s[i] == ' ' || s[i] == ',') {
      ++i;
      continue;
    }
    if (s[i] < '0' || s[i] > '9') throw bad("malformed shape");
    uint64_t dim = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
      if (dim > (1ull << 50)) throw bad("shape dimension too large");
      dim = dim * 10 + static_cast<uint64_t>(s[i] - '0');
      ++i;
    }
    a.shape_.push_back(static_cast<size_t>(dim));
    if (dim != 0 && count > (n / dim)) throw bad("shape larger than the file");
    count *= static_cast<size_t>(dim);
  }
  if (i >= s.size()) throw bad("malformed shape");
  const size_t data_start = header_start + header_len;
  if (count > (n - data_start) / a.itemsize_ || count * a.itemsize_ != n - data_start) {
    throw bad("data size " + std::to_string(n - data_start) + " bytes does not match shape (" + std::to_string(count) +
              " elements of " + std::to_string(a.itemsize_) + " bytes)");
  }
  a.count_ = count;
  a.data_ = p + data_start;
  a.mapped_ = std::move(file);
  return a;
}

void NpyArray::save(const std::string& path) const {
  const std::string header = header_for(descr_, shape_);
  std::random_device rd;
  const std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(rd());
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) throw DataError("cannot create '" + tmp + "': " + std::strerror(errno));
  uint8_t pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0, 0};
  pre[8] = static_cast<uint8_t>(header.size() & 0xff);
  pre[9] = static_cast<uint8_t>(header.size() >> 8);
  bool ok = std::fwrite(pre, 1, 10, f) == 10 && std::fwrite(header.data(), 1, header.size(), f) == header.size();
  const size_t bytes = count_ * itemsize_;
  if (ok && bytes > 0) ok = std::fwrite(data_, 1, bytes, f) == bytes;
  ok = (std::fflush(f) == 0) && ok;
  ok = (::fsync(::fileno(f)) == 0) && ok;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw DataError("cannot write '" + path + "': " + std::strerror(err));
  }
}

}  // namespace dtk::data
