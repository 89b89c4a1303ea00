// dtk/host/error_line.hpp — the text of a "dtk: error:" line, whatever the message holds: control
// bytes (a binary file's contents, a terminal escape) shown as \xNN, and a message longer than
// kMaxErrorLine characters (a 10 MB one-line config quoted back) cut, saying how much was left
// out. Every place that prints an error line uses it (apps/dtk: report_error and the commands
// that print their own).
#pragma once

#include <cstdio>
#include <string>

namespace dtk::host {

constexpr size_t kMaxErrorLine = 2000;

inline std::string error_line(const std::string& message) {
  std::string out;
  size_t shown = 0;
  for (; shown < message.size() && out.size() < kMaxErrorLine; ++shown) {
    const unsigned char c = static_cast<unsigned char>(message[shown]);
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (shown < message.size()) {
    // Not inside a UTF-8 sequence: back to its first byte.
    while (!out.empty() && (static_cast<unsigned char>(out.back()) & 0xC0) == 0x80) out.pop_back(), --shown;
    if (!out.empty() && static_cast<unsigned char>(out.back()) >= 0xC0) out.pop_back(), --shown;
    out += " ... (" + std::to_string(message.size() - shown) + " more characters)";
  }
  return out;
}

// Prints "dtk: error: <message>" as one line on stderr, after whatever the command printed before:
// stdout is block-buffered when piped, so without the flush the error would precede it.
inline void print_error_line(const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "dtk: error: %s\n", error_line(message).c_str());
  std::fflush(stderr);
}

}  // namespace dtk::host
