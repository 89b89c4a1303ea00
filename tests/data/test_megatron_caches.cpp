// Megatron's index caches: names (md5 of Megatron's descriptions), formats, and reading a cache
// folder a Megatron run left, checked against references Python and numpy made once
// (tests/data/fixtures/megatron_caches.txt and megatron_cache_{core,legacy}/, written by
// tools/fixtures/megatron_caches.py; the command is in its header).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dtk/data/gpt_dataset.hpp"
#include "dtk/data/megatron_cache.hpp"
#include "test_util.hpp"

namespace dtk::data {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

std::vector<std::string> fixture_lines(const std::string& kind) {
  std::ifstream in(test::fixtures_dir() + "/megatron_caches.txt");
  EXPECT_TRUE(in.good()) << "missing fixture megatron_caches.txt";
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line))
    if (line.compare(0, kind.size() + 1, kind + " ") == 0) out.push_back(line.substr(kind.size() + 1));
  EXPECT_FALSE(out.empty()) << kind;
  return out;
}

double from_hex(const std::string& h) {
  uint8_t b[8];
  for (int k = 0; k < 8; ++k)
    b[k] = static_cast<uint8_t>(std::stoi(h.substr(2 * static_cast<size_t>(k), 2), nullptr, 16));
  double x;
  std::memcpy(&x, b, 8);
  return x;
}

std::vector<std::string> words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> w;
  std::string t;
  while (in >> t) w.push_back(t);
  return w;
}

TEST(MegatronCaches, Md5ReprSumAndNumpyStrAsPython) {
  for (const std::string& l : fixture_lines("md5")) {
    const std::string text = nlohmann::json::parse(l.substr(33)).get<std::string>();
    EXPECT_EQ(md5_hex(text), l.substr(0, 32)) << l;
  }
  for (const std::string& l : fixture_lines("repr")) {
    EXPECT_EQ(python_float_repr(from_hex(l.substr(0, 16))), l.substr(17)) << l;
  }
  for (const std::string& l : fixture_lines("sum")) {
    const size_t colon = l.find(':');
    auto w = words(l.substr(0, colon));
    std::vector<double> v;
    for (size_t k = 1; k < w.size(); ++k) v.push_back(from_hex(w[k]));
    ASSERT_EQ(v.size(), std::stoul(w[0]));
    EXPECT_EQ(numpy_sum(v), from_hex(l.substr(colon + 2))) << l.substr(0, 40);
  }
  int formatted = 0;
  for (const std::string& l : fixture_lines("npstr")) {
    const size_t colon = l.find(':');
    std::vector<double> v;
    for (const auto& h : words(l.substr(0, colon))) v.push_back(from_hex(h));
    const std::string want = nlohmann::json::parse(l.substr(colon + 2)).get<std::string>();
    const std::string got = numpy_float_array_str(v);
    if (want.find('\n') != std::string::npos) {
      EXPECT_EQ(got, "") << "numpy wraps this one: DTK must not pretend to format it";
    } else {
      EXPECT_EQ(got, want);
      ++formatted;
    }
  }
  EXPECT_GE(formatted, 9);
  // json.dumps(indent=4) round trip of a Megatron-like description.
  const std::string d =
      "{\n    \"a\": [\n        0,\n        0.969\n    ],\n    \"b\": null,\n    \"c\": \"\\u00e9\\\"\",\n"
      "    \"d\": [],\n    \"e\": {}\n}";
  EXPECT_EQ(dumps_indent4(parse_json(d, "test")), d);
  EXPECT_THROW(parse_json("{\"a\": }", "x"), DataError);
}

