// `dtk checkpoint inspect DIR`: what a checkpoint holds and whether it is complete.
// `dtk checkpoint convert SRC DST --tensor_model_parallel_size N ...`: re-partitioned for another
// tensor-, pipeline- or expert-parallel size (dtk/core/checkpoint/checkpoint_convert.hpp).
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace dtk::host {
class PluginHost;
}

// `args` are the words after "checkpoint" (gflags already parsed); `plugins` loads the plugins
// (convert builds the checkpoint's model). Returns the exit status: inspect gives 0 for a complete
// checkpoint, 1 (after one error line) for an incomplete or damaged one.
int run_checkpoint(const std::vector<std::string>& args, const std::function<dtk::host::PluginHost&()>& plugins);
