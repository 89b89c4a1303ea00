// dtk/host/error_line.hpp — the text of a "dtk: error:" line, whatever the message holds: control
// bytes (a binary file's contents, a terminal escape) and bytes that are not UTF-8 (a name read
// from a corrupt file) shown as \xNN, and a message longer than
// kMaxErrorLine characters (a 10 MB one-line config quoted back) cut, saying how much was left
// out. Every place that prints an error line uses it (apps/dtk: report_error and the commands
// that print their own).
#pragma once

#include <cstdio>
#include <string>

namespace dtk::host {

constexpr size_t kMaxErrorLine = 2000;

// The length of the well-formed UTF-8 sequence starting at s[i] (RFC 3629: no overlong forms, no
// surrogates, nothing past U+10FFFF), or 0 where the bytes there are not one.
inline size_t utf8_sequence_length(const std::string& s, size_t i) {
  const auto at = [&](size_t k) { return k < s.size() ? static_cast<unsigned char>(s[k]) : 0u; };
  const unsigned c = at(i);
  size_t n = 0;
  unsigned lo = 0x80, hi = 0xBF;  // the second byte's range
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF)
    n = 2;
  else if (c >= 0xE0 && c <= 0xEF)
    n = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
  else if (c >= 0xF0 && c <= 0xF4)
    n = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
  else
    return 0;
  if (at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if ((at(i + k) & 0xC0) != 0x80) return 0;
  return n;
}

inline std::string error_line(const std::string& message) {
  std::string out;
  size_t shown = 0;
  while (shown < message.size() && out.size() < kMaxErrorLine) {
    const unsigned char c = static_cast<unsigned char>(message[shown]);
    const size_t n = utf8_sequence_length(message, shown);
    // U+0080 to U+009F (C2 80 to C2 9F) are control characters too: CSI is one in some terminals.
    const bool c1 = c == 0xC2 && n == 2 && static_cast<unsigned char>(message[shown + 1]) < 0xA0;
    if (c < 0x20 || c == 0x7f || n == 0 || c1) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
      ++shown;
    } else {
      out.append(message, shown, n);
      shown += n;
    }
  }
  // The loop copies whole UTF-8 sequences only, so the cut is never inside one.
  if (shown < message.size()) out += " ... (" + std::to_string(message.size() - shown) + " more characters)";
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
