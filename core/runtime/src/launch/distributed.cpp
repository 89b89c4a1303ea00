// Multi-process runs: launch environment, TCPStore rendezvous, Gloo process groups.
// See dtk/core/launch/distributed.hpp for the group layout.
#include "dtk/core/launch/distributed.hpp"
#include "../comm/nccl_backend.hpp"
#include "dtk/core/comm/peer_processes.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/core/launch/broken_pipes.hpp"
#include "dtk/core/launch/run_agreement.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <dtk/abi.h>
#include <dtk/comma_list.hpp>
#include <dtk/plugin.hpp>

#include <cerrno>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "local_address.hpp"
#include "startup_watchdog.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace {

struct DistState {
  std::mutex mu;
  bool initialized = false;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  c10::intrusive_ptr<c10d::Store> store;
};

DistState& dist() {
  static DistState* s = new DistState();  // never destroyed: worker threads may outlive main
  return *s;
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, const char* fallback_value = nullptr) {
  const char* v = env(name);
  if (!v) v = fallback_value;
  if (!v) throw HostError(std::string("distributed: environment variable ") + name + " is not set");
  errno = 0;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (errno || end == v || *end || x < 0 || x > 1 << 24)
    throw HostError(std::string("distributed: ") + name + "='" + v + "' is not a non-negative integer");
  return static_cast<int>(x);
}

// Identifies one run among jobs that may share a store: set by `dtk launch`, torchrun or SLURM.
std::string run_id() {
  if (const char* v = env("DTK_RUN_ID")) return v;
  if (const char* v = env("TORCHELASTIC_RUN_ID")) return v;
  if (const char* job = env("SLURM_JOB_ID"))
    return std::string(job) + "." + (env("SLURM_STEP_ID") ? env("SLURM_STEP_ID") : "0");
  return "default";
}


std::string short_error(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return dtk::one_line(ce->what_without_backtrace());
  return dtk::one_line(e.what());
}

}  // namespace

LaunchEnv launch_env_from_environment() {
  LaunchEnv le;
  bool all_local = false;
  // torchrun sets both: one without the other is a broken launch, not a single process.
  if (static_cast<bool>(env("RANK")) != static_cast<bool>(env("WORLD_SIZE")))
    throw HostError(std::string("distributed: ") + (env("RANK") ? "RANK" : "WORLD_SIZE") + " is set but " +
                    (env("RANK") ? "WORLD_SIZE" : "RANK") + " is not (torchrun sets both; unset it to run one process)");
  if (env("RANK") && env("WORLD_SIZE")) {
    le.source = "torchrun";
    le.rank = env_int("RANK");
    le.world_size = env_int("WORLD_SIZE");
    le.local_rank = env("LOCAL_RANK") ? env_int("LOCAL_RANK") : le.rank;
    all_local = env("LOCAL_WORLD_SIZE") && env_int("LOCAL_WORLD_SIZE") == le.world_size;
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS") && env("SLURM_STEP_NUM_TASKS")) {
    // Only inside an srun step: a batch script also sees SLURM_PROCID/SLURM_NTASKS, but there
    // dtk is one process, not one of SLURM_NTASKS ranks.
    le.source = "slurm";
    le.rank = env_int("SLURM_PROCID");
    le.world_size = env_int("SLURM_NTASKS");
    le.local_rank = env("SLURM_LOCALID") ? env_int("SLURM_LOCALID") : le.rank;
    all_local = env("SLURM_NNODES") && env_int("SLURM_NNODES") == 1;
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    le.source = "openmpi";
    le.rank = env_int("OMPI_COMM_WORLD_RANK");
    le.world_size = env_int("OMPI_COMM_WORLD_SIZE");
    le.local_rank = env("OMPI_COMM_WORLD_LOCAL_RANK") ? env_int("OMPI_COMM_WORLD_LOCAL_RANK") : le.rank;
    all_local = env("OMPI_COMM_WORLD_LOCAL_SIZE") && env_int("OMPI_COMM_WORLD_LOCAL_SIZE") == le.world_size;
  } else {
    return le;
  }
  if (le.world_size < 1) throw HostError("distributed: world size (" + le.source + ") must be at least 1");
  if (le.rank >= le.world_size)
    throw HostError("distributed: rank " + std::to_string(le.rank) + " is not below the world size " +
                    std::to_string(le.world_size) + " (" + le.source + " environment)");
  if (le.world_size == 1) {
    le.rank = 0;
    return le;  // one process: no store
  }
  le.distributed = true;
  le.single_node = all_local;
  if (env("MASTER_ADDR"))
    le.master_addr = env("MASTER_ADDR");
  else if (all_local)
    le.master_addr = "127.0.0.1";
  else
    throw HostError("distributed: MASTER_ADDR is not set (" + le.source +
                    " run over several nodes: export MASTER_ADDR=<host of rank 0>)");
  le.master_port = env_int("MASTER_PORT", "29500");
  if (le.master_port < 1 || le.master_port > 65535)
    throw HostError("distributed: MASTER_PORT=" + std::to_string(le.master_port) + " is not a TCP port");
  return le;
}

