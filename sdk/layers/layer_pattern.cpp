// Megatron's per-layer patterns (--moe-layer-freq, --window-attn-skip-freq): see
// dtk/layers/layer_pattern.hpp.
#include <dtk/layers/layer_pattern.hpp>

#include <cctype>
#include <stdexcept>
#include <utility>

namespace dtk::layers {

namespace {

// A layer list in the alphabet Megatron's _eval_pattern accepts: lists of 0 and 1,
// '+' (concatenation), '*' with a count on either side, and parentheses, e.g.
// "([1]*3+[0]*1)*3". Recursive descent, one method per rule.
class LayerPatternParser {
 public:
  explicit LayerPatternParser(std::string text) : t_(std::move(text)) {}
  std::vector<bool> parse() {
    std::vector<bool> v = sum();
    if (at_ != t_.size()) fail("'" + t_.substr(at_) + "' is not a '+' or '*' continuing the list");
    return v;
  }

 private:
  static constexpr size_t kMaxLayers = size_t{1} << 20;
  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument(what + " (in '" + t_ + "'; a list such as [0]*3+[1]*11)");
  }
  char peek() const { return at_ < t_.size() ? t_[at_] : '\0'; }
  bool eat(char c) {
    if (peek() != c) return false;
    ++at_;
    return true;
  }
  // sum := product ('+' product)*
  std::vector<bool> sum() {
    std::vector<bool> v = product();
    while (eat('+')) {
      const std::vector<bool> w = product();
      v.insert(v.end(), w.begin(), w.end());
      if (v.size() > kMaxLayers) fail("more than 2^20 layers");
    }
    return v;
  }
  // product := (count '*')* atom ('*' count)*
  std::vector<bool> product() {
    int64_t repeat = 1;
    while (std::isdigit(static_cast<unsigned char>(peek()))) {
      repeat = times(repeat, count());
      if (!eat('*')) fail("a count must be followed by '*'");
    }
    const std::vector<bool> item = atom();
    while (eat('*')) repeat = times(repeat, count());
    std::vector<bool> v;
    for (int64_t i = 0; i < repeat; ++i) v.insert(v.end(), item.begin(), item.end());
    return v;
  }
  // atom := '[' bit (',' bit)* ']' | '(' sum ')'
  std::vector<bool> atom() {
    std::vector<bool> v;
    if (eat('(')) {
      v = sum();
      if (!eat(')')) fail("a '(' is not closed");
      return v;
    }
    if (!eat('['))
      fail(peek() ? std::string("'") + peek() + "' where a list [..] or '(' belongs" : "the list ends early");
    do {
      const char bit = peek();
      if (bit != '0' && bit != '1')
        fail(bit ? std::string("'") + bit + "' in a list is not 0 or 1" : "a '[' is not closed");
      ++at_;
      v.push_back(bit == '1');
    } while (eat(','));
    if (!eat(']')) fail("a list holds 0 and 1 separated by ','");
    return v;
  }
  int64_t count() {
    const size_t begin = at_;
    while (std::isdigit(static_cast<unsigned char>(peek()))) ++at_;
    if (at_ == begin) fail("'*' needs a count");
    if (at_ - begin > 7) fail("a count above 10^7");
    const int64_t n = std::stoll(t_.substr(begin, at_ - begin));
    if (n == 0) fail("a count of 0 (it empties the list)");
    return n;
  }
  int64_t times(int64_t a, int64_t b) const {
    if (a * b > static_cast<int64_t>(kMaxLayers)) fail("more than 2^20 layers");
    return a * b;
  }

  std::string t_;
  size_t at_ = 0;
};

}  // namespace

LayerPattern parse_layer_pattern(const std::string& text) {
  std::string t;
  for (const char ch : text)
    if (!std::isspace(static_cast<unsigned char>(ch)) && ch != '"' && ch != '\'') t += ch;
  if (t.empty()) throw std::invalid_argument("empty: give an integer N or a list such as [0]*3+[1]*11");
  LayerPattern p;
  if (t.find_first_not_of("0123456789") == std::string::npos) {
    if (t.size() > 9) throw std::invalid_argument("'" + text + "' is too large a layer frequency");
    p.every = std::stoll(t);  // (0 is the caller's to refuse, naming its option)
    return p;
  }
  if (t.find_first_not_of("0123456789-+.eE") == std::string::npos)
    throw std::invalid_argument("'" + text + "' is neither a positive integer nor a list such as [0]*3+[1]*11");
  p.flags = LayerPatternParser(t).parse();
  return p;
}

}  // namespace dtk::layers
