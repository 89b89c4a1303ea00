// dtk/core/launch/distributed.hpp — multi-process runs: the launch environment (torchrun, SLURM,
// Open MPI), the c10d TCPStore rendezvous and the Gloo process groups of Megatron's layout
// (its order tp-cp-dp-pp).
//
// Layout, world = TP x CP x DP x PP:
//   tensor-parallel groups:   consecutive ranks        {0,1}, {2,3}, ...  (tp_rank = rank % tp)
//   data-parallel groups:     a stage's ranks of equal tp_rank            (dp_rank = (rank / tp) % (cp x dp)):
//                             under context parallelism the data- and context-parallel ranks together
//   context-parallel groups:  runs of cp consecutive ranks of a data-parallel group (cp_rank = dp_rank % cp)
//   expert-parallel groups:   runs of ep consecutive ranks of a data-parallel group (ep_rank = dp_rank % ep)
//   pipeline groups:          the ranks of equal tp_rank and dp_rank over the stages (pp_rank = rank / (tp x cp x dp))
//   model-parallel group:     TP x PP ranks of one data-parallel replica
// Each group of size > 1 gets its own ProcessGroupGloo over a PrefixStore of the shared store;
// groups of size 1 get none (their collectives are the identity).
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>
#include <vector>

#include "dtk/core/comm/comm.hpp"
#include "dtk_config.pb.h"

namespace c10d {
class ProcessGroup;
}

namespace dtk::core {

// What the environment says about this process. distributed == false: a single process.
struct LaunchEnv {
  bool distributed = false;
  int rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr;
  int master_port = 0;
  std::string source;  // "torchrun", "slurm", "openmpi" or "" (single process)
  bool single_node = false;  // the launcher says every rank runs on this machine
};

// Reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT (torchrun, dtk launch), else
// SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, else OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK. A world of
// size 1 is a single process. Throws HostError on malformed values.
LaunchEnv launch_env_from_environment();

// "[rank R] " when the environment names a multi-process run, else "" (for error lines).
std::string rank_prefix();

// Rendezvous and process groups for `cfg` (idempotent: a second call is a no-op). Fills
// topology(). Without a distributed environment: a single process, no store. Every wait is
// bounded by distributed.timeout_seconds. Throws HostError with a one-line message. After the
// rendezvous the ranks compare `description` (run_agreement.hpp; empty: not compared) and fail
// together, each naming its difference, before any process group exists.
void init_distributed(const config::RunConfig& cfg, const std::vector<std::string>& description = {});
bool distributed_initialized();

// process_group(group) and collective_timeout() are in dtk/core/comm/comm.hpp, where
// init_distributed installs the groups it created.

// A bounded world barrier, then the process groups and the store are released.
void shutdown_distributed();

}  // namespace dtk::core