std::string rank_prefix() {
  try {
    const LaunchEnv le = launch_env_from_environment();
    if (le.distributed) return "[rank " + std::to_string(le.rank) + "] ";
  } catch (...) {
  }
  return "";
}

namespace {

// Megatron's rank order tp-cp-dp-pp: TP consecutive, the data-parallel group (its context-parallel
// runs consecutive) strided by TP, the pipeline stages outermost.
Topology topology_of(const LaunchEnv& le, int tp, int pp, int ep, int cp) {
  Topology t;
  t.ep_size = ep;
  t.cp_size = cp;
  t.world_rank = le.rank, t.world_size = le.world_size;
  t.tp_size = tp, t.pp_size = pp, t.dp_size = le.world_size / (tp * pp);
  t.tp_rank = le.rank % tp;
  t.dp_rank = (le.rank / tp) % t.dp_size;
  t.pp_rank = le.rank / (tp * t.dp_size);
  return t;
}

std::string rendezvous_failed(const LaunchEnv& le, std::chrono::milliseconds timeout, const std::exception& e) {
  return "distributed: rendezvous at " + le.master_addr + ":" + std::to_string(le.master_port) +
         " failed (world size " + std::to_string(le.world_size) + ", timeout " +
         std::to_string(timeout.count() / 1000) + " s): " + short_error(e);
}

// The c10d TCPStore of the run (rank 0 serves it unless torchrun's agent does, or `serve` is
// false: a second client), under a per-run key namespace.
c10::intrusive_ptr<c10d::Store> open_store(const LaunchEnv& le, std::chrono::milliseconds timeout, bool serve) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(le.master_port);
  // Under torchrun's agent (its default static rendezvous) the agent already serves the store
  // on MASTER_PORT: every rank is a client, under the attempt's prefix, as PyTorch does.
  const bool agent_store =
      env("TORCHELASTIC_USE_AGENT_STORE") && std::string(env("TORCHELASTIC_USE_AGENT_STORE")) == "True";
  so.isServer = serve && le.rank == 0 && !agent_store;
  so.numWorkers = static_cast<std::size_t>(le.world_size);
  so.waitWorkers = false;  // check_in waits, bounded, with a clearer message
  so.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> tcp = c10::make_intrusive<c10d::TCPStore>(le.master_addr, so);
  if (agent_store) {
    const char* attempt = env("TORCHELASTIC_RESTART_COUNT");
    tcp = c10::make_intrusive<c10d::PrefixStore>(std::string("/worker/attempt_") + (attempt ? attempt : "0"), tcp);
  }
  // Keys live under a per-run namespace, so two jobs that meet on one port cannot join (or
  // corrupt) each other's rendezvous: they time out on their own keys instead.
  return c10::make_intrusive<c10d::PrefixStore>("dtk/" + run_id(), tcp);
}

c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& le, std::chrono::milliseconds timeout) {
  try {
    return open_store(le, timeout, true);
  } catch (const std::exception& e) {
    throw HostError(rendezvous_failed(le, timeout, e));
  }
}

