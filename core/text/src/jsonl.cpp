#include "dtk/text/jsonl.hpp"

#include <simdjson.h>

#include <algorithm>
#include <optional>

#include "dtk/data/error.hpp"
#include "dtk/data/utf8.hpp"

namespace dtk::text {

using data::DataError;
using data::find_invalid_utf8;

struct JsonlLineParser::Impl {
  std::vector<std::string> keys;
  simdjson::dom::parser parser;
  std::string padded;  // the line plus simdjson's read-ahead padding
  std::vector<std::optional<simdjson::dom::element>> found;
};

JsonlLineParser::JsonlLineParser(std::vector<std::string> keys) : impl_(std::make_unique<Impl>()) {
  impl_->found.resize(keys.size());
  impl_->keys = std::move(keys);
}

JsonlLineParser::~JsonlLineParser() = default;

void JsonlLineParser::parse(std::string_view line, const std::string& where,
                            std::vector<std::vector<std::string_view>>* values) {
  Impl& m = *impl_;
  m.padded.assign(line.data(), line.size());
  m.padded.resize(line.size() + simdjson::SIMDJSON_PADDING);
  simdjson::dom::element doc;
  if (const auto err = m.parser.parse(m.padded.data(), line.size(), false).get(doc)) {
    const size_t bad = err == simdjson::UTF8_ERROR ? find_invalid_utf8(line) : std::string::npos;
    if (bad != std::string::npos) throw DataError(where + ": invalid UTF-8 at byte " + std::to_string(bad));
    throw DataError(where + ": invalid JSON: " + simdjson::error_message(err));
  }
  simdjson::dom::object object;
  if (doc.get(object)) throw DataError(where + ": the line is not a JSON object");
  std::fill(m.found.begin(), m.found.end(), std::nullopt);
  for (const simdjson::dom::key_value_pair field : object) {
    for (size_t k = 0; k < m.keys.size(); ++k) {
      if (field.key == m.keys[k]) m.found[k] = field.value;
    }
  }
  values->resize(m.keys.size());
  for (size_t k = 0; k < m.keys.size(); ++k) {
    std::vector<std::string_view>& out = (*values)[k];
    out.clear();
    if (!m.found[k]) throw DataError(where + ": missing key '" + m.keys[k] + "'");
    const simdjson::dom::element value = *m.found[k];
    std::string_view s;
    simdjson::dom::array list;
    if (!value.get(s)) {
      out.push_back(s);
    } else if (!value.get(list)) {
      for (const simdjson::dom::element item : list) {
        if (item.get(s)) throw DataError(where + ": '" + m.keys[k] + "' is a list with a non-string");
        out.push_back(s);
      }
    } else {
      throw DataError(where + ": '" + m.keys[k] + "' is not a string or a list of strings");
    }
  }
}

}  // namespace dtk::text
