#include "dtk/core/logging/metrics_jsonl.hpp"

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "dtk/host/error.hpp"  // HostError

namespace dtk::core {

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\', out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

void JsonObject::key(const std::string& k) {
  if (!body_.empty()) body_ += ", ";
  body_ += json_quote(k) + ": ";
}

JsonObject& JsonObject::add(const std::string& k, double value) {
  key(k);
  if (!std::isfinite(value)) {
    body_ += "null";
  } else {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", value);
    body_ += buf;
  }
  return *this;
}

JsonObject& JsonObject::add(const std::string& k, int64_t value) {
  key(k);
  body_ += std::to_string(value);
  return *this;
}

JsonObject& JsonObject::add(const std::string& k, const std::string& value) {
  key(k);
  body_ += json_quote(value);
  return *this;
}

JsonObject& JsonObject::add_raw(const std::string& k, const std::string& json) {
  key(k);
  body_ += json;
  return *this;
}

JsonlWriter::JsonlWriter(const std::string& path) : path_(path), out_(path, std::ios::trunc) {
  if (!out_) throw host::HostError("logging.metrics_jsonl: cannot write " + path);
}

void JsonlWriter::write(const JsonObject& object) {
  out_ << object.str() << '\n';
  out_.flush();
  if (!out_) throw host::HostError("logging.metrics_jsonl: writing " + path_ + " failed");
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw host::HostError("cannot write " + tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw host::HostError("cannot rename " + tmp + " to " + path + ": " + ec.message());
}

}  // namespace dtk::core
