// dtk/comma_list.hpp — the items of a comma-separated option value: Megatron's lists given as one
// string ("aux_loss,global_aux_loss", "1e-2, 1e-3", a kernel list "add_norm,rotary").
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace dtk {

// `text` split at its commas, the spaces and tabs around each item trimmed. Empty items are kept
// ("a,,b" has three items, a trailing comma ends in an empty one, "" is one empty item): each caller
// decides what an empty item means (an error, or nothing).
inline std::vector<std::string> comma_items(std::string_view text) {
  std::vector<std::string> out;
  for (size_t begin = 0;;) {
    const size_t end = std::min(text.find(',', begin), text.size());
    std::string_view item = text.substr(begin, end - begin);
    const size_t first = item.find_first_not_of(" \t");
    item = first == std::string_view::npos ? std::string_view() : item.substr(first);
    item = item.substr(0, item.find_last_not_of(" \t") + 1);
    out.emplace_back(item);
    if (end == text.size()) return out;
    begin = end + 1;
  }
}

}  // namespace dtk
