// dtk/core/logging/metrics_jsonl.hpp — one JSON object per line (logging.metrics_jsonl, --bench_out):
// what the log line and the evaluation block say, for scripts and tools/plot_metrics.py.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace dtk::core {

// A flat JSON object, built field by field. Non-finite numbers become null (JSON has no NaN).
class JsonObject {
 public:
  JsonObject& add(const std::string& key, double value);
  JsonObject& add(const std::string& key, int64_t value);
  JsonObject& add(const std::string& key, int value) { return add(key, static_cast<int64_t>(value)); }
  JsonObject& add(const std::string& key, const std::string& value);
  JsonObject& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonObject& add_raw(const std::string& key, const std::string& json);  // a nested value
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(const std::string& k);
  std::string body_;
};

std::string json_quote(const std::string& s);

// Appends lines to a file created (truncated) at construction; throws HostError naming the
// path when it cannot be opened. Every line is flushed (a crash loses nothing already logged).
class JsonlWriter {
 public:
  explicit JsonlWriter(const std::string& path);
  void write(const JsonObject& object);

 private:
  std::string path_;
  std::ofstream out_;
};

// Writes `text` to `path` through a temporary file and a rename (never a half-written file).
void write_file_atomically(const std::string& path, const std::string& text);

}  // namespace dtk::core
