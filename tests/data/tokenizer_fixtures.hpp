// What the tokenizer tests share: where the fetched tokenizer files and the committed reference
// ids are, the ids of a fixture, and make_tokenizer()'s error line.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "dtk/data/error.hpp"
#include "dtk/text/tokenizer.hpp"
#include "test_util.hpp"

namespace dtk::text::tokenizer_test {

// tools/fetch_tokenizers.sh's folder (DTK_TOKENIZERS_DIR overrides it at run time).
inline std::string tokenizers_dir() {
  const char* env = std::getenv("DTK_TOKENIZERS_DIR");
  return env ? env : DTK_TOKENIZERS_DIR;
}
inline std::string fixture(const std::string& name) {
  return ::dtk::data::test::fixtures_dir() + "/tokenizers/" + name;
}

// Line k of NAME.ids: the reference ids of text k.
inline std::vector<std::vector<int32_t>> reference_ids(const std::string& name) {
  std::istringstream in(::dtk::data::test::read_file(fixture(name + ".ids")));
  std::vector<std::vector<int32_t>> rows;
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    rows.emplace_back();
    for (int32_t id; words >> id;) rows.back().push_back(id);
  }
  return rows;
}

// make_tokenizer(spec)'s DataError line, or "no error".
inline std::string error_of(const TokenizerSpec& spec) {
  try {
    make_tokenizer(spec);
  } catch (const data::DataError& e) {
    return e.what();
  }
  return "no error";
}

// Every place next_cut() offers (asked every `step` bytes) cuts encoding in two there: the ids are
// those of one piece. Stops at the first failure; returns how many cuts were checked.
inline int expect_cuts_keep_the_ids(const Tokenizer& tok, const std::string& text, size_t step) {
  std::vector<int32_t> whole;
  tok.encode(text, &whole);
  int cuts = 0;
  for (size_t from = 1; from < text.size(); from += step) {
    const size_t cut = tok.next_cut(text, from);
    if (cut == std::string_view::npos) continue;
    EXPECT_GT(cut, 0u);
    std::vector<int32_t> parts;
    tok.encode(std::string_view(text).substr(0, cut), &parts);
    tok.encode(std::string_view(text).substr(cut), &parts);
    EXPECT_EQ(parts, whole) << tok.type() << " cut at " << cut;
    if (cut == 0 || parts != whole) break;
    ++cuts;
  }
  return cuts;
}

}  // namespace dtk::text::tokenizer_test
