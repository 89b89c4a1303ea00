// `dtk export hf CHECKPOINT OUT_DIR --vocab_file encoder.json --merge_file vocab.bpe`: a gpt-model
// checkpoint as a Hugging Face GPT2LMHeadModel folder, a llama-model one as a LlamaForCausalLM
// folder; `dtk import hf HF_DIR SAVE_DIR`: the reverse, a checkpoint to fine-tune from
// (dtk/core/export/hf_gpt2.hpp, hf_llama.hpp).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dtk/core/components/components.hpp"
#include "dtk/core/config/config.hpp"

namespace dtk::host {
class PluginHost;
}

// The model of `cfg` (its plugin and options) for one rank of a tensor-parallel layout (and stage
// `stage` of a pipeline split as `split` says: split.stages stages, split.chunks per rank), on the CPU
// in cfg's params_dtype, built only to read its shapes, parameter layout and initial state
// (import, convert). `options` keeps the resolved options alive as long as the model.
struct BuiltModel {
  std::unique_ptr<dtk::host::OptionValues> options;
  std::unique_ptr<dtk::core::ModelInstance> model;
};
BuiltModel build_model(dtk::host::PluginHost& plugins, const dtk::config::RunConfig& cfg, int tp_rank, int tp_size,
                       int stage = 0, const dtk::PipelineSplit& split = {}, int ep_rank = 0, int ep_size = 1);

// `args`: the words after "export". `plugins` resolves the model plugin's options (defaults
// included) for the checkpoint's recorded configuration.
// `dtk generate` and `dtk export hf` run the model `cfg` (the configuration recorded in checkpoint
// `where`) records. What the command line says of the model (--model, --set model.K=V) is checked
// against it: a difference that changes the model's function is refused in one line, unless
// --use_checkpoint_args (then the checkpoint's stands, said on stderr); the options that do not
// (fused_lm_head, ...) apply. Any other --set, --config or --megatron_args is refused: `command`
// reads nothing else of a run configuration.
void apply_command_line_model(dtk::config::RunConfig& cfg, const std::vector<std::string>& sets,
                              dtk::host::PluginHost& plugins, const std::string& where, const std::string& command);

int run_export(const std::vector<std::string>& args, const std::vector<std::string>& sets,
               dtk::host::PluginHost& plugins);
int run_import(const std::vector<std::string>& args, dtk::host::PluginHost& plugins);
