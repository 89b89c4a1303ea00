#include "dtk/data/indexed_dataset.hpp"

#include "dtk/data/pair_fingerprint.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <type_traits>

namespace dtk::data {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kHeaderSize = 9 + 8 + 1 + 8 + 8;  // = 34

template <typename T>
T load_le(const uint8_t* p) {  // the format and every supported host are little endian
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += "\\x";
    s += d[p[i] >> 4];
    s += d[p[i] & 15];
  }
  return s;
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

bool dtype_from_code(uint8_t code, DType* out) {
  if (code < 1 || code > 8) return false;
  *out = static_cast<DType>(code);
  return true;
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kUInt8:
    case DType::kInt8:
      return 1;
    case DType::kInt16:
    case DType::kUInt16:
      return 2;
    case DType::kInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kUInt8:
      return "uint8";
    case DType::kInt8:
      return "int8";
    case DType::kInt16:
      return "int16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat32:
      return "float32";
    case DType::kUInt16:
      return "uint16";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  for (uint8_t c = 1; c <= 8; ++c) {
    DType d = static_cast<DType>(c);
    if (name == dtype_name(d)) return d;
  }
  throw DataError("unknown dtype '" + name +
                  "' (expected uint8, int8, int16, uint16, int32, int64, float32 or float64)");
}

DType optimal_dtype(int64_t vocab_size) { return vocab_size < 65500 ? DType::kUInt16 : DType::kInt32; }

// ---------------------------------------------------------------- reader

bool IndexedDataset::exists(const std::string& prefix) {
  return file_exists(idx_path(prefix)) && file_exists(bin_path(prefix));
}

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_file = idx_path(prefix);
  const std::string bin_file = bin_path(prefix);
  // A file of the pair given for its prefix ("data/x_text_document.idx"): named as such.
  for (const std::string ext : {".idx", ".bin"})
    if (!file_exists(idx_file) && prefix.size() > ext.size() &&
        prefix.compare(prefix.size() - ext.size(), ext.size(), ext) == 0 &&
        exists(prefix.substr(0, prefix.size() - ext.size())))
      throw DataError("'" + prefix + "' is a file of an indexed dataset; a data path is its prefix, '" +
                      prefix.substr(0, prefix.size() - ext.size()) + "'");
  idx_ = MappedFile(idx_file);
  bin_ = MappedFile(bin_file);
  auto corrupt = [&](const std::string& what) { return DataError("corrupt index file '" + idx_file + "': " + what); };
  const uint8_t* p = idx_.data();
  const size_t n = idx_.size();
  if (n < kHeaderSize) {
    throw corrupt("file is " + std::to_string(n) + " bytes, shorter than the 34-byte header");
  }
  if (std::memcmp(p, kMagic, 9) != 0) {
    throw corrupt("header magic is not MMIDIDX\\x00\\x00 (got '" + hex(p, 9) + "')");
  }
  const uint64_t version = load_le<uint64_t>(p + 9);
  if (version != 1) throw corrupt("unsupported version " + std::to_string(version) + " (expected 1)");
  const uint8_t code = p[17];
  if (!dtype_from_code(code, &dtype_)) {
    throw corrupt("unknown dtype code " + std::to_string(code) + " (expected 1..8)");
  }
  const uint64_t s = load_le<uint64_t>(p + 18);
  const uint64_t d = load_le<uint64_t>(p + 26);
  const uint64_t body = n - kHeaderSize;
  // Overflow-safe: each count alone must fit in the body before we multiply.
  if (s > body / 12 || d > body / 8 || s * 12 + d * 8 != body) {
    std::ostringstream os;
    os << "sizes do not add up: header says " << s << " sequences and " << d << " document indices (" << kHeaderSize
       << "+12*" << s << "+8*" << d << " bytes) but the file has " << n << " bytes";
    throw corrupt(os.str());
  }
  if (d == 0) throw corrupt("document index is empty (it must start with 0)");
  num_sequences_ = static_cast<size_t>(s);
  num_doc_entries_ = static_cast<size_t>(d);
  lengths_ = p + kHeaderSize;
  pointers_ = lengths_ + 4 * num_sequences_;
  doc_idx_ = pointers_ + 8 * num_sequences_;

