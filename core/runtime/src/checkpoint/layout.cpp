#include "dtk/core/checkpoint/layout.hpp"

#include <cstdio>
#include <filesystem>

namespace dtk::core {

std::string checkpoint_iter_dir(const std::string& dir, int64_t iteration) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "iter_%07lld", static_cast<long long>(iteration));
  return (std::filesystem::path(dir) / buf).string();
}

std::string checkpoint_tracker_file(const std::string& dir) {
  return (std::filesystem::path(dir) / "latest_checkpointed_iteration.txt").string();
}

}  // namespace dtk::core