// Start-up progress in the store: each rank marks each step it finished, and the address its
// Gloo device advertises, so a rank that waits too long can say whom it waits for.
std::string step_key(const std::string& step, int rank) { return "dtk/startup/" + step + "/" + std::to_string(rank); }
constexpr const char* kFailedKey = "dtk/startup/failed";  // the first failing rank's error

// "rank 1", "ranks 1, 3 and 12 more": at most 8 named.
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < 8; ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > 8) out += " and " + std::to_string(ranks.size() - 8) + " more";
  return out;
}

// The ranks (other than this one) that did not reach `step` (its "began" mark), or, when all
// did, those that did not finish it, read through `store`: the ranks the step waits for.
std::vector<int> ranks_missing(c10d::Store& store, const LaunchEnv& le, const std::string& step) {
  std::vector<int> missing;
  for (const std::string& mark : {step + "/began", step})
    if (missing.empty())
      for (int r = 0; r < le.world_size; ++r)
        if (r != le.rank && !store.check({step_key(mark, r)})) missing.push_back(r);
  return missing;
}

// For the watchdog (its own thread, its own short-lived store connection): whom `step` waits for.
std::string diagnose_startup(const LaunchEnv& le, const std::string& step_id) {
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = open_store(le, std::chrono::seconds(3), false);
  } catch (const std::exception&) {
    return "the store at " + le.master_addr + ":" + std::to_string(le.master_port) +
           " does not answer (rank 0 stopped?)";
  }
  const std::vector<int> missing = ranks_missing(*store, le, step_id);
  if (missing.empty()) return "";
  std::string out = "waiting for " + rank_list(missing);
  // The usual cause across hosts: a peer advertised an address the others cannot reach.
  std::string addresses;
  for (size_t i = 0; i < missing.size() && i < 8; ++i) {
    const std::string key = "dtk/address/" + std::to_string(missing[i]);
    if (!store->check({key})) continue;
    const std::vector<uint8_t> a = store->get(key);
    addresses += std::string(addresses.empty() ? "" : ", ") + "rank " + std::to_string(missing[i]) + " at " +
                 std::string(a.begin(), a.end());
  }
  if (!addresses.empty()) out += " (" + addresses + ")";
  return out;
}

// Every rank checks in; all wait (bounded) until the whole world did, so a missing peer is
// reported here, by count, rather than later as a socket timeout inside Gloo.
// The world this rank was told about, as it was told: "a world of 3 ranks (dtk launch --nnodes 3
// --nproc_per_node 1)", or the launcher's variables.
std::string world_told(const LaunchEnv& le) {
  std::string how;
  if (const char* launch = env("DTK_LAUNCH_WORLD"))
    how = std::string("dtk launch ") + launch;
  else if (env("LOCAL_WORLD_SIZE"))
    how = le.source + ": WORLD_SIZE=" + std::to_string(le.world_size) + ", LOCAL_WORLD_SIZE=" + env("LOCAL_WORLD_SIZE");
  else
    how = le.source;
  return "a world of " + std::to_string(le.world_size) + " ranks (" + how + ")";
}

// Publishes (for every rank waiting) and returns the one line naming two worlds that differ.
std::string publish_world_difference(c10d::Store& store, int rank, const std::string& its_world,
                                     const std::string& rank0_world) {
  const std::string difference = "rank " + std::to_string(rank) + " was started for " + its_world +
                                 " but rank 0 for " + rank0_world +
                                 ": start every launcher with the same --nnodes and --nproc_per_node";
  store.set("dtk/rendezvous/world_mismatch", std::vector<uint8_t>(difference.begin(), difference.end()));
  return difference;
}

// Before waiting for the world: the world every rank was told about is rank 0's, or the launches
// differ (launchers started with other --nnodes or --nproc_per_node), which waiting cannot fix.
// Rank 0 publishes its world; each other rank compares and, when it differs, publishes the
// difference, which rank 0 (and every rank waiting) reports too. Returns "" while nothing differs.
std::string world_difference(c10d::Store& store, const LaunchEnv& le) {
  const std::string world_key = "dtk/rendezvous/world", size_key = "dtk/rendezvous/world_size";
  const std::string mismatch_key = "dtk/rendezvous/world_mismatch";
  if (store.check({mismatch_key})) {
    const std::vector<uint8_t> m = store.get(mismatch_key);
    return std::string(m.begin(), m.end());
  }
  if (le.rank == 0 || !store.check({world_key, size_key})) return "";
  const std::vector<uint8_t> size = store.get(size_key), told = store.get(world_key);
  if (std::string(size.begin(), size.end()) == std::to_string(le.world_size)) return "";
  return publish_world_difference(store, le.rank, world_told(le), std::string(told.begin(), told.end()));
}

