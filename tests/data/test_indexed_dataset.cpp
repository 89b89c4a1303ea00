#include <gtest/gtest.h>

#include <cstring>

#include "dtk/data/indexed_dataset.hpp"
#include "test_util.hpp"

namespace dtk::data {
namespace {

using test::read_file;
using test::TempDir;
using test::write_file;

const DType kAllDTypes[] = {DType::kUInt8, DType::kInt8,    DType::kInt16,   DType::kInt32,
                            DType::kInt64, DType::kFloat64, DType::kFloat32, DType::kUInt16};

void build(const std::string& prefix, DType dtype, const std::vector<std::vector<int64_t>>& docs) {
  IndexedDatasetBuilder b(bin_path(prefix), dtype);
  for (const auto& d : docs) b.add_document(d);
  b.finalize(idx_path(prefix));
}

TEST(IndexedDataset, DTypeCodesAreMegatrons) {
  EXPECT_EQ(static_cast<int>(DType::kUInt8), 1);
  EXPECT_EQ(static_cast<int>(DType::kInt8), 2);
  EXPECT_EQ(static_cast<int>(DType::kInt16), 3);
  EXPECT_EQ(static_cast<int>(DType::kInt32), 4);
  EXPECT_EQ(static_cast<int>(DType::kInt64), 5);
  EXPECT_EQ(static_cast<int>(DType::kFloat64), 6);
  EXPECT_EQ(static_cast<int>(DType::kFloat32), 7);
  EXPECT_EQ(static_cast<int>(DType::kUInt16), 8);
  EXPECT_EQ(optimal_dtype(50257), DType::kUInt16);
  EXPECT_EQ(optimal_dtype(65499), DType::kUInt16);
  EXPECT_EQ(optimal_dtype(65500), DType::kInt32);
  EXPECT_EQ(dtype_from_name("float32"), DType::kFloat32);
  EXPECT_THROW(dtype_from_name("bfloat16"), DataError);
}

TEST(IndexedDataset, RoundTripEveryDType) {
  TempDir dir;
  const std::vector<std::vector<int64_t>> docs = {{1, 2, 3}, {}, {100, 0, 7, 127}, {5}};
  for (DType dt : kAllDTypes) {
    const std::string prefix = dir / (std::string("rt_") + dtype_name(dt));
    build(prefix, dt, docs);
    IndexedDataset ds(prefix);
    EXPECT_EQ(ds.dtype(), dt);
    EXPECT_EQ(ds.num_sequences(), 4u);
    EXPECT_EQ(ds.num_documents(), 4u);
    for (size_t i = 0; i < docs.size(); ++i) {
      EXPECT_EQ(ds.get(i), docs[i]) << dtype_name(dt) << " seq " << i;
      EXPECT_EQ(ds.document_index(i + 1), static_cast<int64_t>(i + 1));
    }
    std::vector<int64_t> part;
    ds.get(2, 1, 2, &part);
    EXPECT_EQ(part, (std::vector<int64_t>{0, 7}));
    EXPECT_THROW(ds.get(2, 3, 2, &part), DataError);
    EXPECT_THROW(ds.get(4), DataError);
    TokenView v = ds.view(2);
    EXPECT_EQ(v.count, 4u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % dtype_size(dt), 0u);
  }
}

// The exact bytes Megatron's IndexedDatasetBuilder(dtype=numpy.uint16) writes for
// add_item([1,2,3]); add_item([4]); end_document(); add_item([5,6]); end_document().
TEST(IndexedDataset, ByteIdenticalToMegatron) {
  TempDir dir;
  const std::string prefix = dir / "m";
  {
    IndexedDatasetBuilder b(bin_path(prefix), DType::kUInt16);
    b.add_item(std::vector<int64_t>{1, 2, 3});
    b.add_item(std::vector<int64_t>{4});
    b.end_document();
    b.add_item(std::vector<int64_t>{5, 6});
    b.end_document();
    b.finalize(idx_path(prefix));
  }
  std::string expect_idx("MMIDIDX\0\0", 9);
  auto u64 = [&](uint64_t v) { expect_idx.append(reinterpret_cast<const char*>(&v), 8); };
  auto i32 = [&](int32_t v) { expect_idx.append(reinterpret_cast<const char*>(&v), 4); };
  u64(1);
  expect_idx.push_back(8);  // uint16
  u64(3);                   // sequences
  u64(3);                   // document index entries: [0, 2, 3]
  i32(3);
  i32(1);
  i32(2);  // lengths
  u64(0);
  u64(6);
  u64(8);  // byte pointers
  u64(0);
  u64(2);
  u64(3);  // document index
  EXPECT_EQ(read_file(idx_path(prefix)), expect_idx);
  const uint16_t toks[] = {1, 2, 3, 4, 5, 6};
  EXPECT_EQ(read_file(bin_path(prefix)), std::string(reinterpret_cast<const char*>(toks), 12));

  IndexedDataset ds(prefix);
  EXPECT_EQ(ds.num_documents(), 2u);
  EXPECT_EQ(ds.get(1), (std::vector<int64_t>{4}));
}

TEST(IndexedDataset, AddIndexConcatenates) {
  TempDir dir;
  build(dir / "a", DType::kInt32, {{1, 2}, {3}});
  build(dir / "b", DType::kInt32, {{4, 5, 6}});
  IndexedDatasetBuilder b(bin_path(dir / "c"), DType::kInt32);
  b.add_index(dir / "a");
  b.add_index(dir / "b");
  b.finalize(idx_path(dir / "c"));
  IndexedDataset c(dir / "c");
  ASSERT_EQ(c.num_sequences(), 3u);
  EXPECT_EQ(c.num_documents(), 3u);
  EXPECT_EQ(c.get(2), (std::vector<int64_t>{4, 5, 6}));
  EXPECT_EQ(c.sequence_pointer(2), 12);
  IndexedDatasetBuilder wrong(bin_path(dir / "d"), DType::kUInt16);
  EXPECT_THROW(wrong.add_index(dir / "a"), DataError);
}

TEST(IndexedDataset, TokenOutOfDTypeRangeIsAnError) {
  TempDir dir;
  IndexedDatasetBuilder b(bin_path(dir / "x"), DType::kUInt16);
  EXPECT_THROW(b.add_item(std::vector<int64_t>{70000}), DataError);
  EXPECT_THROW(b.add_item(std::vector<int64_t>{-1}), DataError);
}

std::string error_of(const std::string& prefix) {
  try {
    IndexedDataset ds(prefix);
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

TEST(IndexedDataset, CorruptFilesGiveOneLineErrorsNamingTheFile) {
  TempDir dir;
  const std::string prefix = dir / "ok";
  build(prefix, DType::kUInt16, {{1, 2, 3}, {4, 5}});
  const std::string idx = read_file(idx_path(prefix));
  const std::string bin = read_file(bin_path(prefix));
  auto expect_error = [&](const std::string& name, const std::string& idx_bytes, const std::string& bin_bytes,
                          const std::string& needle) {
    const std::string p = dir / name;
    write_file(idx_path(p), idx_bytes);
    write_file(bin_path(p), bin_bytes);
    const std::string err = error_of(p);
    EXPECT_NE(err.find(needle), std::string::npos) << name << ": " << err;
    EXPECT_NE(err.find(p), std::string::npos) << name << ": " << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << name << ": " << err;
  };
  std::string bad = idx;
  bad[0] = 'X';
  expect_error("magic", bad, bin, "header magic is not MMIDIDX");
  bad = idx;
  bad[9] = 2;
  expect_error("version", bad, bin, "unsupported version 2");
  bad = idx;
  bad[17] = 9;
  expect_error("dtype", bad, bin, "unknown dtype code 9");
  expect_error("short", idx.substr(0, 20), bin, "shorter than the 34-byte header");
  expect_error("trunc", idx.substr(0, idx.size() - 1), bin, "sizes do not add up");
  bad = idx;
  bad[18] = static_cast<char>(0xff);
  bad[25] = static_cast<char>(0x7f);
  expect_error("huge", bad, bin, "sizes do not add up");
  expect_error("binshort", idx, bin.substr(0, bin.size() - 2), "truncated or corrupt");
  // A .bin longer than its .idx describes (a byte, a token), or sequences that do not lie back to
  // back: another corpus's index, or a cut or extended file.
  expect_error("binbyte", idx, bin + "x", "is 11 bytes but its index");
  expect_error("bintoken", idx, bin + "xy", "is 12 bytes but its index");
  EXPECT_NE(error_of(dir / "bintoken").find("describes 10 (2 sequences of uint16)"), std::string::npos)
      << error_of(dir / "bintoken");
  bad = idx;
  bad[34 + 2 * 4 + 8] = 4;  // sequence 1's pointer: byte 4, inside sequence 0 (which ends at 6)
  expect_error("overlap", bad, bin, "sequence 1 starts at byte 4, not at byte 6");
  bad = idx;
  bad[34 + 2 * 12] = 1;  // document index [0] := 1
  expect_error("docidx", bad, bin, "document index entry 0");
  EXPECT_NE(error_of(dir / "missing").find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace dtk::data
