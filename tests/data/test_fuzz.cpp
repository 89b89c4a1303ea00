// Randomized robustness tests (run under ASan/UBSan in CI): mutated inputs must produce
// success or a DataError, never a crash, a hang or an out-of-bounds read.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>

#include "dtk/data/error.hpp"
#include "dtk/text/gpt2_tokenizer.hpp"
#include "dtk/data/indexed_dataset.hpp"
#include "dtk/text/jsonl.hpp"
#include "dtk/data/npy.hpp"
#include "dtk/data/utf8.hpp"
#include "test_util.hpp"

namespace dtk::data {
namespace {
using namespace ::dtk::text;  // the text tier: tokenizers, jsonl, preprocess

std::string mutate(std::string s, std::mt19937_64& g) {
  const int kind = static_cast<int>(g() % 6);
  if (s.empty()) return std::string(1, static_cast<char>(g()));
  switch (kind) {
    case 0:  // truncate
      s.resize(g() % s.size());
      break;
    case 1:  // flip random bytes
      for (int k = 0, n = 1 + static_cast<int>(g() % 8); k < n; ++k) s[g() % s.size()] = static_cast<char>(g());
      break;
    case 2: {  // overwrite 8 bytes with a huge or negative number
      const size_t at = g() % s.size();
      const uint64_t vals[] = {~0ull, 1ull << 62, 0x7fffffffull, 0x80000000ull, ~0ull - 7, 1ull << 33};
      uint64_t v = vals[g() % 6];
      for (size_t k = 0; k < 8 && at + k < s.size(); ++k) s[at + k] = static_cast<char>(v >> (8 * k));
      break;
    }
    case 3:  // append garbage
      for (int k = 0, n = static_cast<int>(g() % 64); k < n; ++k) s.push_back(static_cast<char>(g()));
      break;
    case 4:  // duplicate a slice
    {
      const size_t a = g() % s.size();
      s.insert(a, s.substr(a, g() % 32));
    } break;
    default:  // delete a slice
    {
      const size_t a = g() % s.size();
      s.erase(a, g() % 16);
    } break;
  }
  return s;
}

TEST(Fuzz, MutatedIndexedDatasetFiles) {
  test::TempDir dir;
  const std::string ok = dir / "ok";
  {
    IndexedDatasetBuilder b(bin_path(ok), DType::kInt32);
    std::mt19937 g(1);
    for (int d = 0; d < 20; ++d) {
      std::vector<int64_t> doc(g() % 30);
      for (auto& t : doc) t = g() % 1000;
      b.add_item(doc);
      if (d % 3 == 0) b.add_item(std::vector<int64_t>{1, 2});
      b.end_document();
    }
    b.finalize(idx_path(ok));
  }
  const std::string idx = test::read_file(idx_path(ok)), bin = test::read_file(bin_path(ok));
  std::mt19937_64 g(42);
  int opened = 0, rejected = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    const std::string p = dir / "m";
    const bool mutate_bin = g() % 4 == 0;
    test::write_file(idx_path(p), mutate_bin ? idx : mutate(idx, g));
    test::write_file(bin_path(p), mutate_bin ? mutate(bin, g) : bin);
    try {
      IndexedDataset ds(p);
      ++opened;
      std::vector<int64_t> out;
      for (size_t i = 0; i < ds.num_sequences(); ++i) {
        out.clear();
        ds.get(i, 0, static_cast<size_t>(ds.sequence_length(i)), &out);
      }
      for (size_t d = 0; d <= ds.num_documents(); ++d) (void)ds.document_index(d);
    } catch (const DataError& e) {
      ++rejected;
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  }
  EXPECT_GT(rejected, 500);
  EXPECT_GT(opened, 10);
}

TEST(Fuzz, MutatedNpyFiles) {
  test::TempDir dir;
  NpyArray::from_int64({1, 2, 3, 4, 5, 6}, {3, 2}, "<i8").save(dir / "a.npy");
  const std::string good = test::read_file(dir / "a.npy");
  std::mt19937_64 g(7);
  for (int iter = 0; iter < 2000; ++iter) {
    test::write_file(dir / "m.npy", mutate(good, g));
    try {
      NpyArray a = NpyArray::load(dir / "m.npy");
      int64_t sum = 0;
      for (size_t i = 0; i < a.size(); ++i) sum += a[i];
      (void)sum;
    } catch (const DataError&) {
    }
  }
}

std::string random_text(std::mt19937_64& g, size_t max_len) {
  // Mostly valid UTF-8 from interesting code points, sometimes raw random bytes.
  static const uint32_t cps[] = {'a',    'Z',    ' ',   '\n',    '\t',   '\r',   '\'',     's',
                                 'l',    '1',    '.',   ',',     '"',    0xA0,   0xE9,     0x301,
                                 0x3000, 0x4E00, 0x663, 0x1F600, 0x200B, 0xFEFF, 0x10FFFF, 0x85};
  std::string s;
  const size_t n = g() % max_len;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = g() % 100;
    if (r < 3) {
      s.push_back(static_cast<char>(g()));
    } else if (r < 10) {
      uint32_t cp = static_cast<uint32_t>(g() % 0x110000);
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = 'x';
      append_utf8(cp, &s);
    } else {
      append_utf8(cps[g() % (sizeof(cps) / sizeof(cps[0]))], &s);
    }
  }
  return s;
}

TEST(Fuzz, TokenizerOnRandomInput) {
  const Gpt2Tokenizer tok(test::encoder_json(), test::vocab_bpe());
  std::mt19937_64 g(3);
  Gpt2Tokenizer::Cache cache;
  int valid = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const std::string s = random_text(g, 80);
    std::vector<int32_t> ids;
    try {
      tok.encode(s, &ids, &cache);
      ++valid;
      EXPECT_EQ(find_invalid_utf8(s), std::string::npos);
      EXPECT_EQ(tok.decode(ids), s);  // byte-level BPE is lossless
    } catch (const DataError&) {
      EXPECT_NE(find_invalid_utf8(s), std::string::npos);
    }
  }
  EXPECT_GT(valid, 500);
}

