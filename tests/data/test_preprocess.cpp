#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "dtk/data/error.hpp"
#include "dtk/text/gpt2_tokenizer.hpp"
#include "dtk/data/indexed_dataset.hpp"
#include "dtk/text/preprocess.hpp"
#include "test_util.hpp"

namespace dtk::data {
namespace {
using namespace ::dtk::text;  // the text tier: tokenizers, jsonl, preprocess

const Tokenizer& gpt2() {
  static const auto tokenizer = make_tokenizer({"GPT2BPETokenizer", "", test::encoder_json(), test::vocab_bpe(), 0});
  return *tokenizer;
}

PreprocessOptions options(const test::TempDir& dir) {
  PreprocessOptions o;
  o.tokenizer = &gpt2();
  o.output_prefix = dir / "out";
  return o;
}

std::string error_of(const PreprocessOptions& o) {
  try {
    preprocess(o);
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

// A whole text file is one document, encoded in parallel chunks, with exactly the ids of the
// reference encoder on the whole file.
TEST(Preprocess, TextFileMatchesReferenceIdsWithChunkedParallelEncoding) {
  test::TempDir dir;
  PreprocessOptions o = options(dir);
  o.inputs = {test::shakespeare_text()};
  o.workers = 2;
  o.batch_bytes = 6000;  // the 120 KB excerpt: ~20 chunks
  o.append_eod = true;
  const PreprocessStats st = preprocess(o);
  EXPECT_EQ(st.documents, 1);
  EXPECT_GE(st.batches, 15);  // really cut into many chunks
  IndexedDataset ds(dir / "out_text_document");
  EXPECT_EQ(ds.dtype(), DType::kUInt16);
  ASSERT_EQ(ds.num_sequences(), 1u);
  const std::vector<int32_t> want = test::shakespeare_reference_ids();
  const std::vector<int64_t> ids = ds.get(0);
  ASSERT_EQ(ids.size(), want.size() + 1);
  EXPECT_EQ(ids.back(), 50256);
  for (size_t i = 0; i + 1 < ids.size(); ++i) ASSERT_EQ(ids[i], want[i]) << "token " << i;
  std::ostringstream text;
  decode_documents(dir / "out_text_document", gpt2(), 0, -1, text);
  EXPECT_EQ(text.str(), test::read_file(o.inputs[0]) + "<|endoftext|>");
}

TEST(Preprocess, JsonlLikeMegatron) {
  test::TempDir dir;
  test::write_file(dir / "in.jsonl",
                   "{\"text\": \"Hello world\", \"title\": \"A\"}\n"
                   "{\"text\": \"\", \"title\": \"B\"}\r\n"
                   "\n"
                   "{\"text\": [\"One.\", \"\", \"Two.\"], \"title\": \"C\"}\n");
  PreprocessOptions o = options(dir);
  o.inputs = {dir / "in.jsonl"};
  o.json_keys = {"text", "title"};
  o.append_eod = true;
  o.workers = 3;
  const PreprocessStats st = preprocess(o);
  EXPECT_EQ(st.documents, 3);
  IndexedDataset text(dir / "out_text_document");
  // Documents: [Hello world EOD], [] (no sequence), [One.] [Two. EOD]
  ASSERT_EQ(text.num_documents(), 3u);
  ASSERT_EQ(text.num_sequences(), 3u);
  EXPECT_EQ(text.document_index(1), 1);
  EXPECT_EQ(text.document_index(2), 1);
  EXPECT_EQ(text.document_index(3), 3);
  EXPECT_EQ(text.get(0), (std::vector<int64_t>{15496, 995, 50256}));
  EXPECT_EQ(text.get(2).back(), 50256);
  IndexedDataset title(dir / "out_title_document");
  EXPECT_EQ(title.num_documents(), 3u);
  EXPECT_EQ(title.num_sequences(), 3u);
  std::ostringstream decoded;
  decode_documents(dir / "out_text_document", gpt2(), 2, 3, decoded);
  EXPECT_EQ(decoded.str(), "One.Two.<|endoftext|>");
  EXPECT_THROW(decode_documents(dir / "out_text_document", gpt2(), 2, 9, decoded), DataError);
}

TEST(Preprocess, BadLinesAreErrorsOrCountedSkips) {
  test::TempDir dir;
  test::write_file(dir / "bad.jsonl",
                   "{\"text\": \"ok\"}\n"
                   "{\"text\": \"broken\"\n"
                   "{\"other\": \"x\"}\n"
                   "{\"text\": \"bad \xff utf8\"}\n"
                   "[1]\n"
                   "{\"text\": 5}\n"
                   "{\"text\": \"fine\"}\n");
  PreprocessOptions o = options(dir);
  o.inputs = {dir / "bad.jsonl"};
  const std::string err = error_of(o);
  EXPECT_NE(err.find(dir / "bad.jsonl:2: invalid JSON"), std::string::npos) << err;
  EXPECT_EQ(err.find('\n'), std::string::npos);
  o.skip_bad_lines = true;
  std::ostringstream log;
  o.log = &log;
  const PreprocessStats st = preprocess(o);
  EXPECT_EQ(st.bad_lines, 5);
  EXPECT_EQ(st.documents, 2);
  EXPECT_NE(log.str().find("skipped 5 bad lines"), std::string::npos) << log.str();

  test::write_file(dir / "bad.txt", "abc\n\xc3(\n");
  o = options(dir);
  o.inputs = {dir / "bad.txt"};
  EXPECT_NE(error_of(o).find(dir / "bad.txt:2: invalid UTF-8 at byte 4"), std::string::npos) << error_of(o);
  o.inputs = {dir / "missing.jsonl"};
  EXPECT_NE(error_of(o).find("cannot open"), std::string::npos);
  o.inputs = {dir / "bad.txt"};
  o.json_keys = {"body"};
  EXPECT_NE(error_of(o).find("needs 'text'"), std::string::npos);
  o = options(dir);
  o.inputs = {dir / "bad.txt"};
  o.tokenizer = nullptr;
  EXPECT_NE(error_of(o).find("no tokenizer"), std::string::npos);
}

// An empty corpus (no lines, or only documents without text) is one error and writes nothing:
// its dataset could not train.
TEST(Preprocess, AnEmptyCorpusIsAnErrorAndWritesNothing) {
  test::TempDir dir;
  test::write_file(dir / "empty.jsonl", "");
  test::write_file(dir / "blank.jsonl", "{\"text\": \"\"}\n{\"text\": \"\"}\n");
  for (const char* name : {"empty.jsonl", "blank.jsonl"}) {
    PreprocessOptions o = options(dir);
    o.inputs = {dir / name};
    o.output_prefix = dir / "out";
    const std::string err = error_of(o);
    EXPECT_NE(err.find("the input '" + (dir / name) + "' holds no tokens ("), std::string::npos)
        << name << ": " << err;
    EXPECT_FALSE(std::ifstream(dir / "out_text_document.bin").good()) << name;
    EXPECT_FALSE(std::ifstream(dir / "out_text_document.idx").good()) << name;
  }
}


// dtk preprocess records the pair it wrote (PREFIX.fingerprint): another corpus's .idx over this
// .bin, or its .bin under this .idx, is refused even where the sizes agree, so that the reader's
// own check (a .bin holding exactly what its .idx describes) cannot tell them apart. Two corpora
// of 7 tokens each, split into documents of 4 + 3 and 3 + 4 tokens.
TEST(Preprocess, AFingerprintRefusesAPairThatWasNotWrittenTogether) {
  test::TempDir dir;
  test::write_file(dir / "a.jsonl", "{\"text\": \"one two three\"}\n{\"text\": \"four five\"}\n");
  test::write_file(dir / "b.jsonl", "{\"text\": \"one two\"}\n{\"text\": \"three four five\"}\n");
  auto run = [&](const std::string& input, const std::string& prefix) {
    PreprocessOptions o = options(dir);
    o.inputs = {dir / input};
    o.output_prefix = dir / prefix;
    o.append_eod = true;
    preprocess(o);
    return dir / (prefix + "_text_document");
  };
  const std::string a = run("a.jsonl", "a"), b = run("b.jsonl", "b");
  auto open_error = [](const std::string& prefix) {
    try {
      IndexedDataset ds(prefix);
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  ASSERT_TRUE(std::ifstream(a + ".fingerprint").good());
  ASSERT_EQ(open_error(a), "");
  ASSERT_EQ(IndexedDataset(a).sequence_length(0), 4);  // the two layouts differ...
  ASSERT_EQ(IndexedDataset(b).sequence_length(0), 3);
  const std::string a_idx = test::read_file(a + ".idx"), a_bin = test::read_file(a + ".bin");
  ASSERT_EQ(a_bin.size(), test::read_file(b + ".bin").size());  // ...over .bin files of one size
  const std::string refused = "' are not the pair dtk preprocess wrote together: '" + a + ".fingerprint' records ";
  test::write_file(a + ".idx", test::read_file(b + ".idx"));
  EXPECT_NE(open_error(a).find("'" + a + ".bin' and '" + a + ".idx" + refused), std::string::npos) << open_error(a);
  test::write_file(a + ".idx", a_idx);
  test::write_file(a + ".bin", test::read_file(b + ".bin"));
  EXPECT_NE(open_error(a).find(refused), std::string::npos) << open_error(a);
  EXPECT_NE(open_error(a).find("Run dtk preprocess again, or delete the fingerprint"), std::string::npos);
  // Writing a new pair over the prefix writes its fingerprint; a pair without one (Megatron's
  // tools write none) is read as before; a file that is not a fingerprint is named.
  run("b.jsonl", "a");
  EXPECT_EQ(open_error(a), "");
  std::remove((a + ".fingerprint").c_str());
  test::write_file(a + ".idx", test::read_file(b + ".idx"));
  EXPECT_EQ(open_error(a), "");
  test::write_file(a + ".fingerprint", "hello\n");
  EXPECT_NE(open_error(a).find("'" + a + ".fingerprint' is not a dtk pair fingerprint (it reads 'hello')"),
            std::string::npos)
      << open_error(a);
}
}  // namespace
}  // namespace dtk::data
