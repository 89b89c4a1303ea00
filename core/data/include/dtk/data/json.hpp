// dtk::data — a small strict JSON (RFC 8259) parser for encoder.json and jsonl lines.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dtk::data {

struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  double number = 0;
  std::string string;                                     // kString (UTF-8)
  std::vector<JsonValue> array;                           // kArray
  std::vector<std::pair<std::string, JsonValue>> object;  // kObject, in input order

  bool is_string() const { return type == Type::kString; }
  // The value of the LAST member named `key` (like Python/JS), or nullptr.
  const JsonValue* Find(std::string_view key) const;
};

// Parses exactly one JSON value (surrounding whitespace allowed). Throws DataError
// "<source>: invalid JSON at byte N: <reason>". Nesting is limited to 256 levels.
JsonValue ParseJson(std::string_view text, const std::string& source);

}  // namespace dtk::data
