// The glog bridge behind dtk_host_services.log: plugin lines join the host's log, tagged with
// the plugin's name, at the plugin's file and line.
#pragma once

#include <cstdint>

namespace dtk::core {

// [thread-safe] `level` is a dtk_log_level; DEBUG lines show with --v=1.
void log_to_glog(void* ctx, int32_t level, const char* plugin, const char* file, int32_t line, const char* message);

}  // namespace dtk::core
