#include "dtk/data/json.hpp"

#include <charconv>
#include <cmath>

#include "dtk/data/error.hpp"
#include "dtk/data/utf8.hpp"

namespace dtk::data {

const JsonValue* JsonValue::Find(std::string_view key) const {
  const JsonValue* found = nullptr;
  for (const auto& kv : object) {
    if (kv.first == key) found = &kv.second;
  }
  return found;
}

namespace {

constexpr int kMaxDepth = 256;

class Parser {
 public:
  Parser(std::string_view s, const std::string& source) : s_(s), source_(source) {}

  JsonValue ParseDocument() {
    SkipWs();
    JsonValue v = ParseValue(0);
    SkipWs();
    if (i_ != s_.size()) Fail("unexpected trailing characters");
    return v;
  }

 private:
  [[noreturn]] void Fail(const std::string& why) const {
    throw DataError(source_ + ": invalid JSON at byte " + std::to_string(i_) + ": " + why);
  }
  bool AtEnd() const { return i_ >= s_.size(); }
  char Peek() const { return AtEnd() ? '\0' : s_[i_]; }
  void SkipWs() {
    while (!AtEnd() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void Expect(char c) {
    if (Peek() != c || AtEnd()) Fail(std::string("expected '") + c + "'");
    ++i_;
  }
  void Literal(std::string_view word) {
    if (s_.substr(i_, word.size()) != word) Fail("invalid literal");
    i_ += word.size();
  }

  JsonValue ParseValue(int depth) {
    if (depth > kMaxDepth) Fail("nesting deeper than 256 levels");
    if (AtEnd()) Fail("unexpected end of input");
    JsonValue v;
    const char c = s_[i_];
    if (c == '{') {
      v.type = JsonValue::Type::kObject;
      ++i_;
      SkipWs();
      if (Peek() == '}' && !AtEnd()) {
        ++i_;
        return v;
      }
      while (true) {
        SkipWs();
        if (Peek() != '"' || AtEnd()) Fail("expected a string key");
        std::string key = ParseString();
        SkipWs();
        Expect(':');
        SkipWs();
        JsonValue member = ParseValue(depth + 1);
        v.object.emplace_back(std::move(key), std::move(member));
        SkipWs();
        if (Peek() == ',' && !AtEnd()) {
          ++i_;
          continue;
        }
        Expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.type = JsonValue::Type::kArray;
      ++i_;
      SkipWs();
      if (Peek() == ']' && !AtEnd()) {
        ++i_;
        return v;
      }
      while (true) {
        SkipWs();
        v.array.push_back(ParseValue(depth + 1));
        SkipWs();
        if (Peek() == ',' && !AtEnd()) {
          ++i_;
          continue;
        }
        Expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.type = JsonValue::Type::kString;
      v.string = ParseString();
      return v;
    }
    if (c == 't') {
      Literal("true");
      v.type = JsonValue::Type::kBool;
      v.boolean = true;
      return v;
    }
    if (c == 'f') {
      Literal("false");
      v.type = JsonValue::Type::kBool;
      return v;
    }
    if (c == 'n') {
      Literal("null");
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      v.type = JsonValue::Type::kNumber;
      v.number = ParseNumber();
      return v;
    }
    Fail(std::string("unexpected character"));
  }

  static bool IsDigit(char c) { return c >= '0' && c <= '9'; }

  double ParseNumber() {
    const size_t start = i_;
    if (Peek() == '-') ++i_;
    if (AtEnd() || !IsDigit(s_[i_])) Fail("invalid number");
    if (s_[i_] == '0') {
      ++i_;
    } else {
      while (!AtEnd() && IsDigit(s_[i_])) ++i_;
    }
    if (!AtEnd() && s_[i_] == '.') {
      ++i_;
      if (AtEnd() || !IsDigit(s_[i_])) Fail("invalid number: digit expected after '.'");
      while (!AtEnd() && IsDigit(s_[i_])) ++i_;
    }
    if (!AtEnd() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (!AtEnd() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (AtEnd() || !IsDigit(s_[i_])) Fail("invalid number: digit expected in exponent");
      while (!AtEnd() && IsDigit(s_[i_])) ++i_;
    }
    double out = 0;
    const auto r = std::from_chars(s_.data() + start, s_.data() + i_, out);
    if (r.ec == std::errc::result_out_of_range) out = s_[start] == '-' ? -HUGE_VAL : HUGE_VAL;
    return out;
  }

  unsigned Hex4() {
    if (s_.size() - i_ < 4) Fail("truncated \\u escape");
    unsigned v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= static_cast<unsigned>(c - 'A' + 10);
      else
        Fail("invalid hex digit in \\u escape");
    }
    return v;
  }

  std::string ParseString() {
    ++i_;  // opening quote
    std::string out;
    while (true) {
      if (AtEnd()) Fail("unterminated string");
      const unsigned char c = static_cast<unsigned char>(s_[i_]);
      if (c == '"') {
        ++i_;
        return out;
      }
      if (c < 0x20) Fail("unescaped control character in string");
      if (c == '\\') {
        ++i_;
        if (AtEnd()) Fail("unterminated escape");
        const char e = s_[i_++];
        switch (e) {
          case '"':
            out.push_back('"');
            break;
          case '\\':
            out.push_back('\\');
            break;
          case '/':
            out.push_back('/');
            break;
          case 'b':
            out.push_back('\b');
            break;
          case 'f':
            out.push_back('\f');
            break;
          case 'n':
            out.push_back('\n');
            break;
          case 'r':
            out.push_back('\r');
            break;
          case 't':
            out.push_back('\t');
            break;
          case 'u': {
            unsigned cp = Hex4();
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              if (s_.size() - i_ < 6 || s_[i_] != '\\' || s_[i_ + 1] != 'u') {
                Fail("lone high surrogate in \\u escape");
              }
              i_ += 2;
              const unsigned lo = Hex4();
              if (lo < 0xDC00 || lo > 0xDFFF) Fail("invalid low surrogate in \\u escape");
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
              Fail("lone low surrogate in \\u escape");
            }
            AppendUtf8(cp, &out);
            break;
          }
          default:
            --i_;
            Fail("invalid escape character");
        }
        continue;
      }
      if (c < 0x80) {
        out.push_back(static_cast<char>(c));
        ++i_;
        continue;
      }
      uint32_t cp;
      const size_t len = DecodeUtf8(s_, i_, &cp);
      if (len == 0) Fail("invalid UTF-8 in string");
      out.append(s_.data() + i_, len);
      i_ += len;
    }
  }

  std::string_view s_;
  const std::string& source_;
  size_t i_ = 0;
};

}  // namespace

JsonValue ParseJson(std::string_view text, const std::string& source) { return Parser(text, source).ParseDocument(); }

}  // namespace dtk::data
