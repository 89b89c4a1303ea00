#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "dtk/data/gpt_dataset.hpp"
#include "test_util.hpp"

namespace dtk::data {
namespace {

using test::TempDir;

// Builds a dataset of `num_docs` documents with random lengths; token t of document d is
// d * 1000 + t (so every sample tells which documents and offsets it came from).
std::shared_ptr<const IndexedDataset> make_data(const std::string& prefix, int num_docs, int min_len, int max_len,
                                                uint32_t seed) {
  std::mt19937 gen(seed);
  IndexedDatasetBuilder b(bin_path(prefix), DType::kInt32);
  for (int d = 0; d < num_docs; ++d) {
    const int len = min_len + static_cast<int>(gen() % static_cast<uint32_t>(max_len - min_len + 1));
    std::vector<int64_t> doc;
    for (int t = 0; t < len; ++t) doc.push_back(d * 1000 + t);
    b.add_document(doc);
  }
  b.finalize(idx_path(prefix));
  return std::make_shared<const IndexedDataset>(prefix);
}

TEST(Split, MegatronNormalization) {
  using A = std::array<size_t, 4>;
  EXPECT_EQ(split_boundaries("969,30,1", 1000), (A{0, 969, 999, 1000}));
  EXPECT_EQ(split_boundaries("969,30,1", 10), (A{0, 10, 10, 10}));
  EXPECT_EQ(split_boundaries("1,1,1", 100), (A{0, 34, 67, 100}));  // round -> [0,33,66,99], shifted
  EXPECT_EQ(split_boundaries("80/20", 10), (A{0, 8, 10, 10}));
  EXPECT_EQ(split_boundaries("1", 7), (A{0, 7, 7, 7}));
  EXPECT_EQ(split_boundaries("98, 2, 0", 50), (A{0, 49, 50, 50}));
  EXPECT_EQ(split_boundaries("1,1", 5), (A{0, 3, 5, 5}));  // round half even: [0,2,4,4] +1
  for (const char* bad : {"a", "", "1,x,2", "-1,2,3", "0,0,0", "1,,2", "nan"}) {
    try {
      split_boundaries(bad, 100);
      ADD_FAILURE() << bad;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find("invalid split"), std::string::npos) << e.what();
    }
  }
}

TEST(GptIndices, HandComputedEpochs) {
  EXPECT_EQ(num_epochs(100, 10, 9), 1);
  EXPECT_EQ(num_epochs(100, 10, 10), 2);
  EXPECT_EQ(num_epochs(100, 10, 19), 2);
  EXPECT_EQ(num_epochs(100, 10, 20), 3);
  EXPECT_EQ(num_epochs(100, 10, 0), 1);
  EXPECT_FALSE(separate_last_epoch(100, 10, 9, 1));
  EXPECT_TRUE(separate_last_epoch(100, 10, 10, 2));   // last epoch supplies 1 of 9 samples
  EXPECT_FALSE(separate_last_epoch(100, 10, 17, 2));  // 8 >= int(0.8 * 9) = 7
  EXPECT_TRUE(separate_last_epoch(100, 10, 15, 2));   // 6 < 7
}

TEST(GptIndices, HandComputedSampleIdx) {
  // Documents of 4, 3, 5 tokens in this order, seq_length 3 (4 tokens per sample, sharing one).
  const std::vector<int32_t> sizes = {4, 3, 5};
  const std::vector<int32_t> doc_idx = {0, 1, 2};
  const auto s = build_sample_idx(sizes, doc_idx, 3, 1, 12);
  // (12 - 1) / 3 = 3 samples: tokens [0,4) [3,7) [6,10) of the 12-token stream.
  EXPECT_EQ(s, (std::vector<int64_t>{0, 0, 0, 3, 1, 2, 2, 2}));
}

// The reference lines of fixtures/megatron_order.txt (made by tools/fixtures/megatron_order.py
// with numpy; see there): "KEY: v v v ..." after a header line.
std::vector<int64_t> numbers(const std::string& line) {
  std::vector<int64_t> v;
  std::istringstream in(line.substr(line.find(':') + 1));
  for (int64_t x; in >> x;) v.push_back(x);
  return v;
}

std::vector<std::string> fixture_lines() {
  std::ifstream in(std::string(DTK_DATA_FIXTURES_DIR) + "/megatron_order.txt");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  EXPECT_GT(lines.size(), 5u) << "fixtures/megatron_order.txt is missing or empty";
  return lines;
}

// key=value of a fixture header line.
int64_t field(const std::string& header, const std::string& key) {
  const size_t at = header.find(" " + key + "=");
  EXPECT_NE(at, std::string::npos) << key << " in " << header;
  return std::stoll(header.substr(at + key.size() + 2));
}

// numpy.random.RandomState(seed).shuffle(numpy.arange(n)), as numpy computed it.
TEST(GptIndices, ShuffleEqualsNumpyRandomState) {
  int checked = 0;
  for (const std::string& line : fixture_lines()) {
    if (line.rfind("shuffle ", 0) != 0) continue;
    std::istringstream head(line.substr(8));
    uint64_t seed = 0;
    size_t n = 0;
    head >> seed >> n;
    std::vector<int64_t> a(n);
    for (size_t i = 0; i < n; ++i) a[i] = static_cast<int64_t>(i);
    NumpyRandomState(seed).shuffle(a.data(), a.size());
    EXPECT_EQ(a, numbers(line)) << line.substr(0, line.find(':'));
    ++checked;
  }
  EXPECT_EQ(checked, 5);
}

// random_interval's masks: 64-bit draws (high word first) above 2^32 - 1, 32-bit ones below; numpy
// seeds MT19937 as std::mt19937 does, and refuses seeds outside [0, 2^32).
TEST(GptIndices, NumpyIntervalAndSeedRange) {
  NumpyRandomState a(5), b(5);
  std::mt19937 ref(5);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(a.next32(), ref());
  const uint64_t big = (uint64_t{1} << 40) + 12345;  // mask 2^41 - 1
  for (int i = 0; i < 50; ++i) {
    uint64_t want;
    do {
      const uint64_t high = b.next32();
      want = ((high << 32) | b.next32()) & ((uint64_t{1} << 41) - 1);
    } while (want > big);
    EXPECT_EQ(a.interval(big), want);
  }
  EXPECT_EQ(a.interval(0), 0u);
  NumpyRandomState top(4294967295u);
  try {
    NumpyRandomState bad(uint64_t{1} << 32);
    ADD_FAILURE() << "seed 2^32 accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("seed 4294967296 is outside [0, 4294967295]"), std::string::npos)
        << e.what();
  }
}

// Megatron-core's document, sample and shuffle indices for one epoch, a separate last epoch, a
// last epoch shuffled with the others, and 25 epochs, as the numpy reference computed them.
TEST(GptIndices, EqualMegatronsForTheSameDocumentsSplitAndSeed) {
  TempDir dir;
  int checked = 0;
  const std::vector<std::string> lines = fixture_lines();
  for (size_t l = 0; l + 3 < lines.size(); ++l) {
    const std::string& h = lines[l];
    if (h.rfind("indices ", 0) != 0) continue;
    const int64_t docs = field(h, "docs");
    IndexedDatasetBuilder b(bin_path(dir / ("m" + std::to_string(l))), DType::kInt32);
    for (int64_t d = 0; d < docs; ++d) {  // the fixture's sizes: (d * 37) % 23 + 1
      std::vector<int64_t> doc;
      for (int64_t t = 0; t < (d * 37) % 23 + 1; ++t) doc.push_back(d * 1000 + t);
      b.add_document(doc);
    }
    b.finalize(idx_path(dir / ("m" + std::to_string(l))));
    auto data = std::make_shared<const IndexedDataset>(dir / ("m" + std::to_string(l)));
    GptDatasetOptions o;
    o.seq_length = field(h, "seq_length");
    o.num_samples = field(h, "num_samples");
    o.seed = static_cast<uint64_t>(field(h, "seed"));
    o.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
    GPTDataset ds(data, static_cast<size_t>(field(h, "first")), static_cast<size_t>(field(h, "end")), o);
    EXPECT_EQ(ds.num_epochs(), field(h, "epochs")) << h;
    auto all = [](const NpyArray& a) {
      std::vector<int64_t> v(a.size());
      for (size_t i = 0; i < a.size(); ++i) v[i] = a[i];
      return v;
    };
    EXPECT_EQ(all(ds.doc_idx()), numbers(lines[l + 1])) << h;
    EXPECT_EQ(all(ds.sample_idx()), numbers(lines[l + 2])) << h;
    EXPECT_EQ(all(ds.shuffle_idx()), numbers(lines[l + 3])) << h;
    ++checked;
  }
  EXPECT_EQ(checked, 4);
}

// Megatron-core's GPTDatasetConfig options Megatron-LM's pretraining leaves on:
// add_extra_token_to_sequence=False (samples of seq_length tokens, the last label padding) and
// drop_last_partial_validation_sequence=False (the valid split keeps its last partial sample,
// padded), and num_samples=None (one epoch): the indices, and GPTDataset.__getitem__'s tokens,
// labels and loss masks of every sample, as the numpy reference computed them.
TEST(GptIndices, MegatronCoreOptionsEqualTheReference) {
  TempDir dir;
  int checked = 0;
  const std::vector<std::string> lines = fixture_lines();
  for (size_t l = 0; l + 6 < lines.size(); ++l) {
    const std::string& h = lines[l];
    if (h.rfind("variant ", 0) != 0) continue;
    const int64_t docs = field(h, "docs");
    const std::string prefix = dir / ("v" + std::to_string(l));
    IndexedDatasetBuilder b(bin_path(prefix), DType::kInt32);
    for (int64_t d = 0; d < docs; ++d) {
      std::vector<int64_t> doc;
      for (int64_t t = 0; t < (d * 37) % 23 + 1; ++t) doc.push_back(d * 1000 + t);
      b.add_document(doc);
    }
    b.finalize(idx_path(prefix));
    auto data = std::make_shared<const IndexedDataset>(prefix);
    GptDatasetOptions o;
    o.seq_length = field(h, "seq_length");
    o.whole_epoch = h.find(" num_samples=none ") != std::string::npos;
    if (!o.whole_epoch) o.num_samples = field(h, "num_samples");
    o.seed = static_cast<uint64_t>(field(h, "seed"));
    o.add_extra_token = field(h, "extra") == 1;
    o.drop_last_partial_validation = field(h, "drop_last") == 1;
    o.name = "valid";  // the split drop_last_partial_validation applies to
    o.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
    GPTDataset ds(data, static_cast<size_t>(field(h, "first")), static_cast<size_t>(field(h, "end")), o);
    EXPECT_EQ(ds.num_epochs(), field(h, "epochs")) << h;
    ASSERT_EQ(static_cast<int64_t>(ds.size()), field(h, "samples")) << h;
    EXPECT_EQ(ds.sample_length(), static_cast<size_t>(o.seq_length + (o.add_extra_token ? 1 : 0)));
    auto all = [](const NpyArray& a) {
      std::vector<int64_t> v(a.size());
      for (size_t i = 0; i < a.size(); ++i) v[i] = a[i];
      return v;
    };
    EXPECT_EQ(all(ds.doc_idx()), numbers(lines[l + 1])) << h;
    EXPECT_EQ(all(ds.sample_idx()), numbers(lines[l + 2])) << h;
    EXPECT_EQ(all(ds.shuffle_idx()), numbers(lines[l + 3])) << h;
    std::vector<int64_t> tokens, labels, mask;
    for (size_t i = 0; i < ds.size(); ++i) {
      std::vector<int64_t> text;
      std::vector<float> loss_mask;
      const std::vector<int64_t> sample = ds.get(i);
      megatron_step_inputs(sample.data(), sample.size(), o.seq_length, &text, &loss_mask);
      ASSERT_EQ(text.size(), static_cast<size_t>(o.seq_length + 1));
      tokens.insert(tokens.end(), text.begin(), text.end() - 1);
      labels.insert(labels.end(), text.begin() + 1, text.end());
      for (float m : loss_mask) mask.push_back(static_cast<int64_t>(m));
    }
    EXPECT_EQ(tokens, numbers(lines[l + 4])) << h;
    EXPECT_EQ(labels, numbers(lines[l + 5])) << h;
    EXPECT_EQ(mask, numbers(lines[l + 6])) << h;
    // The same options through the cache: written, then read back as the same indices.
    GptDatasetOptions c = o;
    c.cache_mode = GptDatasetOptions::CacheMode::kBuild;
    c.cache_dir = dir / ("cache" + std::to_string(l));
    GPTDataset written(data, static_cast<size_t>(field(h, "first")), static_cast<size_t>(field(h, "end")), c);
    GPTDataset read(data, static_cast<size_t>(field(h, "first")), static_cast<size_t>(field(h, "end")), c);
    EXPECT_FALSE(written.loaded_from_cache());
    EXPECT_TRUE(read.loaded_from_cache()) << h;
    EXPECT_EQ(all(read.sample_idx()), numbers(lines[l + 2])) << h;
    ++checked;
  }
  EXPECT_EQ(checked, 8);
  // Only Megatron-core has these options.
  TempDir d2;
  auto data = make_data(d2 / "x", 10, 3, 10, 1);
  GptDatasetOptions legacy;
  legacy.order = MegatronOrder::kLegacy;
  legacy.num_samples = 3;
  legacy.seq_length = 4;
  legacy.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
  legacy.add_extra_token = false;
  try {
    GPTDataset g(data, 0, 10, legacy);
    ADD_FAILURE() << "legacy order accepted add_extra_token=false";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("megatron_legacy has no add_extra_token=false"), std::string::npos) << e.what();
  }
}

