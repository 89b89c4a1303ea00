#include <gtest/gtest.h>

#include <sstream>

#include "dtk/data/error.hpp"
#include "dtk/text/gpt2_tokenizer.hpp"
#include "dtk/data/utf8.hpp"
#include "test_util.hpp"

namespace dtk::data {
namespace {
using namespace ::dtk::text;  // the text tier: tokenizers, jsonl, preprocess

const Gpt2Tokenizer& tok() {
  static Gpt2Tokenizer* tok = new Gpt2Tokenizer(test::encoder_json(), test::vocab_bpe());
  return *tok;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

TEST(Gpt2Tokenizer, Basics) {
  EXPECT_EQ(tok().vocab_size(), 50257u);
  EXPECT_EQ(tok().eod(), 50256);
  EXPECT_EQ(tok().encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(tok().encode(""), std::vector<int32_t>{});
  EXPECT_EQ(tok().decode(tok().encode("Hello, wörld! 😀")), "Hello, wörld! 😀");
  const int64_t bad = 50257;
  EXPECT_THROW(tok().decode(&bad, 1), DataError);
}

TEST(Gpt2Tokenizer, PreTokenizerFollowsTheRegex) {
  std::vector<std::string_view> p;
  gpt2_pre_tokenize("I'm  here\n\n  ok 42x!?", &p);
  std::vector<std::string> got(p.begin(), p.end());
  EXPECT_EQ(got, (std::vector<std::string>{"I", "'m", " ", " here", "\n\n ", " ok", " 42", "x", "!?"}));
}

TEST(Gpt2Tokenizer, InvalidUtf8IsAnError) {
  for (const char* bad : {"\xff", "a\xc3", "\xc0\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80", "ok \xe2\x82"}) {
    EXPECT_THROW(tok().encode(bad), DataError) << bad;
  }
  EXPECT_EQ(find_invalid_utf8("ab\xe2\x82"), 2u);
  EXPECT_EQ(find_invalid_utf8("ab\xe2\x82\xac"), std::string::npos);
}

// Ids produced by the npm `gpt-3-encoder` reference (tools/make_tokenizer_fixture.js).
TEST(Gpt2Tokenizer, MatchesReferenceOnTrickyCases) {
  std::istringstream in(test::read_file(test::fixtures_dir() + "/gpt2_cases.txt"));
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    const size_t tab = line.find('\t');
    ASSERT_NE(tab, std::string::npos);
    const std::string text = from_hex(line.substr(0, tab));
    std::vector<int32_t> want;
    std::istringstream ids(line.substr(tab + 1));
    int32_t id;
    while (ids >> id) want.push_back(id);
    EXPECT_EQ(tok().encode(text), want) << "case " << n << ": " << text;
    ++n;
  }
  EXPECT_GT(n, 300);
}

// The whole excerpt in one piece against the reference ids of the whole file.
TEST(Gpt2Tokenizer, MatchesReferenceOnTinyShakespeare) {
  const std::string text = test::read_file(test::shakespeare_text());
  ASSERT_GT(text.size(), 100000u) << "missing " << test::shakespeare_text();
  const std::vector<int32_t> want = test::shakespeare_reference_ids();
  ASSERT_GT(want.size(), 30000u);
  const std::vector<int32_t> got = tok().encode(text);
  ASSERT_EQ(got.size(), want.size());
  size_t first_diff = got.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      first_diff = i;
      break;
    }
  }
  EXPECT_EQ(first_diff, got.size());
  EXPECT_EQ(tok().decode(got), text);
}

TEST(Gpt2Tokenizer, BadVocabFilesNameTheFile) {
  test::TempDir dir;
  test::write_file(dir / "v.json", "{\"a\": 1,}");
  try {
    Gpt2Tokenizer t(dir / "v.json", test::vocab_bpe());
    FAIL();
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("vocab file '" + (dir / "v.json") + "': invalid JSON: ", 0), 0u) << e.what();
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
  const std::pair<const char*, const char*> bad_vocabs[] = {{"[1]", "expected a non-empty JSON object"},
                                                            {"{}", "expected a non-empty JSON object"},
                                                            {"{\"a\": -1}", "token 'a' has an id that"},
                                                            {"{\"a\": 1.5}", "token 'a' has an id that"},
                                                            {"{\"a\": \"1\"}", "token 'a' has an id that"},
                                                            {"{\"a\": 1e9}", "token 'a' has an id that"},
                                                            {"{\"a\": 1} x", "invalid JSON"},
                                                            {"{\"\xff\": 1}", "invalid JSON"}};
  for (const auto& [bad, why] : bad_vocabs) {
    test::write_file(dir / "v.json", bad);
    try {
      Gpt2Tokenizer t(dir / "v.json", test::vocab_bpe());
      ADD_FAILURE() << bad;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << bad << ": " << e.what();
    }
  }
  test::write_file(dir / "m.bpe", "#version\na b c\n");
  EXPECT_THROW(Gpt2Tokenizer(test::encoder_json(), dir / "m.bpe"), DataError);
  EXPECT_THROW(Gpt2Tokenizer(dir / "nope.json", dir / "m.bpe"), DataError);
}

}  // namespace
}  // namespace dtk::data