TEST(MegatronCaches, CoreSplitAsMegatron) {
  for (const std::string& l : fixture_lines("split_core")) {
    const size_t bar = l.rfind('|'), colon = l.rfind(':');
    const std::string split = l.substr(0, bar);
    const size_t n = std::stoul(l.substr(bar + 1, colon - bar - 1));
    const auto w = words(l.substr(colon + 1));
    const std::array<size_t, 4> want{std::stoul(w[0]), std::stoul(w[1]), std::stoul(w[2]), std::stoul(w[3])};
    EXPECT_EQ(split_boundaries(split, n, MegatronOrder::kCore), want) << l;
  }
  for (const std::string& l : fixture_lines("split_matrix")) {
    const size_t colon = l.rfind(": ");
    EXPECT_EQ(dumps_indent4(core_split_matrix(l.substr(0, colon))), dumps_indent4(parse_json(l.substr(colon + 2), l)))
        << l;
  }
  // Legacy rounding differs: "1,1,1" of 100 documents.
  EXPECT_EQ(split_boundaries("1,1,1", 100, MegatronOrder::kCore), (std::array<size_t, 4>{0, 33, 67, 100}));
  EXPECT_EQ(split_boundaries("1,1,1", 100, MegatronOrder::kLegacy), (std::array<size_t, 4>{0, 34, 67, 100}));
  EXPECT_THROW(split_boundaries("1,2,3,4", 10, MegatronOrder::kCore), DataError);
  // Megatron's regex would read these as "1,2,0" and "1,1": refused, not read past.
  EXPECT_THROW(split_boundaries("-1,2,0", 10, MegatronOrder::kCore), DataError);
  EXPECT_THROW(split_boundaries("nan,1,1", 10, MegatronOrder::kCore), DataError);
  // An empty field: Megatron's regex would read "1,,1" as train 1, valid 1 (test 0).
  for (const char* empty : {"1,,1", "1,1,", ",1,1", "1, ,1"})
    EXPECT_THROW(split_boundaries(empty, 10, MegatronOrder::kCore), DataError) << empty;
  EXPECT_EQ(split_boundaries("1, 0, 1", 10, MegatronOrder::kCore)[3], 10u);
  EXPECT_THROW(parse_order("megatron"), DataError);
}

TEST(MegatronCaches, BlendSizesAndOrderAsMegatron) {
  for (const std::string& l : fixture_lines("blend")) {
    const size_t colon = l.find(':'), bar = l.find('|');
    const auto head = words(l.substr(0, colon));
    const MegatronOrder order = parse_order(head[0]);
    const int64_t n = std::stoll(head[1]);
    std::vector<double> raw;
    for (size_t k = 2; k < head.size(); ++k) raw.push_back(std::stod(head[k]));
    std::vector<int64_t> want;
    for (const auto& x : words(l.substr(colon + 1, bar - colon - 1))) want.push_back(std::stoll(x));
    const auto w = normalize_weights(raw, order);
    EXPECT_EQ(blend_samples_per_dataset(w, n, order), want) << l;
    EXPECT_EQ(blend_size(w, n, order), std::stoll(l.substr(bar + 1))) << l;
  }
  for (const std::string& l : fixture_lines("blend_index")) {
    const size_t colon = l.find(':');
    const auto head = words(l.substr(0, colon));
    std::vector<double> raw;
    for (size_t k = 1; k < head.size(); ++k) raw.push_back(std::stod(head[k]));
    std::vector<int16_t> di;
    std::vector<int64_t> dsi;
    build_blending_indices(numpy_normalize(normalize_weights(raw)), std::stoll(head[0]), &di, &dsi);
    std::string got;
    for (int16_t d : di) got += (got.empty() ? "" : " ") + std::to_string(d);
    EXPECT_EQ(got, l.substr(colon + 2)) << head[0];
  }
  int exhaustive = 0;
  for (const std::string& l : fixture_lines("exhaustive_index")) {
    const size_t colon = l.find(':');
    std::vector<int64_t> sizes;
    for (const auto& x : words(l.substr(0, colon))) sizes.push_back(std::stoll(x));
    std::vector<int16_t> di;
    std::vector<int64_t> dsi;
    build_exhaustive_blending_indices(sizes, &di, &dsi);
    std::string got;
    for (int16_t d : di) got += std::to_string(d) + " ";
    got += "|";
    for (int64_t k : dsi) got += " " + std::to_string(k);
    EXPECT_EQ(got, l.substr(colon + 2)) << l;
    ++exhaustive;
  }
  EXPECT_GE(exhaustive, 5);
}

