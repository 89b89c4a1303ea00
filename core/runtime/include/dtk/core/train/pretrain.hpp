// dtk/core/train/pretrain.hpp — `dtk train`: Megatron's pretrain() over plugins.
#pragma once

#include "dtk/core/train/hooks.hpp"
#include "dtk/host/plugin_host.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

// Runs a whole training job. Returns the process exit code; throws HostError for bad input.
// `hooks`: dtk/core/train/hooks.hpp (empty in a normal run).
int pretrain(const config::RunConfig& cfg, host::PluginHost& plugins, TrainerHooks hooks = {});

}  // namespace dtk::core
