// DTK's tokenizers against their reference encoders, id for id, on real vocabularies and a real
// corpus (the GPL-3 of Debian's base-files, and tests/data/fixtures/tokenizers/edge_cases.txt).
// The reference ids were made by tools/fixtures/tokenizer_ids.sh: Hugging Face tokenizer.json
// files by @lenml/tokenizers (a JavaScript port of Hugging Face's tokenizers), SentencePiece by
// its Python binding wrapped as Megatron's classes wrap it. On a difference the test prints the
// count and the first differing position.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <thread>

#include "dtk/data/error.hpp"
#include "dtk/text/normalize.hpp"
#include "dtk/text/tokenizer.hpp"
#include "test_util.hpp"
#include "tokenizer_fixtures.hpp"

namespace dtk::text {
namespace {

using data::DataError;
namespace test = ::dtk::data::test;
using namespace tokenizer_test;  // NOLINT: the shared fixtures of this folder

const char* const kGpl3 = "/usr/share/common-licenses/GPL-3";

std::vector<std::string> corpus() {
  return {test::read_file(fixture("edge_cases.txt")), test::read_file(kGpl3)};
}

void expect_same_ids(const std::vector<int32_t>& got, const std::vector<int32_t>& want, const std::string& what) {
  size_t first = 0;
  while (first < got.size() && first < want.size() && got[first] == want[first]) ++first;
  EXPECT_TRUE(got == want) << what << ": " << got.size() << " ids, reference " << want.size()
                           << "; first difference at " << first << " (got "
                           << (first < got.size() ? std::to_string(got[first]) : "end") << ", reference "
                           << (first < want.size() ? std::to_string(want[first]) : "end") << ")";
  if (got == want) std::printf("  %s: %zu ids, identical to the reference\n", what.c_str(), got.size());
}

void expect_reference(const Tokenizer& tok, const std::string& name) {
  const auto want = reference_ids(name);
  const auto texts = corpus();
  ASSERT_EQ(want.size(), texts.size()) << name << ".ids";
  for (size_t k = 0; k < texts.size(); ++k)
    expect_same_ids(tok.tokenize(texts[k]), want[k], name + (k == 0 ? " on edge_cases.txt" : " on GPL-3"));
}

std::unique_ptr<Tokenizer> hf(const std::string& folder) {
  return make_tokenizer({"HuggingFaceTokenizer", tokenizers_dir() + "/" + folder, "", "", 0});
}
std::unique_ptr<Tokenizer> sentencepiece(const std::string& type) {
  return make_tokenizer({type, fixture("gpl3_bpe.model"), "", "", 0});
}

TEST(HuggingFaceTokenizer, Llama3IdsEqualTheReference) {
  const auto tok = hf("llama3");
  expect_reference(*tok, "llama3");
  EXPECT_EQ(tok->vocab_size(), 128256);
  EXPECT_EQ(tok->eod(), 128001);  // tokenizer_config.json's eos_token <|end_of_text|>
  EXPECT_EQ(tok->bos(), 128000);
  EXPECT_TRUE(tok->text_prefix().empty());  // this tokenizer.json has no template
}

// Qwen3's tokenizer.json: an NFC normalizer (edge_cases.txt holds decomposed accents, Hangul
// jamo and marks out of canonical order), then Qwen2's regex (one digit per piece), byte-level BPE.
TEST(HuggingFaceTokenizer, Qwen3IdsEqualTheReference) {
  const auto tok = hf("qwen3");
  expect_reference(*tok, "qwen3");
  EXPECT_EQ(tok->vocab_size(), 151669);
  EXPECT_EQ(tok->eod(), 151645);            // tokenizer_config.json's eos_token <|im_end|>
  EXPECT_TRUE(tok->text_prefix().empty());  // no BOS: its post_processor is ByteLevel alone
  // Qwen2's regex takes one digit per piece (Llama 3's up to three).
  const std::vector<int32_t> year = tok->tokenize("2024");
  ASSERT_EQ(year.size(), 4u);
  EXPECT_EQ(year[1], tok->tokenize("0").at(0));
  // NFC before BPE: the decomposed and the composed spellings are one text.
  EXPECT_EQ(tok->tokenize("Cafe\u0301 \u1100\u1161\u11a8"), tok->tokenize("Caf\u00e9 \uac01"));
}

// NFC (dtk/text/normalize.hpp) on cases whose results Unicode's data fixes: composition,
// canonical reordering before it, blocking, Hangul by the algorithm, singletons and exclusions.
TEST(Normalize, NfcComposesReordersAndBlocksAsUnicodeSays) {
  std::string storage;
  auto nfc = [&](const std::string& s) { return std::string(dtk::text::nfc(s, &storage)); };
  EXPECT_EQ(nfc("plain ASCII"), "plain ASCII");
  EXPECT_EQ(nfc("e\u0301"), "\u00e9");               // e + acute -> é
  EXPECT_EQ(nfc("a\u0323\u0302"), "\u1ead");         // a + dot below + circumflex -> ậ
  EXPECT_EQ(nfc("a\u0302\u0323"), "\u1ead");         // marks out of order: reordered first
  EXPECT_EQ(nfc("\u1e0b\u0323"), "\u1e0d\u0307");    // ḋ + dot below -> ḍ + dot above
  EXPECT_EQ(nfc("\u1100\u1161\u11a8"), "\uac01");    // Hangul L V T -> 각
  EXPECT_EQ(nfc("\uac00\u11a8"), "\uac01");          // LV + T
  EXPECT_EQ(nfc("\u212b"), "\u00c5");                // ANGSTROM SIGN, a singleton -> Å
  EXPECT_EQ(nfc("\u0958"), "\u0915\u093c");          // excluded from composition: stays apart
  EXPECT_EQ(nfc("a\u0316\u0301"), "\u00e1\u0316");   // a lower-class mark between does not block
  EXPECT_EQ(nfc("a\u0305\u0301"), "a\u0305\u0301");  // one of the same class does
  EXPECT_EQ(nfc("\u0301e"), "\u0301e");              // a leading mark has no starter
  EXPECT_THROW(dtk::text::nfc("a\xff\u0301", &storage), dtk::data::DataError);
}

TEST(HuggingFaceTokenizer, SentencePieceStyleIdsEqualTheReference) {
  const auto tok = hf("sp-bpe");
  expect_reference(*tok, "sp-bpe");
  EXPECT_EQ(tok->vocab_size(), 32000);
  EXPECT_EQ(tok->text_prefix(), std::vector<int32_t>{1});  // the template's <s>
  EXPECT_EQ(tok->eod(), 2);                                // </s>
}

// Byte-level BPE is lossless. SentencePiece-style BPE is too, except that each stretch of text
// after an added token gets its own "▁" (Llama 2's legacy behaviour): checked on the GPL-3 alone.
TEST(HuggingFaceTokenizer, DecodeGivesTheTextBack) {
  const auto llama3 = hf("llama3");
  for (const std::string& text : corpus()) EXPECT_EQ(llama3->decode(llama3->tokenize(text)), text);
  const auto sp_bpe = hf("sp-bpe");
  const std::string gpl = test::read_file(kGpl3);
  std::vector<int32_t> ids;
  sp_bpe->encode(gpl, &ids);
  EXPECT_EQ(sp_bpe->decode(ids), gpl);
}

TEST(SentencePieceTokenizer, MegatronsThreeClassesEqualTheReference) {
  const auto megatron = sentencepiece("SentencePieceTokenizer");
  expect_reference(*megatron, "sp-megatron");
  EXPECT_EQ(megatron->vocab_size(), 1005);  // 1000 pieces + <CLS> <SEP> <EOD> <MASK> <PAD>
  EXPECT_EQ(megatron->eod(), 1002);         // <EOD>
  const auto gpt = sentencepiece("GPTSentencePieceTokenizer");
  expect_reference(*gpt, "sp-gpt");
  EXPECT_EQ(gpt->vocab_size(), 1000);
  EXPECT_EQ(gpt->eod(), 2);  // </s>
  const auto llama2 = sentencepiece("Llama2Tokenizer");
  expect_reference(*llama2, "sp-llama2");
  EXPECT_EQ(llama2->text_prefix(), std::vector<int32_t>{1});
  EXPECT_EQ(llama2->eod(), 2);
  // SentencePiece's default normalization folds runs of spaces; single-spaced text comes back.
  const std::string text = "The GNU General Public License is a free, copyleft license.\n";
  EXPECT_EQ(gpt->decode(gpt->tokenize(text)), text);
  EXPECT_EQ(megatron->decode(megatron->tokenize("a <EOD> b")), "a <EOD> b");
}

TEST(NullTokenizer, IdsAreTheNumbersAndEodIsTheSize) {
  const auto tok = make_tokenizer({"NullTokenizer", "", "", "", 100});
  EXPECT_EQ(tok->tokenize("5 0 99 100"), (std::vector<int32_t>{5, 0, 99, 100}));
  EXPECT_EQ(tok->vocab_size(), 101);
  EXPECT_EQ(tok->eod(), 100);
  EXPECT_EQ(tok->decode(std::vector<int32_t>{1, 2, 3}), "1 2 3");
  EXPECT_TRUE(tok->tokenize("").empty());
  EXPECT_THROW(tok->tokenize("1 101"), DataError);
  EXPECT_THROW(tok->tokenize("1  2"), DataError);  // split(' ') gives an empty word
  EXPECT_THROW(tok->tokenize("x"), DataError);
}

// Every place next_cut() offers cuts encoding in two there: the ids are those of one piece.
TEST(Tokenizers, EncodingAcrossACutEqualsEncodingWhole) {
  std::vector<std::unique_ptr<Tokenizer>> all;
  all.push_back(make_tokenizer({"", "", test::encoder_json(), test::vocab_bpe(), 0}));
  all.push_back(hf("llama3"));
  all.push_back(hf("qwen3"));
  const std::string text = test::read_file(kGpl3) + test::read_file(fixture("edge_cases.txt"));
  for (const auto& tok : all) EXPECT_GT(expect_cuts_keep_the_ids(*tok, text, 97), 100) << tok->type();
  EXPECT_EQ(sentencepiece("Llama2Tokenizer")->next_cut(text, 0), std::string_view::npos);
}

TEST(Tokenizers, ConcurrentEncodingGivesTheSameIds) {
  const auto tok = hf("llama3");
  const std::string text = test::read_file(kGpl3);
  std::vector<int32_t> a, b;
  std::thread t1([&] { tok->encode(text, &a); });
  std::thread t2([&] { tok->encode(text, &b); });
  t1.join();
  t2.join();
  EXPECT_EQ(a, b);
}

TEST(Tokenizers, BadSelectionsAreOneLineErrors) {
  EXPECT_NE(error_of({"BertWordPieceCase", "", "", "", 0}).find("unknown --tokenizer-type 'BertWordPieceCase'"),
            std::string::npos);
  EXPECT_NE(error_of({"Llama2Tokenizer", "", "", "", 0}).find("needs --tokenizer-model"), std::string::npos);
  EXPECT_NE(error_of({"NullTokenizer", "", "", "", 0}).find("needs --vocab-size"), std::string::npos);
  EXPECT_NE(error_of({"Llama2Tokenizer", fixture("gpl3_bpe.model"), "", "", 1000}).find("takes no --vocab-size"),
            std::string::npos);
  EXPECT_NE(error_of({"", "", "", "", 0}).find("needs --vocab-file"), std::string::npos);
  EXPECT_NE(error_of({"Llama2Tokenizer", kGpl3, "", "", 0}).find("not a SentencePiece model"), std::string::npos);
  EXPECT_NE(error_of({"HuggingFaceTokenizer", "/nonexistent", "", "", 0}).find("no tokenizer.json"),
            std::string::npos);
  EXPECT_NE(error_of({"HuggingFaceTokenizer", kGpl3, "", "", 0}).find("invalid JSON"), std::string::npos);
  EXPECT_NE(error_of({"Llama2Tokenizer", fixture("gpl3_bpe.model"), test::encoder_json(), "", 0})
                .find("takes no --vocab-file"),
            std::string::npos);
}

TEST(HuggingFaceTokenizer, WhatItDoesNotImplementIsRefusedByName) {
  test::TempDir dir;
  std::ofstream(dir / "tokenizer.json") << R"({"added_tokens": [], "normalizer": {"type": "NFKC"},
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "post_processor": null, "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}})";
  EXPECT_NE(error_of({"HuggingFaceTokenizer", dir / "tokenizer.json", "", "", 0}).find("normalizer"),
            std::string::npos);
  std::ofstream(dir / "tokenizer.json") << R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})";
  EXPECT_NE(error_of({"HuggingFaceTokenizer", dir / "tokenizer.json", "", "", 0}).find("model type 'WordPiece'"),
            std::string::npos);
}

}  // namespace
}  // namespace dtk::text