// The fixture run's corpora: document d of a_text_document has (d*37)%23+1 tokens (60
// documents), of b_text_document (d*11)%17+3 (45); token t of document d is d*1000+t.
void make_corpora(const std::string& dir) {
  for (const char* name : {"a_text_document", "b_text_document"}) {
    const bool a = name[0] == 'a';
    IndexedDatasetBuilder b(bin_path(dir + "/" + name), DType::kInt32);
    for (int d = 0; d < (a ? 60 : 45); ++d) {
      const int len = a ? (d * 37) % 23 + 1 : (d * 11) % 17 + 3;
      std::vector<int64_t> doc;
      for (int t = 0; t < len; ++t) doc.push_back(d * 1000 + t);
      b.add_document(doc);
    }
    b.finalize(idx_path(dir + "/" + name));
  }
}

// Runs in a temporary directory with relative prefixes, as the fixture's Megatron run did.
class InDir {
 public:
  explicit InDir(const std::string& dir) : old_(fs::current_path()) { fs::current_path(dir); }
  ~InDir() { fs::current_path(old_); }

 private:
  fs::path old_;
};

std::map<std::string, std::string> listing(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[e.path().string()] = md5_hex(test::read_file(e.path().string()));
  return out;
}

std::string fixture_value(const std::string& kind, const std::string& key) {
  for (const std::string& l : fixture_lines(kind))
    if (l.compare(0, key.size(), key) == 0) return l.substr(l.find(": ") + 2, 32);
  ADD_FAILURE() << kind << " " << key;
  return "";
}

const char* kTokenizer =
    "{\"class\": \"megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText\", \"tokenizer_path\": "
    "\"GPT2BPETokenizer\", \"additional_special_tokens\": \"[]\", \"vocab_file\": \"gpt2-vocab.json\", "
    "\"merges_file\": \"gpt2-merges.txt\"}";

GptDatasetOptions run_options(MegatronOrder order) {
  GptDatasetOptions o;
  o.order = order;
  o.seq_length = 16;
  o.seed = 1234;
  o.split = "969, 30, 1";
  o.cache_dir = "cache";
  return o;
}

void expect_same_samples(const TokenDataset& a, const TokenDataset& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a.get(i), b.get(i)) << i;
}

const char* kBlend = "0.3 a_text_document 0.7 b_text_document";

// A Megatron-core --data-cache-path folder is used as it is: DTK, given the same tokenizer
// description, names every file as Megatron did, reads them, writes nothing; and its own
// order (built without a cache) is the reference's, sample for sample.
TEST(MegatronCaches, CoreFolderIsReusedWithoutRebuilding) {
  TempDir dir;
  make_corpora(dir.path());
  fs::copy(test::fixtures_dir() + "/megatron_cache_core", dir / "cache", fs::copy_options::recursive);
  InDir in(dir.path());
  const auto before = listing("cache");
  GptDatasetOptions o = run_options(MegatronOrder::kCore);
  o.tokenizer_json = kTokenizer;
  const auto tvt = build_train_valid_test_datasets(kBlend, {700, 40, 0}, o);
  EXPECT_EQ(listing("cache"), before) << "DTK wrote into the Megatron cache folder";
  for (const auto* split : {&tvt.train, &tvt.valid}) {
    const auto& blend = dynamic_cast<const BlendedDataset&>(**split);
    EXPECT_TRUE(blend.loaded_from_cache());
    for (size_t k = 0; k < 2; ++k) {
      const auto& g = dynamic_cast<const GPTDataset&>(*blend.part(k));
      EXPECT_TRUE(g.loaded_from_cache()) << g.cache_file("description");
      EXPECT_EQ(g.loaded_from(), g.cache_file("description"));
    }
  }
  EXPECT_EQ(tvt.train->size(), 700u);
  GptDatasetOptions nc = o;
  nc.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
  const auto built = build_train_valid_test_datasets(kBlend, {700, 40, 0}, nc);
  expect_same_samples(*tvt.train, *built.train);
  expect_same_samples(*tvt.valid, *built.valid);
  // The names are Megatron's md5s.
  const auto& b = dynamic_cast<const BlendedDataset&>(*tvt.train);
  EXPECT_EQ(fs::path(b.cache_file("description")).filename().string(),
            fixture_value("blend_hash", "megatron_core train") + "-BlendedDataset-train-description.txt");
  EXPECT_EQ(fs::path(dynamic_cast<const GPTDataset&>(*b.part(1)).cache_file("doc_idx")).filename().string(),
            fixture_value("gpt_hash", "megatron_core b_text_document train") + "-GPTDataset-train-document_index.npy");
}