// An independent, deliberately naive reimplementation of Megatron's algorithm: concatenate
// the documents in doc_idx order; sample j is tokens [j*L, j*L + L + 1) of that stream.
TEST(GptIndices, MatchesNaiveReimplementation) {
  TempDir dir;
  for (uint32_t seed : {1u, 2u, 3u}) {
    auto data = make_data(dir / ("d" + std::to_string(seed)), 40, 0, 30, seed);
    for (int64_t seq_len : {1, 7, 64}) {
      for (int64_t num_samples : {1, 50, 333}) {
        GptDatasetOptions o;
        o.seq_length = seq_len;
        o.num_samples = num_samples;
        o.seed = seed * 11;
        o.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
        GPTDataset ds(data, 5, 35, o);
        // Independent expectations.
        int64_t tokens = 0;
        for (size_t d = 5; d < 35; ++d) tokens += data->sequence_length(d);
        int64_t epochs = 1;
        while ((epochs * tokens - 1) / seq_len < num_samples) ++epochs;
        ASSERT_EQ(ds.num_epochs(), epochs);
        const int64_t total = (epochs * tokens - 1) / seq_len;
        ASSERT_EQ(static_cast<int64_t>(ds.size()), total);
        ASSERT_GE(total, num_samples);
        // Document index: numpy's legacy shuffle, written again here: MT19937, j in [0, i] by
        // masked rejection over 32-bit draws.
        std::mt19937 gen(static_cast<uint32_t>(o.seed));
        auto upto = [&](uint32_t max) {
          uint32_t mask = max;
          for (int s = 1; s < 32; s *= 2) mask |= mask >> s;
          uint32_t x;
          do x = gen() & mask;
          while (x > max);
          return x;
        };
        auto shuffle = [&](auto* a, size_t n) {
          for (size_t i = n; i > 1; --i) std::swap(a[i - 1], a[upto(static_cast<uint32_t>(i - 1))]);
        };
        const int64_t per_epoch = (tokens - 1) / seq_len;
        const int64_t before_last = ((epochs - 1) * tokens - 1) / seq_len;
        const bool separate = epochs > 1 && (num_samples - before_last) < static_cast<int64_t>(0.8 * per_epoch);
        std::vector<int32_t> doc_idx;
        for (int64_t e = 0; e < epochs; ++e)
          for (int32_t d = 5; d < 35; ++d) doc_idx.push_back(d);
        if (separate) {
          shuffle(doc_idx.data(), doc_idx.size() - 30);
          shuffle(doc_idx.data() + doc_idx.size() - 30, 30);
        } else {
          shuffle(doc_idx.data(), doc_idx.size());
        }
        ASSERT_EQ(ds.doc_idx().size(), doc_idx.size());
        for (size_t k = 0; k < doc_idx.size(); ++k) ASSERT_EQ(ds.doc_idx()[k], doc_idx[k]);
        std::vector<int64_t> stream;
        for (int32_t d : doc_idx) {
          const auto v = data->get(static_cast<size_t>(d));
          stream.insert(stream.end(), v.begin(), v.end());
        }
        std::vector<int64_t> shuffle_idx(static_cast<size_t>(total));
        for (int64_t k = 0; k < total; ++k) shuffle_idx[static_cast<size_t>(k)] = k;
        const int64_t first = separate ? before_last : total;
        shuffle(shuffle_idx.data(), static_cast<size_t>(first));
        shuffle(shuffle_idx.data() + first, static_cast<size_t>(total - first));
        for (size_t i = 0; i < ds.size(); ++i) {
          const int64_t j = shuffle_idx[i];
          ASSERT_EQ(ds.shuffle_idx()[i], j);
          const std::vector<int64_t> want(stream.begin() + j * seq_len, stream.begin() + j * seq_len + seq_len + 1);
          ASSERT_EQ(ds.get(i), want) << "seed " << seed << " L " << seq_len << " N " << num_samples << " i " << i;
        }
      }
    }
  }
}

