// dtk/core/checkpoint/layout.hpp — the names of Megatron's checkpoint layout, which every part of
// checkpoint/ shares (save and load, the files of an iteration, the catalog of a save directory):
//   {dir}/latest_checkpointed_iteration.txt     the tracker: the newest complete iteration
//   {dir}/iter_0000004/                         one iteration's files
#pragma once

#include <cstdint>
#include <string>

namespace dtk::core {

// "{dir}/iter_0000004" and "{dir}/latest_checkpointed_iteration.txt".
std::string checkpoint_iter_dir(const std::string& dir, int64_t iteration);
std::string checkpoint_tracker_file(const std::string& dir);
// A folder name of the layout: iter_NNNNNNN -> N; -1 for any other name (temporaries included).
int64_t iteration_of(const std::string& name);

}  // namespace dtk::core