void check_in(c10d::Store& store, const LaunchEnv& le, std::chrono::milliseconds timeout) {
  try {
    const std::string key = "dtk/rendezvous/arrived";
    if (le.rank == 0) {
      const std::string told = world_told(le), size = std::to_string(le.world_size);
      store.set("dtk/rendezvous/world", std::vector<uint8_t>(told.begin(), told.end()));
      store.set("dtk/rendezvous/world_size", std::vector<uint8_t>(size.begin(), size.end()));
    }
    {
      // This rank's world, before it counts as arrived: rank 0 compares every arrived rank's with
      // its own once enough have arrived (a rank that arrives last may not have compared yet).
      const std::string told = world_told(le), size = std::to_string(le.world_size) + " " + told;
      store.set("dtk/rendezvous/world_of/" + std::to_string(le.rank), std::vector<uint8_t>(size.begin(), size.end()));
    }
    store.set(step_key("rendezvous/began", le.rank), std::vector<uint8_t>{1});
    store.set(step_key("rendezvous", le.rank), std::vector<uint8_t>{1});
    store.add(key, 1);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int64_t arrived = store.add(key, 0); arrived < le.world_size; arrived = store.add(key, 0)) {
      if (const std::string d = world_difference(store, le); !d.empty()) throw HostError("distributed: " + d);
      if (std::chrono::steady_clock::now() >= deadline)
        throw HostError(
            "distributed: rendezvous at " + le.master_addr + ":" + std::to_string(le.master_port) +
            " failed: " + std::to_string(arrived) + " of " + std::to_string(le.world_size) +
            " ranks arrived within distributed.timeout_seconds = " + std::to_string(timeout.count() / 1000) +
            " s; missing: " + rank_list(ranks_missing(store, le, "rendezvous")));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // Enough ranks arrived for this rank's world; rank 0's may still be another one.
    if (const std::string d = world_difference(store, le); !d.empty()) throw HostError("distributed: " + d);
    if (le.rank == 0) {
      for (int r = 1; r < le.world_size; ++r) {
        const std::string k = "dtk/rendezvous/world_of/" + std::to_string(r);
        if (!store.check({k})) continue;  // not this rank among the arrived (another world's)
        const std::vector<uint8_t> v = store.get(k);
        const std::string text(v.begin(), v.end());
        const size_t space = text.find(' ');
        if (text.substr(0, space) == std::to_string(le.world_size)) continue;
        throw HostError("distributed: " + publish_world_difference(store, r, text.substr(space + 1), world_told(le)));
      }
    }
  } catch (const HostError&) {
    throw;
  } catch (const std::exception& e) {
    throw HostError(rendezvous_failed(le, timeout, e));
  }
}

