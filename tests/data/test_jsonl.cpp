// The JSON of jsonl lines (dtk::text::JsonlLineParser, simdjson): what `dtk preprocess` accepts,
// what it extracts, and the one-line error of every kind of bad line.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtk/data/error.hpp"
#include "dtk/text/jsonl.hpp"

namespace dtk::data {
namespace {
using namespace ::dtk::text;  // the text tier: tokenizers, jsonl, preprocess

using Values = std::vector<std::vector<std::string_view>>;

std::vector<std::vector<std::string>> parse_ok(JsonlLineParser& p, const std::string& line) {
  Values v;
  p.parse(line, "t", &v);
  std::vector<std::vector<std::string>> out;
  for (const auto& key : v) out.emplace_back(key.begin(), key.end());
  return out;
}

std::string error_of(JsonlLineParser& p, const std::string& line, const std::string& where = "f.jsonl:2") {
  Values v;
  try {
    p.parse(line, where, &v);
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

TEST(JsonlLine, ExtractsStringsAndListsOfStrings) {
  JsonlLineParser p({"text", "title"});
  using S = std::vector<std::vector<std::string>>;
  EXPECT_EQ(parse_ok(p, R"({"text": "Hello", "title": ["A", "", "B"]})"), (S{{"Hello"}, {"A", "", "B"}}));
  EXPECT_EQ(parse_ok(p, R"( {"title": [], "n": -1.5e2, "l": [true, false, null], "text": ""} )"), (S{{""}, {}}));
  // Escapes, surrogate pairs, raw UTF-8, and nested values that are not extracted.
  EXPECT_EQ(
      parse_ok(p,
               R"({"text": "a\"b\\u00e9\ud83d\ude00", "o": {"text": 1, "x": [[{}]]}, "title": "\u00e9\/\b\f\n\r\t"})"),
      (S{{"a\"b\\u00e9\xf0\x9f\x98\x80"}, {"\xc3\xa9/\b\f\n\r\t"}}));
  EXPECT_EQ(parse_ok(p, "{\"text\": \"caf\xc3\xa9 \\u0000\", \"title\": \"x\"}"),
            (S{{std::string("caf\xc3\xa9 \0", 7)}, {"x"}}));
  // A repeated key: its last member wins, as in Python's json.
  EXPECT_EQ(parse_ok(p, R"({"text": "first", "title": "t", "text": "last"})"), (S{{"last"}, {"t"}}));
  // The parser is reused: nothing of the previous line leaks into the next one.
  EXPECT_EQ(error_of(p, R"({"title": "only"})"), "f.jsonl:2: missing key 'text'");
}

TEST(JsonlLine, BadLinesAreOneLineErrorsNamingTheLine) {
  JsonlLineParser p({"text"});
  // Not JSON: simdjson's reason after "invalid JSON: ".
  const std::vector<std::string> not_json = {"{",
                                             "{\"a\"}",
                                             "{\"text\": \"x\",}",
                                             "{\"text\" \"x\"}",
                                             "{\"text\": \"x\"} x",
                                             "{\"text\": \"x\"}}",
                                             "{\"text\": \"x\"",
                                             "[1,]",
                                             "{\"text\": 01}",
                                             "{\"text\": 1.}",
                                             "{\"text\": -}",
                                             "{\"text\": 1e}",
                                             "{\"text\": \"x\", \"n\": 1e400}",
                                             "{\"text\": tru}",
                                             "{\"text\": \"\\x\"}",
                                             "{\"text\": \"\\u00zz\"}",
                                             "{\"text\": \"\\ud800\"}",
                                             "{\"text\": \"\\udc00\"}",
                                             "{\"text\": \"\\ud800\\u0041\"}",
                                             "{\"text\": \"a\x01"
                                             "b\"}",
                                             "{\"text\": [1 2]}",
                                             std::string("{\"text\": \"x\"}\0", 14),
                                             "{\"text\": \"x\", \"d\": " + std::string(100000, '[')};
  for (const std::string& bad : not_json) {
    const std::string err = error_of(p, bad);
    EXPECT_EQ(err.rfind("f.jsonl:2: invalid JSON: ", 0), 0u) << bad << " -> " << err;
    EXPECT_GT(err.size(), std::string("f.jsonl:2: invalid JSON: ").size()) << bad;
    EXPECT_EQ(err.find('\n'), std::string::npos) << err;
  }
  EXPECT_EQ(error_of(p, "{\"a\": nul}", "file.jsonl:3"),
            "file.jsonl:3: invalid JSON: Problem while parsing an atom starting with the letter 'n'");
  // Invalid UTF-8 (anywhere, strings included) is named with its byte offset in the line.
  EXPECT_EQ(error_of(p, "{\"text\": \"\xff\"}"), "f.jsonl:2: invalid UTF-8 at byte 10");
  EXPECT_EQ(error_of(p, "{\"text\": \"ok\xc0\x80\"}"), "f.jsonl:2: invalid UTF-8 at byte 12");
  EXPECT_EQ(error_of(p, "{\"text\": \"\xed\xa0\x80\"}"), "f.jsonl:2: invalid UTF-8 at byte 10");
  EXPECT_EQ(error_of(p, "{\"t\xe2\x82\": \"x\"}"), "f.jsonl:2: invalid UTF-8 at byte 3");
  // Valid JSON, wrong shape.
  for (const char* bad : {"[1]", "\"text\"", "5", "null", "[{\"text\": \"x\"}]"}) {
    EXPECT_EQ(error_of(p, bad), "f.jsonl:2: the line is not a JSON object") << bad;
  }
  EXPECT_EQ(error_of(p, "{\"other\": \"x\"}"), "f.jsonl:2: missing key 'text'");
  EXPECT_EQ(error_of(p, "{\"Text\": \"x\"}"), "f.jsonl:2: missing key 'text'");
  EXPECT_EQ(error_of(p, "{\"text\": 5}"), "f.jsonl:2: 'text' is not a string or a list of strings");
  EXPECT_EQ(error_of(p, "{\"text\": {\"a\": \"b\"}}"), "f.jsonl:2: 'text' is not a string or a list of strings");
  EXPECT_EQ(error_of(p, "{\"text\": null}"), "f.jsonl:2: 'text' is not a string or a list of strings");
  EXPECT_EQ(error_of(p, "{\"text\": [\"a\", 1]}"), "f.jsonl:2: 'text' is a list with a non-string");
  EXPECT_EQ(error_of(p, "{\"text\": [[\"a\"]]}"), "f.jsonl:2: 'text' is a list with a non-string");
  // After errors, the same parser still parses good lines.
  Values v;
  p.parse("{\"text\": \"fine\"}", "t", &v);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0], (std::vector<std::string_view>{"fine"}));
}

}  // namespace
}  // namespace dtk::data
