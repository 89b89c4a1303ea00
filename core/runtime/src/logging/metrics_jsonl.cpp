#include "dtk/core/logging/metrics_jsonl.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
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

namespace {

// Why the last stream operation failed, as the C library says (a full disk: "No space left on
// device"), or nothing where it did not say.
std::string reason() { return errno != 0 ? std::string(": ") + std::strerror(errno) : std::string(); }

}  // namespace

JsonlWriter::JsonlWriter(const std::string& path) : path_(path) {
  errno = 0;
  out_.open(path, std::ios::trunc);
  if (!out_) throw host::HostError("logging.metrics_jsonl: cannot write " + path + reason());
}

void JsonlWriter::write(const JsonObject& object) {
  errno = 0;
  out_ << object.str() << '\n';
  out_.flush();
  if (!out_) throw host::HostError("logging.metrics_jsonl: writing " + path_ + " failed" + reason());
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    errno = 0;
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.close();  // some file systems (quotas, NFS) report a failed write only here
    if (!out) {
      const std::string why = reason();
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);  // nothing half-written stays
      throw host::HostError("cannot write " + tmp + why);
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw host::HostError("cannot rename " + tmp + " to " + path + ": " + ec.message());
}

}  // namespace dtk::core
