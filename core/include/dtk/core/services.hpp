// dtk/core/services.hpp — the dtk_host_services table the host hands to every plugin:
// logging into glog, statuses, process groups and collectives, RNG seeds, device services.
#pragma once

#include <dtk/abi.h>

#include <cstdint>
#include <string>

#include "dtk_config.pb.h"

namespace dtk::core {

// Ranks and sizes of the process groups of this process (Megatron's layout).
struct Topology {
  int world_rank = 0, world_size = 1;
  int tp_rank = 0, tp_size = 1;
  int pp_rank = 0, pp_size = 1;
  int dp_rank = 0, dp_size = 1;
};

// The LibTorch version this host runs ("1.13.0"); compute plugins must match it.
const char* host_torch_version();

// The process-wide services table. Valid for the process lifetime.
const dtk_host_services* host_services();

// Streams, events and pinned memory (device_services.cpp). This build is CPU-only: every
// stream is the CPU's in-order queue, events are always complete, pinned memory is plain.
const dtk_device_services* device_services();

// What rng_seed derives from (train.seed). Call before creating plugin objects.
void set_run_config(const config::RunConfig& cfg);
const Topology& topology();

// World-wide MAX of `value` through a bounded collective (the identity for one process): a
// barrier that also carries a flag or a number. `what` names the wait in a failure.
int64_t world_max(int64_t value, const Topology& topo, const char* what);

// After a step every rank ran: throws this rank's `error` if it has one, else `others_failed`
// (default "<what>: another rank failed (its error is above)") if any rank failed.
void agree(const std::string& error, const Topology& topo, const char* what, const std::string& others_failed = "");
// Set by init_distributed (dtk/core/distributed.hpp) once the process groups exist.
void set_topology(const Topology& t);

}  // namespace dtk::core
