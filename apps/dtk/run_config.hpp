// What `dtk train` and `dtk config` do to the resolved configuration beyond the config file and
// --set: a Megatron command line (--megatron_args) and the tokenizer files.
#pragma once

#include <string>
#include <vector>

#include "dtk/core/config/megatron_args.hpp"
#include "dtk_config.pb.h"

// Maps `megatron_args` (flags, or @FILE) onto `cfg`; `with_megatron_defaults`: Megatron's values
// for what the flags leave out (no --config file given). Throws HostError listing every flag
// DTK cannot run. Returns the mapping: its `ignored` lists the flags accepted with no effect here,
// its `flag_of` the flag behind each field it set.
dtk::core::MegatronMapping apply_megatron_args(dtk::config::RunConfig& cfg, const std::string& megatron_args,
                                               bool with_megatron_defaults);

// With a tokenizer named (tokenizer.type / model_file / vocab_file): loads it, fills
// tokenizer.vocab_size and derives model.vocab_size from it (an explicit, different
// model.vocab_size or a dataset vocab_size above it is refused) and causal_lm's eod_token.
// Throws HostError with one line.
void apply_tokenizer_files(dtk::config::RunConfig& cfg);
