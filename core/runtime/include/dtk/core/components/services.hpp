// dtk/core/components/services.hpp — the dtk_host_services table the host hands to every plugin:
// logging into glog, statuses, process groups and collectives (an adapter over comm.hpp), RNG
// seeds, device services, extensions.
#pragma once

#include <dtk/abi.h>

#include <cstdint>
#include <string>

#include "dtk/core/comm/comm.hpp"  // Topology, topology(), world_max, agree (host code's comm API)
#include "dtk_config.pb.h"

namespace dtk::core {

// The LibTorch version this host runs ("1.13.0"); compute plugins must match it.
const char* host_torch_version();

// The process-wide services table. Valid for the process lifetime.
const dtk_host_services* host_services();

// Streams, events and pinned memory (device_services.cpp). This build is CPU-only: every
// stream is the CPU's in-order queue, events are always complete, pinned memory is plain.
const dtk_device_services* device_services();

// What rng_seed derives from (train.seed). Call before creating plugin objects.
void set_run_config(const config::RunConfig& cfg);

}  // namespace dtk::core