// What DTK writes is what Megatron wrote, byte for byte: the same file names in the same folders,
// numpy's .npy headers and dtypes, the same descriptions. So Megatron (numpy.load) reads DTK's
// caches as its own, and a Megatron run given DTK's folder does not rebuild.
std::map<std::string, std::string> relative_listing(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& [path, md5] : listing(dir)) out[fs::relative(path, dir).string()] = md5;
  return out;
}

TEST(MegatronCaches, WrittenCachesAreTheReferencesBytes) {
  {
    TempDir dir;
    make_corpora(dir.path());
    InDir in(dir.path());
    GptDatasetOptions o = run_options(MegatronOrder::kCore);
    o.tokenizer_json = kTokenizer;
    build_train_valid_test_datasets(kBlend, {700, 40, 0}, o);
    const auto written = relative_listing("cache");
    const auto reference = relative_listing(test::fixtures_dir() + "/megatron_cache_core");
    EXPECT_EQ(written, reference);
  }
  {
    TempDir dir;
    make_corpora(dir.path());
    InDir in(dir.path());
    build_train_valid_test_datasets(kBlend, {700, 40, 0}, run_options(MegatronOrder::kLegacy));
    // Legacy Megatron writes where it looked last: --data-cache-path ("cache") for the datasets
    // too. The reference folder keeps them in index-cache (found there first, as a run without
    // --data-cache-path left them): the same files.
    const std::string ref = test::fixtures_dir() + "/megatron_cache_legacy";
    auto reference = relative_listing(ref + "/cache");
    reference.merge(relative_listing(ref + "/index-cache"));
    EXPECT_EQ(relative_listing("cache"), reference);
    EXPECT_FALSE(fs::exists("index-cache"));
  }
}

// Without the tokenizer's description DTK cannot recompute Megatron's md5s: it finds the
// datasets' and the blend's files by their descriptions, and writes nothing.
TEST(MegatronCaches, CoreFolderIsFoundByDescription) {
  TempDir dir;
  make_corpora(dir.path());
  fs::copy(test::fixtures_dir() + "/megatron_cache_core", dir / "cache", fs::copy_options::recursive);
  InDir in(dir.path());
  const auto before = listing("cache");
  const auto tvt = build_train_valid_test_datasets(kBlend, {700, 40, 0}, run_options(MegatronOrder::kCore));
  const auto& blend = dynamic_cast<const BlendedDataset&>(*tvt.train);
  EXPECT_TRUE(blend.loaded_from_cache());
  EXPECT_EQ(fs::path(blend.loaded_from()).filename().string(),
            fixture_value("blend_hash", "megatron_core train") + "-BlendedDataset-train-description.txt");
  EXPECT_FALSE(test::file_exists(blend.cache_file("description")));
  EXPECT_EQ(listing("cache"), before) << "DTK wrote into the Megatron cache folder";
  const auto& a = dynamic_cast<const GPTDataset&>(*blend.part(0));
  EXPECT_TRUE(a.loaded_from_cache());
  EXPECT_EQ(fs::path(a.loaded_from()).filename().string(),
            fixture_value("gpt_hash", "megatron_core a_text_document train") + "-GPTDataset-train-description.txt");
  EXPECT_EQ(
      fs::path(a.cache_file("description")).filename().string(),
      fixture_value("gpt_hash_null", "megatron_core a_text_document train") + "-GPTDataset-train-description.txt");
  EXPECT_FALSE(test::file_exists(a.cache_file("description"))) << "a dataset found in the folder was written again";
}

