// `dtk export hf CHECKPOINT OUT_DIR --vocab_file encoder.json --merge_file vocab.bpe`: a gpt-model
// checkpoint as a Hugging Face GPT2LMHeadModel folder; `dtk import hf HF_DIR SAVE_DIR`: the
// reverse, a checkpoint to fine-tune from (dtk/core/hf_gpt2.hpp).
#pragma once

#include <string>
#include <vector>

namespace dtk::host {
class PluginHost;
}

// `args`: the words after "export". `plugins` resolves the model plugin's options (defaults
// included) for the checkpoint's recorded configuration.
int run_export(const std::vector<std::string>& args, dtk::host::PluginHost& plugins);
int run_import(const std::vector<std::string>& args, dtk::host::PluginHost& plugins);
