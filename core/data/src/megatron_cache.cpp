#include "dtk/data/megatron_cache.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "dtk/data/error.hpp"

namespace dtk::data {

// ------------------------------------------------------------------ md5 (RFC 1321)

namespace {

uint32_t rotl(uint32_t x, int c) { return (x << c) | (x >> (32 - c)); }

void md5_block(uint32_t h[4], const uint8_t* p) {
  static const uint32_t K[64] = {
      0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613, 0xfd469501,
      0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193, 0xa679438e, 0x49b40821,
      0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d, 0x02441453, 0xd8a1e681, 0xe7d3fbc8,
      0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed, 0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a,
      0xfffa3942, 0x8771f681, 0x6d9d6122, 0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70,
      0x289b7ec6, 0xeaa127fa, 0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665,
      0xf4292244, 0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
      0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb, 0xeb86d391};
  static const int R[64] = {7,  12, 17, 22, 7,  12, 17, 22, 7,  12, 17, 22, 7,  12, 17, 22, 5,  9,  14, 20, 5,  9,
                            14, 20, 5,  9,  14, 20, 5,  9,  14, 20, 4,  11, 16, 23, 4,  11, 16, 23, 4,  11, 16, 23,
                            4,  11, 16, 23, 6,  10, 15, 21, 6,  10, 15, 21, 6,  10, 15, 21, 6,  10, 15, 21};
  uint32_t m[16];
  for (int k = 0; k < 16; ++k) {
    m[k] = static_cast<uint32_t>(p[4 * k]) | (static_cast<uint32_t>(p[4 * k + 1]) << 8) |
           (static_cast<uint32_t>(p[4 * k + 2]) << 16) | (static_cast<uint32_t>(p[4 * k + 3]) << 24);
  }
  uint32_t a = h[0], b = h[1], c = h[2], d = h[3];
  for (int k = 0; k < 64; ++k) {
    uint32_t f;
    int g;
    if (k < 16) {
      f = (b & c) | (~b & d);
      g = k;
    } else if (k < 32) {
      f = (d & b) | (~d & c);
      g = (5 * k + 1) % 16;
    } else if (k < 48) {
      f = b ^ c ^ d;
      g = (3 * k + 5) % 16;
    } else {
      f = c ^ (b | ~d);
      g = (7 * k) % 16;
    }
    const uint32_t t = d;
    d = c;
    c = b;
    b = b + rotl(a + f + K[k] + m[g], R[k]);
    a = t;
  }
  h[0] += a;
  h[1] += b;
  h[2] += c;
  h[3] += d;
}

}  // namespace

std::string md5_hex(const std::string& bytes) {
  uint32_t h[4] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476};
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  size_t off = 0;
  for (; off + 64 <= n; off += 64) md5_block(h, p + off);
  uint8_t tail[128] = {0};
  const size_t rest = n - off;
  if (rest) std::memcpy(tail, p + off, rest);
  tail[rest] = 0x80;
  const size_t tail_len = rest + 1 + 8 <= 64 ? 64 : 128;
  const uint64_t bits = static_cast<uint64_t>(n) * 8;
  for (int k = 0; k < 8; ++k) tail[tail_len - 8 + k] = static_cast<uint8_t>(bits >> (8 * k));
  md5_block(h, tail);
  if (tail_len == 128) md5_block(h, tail + 64);
  std::string out;
  char buf[3];
  for (int w = 0; w < 4; ++w) {
    for (int k = 0; k < 4; ++k) {
      std::snprintf(buf, sizeof buf, "%02x", (h[w] >> (8 * k)) & 0xff);
      out += buf;
    }
  }
  return out;
}

// ------------------------------------------------------------------ Python / numpy formatting

namespace {

// The shortest round-trip digits of |x| > 0 and its decimal point position: x = 0.DIGITS * 10^decpt.
void shortest_digits(double x, std::string* digits, int* decpt) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, std::fabs(x), std::chars_format::scientific);
  const std::string s(buf, r.ptr);
  const size_t e = s.find('e');
  digits->clear();
  for (size_t k = 0; k < e; ++k)
    if (s[k] != '.') *digits += s[k];
  while (digits->size() > 1 && digits->back() == '0') digits->pop_back();
  *decpt = std::stoi(s.substr(e + 1)) + 1;
}

}  // namespace

