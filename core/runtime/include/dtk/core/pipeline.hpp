// dtk/core/pipeline.hpp — `dtk train`: Megatron's pretrain() over plugins.
#pragma once

#include "dtk/host/plugin_host.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

// Runs a whole training job. Returns the process exit code; throws HostError for bad input.
int pretrain(const config::RunConfig& cfg, host::PluginHost& plugins);

}  // namespace dtk::core
