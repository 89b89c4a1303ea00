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

// Which \s: JavaScript's (the reference encoders of GPT-2 and Hugging Face tokenizers run JS
// regexes) or Unicode's White_Space (tiktoken's regexes run in Rust). They differ on two code
// points: U+0085 is White_Space and not JS \s; U+FEFF is JS \s and not White_Space.
enum class Spaces { kJavaScript, kWhiteSpace };

// Code point at byte i: its class and byte length. Throws on invalid UTF-8.
struct Cp {
  CharClass cls;
  uint32_t cp;
  size_t len;
};
Cp at(std::string_view s, size_t i, Spaces spaces = Spaces::kJavaScript) {
  const uint8_t b = static_cast<uint8_t>(s[i]);
  if (b < 0x80) return {classify(b), b, 1};
  uint32_t cp = 0;
  const size_t len = decode_utf8(s, i, &cp);
  if (len == 0) throw DataError("invalid UTF-8 at byte " + std::to_string(i));
  if (spaces == Spaces::kWhiteSpace && (cp == 0x85 || cp == 0xFEFF)) return {cp == 0x85 ? kSpace : kOther, cp, len};
  return {classify(cp), cp, len};
}

// End of the run of code points of class `cls` starting at byte i.
size_t run_end(std::string_view s, size_t i, CharClass cls, Spaces spaces = Spaces::kJavaScript) {
  while (i < s.size()) {
    const Cp c = at(s, i, spaces);
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

// \s*[\r\n]+ | \s+(?!\S) | \s+ at a whitespace code point i: the end of the match. (Also
// TikTokenizer v1's \s*[\r\n]: \s* backs off to the same last newline, which ends both.)
size_t newline_aware_whitespace(std::string_view s, size_t i, Spaces spaces) {
  size_t end = i, last = i, after_newline = std::string_view::npos;
  size_t count = 0;
  while (end < s.size()) {
    const Cp w = at(s, end, spaces);
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
const char* const kQwen2PreTokenizePattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// Megatron's _PATTERN_TIKTOKEN_V1 and _PATTERN_TIKTOKEN_V2 (megatron/core/tokenizers/text/
// libraries/tiktoken_tokenizer.py).
const char* const kTiktokenV1Pattern =
    R"([^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)";
const char* const kTiktokenV2Pattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

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

namespace {

// The last alternatives of the cl100k family and of TikTokenizer v2, at code point c (byte i)
// where no letter or number alternative matched: ` ?[^\s\p{L}\p{N}]+[\r\n]*` (v2: `[\r\n/]*`
// after the run, `slash_after`), else \s*[\r\n]+|\s+(?!\S)|\s+ (c is whitespace then). The end.
size_t punctuation_or_whitespace(std::string_view s, size_t i, const Cp& c, Spaces sp, bool slash_after) {
  const size_t n = s.size();
  size_t start = i;
  if (c.cp == ' ' && i + 1 < n && at(s, i + 1, sp).cls == kOther) start = i + 1;
  if (at(s, start, sp).cls != kOther) return newline_aware_whitespace(s, i, sp);
  size_t end = run_end(s, start, kOther, sp);
  while (end < n && (s[end] == '\r' || s[end] == '\n' || (slash_after && s[end] == '/'))) ++end;
  return end;
}

// The family of tiktoken cl100k's regex (Llama 3's, Qwen2's, TikTokenizer v1's):
//   contractions?|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// (v1 spells two quantifiers possessive, ?+ and ++; neither changes a match here: the optional
// code point is never a letter, and [\r\n] is never in [^\s\p{L}\p{N}].)
struct Cl100kRules {
  bool contractions;
  int max_digits;
  Spaces spaces;
};

void cl100k_family_pre_tokenize(std::string_view s, std::vector<std::string_view>* pieces, Cl100kRules rules) {
  const size_t n = s.size();
  const Spaces sp = rules.spaces;
  size_t i = 0;
  const auto emit = [&](size_t end) {
    pieces->push_back(s.substr(i, end - i));
    i = end;
  };
  while (i < n) {
    const Cp c = at(s, i, sp);
    if (rules.contractions && c.cp == '\'') {
      if (const size_t len = contraction_any_case(s, i)) {
        emit(i + len);
        continue;
      }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (c.cls == kLetter) {
      emit(run_end(s, i, kLetter, sp));
      continue;
    }
    if (c.cls != kNumber && !is_newline(c.cp) && i + c.len < n && at(s, i + c.len, sp).cls == kLetter) {
      emit(run_end(s, i + c.len, kLetter, sp));
      continue;
    }
    // \p{N}{1,max_digits}
    if (c.cls == kNumber) {
      size_t end = i;
      for (int k = 0; k < rules.max_digits && end < n; ++k) {
        const Cp d = at(s, end, sp);
        if (d.cls != kNumber) break;
        end += d.len;
      }
      emit(end);
      continue;
    }
    emit(punctuation_or_whitespace(s, i, c, sp, /*slash_after=*/false));
  }
}

// TikTokenizer v2's letter classes: [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] ("upper set") and
// [\p{Ll}\p{Lm}\p{Lo}\p{M}] ("lower set") overlap in the caseless letters and the marks; a mark
// is not \p{L}, so it is also [^\r\n\p{L}\p{N}] and [^\s\p{L}\p{N}].
enum Case : uint8_t { kNoCase, kUpperCase, kLowerCase, kCaseless, kMarkCase };

Case case_at(const Cp& c) {
  if (c.cp < 128) return c.cp >= 'A' && c.cp <= 'Z' ? kUpperCase : (c.cp >= 'a' && c.cp <= 'z' ? kLowerCase : kNoCase);
  if (c.cls == kLetter) {
    if (in_ranges(kUpperLetterRanges, c.cp)) return kUpperCase;
    return in_ranges(kLowerLetterRanges, c.cp) ? kLowerCase : kCaseless;
  }
  return c.cls == kOther && in_ranges(kMarkRanges, c.cp) ? kMarkCase : kNoCase;
}
bool in_upper_set(Case k) { return k == kUpperCase || k == kCaseless || k == kMarkCase; }
bool in_lower_set(Case k) { return k == kLowerCase || k == kCaseless || k == kMarkCase; }

Case case_of(std::string_view s, size_t i) { return case_at(at(s, i, Spaces::kWhiteSpace)); }

size_t case_run_end(std::string_view s, size_t i, bool (*in_set)(Case)) {
  while (i < s.size()) {
    const Cp c = at(s, i, Spaces::kWhiteSpace);
    if (!in_set(case_at(c))) break;
    i += c.len;
  }
  return i;
}

// Start of the code point before byte i (the text before i is valid UTF-8: it was read forward).
size_t previous_code_point(std::string_view s, size_t i) {
  do --i;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80);
  return i;
}

constexpr size_t kNoMatch = std::string_view::npos;

// [upper set]*[lower set]+ at byte j: the end of the match, or kNoMatch. The greedy upper run
// gives back code points until the lower run can start: at the last caseless letter or mark.
size_t uppers_then_lowers(std::string_view s, size_t j) {
  const size_t upper_end = case_run_end(s, j, in_upper_set);
  if (upper_end < s.size() && in_lower_set(case_of(s, upper_end))) return case_run_end(s, upper_end, in_lower_set);
  for (size_t e = upper_end; e > j;) {
    e = previous_code_point(s, e);
    if (in_lower_set(case_of(s, e))) return case_run_end(s, e, in_lower_set);
  }
  return kNoMatch;
}

// [upper set]+[lower set]* at byte j: the end of the match, or kNoMatch.
size_t upper_word(std::string_view s, size_t j) {
  const size_t upper_end = case_run_end(s, j, in_upper_set);
  return upper_end == j ? kNoMatch : case_run_end(s, upper_end, in_lower_set);
}

}  // namespace

void llama3_pre_tokenize(std::string_view s, std::vector<std::string_view>* pieces) {
  cl100k_family_pre_tokenize(s, pieces, {true, 3, Spaces::kJavaScript});
}

void qwen2_pre_tokenize(std::string_view s, std::vector<std::string_view>* pieces) {
  cl100k_family_pre_tokenize(s, pieces, {true, 1, Spaces::kJavaScript});
}

void tiktoken_v1_pre_tokenize(std::string_view s, std::vector<std::string_view>* pieces) {
  cl100k_family_pre_tokenize(s, pieces, {false, 1, Spaces::kWhiteSpace});
}

void tiktoken_v2_pre_tokenize(std::string_view s, std::vector<std::string_view>* pieces) {
  constexpr Spaces sp = Spaces::kWhiteSpace;
  const size_t n = s.size();
  size_t i = 0;
  const auto emit = [&](size_t end) {
    pieces->push_back(s.substr(i, end - i));
    i = end;
  };
  while (i < n) {
    const Cp c = at(s, i, sp);
    const Case k = case_at(c);
    // [^\r\n\p{L}\p{N}]?[upper set]*[lower set]+ | [^\r\n\p{L}\p{N}]?[upper set]+[lower set]*,
    // each first with the optional code point, then without it, as the regex tries them.
    const bool optional_first =
        k != kUpperCase && k != kLowerCase && k != kCaseless && c.cls != kNumber && !is_newline(c.cp);
    size_t end = optional_first ? uppers_then_lowers(s, i + c.len) : kNoMatch;
    if (end == kNoMatch) end = uppers_then_lowers(s, i);
    if (end == kNoMatch && optional_first) end = upper_word(s, i + c.len);
    if (end == kNoMatch) end = upper_word(s, i);
    if (end != kNoMatch) {
      emit(end);
      continue;
    }
    // \p{N}
    if (c.cls == kNumber) {
      emit(i + c.len);
      continue;
    }
    emit(punctuation_or_whitespace(s, i, c, sp, /*slash_after=*/true));
  }
}

}  // namespace dtk::text