  // Document index: starts at 0, non-decreasing, ends at S.
  int64_t prev = 0;
  for (size_t k = 0; k < num_doc_entries_; ++k) {
    const int64_t v = document_index(k);
    if ((k == 0 && v != 0) || v < prev || static_cast<uint64_t>(v) > s) {
      throw corrupt("document index entry " + std::to_string(k) + " = " + std::to_string(v) +
                    " is out of order or out of range [0, " + std::to_string(s) + "]");
    }
    prev = v;
  }
  if (static_cast<uint64_t>(prev) != s) {
    throw corrupt("last document index entry is " + std::to_string(prev) + " but there are " + std::to_string(s) +
                  " sequences");
  }
  check_bin_matches_index(bin_file, idx_file);
  check_pair_fingerprint(prefix, bin_, idx_);  // pair_fingerprint.hpp: what the sizes cannot show
}

// Every sequence must lie inside the .bin, and (as Megatron writes them: its index writer's
// pointers are the running sum of the sizes) back to back from byte 0, so the .bin holds exactly
// what the .idx describes. A .bin with bytes to spare, or sequences that overlap or leave gaps,
// is another corpus's index over this data (or one of them was cut or extended): its tokens would
// be read from the wrong places without a word. One pass over the index.
void IndexedDataset::check_bin_matches_index(const std::string& bin_file, const std::string& idx_file) const {
  const uint64_t item = dtype_size(dtype_);
  const uint64_t bin_size = bin_.size();
  uint64_t expected = 0;  // where the next sequence starts
  for (size_t i = 0; i < num_sequences_; ++i) {
    const int64_t len = sequence_length(i);
    const int64_t ptr = sequence_pointer(i);
    if (len < 0 || ptr < 0 || static_cast<uint64_t>(ptr) % item != 0 || static_cast<uint64_t>(ptr) > bin_size ||
        static_cast<uint64_t>(len) > (bin_size - static_cast<uint64_t>(ptr)) / item) {
      std::ostringstream os;
      os << "data file '" << bin_file << "' (" << bin_size << " bytes) does not match index '" << idx_file
         << "': sequence " << i << " has length " << len << " at byte offset " << ptr << " (" << dtype_name(dtype_)
         << "), truncated or corrupt";
      throw DataError(os.str());
    }
    if (static_cast<uint64_t>(ptr) != expected) {
      std::ostringstream os;
      os << "data file '" << bin_file << "' does not match index '" << idx_file << "': sequence " << i
         << " starts at byte " << ptr << ", not at byte " << expected
         << " where the sequences before it end (Megatron writes them back to back)";
      throw DataError(os.str());
    }
    expected += static_cast<uint64_t>(len) * item;
  }
  if (bin_size != expected) {
    std::ostringstream os;
    os << "data file '" << bin_file << "' is " << bin_size << " bytes but its index '" << idx_file << "' describes "
       << expected << " (" << num_sequences_ << " sequences of " << dtype_name(dtype_)
       << "): the two files are not one dataset, or one was cut or extended";
    throw DataError(os.str());
  }
}

int32_t IndexedDataset::sequence_length(size_t i) const { return load_le<int32_t>(lengths_ + 4 * i); }
int64_t IndexedDataset::sequence_pointer(size_t i) const { return load_le<int64_t>(pointers_ + 8 * i); }
int64_t IndexedDataset::document_index(size_t d) const { return load_le<int64_t>(doc_idx_ + 8 * d); }

std::vector<int32_t> IndexedDataset::sequence_lengths() const {
  std::vector<int32_t> out(num_sequences_);
  if (num_sequences_ > 0) std::memcpy(out.data(), lengths_, 4 * num_sequences_);
  return out;
}

TokenView IndexedDataset::view(size_t i, size_t offset, size_t length) const {
  if (i >= num_sequences_) {
    throw DataError("'" + prefix_ + "': sequence " + std::to_string(i) + " out of range (" +
                    std::to_string(num_sequences_) + " sequences)");
  }
  const size_t len = static_cast<size_t>(sequence_length(i));
  if (offset > len || length > len - offset) {
    throw DataError("'" + prefix_ + "': tokens [" + std::to_string(offset) + ", +" + std::to_string(length) +
                    ") out of range for sequence " + std::to_string(i) + " of length " + std::to_string(len));
  }
  TokenView v;
  v.dtype = dtype_;
  v.count = length;
  v.data = bin_.data() == nullptr
               ? nullptr
               : bin_.data() + static_cast<size_t>(sequence_pointer(i)) + offset * dtype_size(dtype_);
  return v;
}

void require_token_dtype(const IndexedDataset& dataset) {
  if (dataset.dtype() != DType::kFloat32 && dataset.dtype() != DType::kFloat64) return;
  throw DataError("'" + idx_path(dataset.prefix()) + "' holds " + dtype_name(dataset.dtype()) + " values (dtype code " +
                  std::to_string(static_cast<int>(dataset.dtype())) +
                  "), which cannot be token ids: a GPT dataset needs an integer dtype (1-5 or 8)");
}

