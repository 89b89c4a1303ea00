// dtk::data — strict UTF-8 decoding (no overlongs, no surrogates, nothing above U+10FFFF).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dtk::data {

// Decodes one code point at s[i]; returns its length in bytes (1..4), or 0 when the bytes at i
// are not valid UTF-8 (or i >= s.size()).
size_t decode_utf8(std::string_view s, size_t i, uint32_t* cp);
// Byte offset of the first invalid UTF-8 sequence, or std::string::npos when `s` is valid.
size_t find_invalid_utf8(std::string_view s);
// Appends the UTF-8 encoding of `cp` (must be a valid scalar value).
void append_utf8(uint32_t cp, std::string* out);

}  // namespace dtk::data
