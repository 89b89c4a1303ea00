// `dtk generate --load DIR --prompt TEXT | --prompts_file FILE ...`: text from a checkpoint with
// the model's key/value cache (dtk/core/export/generate.hpp), decoded with the GPT-2 BPE; under `dtk
// launch --nproc_per_node N` for a checkpoint saved at tensor-parallel size N.
#pragma once

namespace dtk::host {
class PluginHost;
}

#include <string>
#include <vector>

// `sets`: the command line's --set assignments (model options only; apply_command_line_model).
int run_generate(const std::vector<std::string>& sets, dtk::host::PluginHost& plugins);
