// The hand-written regexes of pre_tokenize.hpp. Each alternative is tried in the regex's order at
// the current position, with the backtracking the regex engine would do spelled out.
#include "dtk/text/pre_tokenize.hpp"

#include "dtk/data/error.hpp"
#include "dtk/data/utf8.hpp"

namespace dtk::text {

using data::DataError;
using data::decode_utf8;

namespace {

struct CodeRange {
  uint32_t lo, hi;
};
#include "unicode_tables.inc"

template <size_t N>
bool in_ranges(const CodeRange (&table)[N], uint32_t cp) {
  size_t lo = 0, hi = N;
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (cp < table[mid].lo)
      hi = mid;
    else if (cp > table[mid].hi)
      lo = mid + 1;
    else
      return true;
  }
  return false;
}

enum CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };  // kSpace = any \s

CharClass classify(uint32_t cp) {
  if (cp < 128) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return kLetter;
    if (cp >= '0' && cp <= '9') return kNumber;
    if (cp == ' ' || (cp >= 9 && cp <= 13)) return kSpace;
    return kOther;
  }
  if (in_ranges(kLetterRanges, cp)) return kLetter;
  if (in_ranges(kNumberRanges, cp)) return kNumber;
  if (in_ranges(kSpaceRanges, cp)) return kSpace;
  return kOther;
}

// Code point at byte i: its class and byte length. Throws on invalid UTF-8.
struct Cp {
  CharClass cls;
  uint32_t cp;
  size_t len;
};
Cp at(std::string_view s, size_t i) {
  const uint8_t b = static_cast<uint8_t>(s[i]);
  if (b < 0x80) return {classify(b), b, 1};
  uint32_t cp = 0;
  const size_t len = decode_utf8(s, i, &cp);
  if (len == 0) throw DataError("invalid UTF-8 at byte " + std::to_string(i));
  return {classify(cp), cp, len};
}

// End of the run of code points of class `cls` starting at byte i.
size_t run_end(std::string_view s, size_t i, CharClass cls) {
  while (i < s.size()) {
    const Cp c = at(s, i);
    if (c.cls != cls) break;
    i += c.len;
  }
  return i;
}

bool is_newline(uint32_t cp) { return cp == '\r' || cp == '\n'; }

// (?i:'s|'t|'re|'ve|'m|'ll|'d) at byte i (s[i] == '\''): the length matched, or 0.
size_t contraction_any_case(std::string_view s, size_t i) {
  const auto lower = [&](size_t k) -> char {
    return k < s.size() && s[k] >= 'A' && s[k] <= 'Z' ? static_cast<char>(s[k] - 'A' + 'a') : (k < s.size() ? s[k] : '\0');
  };
  const char a = lower(i + 1), b = lower(i + 2);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// \s*[\r\n]+ | \s+(?!\S) | \s+ at a whitespace code point i: the end of the match.
size_t llama3_whitespace(std::string_view s, size_t i) {
  size_t end = i, last = i, after_newline = std::string_view::npos;
  size_t count = 0;
  while (end < s.size()) {
    const Cp w = at(s, end);
    if (w.cls != kSpace) break;
    last = end;
    end += w.len;
    ++count;
    if (is_newline(w.cp)) after_newline = end;
  }
  // \s*[\r\n]+: \s* backs off to the last newline of the run, [\r\n]+ takes it.
  if (after_newline != std::string_view::npos) return after_newline;
  // \s+(?!\S): the whole run at the end of text, else all but its last code point.
  if (end == s.size() || count < 2) return end;  // count == 1 before a non-space: \s+
  return last;
}

}  // namespace

const char* const kGpt2PreTokenizePattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const char* const kLlama3PreTokenizePattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

const uint32_t* byte_level_alphabet() {
  static const struct Table {
    uint32_t cp[256];
    Table() {
      int n = 0;
      for (int b = 0; b < 256; ++b) {
        const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        cp[b] = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      }
    }
  } table;
  return table.cp;
}


void gpt2_pre_tokenize(std::string_view s, std::vector<std::string_view>* pieces) {
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const Cp c = at(s, i);
    size_t end;
    if (c.cp == '\'' && i + 1 < n) {
      // 's|'t|'re|'ve|'m|'ll|'d (ASCII, case-sensitive)
      const char a = s[i + 1];
      const char b = i + 2 < n ? s[i + 2] : '\0';
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        pieces->push_back(s.substr(i, 2));
        i += 2;
        continue;
      }
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        pieces->push_back(s.substr(i, 3));
        i += 3;
        continue;
      }
    }
    if (c.cls == kSpace) {
      if (c.cp == ' ' && i + 1 < n) {
        // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+" with the optional space
        const Cp next = at(s, i + 1);
        if (next.cls != kSpace) {
          end = run_end(s, i + 1, next.cls);
          pieces->push_back(s.substr(i, end - i));
          i = end;
          continue;
        }
      }
      // \s+(?!\S) | \s+ : a whitespace run; if a non-space follows a run of >= 2 code points,
      // the last one is left to start the next piece.
      size_t last = i;
      end = i;
      size_t count = 0;
      while (end < n) {
        const Cp w = at(s, end);
        if (w.cls != kSpace) break;
        last = end;
        end += w.len;
        ++count;
      }
      if (end < n && count >= 2) end = last;
      pieces->push_back(s.substr(i, end - i));
      i = end;
      continue;
    }
    end = run_end(s, i + c.len, c.cls);
    pieces->push_back(s.substr(i, end - i));
    i = end;
  }
}


void llama3_pre_tokenize(std::string_view s, std::vector<std::string_view>* pieces) {
  const size_t n = s.size();
  size_t i = 0;
  const auto emit = [&](size_t end) {
    pieces->push_back(s.substr(i, end - i));
    i = end;
  };
  while (i < n) {
    const Cp c = at(s, i);
    if (c.cp == '\'') {
      if (const size_t len = contraction_any_case(s, i)) {
        emit(i + len);
        continue;
      }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (c.cls == kLetter) {
      emit(run_end(s, i, kLetter));
      continue;
    }
    if (c.cls != kNumber && !is_newline(c.cp) && i + c.len < n && at(s, i + c.len).cls == kLetter) {
      emit(run_end(s, i + c.len, kLetter));
      continue;
    }
    // \p{N}{1,3}
    if (c.cls == kNumber) {
      size_t end = i;
      for (int k = 0; k < 3 && end < n; ++k) {
        const Cp d = at(s, end);
        if (d.cls != kNumber) break;
        end += d.len;
      }
      emit(end);
      continue;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    size_t start = i;
    if (c.cp == ' ' && i + 1 < n && at(s, i + 1).cls == kOther) start = i + 1;
    if (at(s, start).cls == kOther) {
      size_t end = run_end(s, start, kOther);
      while (end < n && (s[end] == '\r' || s[end] == '\n')) ++end;
      emit(end);
      continue;
    }
    emit(llama3_whitespace(s, i));  // c is whitespace here
  }
}

}  // namespace dtk::text
