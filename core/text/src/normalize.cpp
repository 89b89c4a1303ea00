// Unicode's NFC (UAX #15): see dtk/text/normalize.hpp.
#include "dtk/text/normalize.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dtk/data/error.hpp"
#include "dtk/data/utf8.hpp"

namespace dtk::text {
namespace {

struct CombiningRange {
  uint32_t first, last;
  uint8_t combining_class;
};
struct Decomposition {
  uint32_t cp, offset, length;  // kDecompositionPool[offset, offset + length)
};
struct Composition {
  uint32_t first, second, composite;
};
#include "nfc_tables.inc"

// Hangul syllables compose and decompose by arithmetic (Unicode's chapter 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

uint8_t combining_class(uint32_t cp) {
  if (cp < 0x300) return 0;
  const auto* end = std::end(kCombiningClasses);
  const auto* r = std::upper_bound(std::begin(kCombiningClasses), end, cp,
                                   [](uint32_t c, const CombiningRange& x) { return c < x.first; });
  if (r == std::begin(kCombiningClasses)) return 0;
  --r;
  return cp <= r->last ? r->combining_class : 0;
}

void decompose(uint32_t cp, std::vector<uint32_t>* out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const uint32_t s = cp - kSBase;
    out->push_back(kLBase + s / kNCount);
    out->push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out->push_back(kTBase + s % kTCount);
    return;
  }
  const auto* d = std::lower_bound(std::begin(kDecompositions), std::end(kDecompositions), cp,
                                   [](const Decomposition& x, uint32_t c) { return x.cp < c; });
  if (d == std::end(kDecompositions) || d->cp != cp) {
    out->push_back(cp);
    return;
  }
  out->insert(out->end(), kDecompositionPool + d->offset, kDecompositionPool + d->offset + d->length);
}

// The primary composite of (a, b), or 0 when there is none.
uint32_t compose(uint32_t a, uint32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  const auto* c = std::lower_bound(std::begin(kCompositions), std::end(kCompositions), std::pair{a, b},
                                   [](const Composition& x, const std::pair<uint32_t, uint32_t>& key) {
                                     return x.first != key.first ? x.first < key.first : x.second < key.second;
                                   });
  return c != std::end(kCompositions) && c->first == a && c->second == b ? c->composite : 0;
}

// Canonical ordering: each run of combining marks sorted by class, stably.
void reorder(std::vector<uint32_t>* cps) {
  auto& v = *cps;
  for (size_t i = 0; i < v.size();) {
    if (combining_class(v[i]) == 0) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < v.size() && combining_class(v[end]) != 0) ++end;
    std::stable_sort(v.begin() + static_cast<std::ptrdiff_t>(i), v.begin() + static_cast<std::ptrdiff_t>(end),
                     [](uint32_t x, uint32_t y) { return combining_class(x) < combining_class(y); });
    i = end;
  }
}

// Canonical composition: each mark joins the last starter unless a mark of the same or a higher
// class, or a starter, stands between them.
std::vector<uint32_t> recompose(const std::vector<uint32_t>& d) {
  std::vector<uint32_t> out;
  out.reserve(d.size());
  size_t starter = SIZE_MAX;
  int last_class = -1;  // of the last code point kept after the starter; -1: none (adjacent)
  for (uint32_t cp : d) {
    const int cls = combining_class(cp);
    if (starter != SIZE_MAX && (last_class == -1 || (last_class != 0 && last_class < cls))) {
      if (const uint32_t composite = compose(out[starter], cp)) {
        out[starter] = composite;
        continue;
      }
    }
    if (cls == 0) {
      starter = out.size();
      last_class = -1;
    } else {
      last_class = cls;
    }
    out.push_back(cp);
  }
  return out;
}

}  // namespace

std::string_view nfc(std::string_view text, std::string* storage) {
  size_t i = 0;
  uint32_t cp = 0;
  while (i < text.size()) {  // the quick check: nothing below U+0300 decomposes, composes or reorders
    if (static_cast<unsigned char>(text[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t len = data::decode_utf8(text, i, &cp);
    if (len == 0) throw data::DataError("invalid UTF-8 at byte " + std::to_string(i));
    if (cp >= 0x300) break;
    i += len;
  }
  if (i == text.size()) return text;
  std::vector<uint32_t> decomposed;
  decomposed.reserve(text.size());
  for (size_t k = 0; k < text.size();) {
    const size_t len = data::decode_utf8(text, k, &cp);
    if (len == 0) throw data::DataError("invalid UTF-8 at byte " + std::to_string(k));
    decompose(cp, &decomposed);
    k += len;
  }
  reorder(&decomposed);
  storage->clear();
  for (uint32_t c : recompose(decomposed)) data::append_utf8(c, storage);
  return *storage;
}

}  // namespace dtk::text