// Every rank publishes what it will run; each compares with rank 0's and counts a mismatch; after
// a second check-in every rank knows whether any differed (run_agreement.hpp). Store waits are
// bounded by the rendezvous timeout.
void require_same_run(c10d::Store& store, const LaunchEnv& le, const std::vector<std::string>& description,
                      std::chrono::milliseconds timeout) {
  if (description.empty()) return;
  std::string difference;
  int64_t differing = 0;
  try {
    const std::string text = join_lines(description);
    store.set("dtk/run/" + std::to_string(le.rank), std::vector<uint8_t>(text.begin(), text.end()));
    const std::vector<uint8_t> r0 = store.get("dtk/run/0");
    difference = first_difference(description, split_lines(std::string(r0.begin(), r0.end())));
    store.add("dtk/run/differing", difference.empty() ? 0 : 1);
    const std::string key = "dtk/run/compared";
    store.set(key + "/" + std::to_string(le.rank), std::vector<uint8_t>{1});  // who compared, for the error below
    store.add(key, 1);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (store.add(key, 0) < le.world_size) {
      if (std::chrono::steady_clock::now() >= deadline) {
        std::vector<int> missing;  // the ranks that did not compare their configuration
        for (int r = 0; r < le.world_size; ++r)
          if (!store.check({key + "/" + std::to_string(r)})) missing.push_back(r);
        throw HostError("distributed: comparing the ranks' configurations: not every rank took part within "
                        "distributed.timeout_seconds = " + std::to_string(timeout.count() / 1000) + " s; missing: " +
                        rank_list(missing));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    differing = store.add("dtk/run/differing", 0);
  } catch (const HostError&) {
    throw;
  } catch (const std::exception& e) {
    throw HostError(rendezvous_failed(le, timeout, e));
  }
  if (!difference.empty())
    throw HostError("rank " + std::to_string(le.rank) + " was started with another configuration than rank 0: " +
                    difference + " (start every rank with the same config, --set flags and plugins)");
  if (differing > 0)
    throw HostError(std::to_string(differing) + " of " + std::to_string(le.world_size) +
                    " ranks were started with another configuration than rank 0 (their errors name the setting)");
}

// The Gloo device(s) of this rank and the address they advertise (local_address.hpp):
// GLOO_SOCKET_IFNAME (a comma-separated list, as PyTorch reads it) when set, else the local end
// of the route to MASTER_ADDR.
struct GlooEndpoint {
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  std::string address;      // what peers connect to, e.g. "192.168.77.2 (v2)"
  std::string description;  // for the log line
};

GlooEndpoint gloo_endpoint(const LaunchEnv& le) {
  GlooEndpoint ep;
  if (const char* names = env("GLOO_SOCKET_IFNAME")) {
    const std::string list = names;
    for (const std::string& name : comma_items(list)) {
      if (name.empty()) continue;
      const std::string address = interface_address(name, "GLOO_SOCKET_IFNAME");
      ep.devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
      ep.address += (ep.address.empty() ? "" : ", ") + address + " (" + name + ")";
    }
    if (ep.devices.empty()) throw HostError("distributed: GLOO_SOCKET_IFNAME='" + list + "' names no interface");
    ep.description = ep.address + ", from GLOO_SOCKET_IFNAME";
    return ep;
  }
  LocalAddress local = local_address_towards(le.master_addr, "MASTER_ADDR");
  ep.description = "the route to MASTER_ADDR " + le.master_addr;
  // MASTER_ADDR given as a name that resolves to the loopback here, in a world over several
  // nodes: this is the master node of a host whose /etc/hosts maps its own name to 127.0.x.x.
  // The loopback would be unreachable from the other nodes: take the outward interface.
  const bool literal_loopback = le.master_addr == "localhost" || is_loopback_address(le.master_addr);
  if (is_loopback_address(local.address) && !literal_loopback && !le.single_node) {
    local = outward_address();
    ep.description = "this host's outward interface (MASTER_ADDR " + le.master_addr + " resolves to the loopback here)";
  }
  ep.devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(local.address));
  ep.address = local.address + (local.interface.empty() ? "" : " (" + local.interface + ")");
  ep.description = ep.address + ", " + ep.description;
  return ep;
}

// The Gloo groups of this rank in Megatron's layout; every rank creates its groups in the same
// order: world, TP, DP, PP, MP.
ProcessGroups create_groups(const LaunchEnv& le, const Topology& t, const c10::intrusive_ptr<c10d::Store>& store,
                            const GlooEndpoint& endpoint, std::chrono::milliseconds timeout,
                            nccl_backend::GroupMembers* members_out) {
  ProcessGroups groups;  // indexed by dtk_group
  // Members of a group, in group-rank order.
  auto make = [&](int32_t group, const std::string& name, const std::vector<int>& members) {
    (*members_out)[static_cast<size_t>(group)] = members;
    if (members.size() <= 1) return;
    int my = -1;
    for (size_t i = 0; i < members.size(); ++i)
      if (members[i] == le.rank) my = static_cast<int>(i);
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices = endpoint.devices;
    opts->threads = 2;
    auto prefix = c10::make_intrusive<c10d::PrefixStore>("dtk/" + name, store);
    try {
      groups[static_cast<size_t>(group)] =
          c10::make_intrusive<c10d::ProcessGroupGloo>(prefix, my, static_cast<int>(members.size()), opts);
    } catch (const std::exception& e) {
      std::string waiting;
      try {
        waiting = diagnose_startup(le, "groups");
      } catch (const std::exception&) {
      }
      throw HostError("distributed: creating the " + name + " process group failed: " + short_error(e) +
                      (waiting.empty() ? "" : "; " + waiting));
    }
  };
  const int tp = t.tp_size, pp = t.pp_size;
  const int replica = t.pp_rank * t.dp_size * tp;  // first rank of this pipeline stage
  std::vector<int> world, tp_members, dp_members, pp_members, mp_members;
  for (int r = 0; r < le.world_size; ++r) world.push_back(r);
  for (int i = 0; i < tp; ++i) tp_members.push_back(replica + t.dp_rank * tp + i);
  for (int i = 0; i < t.dp_size; ++i) dp_members.push_back(replica + i * tp + t.tp_rank);
  for (int i = 0; i < pp; ++i) pp_members.push_back(i * t.dp_size * tp + t.dp_rank * tp + t.tp_rank);
  for (int p = 0; p < pp; ++p)
    for (int i = 0; i < tp; ++i) mp_members.push_back(p * t.dp_size * tp + t.dp_rank * tp + i);
  make(DTK_GROUP_WORLD, "world", world);
  make(DTK_GROUP_TENSOR_PARALLEL, "tp/" + std::to_string(t.pp_rank * t.dp_size + t.dp_rank), tp_members);
  make(DTK_GROUP_DATA_PARALLEL, "dp/" + std::to_string(t.pp_rank * tp + t.tp_rank), dp_members);
  make(DTK_GROUP_PIPELINE_PARALLEL, "pp/" + std::to_string(t.dp_rank * tp + t.tp_rank), pp_members);
  make(DTK_GROUP_MODEL_PARALLEL, "mp/" + std::to_string(t.dp_rank), mp_members);
  // Expert parallelism splits the data-parallel group: runs of ep_size consecutive DP ranks hold
  // different experts; the DP ranks with the same expert-parallel rank hold the same ones.
  std::vector<int> ep_members, edp_members;
  for (int i = 0; i < t.ep_size; ++i) ep_members.push_back(dp_members[t.edp_rank() * t.ep_size + i]);
  for (int i = 0; i < t.edp_size(); ++i) edp_members.push_back(dp_members[i * t.ep_size + t.ep_rank()]);
  const std::string dp_name = std::to_string(t.pp_rank * tp + t.tp_rank);
  make(DTK_GROUP_EXPERT_PARALLEL, "ep/" + dp_name + "/" + std::to_string(t.edp_rank()), ep_members);
  make(DTK_GROUP_EXPERT_DATA_PARALLEL, "edp/" + dp_name + "/" + std::to_string(t.ep_rank()), edp_members);
  // Context parallelism splits it too: runs of cp_size consecutive DP ranks share the samples.
  std::vector<int> cp_members;
  for (int i = 0; i < t.cp_size; ++i) cp_members.push_back(dp_members[t.data_rank() * t.cp_size + i]);
  make(DTK_GROUP_CONTEXT_PARALLEL, "cp/" + dp_name + "/" + std::to_string(t.data_rank()), cp_members);
  return groups;
}

// Every start-up step, each bounded by its own timeout and, as a backstop, by the watchdog:
// store, rendezvous, configuration check, process groups, a first world barrier. Each rank
// marks the steps it finished in the store (step_key) so a waiting rank can name whom it waits for.
ProcessGroups start_world(const LaunchEnv& le, const Topology& t, const std::vector<std::string>& description,
                          std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Store>& store, bool nccl) {
  const GlooEndpoint endpoint = gloo_endpoint(le);
  const std::string where = le.master_addr + ":" + std::to_string(le.master_port);
  // Once every rank checked in, the watchdog's own store client watches for a peer's failure
  // (published under kFailedKey) or rank 0's store going away, so the others stop at once.
  std::atomic<bool> checked_in{false};
  c10::intrusive_ptr<c10d::Store> watch_store;  // used on the watchdog's thread only
  int store_failures = 0;  // in a row: one slow answer from a busy store is not a lost run
  const std::string mine = "rank " + std::to_string(le.rank) + " failed: ";
  auto lost = [&]() -> std::string {
    if (!checked_in) return "";
    try {
      if (!watch_store) watch_store = open_store(le, std::chrono::seconds(3), false);
      store_failures = 0;
      if (!watch_store->check({kFailedKey})) return "";
      const std::vector<uint8_t> got = watch_store->get(kFailedKey);
      const std::string why(got.begin(), got.end());
      return why.rfind(mine, 0) == 0 ? "" : why;  // this rank's own failure is reported by itself
    } catch (const std::exception&) {
      watch_store.reset();
      if (le.rank == 0 || ++store_failures < 3) return "";
      return "rank 0 stopped (its store at " + where + " no longer answers)";
    }
  };
  StartupWatchdog watchdog(
      timeout, [&le](const std::string& key) { return key.empty() ? std::string() : diagnose_startup(le, key); },
      lost);
  std::string current = "connecting to the store at " + where;  // the step under way, for errors
  auto begin = [&](const std::string& key, const std::string& step) {
    watchdog.step(step, key);
    current = step;
    if (!key.empty() && store) store->set(step_key(key + "/began", le.rank), std::vector<uint8_t>{1});
  };
  auto done = [&](const std::string& id) { store->set(step_key(id, le.rank), std::vector<uint8_t>{1}); };
  begin("", "connecting to the store at " + where);
  store = connect_store(le, timeout);
  begin("rendezvous", "the rendezvous at " + where);
  check_in(*store, le, timeout);
  checked_in = true;
  try {
    // Every rank says where its Gloo device listens (one line each: on several hosts a wrong
    // address is the first thing to look for). On stderr: stdout may be a command's product
    // (`dtk generate` prints its text there).
    std::fprintf(stderr, "%s> distributed: Gloo listens on %s\n", rank_prefix().c_str(), endpoint.description.c_str());
    std::fflush(stderr);
    store->set("dtk/address/" + std::to_string(le.rank),
               std::vector<uint8_t>(endpoint.address.begin(), endpoint.address.end()));
    const std::string process = this_process_identity();
    store->set("dtk/process/" + std::to_string(le.rank), std::vector<uint8_t>(process.begin(), process.end()));
    begin("config", "comparing the ranks' configurations");
    require_same_run(*store, le, description, timeout);
    done("config");
    begin("groups", "creating the process groups");
    nccl_backend::GroupMembers members;
    ProcessGroups groups = create_groups(le, t, store, endpoint, timeout, &members);
    if (nccl) {
      // CUDA tensors' collectives: one NCCL communicator per group, on this rank's GPU (the Gloo
      // groups keep the host tensors).
      current = "creating the NCCL communicators";
      nccl_backend::create(members, le.rank, c10::make_intrusive<c10d::PrefixStore>("dtk/nccl", store),
                           training_device().index(), timeout);
    }
    done("groups");
    // Every rank's address, for naming the peer in a collective's error (comm.hpp), the first
    // barrier's included: every rank stored its address before the groups could connect.
    std::vector<std::string> addresses;
    for (int r = 0; r < le.world_size; ++r) {
      const std::vector<uint8_t> a = store->get("dtk/address/" + std::to_string(r));
      const std::string text(a.begin(), a.end());
      addresses.push_back(text.substr(0, text.find(' ')));
    }
    set_rank_addresses(std::move(addresses));
    std::vector<std::string> processes;
    for (int r = 0; r < le.world_size; ++r) {
      const std::vector<uint8_t> p = store->get("dtk/process/" + std::to_string(r));
      processes.emplace_back(p.begin(), p.end());
    }
    set_rank_processes(std::move(processes));
    begin("barrier", "the first collective (a world barrier)");
    try {
      groups[DTK_GROUP_WORLD]->barrier()->wait(timeout);
    } catch (const std::exception& e) {
      throw HostError("distributed: the first collective (a world barrier) failed: " + describe_comm_error(e));
    }
    done("barrier");
    return groups;
  } catch (const std::exception& e) {
    // A store error (c10::Error) gets the step's context; then the others hear of it (best
    // effort: the store may be what failed; the first failure stays, later ones do not replace
    // it) before this rank exits.
    const std::string message = dynamic_cast<const HostError*>(&e)
                                    ? dtk::one_line(e.what())
                                    : "distributed: " + current + " failed: " + short_error(e);
    try {
      const std::string why = mine + message;
      store->compareSet(kFailedKey, {}, std::vector<uint8_t>(why.begin(), why.end()));
    } catch (const std::exception&) {
    }
    throw HostError(message);
  }
}

}  // namespace