TEST(GptDataset, CacheIsWrittenReusedAndValidated) {
  TempDir dir;
  auto data = make_data(dir / "c", 50, 1, 40, 5);
  GptDatasetOptions o;
  o.seq_length = 16;
  o.num_samples = 100;
  o.seed = 3;
  GPTDataset a(data, 0, 45, o);
  EXPECT_FALSE(a.loaded_from_cache());
  // Megatron-core's default place and names: PREFIX/cache/GPTDataset_indices/<md5>-GPTDataset-train-*.
  const std::string f = a.cache_file("doc_idx");
  EXPECT_EQ(f.rfind(dir / "c/cache/GPTDataset_indices/", 0), 0u) << f;
  EXPECT_EQ(f.substr(f.size() - 25), "-train-document_index.npy") << f;
  EXPECT_EQ(test::read_file(a.cache_file("description")), a.description());
  for (const char* w : {"doc_idx", "sample_idx", "shuffle_idx", "description"})
    EXPECT_TRUE(test::file_exists(a.cache_file(w)));
  GPTDataset b(data, 0, 45, o);
  EXPECT_TRUE(b.loaded_from_cache());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a.get(i), b.get(i));
  // A corrupt cache is rebuilt.
  test::write_file(a.cache_file("sample_idx"), "garbage");
  GPTDataset c(data, 0, 45, o);
  EXPECT_FALSE(c.loaded_from_cache());
  EXPECT_EQ(c.get(7), a.get(7));
  // Another seed, another description, another file.
  o.seed = 4;
  EXPECT_NE(GPTDataset(data, 0, 45, o).cache_file("doc_idx"), f);
  // Legacy: DIR/index-cache/<md5>_doc_idx.npy, or --data-cache-path.
  o.order = MegatronOrder::kLegacy;
  o.name = "valid";
  GPTDataset d(data, 45, 50, o);
  EXPECT_EQ(d.cache_file("doc_idx").rfind(dir / "index-cache/", 0), 0u) << d.cache_file("doc_idx");
  EXPECT_EQ(test::read_file(d.cache_file("description")), d.description());
  EXPECT_EQ(d.description(), "GPT Dataset\n\nData prefix " + (dir / "c") +
                                 "\nDataset name valid\nNumber of samples 100\nSequence length 16\nRandom seed 4\n"
                                 "Split 969, 30, 1\n");
  o.cache_dir = dir / "elsewhere";
  GPTDataset e(data, 45, 50, o);
  EXPECT_TRUE(e.loaded_from_cache()) << "the index-cache next to the data is looked in first";
  EXPECT_THROW(d.get(d.size()), DataError);
}