void convert_tokens(const TokenView& v, int64_t* out) {
  const size_t n = v.count;
  switch (v.dtype) {
    case DType::kUInt8: {
      auto p = static_cast<const uint8_t*>(v.data);
      for (size_t k = 0; k < n; ++k) out[k] = p[k];
      break;
    }
    case DType::kInt8: {
      auto p = static_cast<const int8_t*>(v.data);
      for (size_t k = 0; k < n; ++k) out[k] = p[k];
      break;
    }
    case DType::kInt16: {
      auto p = static_cast<const int16_t*>(v.data);
      for (size_t k = 0; k < n; ++k) out[k] = p[k];
      break;
    }
    case DType::kUInt16: {
      auto p = static_cast<const uint16_t*>(v.data);
      for (size_t k = 0; k < n; ++k) out[k] = p[k];
      break;
    }
    case DType::kInt32: {
      auto p = static_cast<const int32_t*>(v.data);
      for (size_t k = 0; k < n; ++k) out[k] = p[k];
      break;
    }
    case DType::kInt64: {
      if (n) std::memcpy(out, v.data, 8 * n);
      break;
    }
    case DType::kFloat32: {
      auto p = static_cast<const float*>(v.data);
      for (size_t k = 0; k < n; ++k)
        out[k] = std::isfinite(p[k]) && std::fabs(p[k]) < 9.2e18f ? static_cast<int64_t>(p[k]) : 0;
      break;
    }
    case DType::kFloat64: {
      auto p = static_cast<const double*>(v.data);
      for (size_t k = 0; k < n; ++k)
        out[k] = std::isfinite(p[k]) && std::fabs(p[k]) < 9.2e18 ? static_cast<int64_t>(p[k]) : 0;
      break;
    }
  }
}

void IndexedDataset::get(size_t i, size_t offset, size_t length, std::vector<int64_t>* out) const {
  TokenView v = view(i, offset, length);
  const size_t base = out->size();
  out->resize(base + v.count);
  convert_tokens(v, out->data() + base);
}

std::vector<int64_t> IndexedDataset::get(size_t i) const {
  std::vector<int64_t> out;
  if (i >= num_sequences_) view(i, 0, 0);  // throws
  get(i, 0, static_cast<size_t>(sequence_length(i)), &out);
  return out;
}

// ---------------------------------------------------------------- writer