// A cache that does not fit the data is not used: rebuilt, in Megatron's name, from scratch.
TEST(MegatronCaches, CacheNotFittingTheDataIsRebuilt) {
  TempDir dir;
  make_corpora(dir.path());
  fs::copy(test::fixtures_dir() + "/megatron_cache_core", dir / "cache", fs::copy_options::recursive);
  InDir in(dir.path());
  GptDatasetOptions o = run_options(MegatronOrder::kCore);
  o.tokenizer_json = kTokenizer;
  o.name = "train";
  o.num_samples = 212;
  auto data = std::make_shared<const IndexedDataset>("a_text_document");
  const std::string doc = GPTDataset(data, 0, 58, o).cache_file("doc_idx");
  const NpyArray good = NpyArray::load(doc);
  std::vector<int64_t> v;
  for (size_t k = 0; k < good.size(); ++k) v.push_back(good[k]);
  std::swap(v[0], v[1]);  // still a valid document index, no longer the one its sample index was made from
  if (v[0] == v[1]) std::swap(v[0], v[2]);
  NpyArray::from_int64(v, {v.size()}, "<i4").save(doc);
  GPTDataset rebuilt(data, 0, 58, o);
  EXPECT_FALSE(rebuilt.loaded_from_cache());
  const NpyArray again = NpyArray::load(doc);
  for (size_t k = 0; k < good.size(); ++k) ASSERT_EQ(again[k], good[k]) << k;
  GPTDataset reread(data, 0, 58, o);
  EXPECT_TRUE(reread.loaded_from_cache());
}

// Legacy Megatron (DeepSpeed-Domino): the datasets' files in DIR_OF_PREFIX/index-cache, the
// blend's in --data-cache-path, all read as they are.
TEST(MegatronCaches, LegacyFoldersAreReusedWithoutRebuilding) {
  TempDir dir;
  make_corpora(dir.path());
  fs::copy(test::fixtures_dir() + "/megatron_cache_legacy", dir.path(), fs::copy_options::recursive);
  InDir in(dir.path());
  const auto before = listing(".");
  const auto tvt = build_train_valid_test_datasets(kBlend, {700, 40, 0}, run_options(MegatronOrder::kLegacy));
  EXPECT_EQ(listing("."), before) << "DTK wrote next to a legacy Megatron cache";
  for (const auto* split : {&tvt.train, &tvt.valid}) {
    const auto& blend = dynamic_cast<const BlendedDataset&>(**split);
    EXPECT_TRUE(blend.loaded_from_cache()) << blend.cache_file("description");
    for (size_t k = 0; k < 2; ++k) EXPECT_TRUE(dynamic_cast<const GPTDataset&>(*blend.part(k)).loaded_from_cache());
  }
  EXPECT_EQ(tvt.train->size(), 705u);  // legacy: the blend is as long as its parts' samples together
  GptDatasetOptions nc = run_options(MegatronOrder::kLegacy);
  nc.cache_mode = GptDatasetOptions::CacheMode::kNoCache;
  const auto built = build_train_valid_test_datasets(kBlend, {700, 40, 0}, nc);
  expect_same_samples(*tvt.train, *built.train);
  expect_same_samples(*tvt.valid, *built.valid);
  // Written from scratch: the same names (all under --data-cache-path, where legacy Megatron
  // writes when it is given).
  fs::remove_all("index-cache");
  fs::remove_all("cache");
  build_train_valid_test_datasets(kBlend, {700, 40, 0}, run_options(MegatronOrder::kLegacy));
  std::set<std::string> a, b;
  for (const auto& kv : listing(".")) a.insert(fs::path(kv.first).filename().string());
  for (const auto& kv : before) b.insert(fs::path(kv.first).filename().string());
  EXPECT_EQ(a, b);
  EXPECT_FALSE(fs::exists("index-cache"));
}