void init_distributed(const config::RunConfig& cfg, const std::vector<std::string>& description) {
  DistState& d = dist();
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.initialized) return;
  const auto& dc = cfg.distributed();
  d.timeout = std::chrono::seconds(dc.timeout_seconds() > 0 ? dc.timeout_seconds() : 300);
  const LaunchEnv le = launch_env_from_environment();
  const int tp = std::max(1, dc.tensor_model_parallel_size());
  const int pp = std::max(1, dc.pipeline_model_parallel_size());
  if (le.world_size % (tp * pp) != 0)
    throw HostError("distributed: world size " + std::to_string(le.world_size) +
                    " is not divisible by tensor x pipeline model parallel size " + std::to_string(tp * pp));
  const int ep = std::max(1, dc.expert_model_parallel_size());
  if ((le.world_size / (tp * pp)) % ep != 0)
    throw HostError("distributed: the data-parallel size " + std::to_string(le.world_size / (tp * pp)) +
                    " is not divisible by distributed.expert_model_parallel_size " + std::to_string(ep) +
                    " (expert parallelism splits the data-parallel ranks)");
  const int cp = std::max(1, dc.context_parallel_size());
  if ((le.world_size / (tp * pp)) % cp != 0)
    throw HostError("distributed: the data- x context-parallel size " + std::to_string(le.world_size / (tp * pp)) +
                    " (world size " + std::to_string(le.world_size) + " / tensor x pipeline model parallel size " +
                    std::to_string(tp * pp) + ") is not divisible by distributed.context_parallel_size " +
                    std::to_string(cp));
  const Topology t = topology_of(le, tp, pp, ep, cp);
  ProcessGroups groups;
  if (le.distributed) {
    const bool nccl = dc.backend() == "nccl";
    if (!dc.backend().empty() && dc.backend() != "gloo" && !nccl)
      throw HostError("distributed: unknown backend '" + dc.backend() + "' (gloo or nccl)");
    if (nccl && !training_device().is_cuda())
      throw HostError("distributed: backend nccl needs train.device=cuda (NCCL moves CUDA tensors; CPU runs use gloo)");
    route_broken_pipes();  // a peer lost while Gloo writes to it is an error line, not a silent death
    groups = start_world(le, t, description, d.timeout, d.store, nccl);
  }
  install_process_groups(t, std::move(groups), d.timeout);
  set_simulated_link(parse_simulated_link(dc.simulated_link()));
  d.initialized = true;
}

bool distributed_initialized() {
  std::lock_guard<std::mutex> lock(dist().mu);
  return dist().initialized;
}

void shutdown_distributed() {
  DistState& d = dist();
  c10::intrusive_ptr<GroupBackend> world;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    if (!d.initialized) return;
  }
  world = process_group(DTK_GROUP_WORLD);
  // Nobody leaves while a peer may still talk to it (rank 0 also serves the store).
  if (world) {
    try {
      world->barrier()->wait(d.timeout);
    } catch (const std::exception& e) {
      throw HostError("distributed: final barrier failed: " + short_error(e));
    }
  }
  nccl_backend::release();
  release_process_groups();
  std::lock_guard<std::mutex> lock(d.mu);
  d.store.reset();
  d.initialized = false;
}

}  // namespace dtk::core
