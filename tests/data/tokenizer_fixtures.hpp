// What the tokenizer tests share: where the fetched tokenizer files and the committed reference
// ids are, the ids of a fixture, and make_tokenizer()'s error line.
#pragma once

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

}  // namespace dtk::text::tokenizer_test
