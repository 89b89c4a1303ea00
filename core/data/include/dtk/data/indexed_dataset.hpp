// dtk::data — Megatron-LM's memory-mapped indexed dataset (MMapIndexedDataset), read and write.
//
// File format (all little endian), exactly as megatron/core/datasets/indexed_dataset.py:
//   PREFIX.idx: "MMIDIDX\0\0" | u64 version (=1) | u8 dtype code | u64 S (sequence count)
//               | u64 D (document-index count = documents + 1)
//               | i32 sequence_lengths[S] | i64 sequence_pointers[S] (byte offsets into .bin)
//               | i64 document_indices[D] (sequence index where each document starts; [0]=0,
//                 [D-1]=S)
//   PREFIX.bin: the tokens of every sequence, back to back, in the dtype.
// Reading is zero-copy: both files are mmap'ed, and every count and pointer is validated against
// the file sizes when the dataset is opened, so no later access can go out of bounds.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "dtk/data/error.hpp"
#include "dtk/data/mapped_file.hpp"

namespace dtk::data {

// Megatron's numeric dtype codes (megatron/core/datasets/indexed_dataset.py, class DType).
// Note: legacy megatron/data/indexed_dataset.py mapped 6 to np.float (= float64) and 7 to
// np.double; Megatron-Core maps 6 = float64 and 7 = float32. We follow Megatron-Core.
enum class DType : uint8_t {
  kUInt8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUInt16 = 8,
};

// True and sets *out when `code` is a valid Megatron dtype code.
bool dtype_from_code(uint8_t code, DType* out);
size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
// Parses "uint16", "int32", ... (the names DTypeName returns); throws DataError.
DType dtype_from_name(const std::string& name);
// Megatron's choice for a vocabulary: uint16 when vocab_size < 65500, else int32.
DType optimal_dtype(int64_t vocab_size);

inline std::string idx_path(const std::string& prefix) { return prefix + ".idx"; }
inline std::string bin_path(const std::string& prefix) { return prefix + ".bin"; }

// A typed view of tokens inside the .bin mapping (zero-copy). `data` is aligned for `dtype`.
struct TokenView {
  const void* data = nullptr;
  size_t count = 0;
  DType dtype = DType::kUInt16;
};

class IndexedDataset {
 public:
  // Opens PREFIX.idx and PREFIX.bin; throws DataError naming the file and the problem.
  explicit IndexedDataset(const std::string& prefix);
  static bool exists(const std::string& prefix);

  const std::string& prefix() const { return prefix_; }
  DType dtype() const { return dtype_; }
  size_t num_sequences() const { return num_sequences_; }
  // Number of documents (= document index entries - 1).
  size_t num_documents() const { return num_doc_entries_ - 1; }

  // Index accessors (bounds are the caller's: i < num_sequences(), d < num_documents()+1).
  int32_t sequence_length(size_t i) const;
  int64_t sequence_pointer(size_t i) const;
  int64_t document_index(size_t d) const;
  // All sequence lengths, copied (aligned) — what index construction needs.
  std::vector<int32_t> sequence_lengths() const;

  // Tokens [offset, offset+length) of sequence i, zero-copy. Throws DataError when out of range.
  TokenView view(size_t i, size_t offset, size_t length) const;
  TokenView view(size_t i) const { return view(i, 0, static_cast<size_t>(sequence_length(i))); }
  // Appends tokens [offset, offset+length) of sequence i to `out`, converted to int64.
  void get(size_t i, size_t offset, size_t length, std::vector<int64_t>* out) const;
  std::vector<int64_t> get(size_t i) const;

 private:
  void check_bin_matches_index(const std::string& bin_file, const std::string& idx_file) const;
  std::string prefix_;
  MappedFile idx_;
  MappedFile bin_;
  DType dtype_ = DType::kUInt16;
  size_t num_sequences_ = 0;
  size_t num_doc_entries_ = 0;
  const uint8_t* lengths_ = nullptr;   // i32[S], maybe unaligned inside the mapping
  const uint8_t* pointers_ = nullptr;  // i64[S]
  const uint8_t* doc_idx_ = nullptr;   // i64[D]
};

// Converts `count` tokens of `view` to int64, writing to out[0..count).
void convert_tokens(const TokenView& view, int64_t* out);

// Throws DataError unless the dataset's dtype holds token ids (an integer one): a float
// dataset's values are not ids, and reading them as ids would silently train on garbage.
void require_token_dtype(const IndexedDataset& dataset);

// Writes PREFIX.bin while sequences are added, then PREFIX.idx on finalize(). Produces files
// byte-identical to Megatron's IndexedDatasetBuilder for the same add_item/end_document calls.
class IndexedDatasetBuilder {
 public:
  IndexedDatasetBuilder(const std::string& bin_path, DType dtype);
  ~IndexedDatasetBuilder();
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;

  // One sequence (Megatron add_item). Throws DataError if a token does not fit the dtype.
  void add_item(const int64_t* tokens, size_t count);
  void add_item(const int32_t* tokens, size_t count);
  void add_item(const std::vector<int64_t>& tokens) { add_item(tokens.data(), tokens.size()); }
  // Streams one sequence in parts: append_to_item(...)* then close_item().
  void append_to_item(const int32_t* tokens, size_t count);
  void close_item();
  // Closes the current document (Megatron end_document).
  void end_document();
  // One sequence forming one document (Megatron add_document(tokens, [len(tokens)])).
  void add_document(const std::vector<int64_t>& tokens) {
    add_item(tokens);
    end_document();
  }
  // Appends a whole existing dataset of the same dtype (Megatron add_index).
  void add_index(const std::string& prefix);
  // Flushes .bin and writes the .idx file.
  void finalize(const std::string& idx_path);

  size_t num_sequences() const { return lengths_.size(); }
  size_t num_documents() const { return doc_idx_.size() - 1; }
  uint64_t bytes_written() const { return bin_bytes_; }

 private:
  template <typename T>
  void add_item_impl(const T* tokens, size_t count);
  template <typename T>
  void append_impl(const T* tokens, size_t count);
  void write_bin(const void* data, size_t bytes);

  std::string bin_path_;
  DType dtype_;
  std::FILE* bin_ = nullptr;
  uint64_t bin_bytes_ = 0;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_idx_{0};
  std::vector<uint8_t> scratch_;
  uint64_t open_item_ = 0;  // tokens appended to the item not yet closed
};

}  // namespace dtk::data
