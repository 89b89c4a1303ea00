#include "dtk/core/checkpoint/layout.hpp"

#include <cstdio>
#include <filesystem>
#include <regex>

namespace dtk::core {

std::string checkpoint_iter_dir(const std::string& dir, int64_t iteration) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "iter_%07lld", static_cast<long long>(iteration));
  return (std::filesystem::path(dir) / buf).string();
}

std::string checkpoint_tracker_file(const std::string& dir) {
  return (std::filesystem::path(dir) / "latest_checkpointed_iteration.txt").string();
}

int64_t iteration_of(const std::string& name) {
  static const std::regex re(R"(^iter_(\d{7,})$)");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return -1;
  try {
    return std::stoll(m[1].str());
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace dtk::core
