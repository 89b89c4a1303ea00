// Megatron's TikTokenizer: ids against js-tiktoken (the JavaScript port of tiktoken) given what
// Megatron's TikTokenTokenizer gives tiktoken (tools/fixtures/tokenizer_ids.sh), on OpenAI's
// o200k_base ranks written as Megatron's vocabulary file (tools/fetch_tokenizers.sh); the
// byte-pair merge, the special tokens and the file checks on a small vocabulary written here.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "dtk/data/error.hpp"
#include "dtk/text/pre_tokenize.hpp"
#include "dtk/text/tokenizer.hpp"
#include "test_util.hpp"
#include "tokenizer_fixtures.hpp"

namespace dtk::text {
namespace {

using data::DataError;
namespace test = ::dtk::data::test;
using namespace tokenizer_test;  // NOLINT: the shared fixtures of this folder

std::string o200k() { return tokenizers_dir() + "/tiktoken/o200k_base.json"; }

TokenizerSpec tiktoken_spec(const std::string& file, const std::string& pattern = "") {
  TokenizerSpec s;
  s.type = "TikTokenizer";
  s.model_file = file;
  s.tiktoken_pattern = pattern;
  return s;
}

// The fixture's texts: the tokenizers' shared corpus and the words v2 cuts by letter case.
std::vector<std::string> texts() {
  return {test::read_file(fixture("edge_cases.txt")), test::read_file("/usr/share/common-licenses/GPL-3"),
          test::read_file(fixture("cased_words.txt"))};
}

TEST(TikTokenizer, MegatronsV1AndV2IdsEqualTheReference) {
  const auto corpus = texts();
  for (const std::string pattern : {"v1", "v2"}) {
    const auto tok = make_tokenizer(tiktoken_spec(o200k(), pattern));
    const auto want = reference_ids("tiktoken-" + pattern);
    ASSERT_EQ(want.size(), corpus.size());
    for (size_t k = 0; k < corpus.size(); ++k) {
      const std::vector<int32_t> got = tok->tokenize(corpus[k]);
      size_t first = 0;
      while (first < got.size() && first < want[k].size() && got[first] == want[k][first]) ++first;
      EXPECT_EQ(got, want[k]) << pattern << " text " << k << ": " << got.size() << " ids, reference " << want[k].size()
                              << "; first difference at " << first;
      if (got == want[k])
        std::printf("  %s text %zu: %zu ids, identical to js-tiktoken\n", pattern.c_str(), k, got.size());
    }
    // Megatron's defaults: 131072 ids, of which the first 1000 are special; </s> ends documents.
    EXPECT_EQ(tok->vocab_size(), 131072);
    EXPECT_EQ(tok->eod(), 2);
    EXPECT_EQ(tok->bos(), 1);
    EXPECT_EQ(tok->type(), "TikTokenizer");
  }
}

TEST(TikTokenizer, DecodeGivesTheTextBack) {
  const auto tok = make_tokenizer(tiktoken_spec(o200k()));
  for (const std::string& text : texts()) EXPECT_EQ(tok->decode(tok->tokenize(text)), text);
  EXPECT_EQ(tok->decode(std::vector<int32_t>{1, 7, 999}), "<s><SPECIAL_7><SPECIAL_999>");
  EXPECT_THROW(tok->decode(std::vector<int32_t>{131072}), DataError);
  EXPECT_THROW(tok->decode(std::vector<int32_t>{-1}), DataError);
}

TEST(TikTokenizer, EncodingAcrossACutEqualsEncodingWhole) {
  const auto tok = make_tokenizer(tiktoken_spec(o200k()));
  std::string text;
  for (const std::string& t : texts()) text += t;
  EXPECT_GT(expect_cuts_keep_the_ids(*tok, text, 89), 100);
  std::vector<int32_t> whole;
  tok->encode(text, &whole);
  std::vector<int32_t> a, b;
  std::thread t1([&] { tok->encode(text, &a); });
  std::thread t2([&] { tok->encode(text, &b); });
  t1.join();
  t2.join();
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, whole);
}

// `dtk export hf` writes hf_tokenizer_json() as a llama folder's tokenizer.json: Hugging Face's
// merge-based BPE over it (DTK's HuggingFaceTokenizer, itself equal to a JavaScript port of
// Hugging Face's tokenizers on Llama 3) gives the ids of tiktoken's rank-based one. Every special
// token is in the vocabulary at its id too: Hugging Face's loader takes an added token's id from
// there (else it hands out the next free one), not from "added_tokens".
TEST(TikTokenizer, ItsHuggingFaceTokenizerJsonEncodesTheSame) {
  test::TempDir dir;
  const auto corpus = texts();
  for (const std::string pattern : {"v1", "v2"}) {
    const auto tok = make_tokenizer(tiktoken_spec(o200k(), pattern));
    const std::string file = dir / (pattern + ".tokenizer.json");
    const std::string json_text = tok->hf_tokenizer_json();
    std::ofstream(file) << json_text;
    const nlohmann::json j = nlohmann::json::parse(json_text);
    const nlohmann::json& vocab = j["model"]["vocab"];
    ASSERT_EQ(j["added_tokens"].size(), 1000u);
    for (const nlohmann::json& added : j["added_tokens"]) {
      const std::string content = added["content"];
      ASSERT_TRUE(vocab.contains(content)) << content;
      EXPECT_EQ(vocab[content], added["id"]) << content;
    }
    TokenizerSpec hf_spec;
    hf_spec.type = "HuggingFaceTokenizer";
    hf_spec.model_file = file;
    const auto hf = make_tokenizer(hf_spec);
    EXPECT_EQ(hf->vocab_size(), tok->vocab_size());
    for (size_t k = 0; k < corpus.size(); ++k)
      EXPECT_EQ(hf->tokenize(corpus[k]), tok->tokenize(corpus[k])) << pattern << " text " << k;
    EXPECT_EQ(hf->decode(hf->tokenize(corpus[0])), corpus[0]);
  }
}

// tiktoken's regexes run in Rust: \s is White_Space, which holds U+0085 and not U+FEFF (the
// JavaScript reference reads both the other way, so the fixture texts hold neither).
TEST(TikTokenizer, WhitespaceIsUnicodesWhiteSpace) {
  const auto pieces = [](void (*cut)(std::string_view, std::vector<std::string_view>*), const std::string& s) {
    std::vector<std::string_view> out;
    cut(s, &out);
    return std::vector<std::string>(out.begin(), out.end());
  };
  const std::string nel = "\xC2\x85", bom = "\xEF\xBB\xBF";
  for (auto cut : {tiktoken_v1_pre_tokenize, tiktoken_v2_pre_tokenize}) {
    EXPECT_EQ(pieces(cut, "a" + nel + nel + "b"), (std::vector<std::string>{"a", nel, nel + "b"}));
    EXPECT_EQ(pieces(cut, "a" + bom + bom + "b"), (std::vector<std::string>{"a", bom + bom, "b"}));
  }
}

// A vocabulary in Megatron's format: the 256 bytes, then `more` in rank order.
void write_vocabulary(const std::string& path, const std::vector<std::string>& more) {
  static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const auto b64 = [](const std::string& s) {
    std::string out;
    for (size_t i = 0; i < s.size(); i += 3) {
      uint32_t v = static_cast<uint8_t>(s[i]) << 16;
      if (i + 1 < s.size()) v |= static_cast<uint8_t>(s[i + 1]) << 8;
      if (i + 2 < s.size()) v |= static_cast<uint8_t>(s[i + 2]);
      out += a[(v >> 18) & 63];
      out += a[(v >> 12) & 63];
      out += i + 1 < s.size() ? a[(v >> 6) & 63] : '=';
      out += i + 2 < s.size() ? a[v & 63] : '=';
    }
    return out;
  };
  std::ofstream f(path);
  f << "[";
  for (int i = 0; i < 256 + static_cast<int>(more.size()); ++i) {
    const std::string bytes = i < 256 ? std::string(1, static_cast<char>(i)) : more[i - 256];
    f << (i ? ",\n" : "") << "{\"rank\": " << i << ", \"token_bytes\": \"" << b64(bytes) << "\", \"token_str\": \"\"}";
  }
  f << "]";
}

// tiktoken's merge: the adjacent pair with the lowest rank first, the leftmost of equal ranks; a
// piece that is a token is that token. 10 special ids, so rank r is id r + 10.
TEST(TikTokenizer, BytePairMergeFollowsTheRanks) {
  test::TempDir dir;
  const std::string file = dir / "vocab.json";
  write_vocabulary(file, {"ab", "aa", "abd", "bc", "aaaa"});  // ranks 256..260
  TokenizerSpec s = tiktoken_spec(file);
  s.tiktoken_num_special_tokens = 10;
  s.vocab_size = 10 + 261;
  const auto tok = make_tokenizer(s);
  const auto ids = [&](const std::string& text) { return tok->tokenize(text); };
  const int32_t a = 10 + 'a', c = 10 + 'c', x = 10 + 'x';
  EXPECT_EQ(ids("abc"), (std::vector<int32_t>{266, c}));  // ab (256) before bc (259)
  EXPECT_EQ(ids("abcab"), (std::vector<int32_t>{266, c, 266}));
  EXPECT_EQ(ids("aaa"), (std::vector<int32_t>{267, a}));  // the leftmost aa
  EXPECT_EQ(ids("aaaa"), (std::vector<int32_t>{270}));    // a token as a whole
  EXPECT_EQ(ids("cbc"), (std::vector<int32_t>{c, 269}));
  EXPECT_EQ(ids("xabd"), (std::vector<int32_t>{x, 268}));  // ab, then ab + d
  // Special tokens written in the text are their ids (allowed_special="all"), the fillers too.
  const std::vector<int32_t> specials = ids("a<s>b<SPECIAL_9>");
  EXPECT_EQ(specials, (std::vector<int32_t>{10 + 'a', 1, 10 + 'b', 9}));
  EXPECT_EQ(tok->decode(ids("<SPECIAL_10>")), "<SPECIAL_10>");  // past the 10 specials: plain text
  EXPECT_EQ(ids("<SPECIAL_10>").size(), 12u);                   // one id per byte here
  EXPECT_EQ(tok->eod(), 2);
}

TEST(TikTokenizer, BadVocabulariesAndSettingsAreOneLineErrors) {
  test::TempDir dir;
  const std::string good = dir / "good.json";
  write_vocabulary(good, {"ab"});
  TokenizerSpec s = tiktoken_spec(good);
  s.tiktoken_num_special_tokens = 10;
  s.vocab_size = 267;
  EXPECT_EQ(error_of(s), "no error");
  try {  // the text is checked whole, before any id: the byte counts from its start
    make_tokenizer(s)->tokenize("<s>ab\xff");
    ADD_FAILURE() << "invalid UTF-8 accepted";
  } catch (const DataError& e) {
    EXPECT_STREQ(e.what(), "invalid UTF-8 at byte 5");
  }
  const auto expect_error = [&](TokenizerSpec spec, const std::string& what) {
    const std::string e = error_of(spec);
    EXPECT_NE(e.find(what), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  };
  const auto with_file = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    TokenizerSpec t = s;
    t.model_file = dir / name;
    return t;
  };
  expect_error(with_file("bad.json", "[{\"rank\": 0,"), "is not valid JSON");
  expect_error(with_file("object.json", "{}"), "holds a JSON object, not a list of tokens");
  expect_error(with_file("keys.json", "[{\"rank\": 0, \"token_bytes\": \"AA==\"}]"), "entry 0 is not");
  expect_error(with_file("rank.json", "[{\"rank\": 1, \"token_bytes\": \"AA==\", \"token_str\": \"\"}]"),
               "entry 0 has rank 1");
  expect_error(with_file("b64.json", "[{\"rank\": 0, \"token_bytes\": \"A?==\", \"token_str\": \"\"}]"),
               "token_bytes is not a non-empty base64 string");
  expect_error(with_file("order.json", "[{\"rank\": 0, \"token_bytes\": \"AQ==\", \"token_str\": \"\"}]"),
               "must be the single byte 0");
  TokenizerSpec few = s;
  few.vocab_size = 300;
  expect_error(few, "has 257 tokens; --vocab-size 300 with 10 special tokens needs 290");
  const std::string twice = dir / "twice.json";
  write_vocabulary(twice, {"ab", "ab"});
  TokenizerSpec dup = s;
  dup.model_file = twice;
  dup.vocab_size = 268;
  expect_error(dup, "entry 257 repeats the bytes of an earlier token");
  TokenizerSpec pattern = s;
  pattern.tiktoken_pattern = "v3";
  expect_error(pattern, "--tiktoken-pattern must be v1 or v2, got 'v3'");
  TokenizerSpec specials = s;
  specials.special_tokens = {"<unk>", "<s>", "</s>"};
  expect_error(specials, "must include <mask>");
  specials.special_tokens = {"<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<s>"};
  expect_error(specials, "special token '<s>' is given twice");
  TokenizerSpec many = s;
  many.tiktoken_num_special_tokens = 5;
  expect_error(many, "len(special tokens) 7 <= --tiktoken-num-special-tokens 5");
  TokenizerSpec huge = s;
  huge.vocab_size = int64_t{1} << 31;
  expect_error(huge, "is above 2^31 - 1");
  huge.vocab_size = (int64_t{1} << 31) - 1;
  huge.tiktoken_num_special_tokens = huge.vocab_size - 300;
  expect_error(huge, "is more than the 2^20 DTK builds");
  TokenizerSpec small = s;
  small.vocab_size = 200;
  expect_error(small, "leaves 190 tokens beside 10 special ones");
  expect_error(with_file("vocab.txt", "[]"), "must be a .json file");
  expect_error(tiktoken_spec(dir / "missing.json"), "is not a file");
  expect_error(tiktoken_spec(""), "needs --tokenizer-model");
  TokenizerSpec other;
  other.type = "NullTokenizer";
  other.vocab_size = 10;
  other.tiktoken_pattern = "v2";
  expect_error(other, "takes no --tiktoken-pattern");
  other.tiktoken_pattern.clear();
  other.special_tokens = {"<s>"};
  expect_error(other, "takes no --tokenizer-special-tokens");
}

}  // namespace
}  // namespace dtk::text