std::string python_float_repr(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "Infinity" : "-Infinity";
  std::string sign = std::signbit(x) ? "-" : "";
  if (x == 0) return sign + "0.0";
  std::string d;
  int decpt;
  shortest_digits(x, &d, &decpt);
  if (decpt > -4 && decpt <= 16) {
    std::string out;
    if (decpt <= 0) {
      out = "0." + std::string(static_cast<size_t>(-decpt), '0') + d;
    } else if (static_cast<size_t>(decpt) >= d.size()) {
      out = d + std::string(static_cast<size_t>(decpt) - d.size(), '0') + ".0";
    } else {
      out = d.substr(0, static_cast<size_t>(decpt)) + "." + d.substr(static_cast<size_t>(decpt));
    }
    return sign + out;
  }
  std::string out = d.substr(0, 1);
  if (d.size() > 1) out += "." + d.substr(1);
  const int e = decpt - 1;
  char eb[16];
  std::snprintf(eb, sizeof eb, "e%c%02d", e < 0 ? '-' : '+', std::abs(e));
  return sign + out + eb;
}

double numpy_sum(const std::vector<double>& v) {
  // numpy's pairwise_sum over a contiguous float64 array.
  struct Rec {
    static double sum(const double* a, size_t n) {
      if (n < 8) {
        double res = 0.;  // numpy starts from -0.0 in newer versions; equal for the sums of weights
        for (size_t i = 0; i < n; ++i) res += a[i];
        return res;
      }
      if (n <= 128) {
        double r[8];
        for (int k = 0; k < 8; ++k) r[k] = a[k];
        size_t i;
        for (i = 8; i < n - (n % 8); i += 8)
          for (int k = 0; k < 8; ++k) r[k] += a[i + static_cast<size_t>(k)];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) res += a[i];
        return res;
      }
      size_t n2 = n / 2;
      n2 -= n2 % 8;
      return sum(a, n2) + sum(a + n2, n - n2);
    }
  };
  return Rec::sum(v.data(), v.size());
}

std::vector<double> numpy_normalize(const std::vector<double>& w) {
  const double s = numpy_sum(w);
  std::vector<double> out;
  for (double x : w) out.push_back(x / s);
  return out;
}

std::string numpy_float_array_str(const std::vector<double>& v) {
  // numpy's FloatingFormat, floatmode 'maxprec', precision 8, no suppression: positional
  // unless max >= 1e8 or min nonzero < 1e-4 or max/min > 1e3; each value its shortest
  // round-trip digits cut at 8 decimals, trailing zeros trimmed to ".", then the integer parts
  // padded on the left and the fractions on the right to common widths.
  double max_v = 0, min_v = 0;
  bool any = false;
  for (double x : v) {
    if (!std::isfinite(x)) return "";
    const double a = std::fabs(x);
    if (a == 0) continue;
    max_v = any ? std::max(max_v, a) : a;
    min_v = any ? std::min(min_v, a) : a;
    any = true;
  }
  if (any && (max_v >= 1e8 || min_v < 0.0001 || max_v / min_v > 1000.)) return "";
  std::vector<std::pair<std::string, std::string>> parts;
  size_t pad_left = 0, pad_right = 0;
  for (double x : v) {
    std::string s;
    if (x == 0) {
      s = std::signbit(x) ? "-0." : "0.";
    } else {
      std::string d;
      int decpt;
      shortest_digits(x, &d, &decpt);
      const int frac_digits = static_cast<int>(d.size()) - decpt;
      if (frac_digits > 8) {
        char buf[64];
        std::snprintf(buf, sizeof buf, "%.8f", std::fabs(x));
        s = buf;
        while (s.back() == '0') s.pop_back();
      } else {
        if (decpt <= 0) {
          s = "0." + std::string(static_cast<size_t>(-decpt), '0') + d;
        } else if (static_cast<size_t>(decpt) >= d.size()) {
          s = d + std::string(static_cast<size_t>(decpt) - d.size(), '0') + ".";
        } else {
          s = d.substr(0, static_cast<size_t>(decpt)) + "." + d.substr(static_cast<size_t>(decpt));
        }
      }
      if (x < 0) s = "-" + s;
    }
    const size_t dot = s.find('.');
    parts.emplace_back(s.substr(0, dot), s.substr(dot + 1));
    pad_left = std::max(pad_left, dot);
    pad_right = std::max(pad_right, s.size() - dot - 1);
  }
  std::string out = "[";
  for (size_t k = 0; k < parts.size(); ++k) {
    if (k) out += " ";
    out += std::string(pad_left - parts[k].first.size(), ' ') + parts[k].first + "." + parts[k].second +
           std::string(pad_right - parts[k].second.size(), ' ');
  }
  out += "]";
  if (out.size() > 75) return "";
  return out;
}

// ------------------------------------------------------------------ JSON