// A cache_dir that does not exist yet is created (nested too), as Megatron creates its
// --data-cache-path; one that cannot be created is one clear error.
// Token ids are integers: an index whose dtype is float32 or float64 is refused, naming the file.
TEST(GptDataset, FloatDataIsNotTokens) {
  TempDir dir;
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    const std::string prefix = dir / dtype_name(dt);
    IndexedDatasetBuilder b(bin_path(prefix), dt);
    b.add_document({1, 2, 3, 4, 5, 6, 7, 8, 9});
    b.finalize(idx_path(prefix));
    auto data = std::make_shared<const IndexedDataset>(prefix);
    GptDatasetOptions o;
    o.seq_length = 4;
    o.num_samples = 1;
    o.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
    try {
      GPTDataset ds(data, 0, 1, o);
      ADD_FAILURE() << dtype_name(dt) << " data accepted as tokens";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(idx_path(prefix) + "' holds " + dtype_name(dt) + " values"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(GptDataset, CacheDirIsCreated) {
  TempDir dir;
  auto data = make_data(dir / "c", 20, 5, 30, 4);
  GptDatasetOptions o;
  o.seq_length = 8;
  o.num_samples = 30;
  o.cache_dir = dir / "new/cache";
  GPTDataset a(data, 0, 20, o);
  EXPECT_TRUE(std::ifstream(a.cache_file("shuffle_idx")).good()) << a.cache_file("shuffle_idx");
  std::ofstream(dir / "file") << "x";
  o.cache_dir = dir / "file/cache";
  try {
    GPTDataset b(data, 0, 20, o);
    ADD_FAILURE() << "a cache_dir under a file was accepted";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create the index cache directory"), std::string::npos) << e.what();
  }
}

TEST(GptDataset, WaitOnlyWaitsForTheBuilder) {
  TempDir dir;
  auto data = make_data(dir / "w", 30, 5, 20, 9);
  GptDatasetOptions o;
  o.seq_length = 8;
  o.num_samples = 40;
  o.cache_mode = GptDatasetOptions::CacheMode::kWaitOnly;
  o.wait_timeout_s = 0.3;
  try {
    GPTDataset never(data, 0, 30, o);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  o.wait_timeout_s = 30;
  std::unique_ptr<GPTDataset> waiter;
  std::thread t([&] { waiter = std::make_unique<GPTDataset>(data, 0, 30, o); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  GptDatasetOptions ob = o;
  ob.cache_mode = GptDatasetOptions::CacheMode::kBuild;
  GPTDataset builder(data, 0, 30, ob);
  t.join();
  ASSERT_TRUE(waiter);
  EXPECT_TRUE(waiter->loaded_from_cache());
  EXPECT_EQ(waiter->get(3), builder.get(3));
}

TEST(GptDataset, TooSmallIsAClearError) {
  TempDir dir;
  auto data = make_data(dir / "s", 3, 2, 2, 1);  // 6 tokens
  GptDatasetOptions o;
  o.seq_length = 8;
  o.num_samples = 0;
  o.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
  try {
    GPTDataset ds(data, 0, 3, o);
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("too small for one sample"), std::string::npos) << e.what();
  }
  // As Megatron: samples asked for from a split shorter than one come from its epochs repeated.
  o.num_samples = 3;
  GPTDataset ds(data, 0, 3, o);
  EXPECT_EQ(ds.num_epochs(), 5);
  EXPECT_EQ(ds.size(), 3u);
  EXPECT_THROW(GPTDataset(data, 2, 2, o), DataError);
  EXPECT_THROW(GPTDataset(data, 0, 4, o), DataError);
}

TEST(Blending, GreedyRatiosWithinOnePercent) {
  std::vector<int16_t> di;
  std::vector<int64_t> dsi;
  const auto w = normalize_weights({3, 5, 2});
  build_blending_indices(w, 10000, &di, &dsi);
  std::map<int, int64_t> count;
  for (size_t i = 0; i < di.size(); ++i) {
    EXPECT_EQ(dsi[i], count[di[i]]);
    ++count[di[i]];
  }
  for (int k = 0; k < 3; ++k) EXPECT_NEAR(static_cast<double>(count[k]) / 10000.0, w[static_cast<size_t>(k)], 0.01);
  // Hand-computed start: i=0 and i=1 both use max(i,1)=1; errors .3/.5/.2 -> 1, then .3/-.5/.2 -> 0.
  EXPECT_EQ(di[0], 1);
  EXPECT_EQ(di[1], 0);
  EXPECT_EQ(blend_samples_per_dataset({0.3, 0.7}, 1000), (std::vector<int64_t>{302, 704}));
  EXPECT_THROW(normalize_weights({}), DataError);
  EXPECT_THROW(normalize_weights({0, 0}), DataError);
  EXPECT_THROW(normalize_weights({0, 1}), DataError);  // a dataset asked for no samples
  EXPECT_THROW(normalize_weights({1, -1}), DataError);
}

TEST(Blending, DataPathAndEndToEnd) {
  TempDir dir;
  make_data(dir / "a", 200, 10, 50, 1);
  make_data(dir / "b", 100, 10, 50, 2);
  // Megatron's get_blend_from_list: pairs whose first words are not numbers are prefixes without
  // weights; a mix of numbers and prefixes is an error.
  const DataBlend u = parse_data_path("x " + (dir / "a"));
  EXPECT_FALSE(u.weighted);
  EXPECT_EQ(u.prefixes, (std::vector<std::string>{"x", dir / "a"}));
  EXPECT_THROW(parse_data_path("0.3 a b c"), DataError);
  EXPECT_THROW(parse_data_path("0.3 a 0.7"), DataError);
  EXPECT_THROW(parse_data_path(""), DataError);
  const DataBlend b = parse_data_path("3 " + (dir / "a") + " 7 " + (dir / "b"));
  EXPECT_TRUE(b.weighted);
  EXPECT_EQ(b.weights, (std::vector<double>{3, 7}));
  GptDatasetOptions o;
  o.seq_length = 32;
  o.seed = 5;
  o.cache_dir = dir.path();
  o.split = "90,10,0";
  const auto tvt =
      build_train_valid_test_datasets("0.3 " + (dir / "a") + " 0.7 " + (dir / "b"), {10000, 100, 0}, o);
  ASSERT_TRUE(tvt.train && tvt.valid);
  EXPECT_FALSE(tvt.test);
  EXPECT_EQ(tvt.train->size(), 10000u);
  int from_a = 0;
  for (size_t i = 0; i < tvt.train->size(); ++i) {
    const auto s = tvt.train->get(i);
    ASSERT_EQ(s.size(), 33u);
    // Dataset a has 200 docs, ids < 200*1000; the tokens of b are < 100*1000 too, so tell them
    // apart by the blended index instead.
    from_a += static_cast<const BlendedDataset&>(*tvt.train).dataset_of(i) == 0;
  }
  EXPECT_NEAR(from_a / 10000.0, 0.3, 0.01);
  o.split = "969,30,1";
  const auto single = build_train_valid_test_datasets(dir / "a", {50, 5, 5}, o);
  ASSERT_TRUE(single.train);
  EXPECT_GE(single.train->size(), 50u);
  o.split = "1";
  EXPECT_THROW(build_train_valid_test_datasets(dir / "missing", {1, 0, 0}, o), DataError);
}

// eval.full_validation asks for a split whole (kWholeSplit): a single prefix's split is one epoch
// of its documents, every sample once, as Megatron-core's num_samples None builds it (whose indices
// GptIndices.MegatronCoreOptionsEqualTheReference proves). A blend without weights reads one epoch
// of each prefix, every sample once (Megatron-core's exhaustive blending, whose order and cache
// MegatronCaches.ExhaustiveBlendAsMegatronCore prove); a weighted blend is refused in one line.
TEST(Blending, AWholeSplitIsEverySampleOnceAndAWeightedBlendIsRefused) {
  TempDir dir;
  auto data = make_data(dir / "a", 200, 10, 50, 1);
  auto data_b = make_data(dir / "b", 100, 10, 50, 2);
  GptDatasetOptions o;
  o.seq_length = 32;
  o.seed = 5;
  o.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
  o.split = "90,10,0";
  const auto tvt = build_train_valid_test_datasets(dir / "a", {100, kWholeSplit, kWholeSplit}, o);
  ASSERT_TRUE(tvt.valid);
  EXPECT_FALSE(tvt.test);  // no documents: no split, whole or not
  GptDatasetOptions one = o;
  one.name = "valid";
  one.whole_epoch = true;
  const GPTDataset epoch(data, 180, 200, one);  // documents [180, 200): split 90,10,0 of 200
  EXPECT_EQ(epoch.num_epochs(), 1);
  ASSERT_EQ(tvt.valid->size(), epoch.size());
  for (size_t i = 0; i < epoch.size(); ++i) ASSERT_EQ(tvt.valid->get(i), epoch.get(i)) << i;

  // Without weights: the blend holds each sample of both epochs once, and nothing else.
  const auto both = build_train_valid_test_datasets((dir / "a") + " " + (dir / "b"), {100, kWholeSplit, 0}, o);
  const GPTDataset epoch_b(data_b, 90, 100, one);
  ASSERT_TRUE(both.valid);
  ASSERT_EQ(both.valid->size(), epoch.size() + epoch_b.size());
  const auto& blend = dynamic_cast<const BlendedDataset&>(*both.valid);
  std::set<std::pair<int, int64_t>> seen;
  for (size_t i = 0; i < blend.size(); ++i) {
    const int d = blend.dataset_of(i);
    EXPECT_TRUE(seen.insert({d, blend.sample_of(i)}).second) << "sample drawn twice at " << i;
    ASSERT_EQ(blend.get(i), (d == 0 ? epoch : epoch_b).get(static_cast<size_t>(blend.sample_of(i)))) << i;
  }
  EXPECT_EQ(seen.size(), blend.size());
  EXPECT_NE(blend.dataset_of(0), blend.dataset_of(1));  // interleaved by size, not one after the other

  try {
    build_train_valid_test_datasets("0.3 " + (dir / "a") + " 0.7 " + (dir / "b"), {100, kWholeSplit, 0}, o);
    ADD_FAILURE() << "a whole split of a weighted blend was built";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("the valid split is read whole (eval.full_validation), but it is a "
                                         "weighted blend of 2 prefixes"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("give the split prefixes without weights"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dtk::data