IndexedDatasetBuilder::IndexedDatasetBuilder(const std::string& bin_path, DType dtype)
    : bin_path_(bin_path), dtype_(dtype) {
  if (dtype_size(dtype) == 0) throw DataError("'" + bin_path + "': invalid dtype");
  bin_ = std::fopen(bin_path.c_str(), "wb");
  if (bin_ == nullptr) {
    throw DataError("cannot create '" + bin_path + "': " + std::strerror(errno));
  }
  std::setvbuf(bin_, nullptr, _IOFBF, 1 << 20);
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() {
  if (bin_ != nullptr) std::fclose(bin_);
}

void IndexedDatasetBuilder::write_bin(const void* data, size_t bytes) {
  if (bin_ == nullptr) throw DataError("'" + bin_path_ + "': builder already finalized");
  if (bytes > 0 && std::fwrite(data, 1, bytes, bin_) != bytes) {
    throw DataError("write error on '" + bin_path_ + "': " + std::strerror(errno));
  }
  bin_bytes_ += bytes;
}

namespace {
template <typename Out, typename In>
bool fits_int(In v) {
  return static_cast<int64_t>(v) >= static_cast<int64_t>(std::numeric_limits<Out>::min()) &&
         (std::is_same<Out, int64_t>::value ||
          static_cast<int64_t>(v) <= static_cast<int64_t>(std::numeric_limits<Out>::max()));
}
template <typename Out, typename In>
void pack(const In* in, size_t n, uint8_t* dst, const std::string& path) {
  for (size_t k = 0; k < n; ++k) {
    Out o;
    if constexpr (std::is_floating_point<Out>::value) {
      o = static_cast<Out>(in[k]);
    } else {
      if (!fits_int<Out>(in[k])) {
        throw DataError("'" + path + "': token " + std::to_string(in[k]) + " does not fit the dataset dtype");
      }
      o = static_cast<Out>(in[k]);
    }
    std::memcpy(dst + k * sizeof(Out), &o, sizeof(Out));
  }
}
}  // namespace

template <typename T>
void IndexedDatasetBuilder::add_item_impl(const T* tokens, size_t count) {
  append_impl(tokens, count);
  close_item();
}

void IndexedDatasetBuilder::append_to_item(const int32_t* tokens, size_t count) { append_impl(tokens, count); }

void IndexedDatasetBuilder::close_item() {
  lengths_.push_back(static_cast<int32_t>(open_item_));
  open_item_ = 0;
}

template <typename T>
void IndexedDatasetBuilder::append_impl(const T* tokens, size_t count) {
  if (open_item_ + count > static_cast<uint64_t>(std::numeric_limits<int32_t>::max())) {
    throw DataError("'" + bin_path_ + "': sequence of " + std::to_string(count) +
                    " tokens exceeds the int32 length field");
  }
  const size_t item = dtype_size(dtype_);
  scratch_.resize(count * item);
  uint8_t* dst = scratch_.data();
  switch (dtype_) {
    case DType::kUInt8:
      pack<uint8_t>(tokens, count, dst, bin_path_);
      break;
    case DType::kInt8:
      pack<int8_t>(tokens, count, dst, bin_path_);
      break;
    case DType::kInt16:
      pack<int16_t>(tokens, count, dst, bin_path_);
      break;
    case DType::kUInt16:
      pack<uint16_t>(tokens, count, dst, bin_path_);
      break;
    case DType::kInt32:
      pack<int32_t>(tokens, count, dst, bin_path_);
      break;
    case DType::kInt64:
      pack<int64_t>(tokens, count, dst, bin_path_);
      break;
    case DType::kFloat32:
      pack<float>(tokens, count, dst, bin_path_);
      break;
    case DType::kFloat64:
      pack<double>(tokens, count, dst, bin_path_);
      break;
  }
  write_bin(dst, count * item);
  open_item_ += count;
}

void IndexedDatasetBuilder::add_item(const int64_t* tokens, size_t count) { add_item_impl(tokens, count); }
void IndexedDatasetBuilder::add_item(const int32_t* tokens, size_t count) { add_item_impl(tokens, count); }

void IndexedDatasetBuilder::end_document() {
  if (open_item_ != 0) close_item();
  doc_idx_.push_back(static_cast<int64_t>(lengths_.size()));
}

void IndexedDatasetBuilder::add_index(const std::string& prefix) {
  IndexedDataset other(prefix);
  if (other.dtype() != dtype_) {
    throw DataError("cannot merge '" + prefix + "': dtype " + dtype_name(other.dtype()) +
                    " differs from the builder's " + dtype_name(dtype_));
  }
  const int64_t offset = static_cast<int64_t>(lengths_.size());
  for (size_t i = 0; i < other.num_sequences(); ++i) {
    TokenView v = other.view(i);
    write_bin(v.data, v.count * dtype_size(dtype_));
    lengths_.push_back(other.sequence_length(i));
  }
  for (size_t d = 1; d <= other.num_documents(); ++d) {
    doc_idx_.push_back(offset + other.document_index(d));
  }
}

void IndexedDatasetBuilder::finalize(const std::string& idx_path) {
  if (bin_ == nullptr) throw DataError("'" + bin_path_ + "': builder already finalized");
  if (open_item_ != 0) close_item();
  const int rc = std::fclose(bin_);
  bin_ = nullptr;
  if (rc != 0) throw DataError("write error on '" + bin_path_ + "': " + std::strerror(errno));

  std::FILE* f = std::fopen(idx_path.c_str(), "wb");
  if (f == nullptr) throw DataError("cannot create '" + idx_path + "': " + std::strerror(errno));
  std::vector<uint8_t> buf;
  auto put = [&buf](const void* p, size_t n) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    buf.insert(buf.end(), b, b + n);
  };
  const uint64_t version = 1;
  const uint8_t code = static_cast<uint8_t>(dtype_);
  const uint64_t s = lengths_.size();
  const uint64_t d = doc_idx_.size();
  put(kMagic, 9);
  put(&version, 8);
  put(&code, 1);
  put(&s, 8);
  put(&d, 8);
  buf.reserve(buf.size() + 12 * s + 8 * d);
  if (s) put(lengths_.data(), 4 * s);
  const int64_t item = static_cast<int64_t>(dtype_size(dtype_));
  int64_t ptr = 0;
  for (int32_t len : lengths_) {
    put(&ptr, 8);
    ptr += static_cast<int64_t>(len) * item;
  }
  put(doc_idx_.data(), 8 * d);
  const bool ok = std::fwrite(buf.data(), 1, buf.size(), f) == buf.size();
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) throw DataError("write error on '" + idx_path + "': " + std::strerror(errno));
}

}  // namespace dtk::data