PyJson PyJson::boolean(bool v) {
  PyJson j;
  j.kind = Kind::kBool;
  j.b = v;
  return j;
}
PyJson PyJson::integer(int64_t v) {
  PyJson j;
  j.kind = Kind::kInt;
  j.i = v;
  return j;
}
PyJson PyJson::real(double v) {
  PyJson j;
  j.kind = Kind::kFloat;
  j.f = v;
  return j;
}
PyJson PyJson::string(std::string v) {
  PyJson j;
  j.kind = Kind::kString;
  j.s = std::move(v);
  return j;
}
PyJson PyJson::array(std::vector<PyJson> v) {
  PyJson j;
  j.kind = Kind::kArray;
  j.items = std::move(v);
  return j;
}
PyJson PyJson::object() {
  PyJson j;
  j.kind = Kind::kObject;
  return j;
}
PyJson& PyJson::set(const std::string& key, PyJson value) {
  members.emplace_back(key, std::move(value));
  return *this;
}
const PyJson* PyJson::find(const std::string& key) const {
  if (kind != Kind::kObject) return nullptr;
  for (const auto& m : members)
    if (m.first == key) return &m.second;
  return nullptr;
}

namespace {

struct Parser {
  const std::string& t;
  const std::string& what;
  size_t p = 0;
  [[noreturn]] void fail(const std::string& why) const {
    throw DataError("'" + what + "' is not the JSON Megatron writes: " + why + " at offset " + std::to_string(p));
  }
  void ws() {
    while (p < t.size() && (t[p] == ' ' || t[p] == '\n' || t[p] == '\r' || t[p] == '\t')) ++p;
  }
  bool lit(const char* s) {
    const size_t n = std::strlen(s);
    if (t.compare(p, n, s) == 0) {
      p += n;
      return true;
    }
    return false;
  }
  static void put_utf8(std::string* out, uint32_t cp) {
    if (cp < 0x80) {
      *out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      *out += static_cast<char>(0xc0 | (cp >> 6));
      *out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      *out += static_cast<char>(0xe0 | (cp >> 12));
      *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      *out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      *out += static_cast<char>(0xf0 | (cp >> 18));
      *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      *out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }
  uint32_t hex4() {
    if (p + 4 > t.size()) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = t[p++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= static_cast<uint32_t>(c - 'A' + 10);
      else
        fail("bad \\u escape");
    }
    return v;
  }
  std::string str() {
    if (t[p] != '"') fail("expected a string");
    ++p;
    std::string out;
    while (true) {
      if (p >= t.size()) fail("unterminated string");
      const char c = t[p++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (p >= t.size()) fail("unterminated string");
      const char e = t[p++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xd800 && cp < 0xdc00 && t.compare(p, 2, "\\u") == 0) {
            p += 2;
            const uint32_t lo = hex4();
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          put_utf8(&out, cp);
          break;
        }
        default:
          fail("bad escape");
      }
    }
  }
  PyJson value(int depth) {
    if (depth > 64) fail("nested too deeply");
    ws();
    if (p >= t.size()) fail("unexpected end");
    const char c = t[p];
    if (c == '{') {
      ++p;
      PyJson o = PyJson::object();
      ws();
      if (p < t.size() && t[p] == '}') {
        ++p;
        return o;
      }
      while (true) {
        ws();
        if (p >= t.size()) fail("unexpected end");
        std::string k = str();
        ws();
        if (p >= t.size() || t[p] != ':') fail("expected ':'");
        ++p;
        o.set(k, value(depth + 1));
        ws();
        if (p < t.size() && t[p] == ',') {
          ++p;
          continue;
        }
        if (p < t.size() && t[p] == '}') {
          ++p;
          return o;
        }
        fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      ++p;
      PyJson a = PyJson::array();
      ws();
      if (p < t.size() && t[p] == ']') {
        ++p;
        return a;
      }
      while (true) {
        a.items.push_back(value(depth + 1));
        ws();
        if (p < t.size() && t[p] == ',') {
          ++p;
          continue;
        }
        if (p < t.size() && t[p] == ']') {
          ++p;
          return a;
        }
        fail("expected ',' or ']'");
      }
    }
    if (c == '"') return PyJson::string(str());
    if (lit("null")) return PyJson::null();
    if (lit("true")) return PyJson::boolean(true);
    if (lit("false")) return PyJson::boolean(false);
    if (lit("NaN")) return PyJson::real(std::nan(""));
    if (lit("Infinity")) return PyJson::real(HUGE_VAL);
    if (lit("-Infinity")) return PyJson::real(-HUGE_VAL);
    const size_t start = p;
    bool is_float = false;
    if (p < t.size() && t[p] == '-') ++p;
    while (p < t.size() &&
           ((t[p] >= '0' && t[p] <= '9') || t[p] == '.' || t[p] == 'e' || t[p] == 'E' || t[p] == '+' || t[p] == '-')) {
      if (t[p] == '.' || t[p] == 'e' || t[p] == 'E') is_float = true;
      ++p;
    }
    const std::string num = t.substr(start, p - start);
    if (num.empty() || num == "-") fail("unexpected character");
    if (is_float) {
      double v = 0;
      const auto r = std::from_chars(num.data(), num.data() + num.size(), v);
      if (r.ec != std::errc() || r.ptr != num.data() + num.size()) fail("bad number");
      return PyJson::real(v);
    }
    int64_t v = 0;
    const auto r = std::from_chars(num.data(), num.data() + num.size(), v);
    if (r.ec != std::errc() || r.ptr != num.data() + num.size()) fail("bad number");
    return PyJson::integer(v);
  }
};

void dump_string(const std::string& s, std::string* out) {
  *out += '"';
  for (size_t k = 0; k < s.size();) {
    const auto c = static_cast<unsigned char>(s[k]);
    uint32_t cp = c;
    size_t len = 1;
    if (c >= 0x80) {  // decode UTF-8; a stray byte stands for itself (as U+00XX)
      int extra = (c >= 0xf0) ? 3 : (c >= 0xe0) ? 2 : (c >= 0xc0) ? 1 : 0;
      if (extra && k + static_cast<size_t>(extra) < s.size() + 0) {
        uint32_t v = c & (0x3f >> extra);
        bool ok = true;
        for (int m = 1; m <= extra; ++m) {
          const auto cc = static_cast<unsigned char>(s[k + static_cast<size_t>(m)]);
          if ((cc & 0xc0) != 0x80) ok = false;
          v = (v << 6) | (cc & 0x3f);
        }
        if (ok) {
          cp = v;
          len = static_cast<size_t>(extra) + 1;
        }
      }
    }
    k += len;
    char buf[16];
    switch (cp) {
      case '"':
        *out += "\\\"";
        continue;
      case '\\':
        *out += "\\\\";
        continue;
      case '\n':
        *out += "\\n";
        continue;
      case '\r':
        *out += "\\r";
        continue;
      case '\t':
        *out += "\\t";
        continue;
      case '\b':
        *out += "\\b";
        continue;
      case '\f':
        *out += "\\f";
        continue;
      default:
        break;
    }
    if (cp >= 0x20 && cp <= 0x7e) {
      *out += static_cast<char>(cp);
    } else if (cp >= 0x10000) {
      const uint32_t v = cp - 0x10000;
      std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
      *out += buf;
    } else {
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      *out += buf;
    }
  }
  *out += '"';
}

void dump(const PyJson& v, int level, std::string* out) {
  const std::string pad((static_cast<size_t>(level) + 1) * 4, ' ');
  const std::string close(static_cast<size_t>(level) * 4, ' ');
  switch (v.kind) {
    case PyJson::Kind::kNull:
      *out += "null";
      return;
    case PyJson::Kind::kBool:
      *out += v.b ? "true" : "false";
      return;
    case PyJson::Kind::kInt:
      *out += std::to_string(v.i);
      return;
    case PyJson::Kind::kFloat:
      *out += python_float_repr(v.f);
      return;
    case PyJson::Kind::kString:
      dump_string(v.s, out);
      return;
    case PyJson::Kind::kArray:
      if (v.items.empty()) {
        *out += "[]";
        return;
      }
      *out += "[\n";
      for (size_t k = 0; k < v.items.size(); ++k) {
        if (k) *out += ",\n";
        *out += pad;
        dump(v.items[k], level + 1, out);
      }
      *out += "\n" + close + "]";
      return;
    case PyJson::Kind::kObject:
      if (v.members.empty()) {
        *out += "{}";
        return;
      }
      *out += "{\n";
      for (size_t k = 0; k < v.members.size(); ++k) {
        if (k) *out += ",\n";
        *out += pad;
        dump_string(v.members[k].first, out);
        *out += ": ";
        dump(v.members[k].second, level + 1, out);
      }
      *out += "\n" + close + "}";
      return;
  }
}

}  // namespace

PyJson parse_json(const std::string& text, const std::string& what) {
  Parser ps{text, what};
  PyJson v = ps.value(0);
  ps.ws();
  if (ps.p != text.size()) ps.fail("trailing characters");
  return v;
}

std::string dumps_indent4(const PyJson& value) {
  std::string out;
  dump(value, 0, &out);
  return out;
}

}  // namespace dtk::data