// The samples of a split as the reference's "samples RUN SPLIT:" line hashes them: the first 8 hex
// digits of the md5 of the tokens written "t0 t1 ...", for the first (up to) 60 samples.
void expect_reference_samples(const std::string& run, const std::string& split, const TokenDataset& d) {
  std::string got;
  for (size_t i = 0; i < std::min<size_t>(60, d.size()); ++i) {
    std::string text;
    for (int64_t t : d.get(i)) text += (text.empty() ? "" : " ") + std::to_string(t);
    got += (got.empty() ? "" : " ") + md5_hex(text).substr(0, 8);
  }
  bool found = false;
  for (const std::string& l : fixture_lines("samples")) {
    if (l.compare(0, run.size() + split.size() + 3, run + " " + split + ": ") != 0) continue;
    EXPECT_EQ(got, l.substr(run.size() + split.size() + 3)) << run << " " << split;
    found = true;
  }
  EXPECT_TRUE(found) << run << " " << split;
}

// Builds a run twice: into an empty folder (the reference's files, byte for byte), and over a
// copy of the reference folder (read, nothing written, the same samples).
template <typename Build>
void check_run(const std::string& folder, MegatronOrder order, const std::string& run, Build build) {
  const std::string ref = test::fixtures_dir() + "/" + folder;
  {
    TempDir dir;
    make_corpora(dir.path());
    InDir in(dir.path());
    const TrainValidTest tvt = build();
    if (order == MegatronOrder::kCore) {
      EXPECT_EQ(relative_listing("cache"), relative_listing(ref)) << folder;
    } else {
      auto reference = relative_listing(ref + "/cache");
      reference.merge(relative_listing(ref + "/index-cache"));
      EXPECT_EQ(relative_listing("cache"), reference) << folder;
    }
    const char* names[3] = {"train", "valid", "test"};
    const std::shared_ptr<const TokenDataset>* splits[3] = {&tvt.train, &tvt.valid, &tvt.test};
    for (int s = 0; s < 3; ++s)
      if (*splits[s]) expect_reference_samples(run, names[s], **splits[s]);
  }
  {
    TempDir dir;
    make_corpora(dir.path());
    if (order == MegatronOrder::kCore)
      fs::copy(ref, dir / "cache", fs::copy_options::recursive);
    else
      fs::copy(ref, dir.path(), fs::copy_options::recursive);
    InDir in(dir.path());
    const auto before = listing(".");
    const TrainValidTest tvt = build();
    EXPECT_EQ(listing("."), before) << "DTK wrote next to the reference " << folder;
    for (const auto* split : {&tvt.train, &tvt.valid, &tvt.test}) {
      if (!*split) continue;
      if (const auto* b = dynamic_cast<const BlendedDataset*>(split->get())) {
        EXPECT_TRUE(b->loaded_from_cache()) << folder;
        for (size_t k = 0; k < b->num_parts(); ++k)
          EXPECT_TRUE(dynamic_cast<const GPTDataset&>(*b->part(k)).loaded_from_cache()) << folder;
      } else {
        EXPECT_TRUE(dynamic_cast<const GPTDataset&>(**split).loaded_from_cache()) << folder;
      }
    }
  }
}

