// dtk::data — the JSON of one jsonl line for `dtk preprocess`, parsed with simdjson.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dtk::text {

// Extracts the strings of some keys from jsonl lines. One parser per thread: it reuses its
// buffers from line to line. Strict RFC 8259 JSON in UTF-8 (numbers must fit a double or a
// 64-bit integer, nesting <= 1024); when a key repeats, its last member wins (as Python's json,
// hence Megatron's preprocess_data.py).
class JsonlLineParser {
 public:
  explicit JsonlLineParser(std::vector<std::string> keys);
  ~JsonlLineParser();
  JsonlLineParser(const JsonlLineParser&) = delete;
  JsonlLineParser& operator=(const JsonlLineParser&) = delete;

  // Fills (*values)[k] with the strings of keys[k]: a string value is one, a list of strings one
  // per element. They point into the parser, valid until the next Parse. A bad line throws
  // DataError "<where>: what is wrong" (one line): invalid JSON (with simdjson's reason), invalid
  // UTF-8 at byte N, not a JSON object, a missing key, a value that is neither a string nor a list
  // of strings.
  void parse(std::string_view line, const std::string& where, std::vector<std::vector<std::string_view>>* values);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtk::text
