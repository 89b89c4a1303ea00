// What `dtk train` and `dtk config` do to the resolved configuration beyond the config file and
// --set: a Megatron command line (--megatron_args), DeepSpeed's config (--deepspeed_config) and
// the tokenizer files.
#pragma once

#include <string>
#include <vector>

#include "dtk/core/config/deepspeed_config.hpp"
#include "dtk/core/config/megatron_args.hpp"
#include "dtk_config.pb.h"

// Maps `megatron_args` (flags, or @FILE) onto `cfg`; `with_megatron_defaults`: Megatron's values
// for what the flags leave out (no --config file given). Throws HostError listing every flag
// DTK cannot run. Returns the mapping: its `ignored` lists the flags accepted with no effect here,
// its `flag_of` the flag behind each field it set.
dtk::core::MegatronMapping apply_megatron_args(dtk::config::RunConfig& cfg, const std::string& megatron_args,
                                               bool with_megatron_defaults);

// Maps DeepSpeed's config FILE onto `cfg` as DeepSpeed's engine alone reads it (`dtk train
// --deepspeed_config`): ZeRO, precision, batch, clipping, and the file's optimizer, scheduler and
// logging. Throws HostError listing every key DTK cannot run. Returns the mapping (source
// "--deepspeed_config"): `ignored` lists the keys with no effect here, `flag_of` the key behind
// each field it set; `read` (when given) receives what the file says, for the checks made once the
// plugin flags and --set have been applied (check_deepspeed_client).
dtk::core::MegatronMapping apply_deepspeed_config(dtk::config::RunConfig& cfg, const std::string& path,
                                                  dtk::core::DeepSpeedConfig* read = nullptr);

// After the plugin flags and --set: DeepSpeed's refusals of an optimizer the file did not choose,
// and a rate changed under the WarmupCosineLR ratios the file scaled. Throws HostError.
void check_deepspeed_client(const dtk::config::RunConfig& cfg, const dtk::core::DeepSpeedConfig& ds,
                            const std::string& path);

// With a tokenizer named (tokenizer.type / model_file / vocab_file): loads it, fills
// tokenizer.vocab_size and derives model.vocab_size from it (an explicit, different
// model.vocab_size or a dataset vocab_size above it is refused) and causal_lm's eod_token.
// Throws HostError with one line.
void apply_tokenizer_files(dtk::config::RunConfig& cfg);