// Megatron-core, --data-path with prefixes and no weights: each dataset one epoch ("num_samples":
// null), the blend weighted by their sizes (normalized once), min(N, their samples) long.
TEST(MegatronCaches, BlendWeightedBySizesAsMegatronCore) {
  GptDatasetOptions o = run_options(MegatronOrder::kCore);
  o.tokenizer_json = kTokenizer;
  o.split = "80, 20, 0";
  check_run("megatron_cache_core_sizes", MegatronOrder::kCore, "megatron_core_sizes", [&] {
    const auto tvt = build_train_valid_test_datasets("a_text_document b_text_document", {50, 40, 0}, o);
    EXPECT_EQ(tvt.train->size(), 50u);  // fewer than the datasets' samples: N
    EXPECT_LT(tvt.valid->size(), 40u);  // more: all of theirs
    return tvt;
  });
  // Legacy Megatron needs weights.
  TempDir dir;
  make_corpora(dir.path());
  InDir in(dir.path());
  try {
    build_train_valid_test_datasets("a_text_document b_text_document", {50, 40, 0},
                                    run_options(MegatronOrder::kLegacy));
    ADD_FAILURE() << "legacy accepted a blend without weights";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("needs a weight before every prefix"), std::string::npos) << e.what();
  }
}

// Megatron-core, --full-validation over prefixes without weights: the valid and test splits read
// whole ("num_samples": null), their blends exhaustive ("size": null, the datasets' sizes as
// weights), every sample of each dataset once; the train split as above.
TEST(MegatronCaches, ExhaustiveBlendAsMegatronCore) {
  GptDatasetOptions o = run_options(MegatronOrder::kCore);
  o.tokenizer_json = kTokenizer;
  o.split = "70, 20, 10";
  check_run("megatron_cache_core_whole", MegatronOrder::kCore, "megatron_core_whole", [&] {
    const auto tvt =
        build_train_valid_test_datasets("a_text_document b_text_document", {50, kWholeSplit, kWholeSplit}, o);
    EXPECT_EQ(tvt.train->size(), 50u);
    for (const auto* split : {&tvt.valid, &tvt.test}) {
      const auto& b = dynamic_cast<const BlendedDataset&>(**split);
      EXPECT_EQ(b.size(), b.part(0)->size() + b.part(1)->size());
    }
    return tvt;
  });
}

// Per-split data paths (--train-data-path, --valid-data-path, --test-data-path): Megatron-core
// (no split in the descriptions, a single prefix a plain dataset, a blend without weights by
// sizes) and legacy (the split string in them).
TEST(MegatronCaches, PerSplitDataPathsAsMegatron) {
  const std::string blend = "0.4 a_text_document 0.6 b_text_document";
  GptDatasetOptions o = run_options(MegatronOrder::kCore);
  o.tokenizer_json = kTokenizer;
  check_run("megatron_cache_core_per_split", MegatronOrder::kCore, "megatron_core_per_split", [&] {
    return build_per_split_datasets({blend, "b_text_document", "a_text_document b_text_document"}, {300, 40, 30}, o);
  });
  check_run("megatron_cache_legacy_per_split", MegatronOrder::kLegacy, "megatron_legacy_per_split", [&] {
    return build_per_split_datasets({blend, "b_text_document", ""}, {300, 40, 0}, run_options(MegatronOrder::kLegacy));
  });
}

// Megatron-LM before mid-2023 named the legacy caches after the prefix, next to the data.
TEST(MegatronCaches, OlderIndexmapNamesAreRead) {
  TempDir dir;
  make_corpora(dir.path());
  InDir in(dir.path());
  const std::string h = fixture_value("gpt_hash", "megatron_legacy a_text_document train");
  const std::string from = test::fixtures_dir() + "/megatron_cache_legacy/index-cache/" + h;
  const std::string old = "a_text_document_train_indexmap_212ns_16sl_1234s_";
  for (const char* w : {"doc", "sample", "shuffle"})
    fs::copy_file(from + "_" + w + "_idx.npy", old + w + "_idx.npy");
  GptDatasetOptions o = run_options(MegatronOrder::kLegacy);
  o.num_samples = 212;
  GPTDataset g(std::make_shared<const IndexedDataset>("a_text_document"), 0, 58, o);
  EXPECT_TRUE(g.loaded_from_cache());
  EXPECT_EQ(g.loaded_from(), old + "doc_idx.npy");
  EXPECT_EQ(fs::path(g.cache_file("doc_idx")).filename().string(), h + "_doc_idx.npy");
}

}  // namespace
}  // namespace dtk::data