// Differential: the jsonl line parser (simdjson) against nlohmann_json as an independent oracle,
// on mutated lines. Both must agree on which lines are bad, and on the extracted strings.
TEST(Fuzz, JsonlLineParserAgreesWithNlohmannOnMutatedLines) {
  const std::string seeds[] = {
      R"({"text": "h\u00e9llo \"w\" \u00e9\ud83d\ude00", "n": [1, -2.5e3, true, false, null, {}], "o": {"a": []}})",
      R"({"o": [[[[{"a":"b"}]]]], "text": ["x\\\/\b\f\n\r\t", "", "y"]})",
      "{\"text\": \"-0.0e+1 caf\xc3\xa9\", \"text\": \"dup \xe6\xbc\xa2\"}", R"([{"text": "not an object"}])"};
  JsonlLineParser parser({"text"});
  std::mt19937_64 g(11);
  int good = 0, bad = 0;
  for (int iter = 0; iter < 6000; ++iter) {
    std::string s = seeds[g() % 4];
    for (int k = 0, n = static_cast<int>(g() % 3); k < n; ++k) s = mutate(s, g);
    // Oracle: nlohmann_json (strict RFC 8259 + UTF-8), then the shape rules of a jsonl line.
    std::vector<std::string> want;
    bool want_ok = false;
    // A raw NUL byte is never valid JSON, but nlohmann's lexer takes it for the end of the input.
    const nlohmann::json j = nlohmann::json::parse(s, nullptr, /*allow_exceptions=*/false);
    if (s.find('\0') == std::string::npos && !j.is_discarded() && j.is_object() && j.contains("text")) {
      const nlohmann::json& t = j["text"];
      if (t.is_string()) {
        want = {t.get<std::string>()};
        want_ok = true;
      } else if (t.is_array()) {
        want_ok = std::all_of(t.begin(), t.end(), [](const nlohmann::json& e) { return e.is_string(); });
        for (const auto& e : t)
          if (e.is_string()) want.push_back(e.get<std::string>());
      }
    }
    std::vector<std::vector<std::string_view>> got;
    try {
      parser.parse(s, "fuzz.jsonl:7", &got);
      ASSERT_TRUE(want_ok) << "accepted a line the oracle rejects: " << s;
      ASSERT_EQ(got.size(), 1u);
      EXPECT_EQ(std::vector<std::string>(got[0].begin(), got[0].end()), want) << s;
      ++good;
    } catch (const DataError& e) {
      ASSERT_FALSE(want_ok) << "rejected a line the oracle accepts: " << s << ": " << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("fuzz.jsonl:7: ", 0), 0u) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
      ++bad;
    }
  }
  EXPECT_GT(good, 1000);
  EXPECT_GT(bad, 1000);
}

}  // namespace
}  // namespace dtk::data
