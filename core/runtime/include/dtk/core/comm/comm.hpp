// dtk/core/comm/comm.hpp — communication for host code: the process groups of this process
// (Megatron's layout, installed by init_distributed), and collectives over them with bounded
// waits. The ABI's dtk_comm_services (services.cpp) is a thin adapter over this API; host code
// calls it directly.
//
// Every collective is issued at once and returns a Work; wait() (or the Work's destructor) ends
// it, bounded by a timeout (the run's collective timeout by default). Groups of size one are the
// identity (no backend). Failures throw dtk::Error with DTK_ERR_COMM (collective failed or timed
// out) or DTK_ERR_INVALID_ARGUMENT (bad group, shape, op), one line naming the collective.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <dtk/abi.h>
#include <torch/csrc/api/include/torch/version.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace at {
class Tensor;
}
namespace c10d {
class Backend;
class ProcessGroup;
}

// An issued collective (the ABI's opaque dtk_comm_work): defined in comm/collectives.cpp.
struct dtk_comm_work;

namespace dtk::core {

// Ranks and sizes of the process groups of this process (Megatron's layout).
struct Topology {
  int world_rank = 0, world_size = 1;
  int tp_rank = 0, tp_size = 1;
  int pp_rank = 0, pp_size = 1;
  // The data-parallel group's: under context parallelism the data- and context-parallel ranks
  // together (Megatron's order tp-cp-dp-pp), the ranks that hold the same parameters.
  int dp_rank = 0, dp_size = 1;
  // Context parallelism splits the data-parallel group: runs of cp_size consecutive ranks split
  // each sequence (context-parallel rank dp_rank % cp_size); the runs read different samples
  // (data rank dp_rank / cp_size of data_size()).
  int cp_size = 1;
  int cp_rank() const { return dp_rank % cp_size; }
  int data_rank() const { return dp_rank / cp_size; }
  int data_size() const { return dp_size / cp_size; }
  // Expert parallelism splits the data-parallel group (Megatron's order tp-ep-dp-pp): expert-
  // parallel rank dp_rank % ep_size, expert-data-parallel rank dp_rank / ep_size.
  int ep_size = 1;
  int ep_rank() const { return dp_rank % ep_size; }
  int edp_rank() const { return dp_rank / ep_size; }
  int edp_size() const { return dp_size / ep_size; }
};

const Topology& topology();
// Rank of this process in `group` (a dtk_group) and the group's size; -1 for an unknown group.
int32_t group_rank(int32_t group);
int32_t group_size(int32_t group);

// What carries a group's collectives: LibTorch 1.13's c10d::ProcessGroup; in LibTorch 2.x the Gloo
// group is a c10d::Backend (ProcessGroup became a front end that dispatches to backends), with the
// same collective methods, which is all dtk calls.
#if TORCH_VERSION_MAJOR >= 2
using GroupBackend = c10d::Backend;
#else
using GroupBackend = c10d::ProcessGroup;
#endif

// The process group of `group`, or null when the group has size 1 (or distributed is off).
c10::intrusive_ptr<GroupBackend> process_group(int32_t group);
// The run's collective timeout (distributed.timeout_seconds; 300 s when unset).
std::chrono::milliseconds collective_timeout();

// Installed by init_distributed once the groups exist (indexed by dtk_group), released by
// shutdown_distributed. Without them every group larger than one has no backend.
// Every dtk_group, world to context-parallel.
inline constexpr size_t kNumGroups = 8;
using ProcessGroups = std::array<c10::intrusive_ptr<GroupBackend>, kNumGroups>;
void install_process_groups(const Topology& topology, ProcessGroups groups, std::chrono::milliseconds timeout);
void release_process_groups();
// The address each rank's backend listens on (indexed by world rank; numeric), so that a
// failed collective can name the peer behind an address in the backend's error.
void set_rank_addresses(std::vector<std::string> addresses);
// A backend's error in one line, naming the peer behind an address in it when the ranks'
// addresses are known ("... (the peer: rank 1 at 192.168.77.2)").
std::string describe_comm_error(const std::exception& e);
// Sets the layout alone (tests of group arithmetic; no backends).
void set_topology(const Topology& t);

// An issued collective. wait() finishes it on this rank (AVG division, chunk copies) once the
// backend completed; a Work dropped without wait() waits in its destructor (bounded, errors
// logged), so a result is never silently skipped.
class Work {
 public:
  explicit Work(std::unique_ptr<dtk_comm_work> work);
  Work(Work&& other) noexcept;
  Work& operator=(Work&&) = delete;
  ~Work();
  // Bounded: timeout <= 0 uses the run's collective timeout. Throws on failure or timeout.
  void wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // wait() for a collective issued to be waited at once: its whole duration counts as exposed
  // (CommTiming), even when it finished before the wait began (the issuing thread computed
  // nothing meanwhile).
  void wait_synchronous();
  // Hands the pending collective over (the ABI's async handle); finish it with complete().
  dtk_comm_work* release();
  // Finishes a released collective (same semantics as wait()).
  static void complete(dtk_comm_work& work, std::chrono::milliseconds timeout);
  // Frees a released collective without finishing it (after complete(), or to abandon it).
  static void discard(dtk_comm_work* work);

 private:
  std::unique_ptr<dtk_comm_work> work_;
};

// Collectives (issue; call wait() on the result). `op` is a dtk_reduce_op.
Work all_reduce(const at::Tensor& inout, int32_t group, int32_t op = DTK_REDUCE_SUM);
Work broadcast(const at::Tensor& inout, int32_t group, int32_t root);
// out = [size(group) * n, ...] gathered along dim 0 in rank order from in = [n, ...].
Work all_gather(const at::Tensor& out, const at::Tensor& in, int32_t group);
// in = [size(group) * n, ...]; rank r receives reduced chunk r into out = [n, ...].
Work reduce_scatter(const at::Tensor& out, const at::Tensor& in, int32_t group, int32_t op = DTK_REDUCE_SUM);
// Personalised exchange (an MoE layer's token dispatch): this rank sends in's rows in size(group)
// consecutive parts, in_splits[j] rows to rank j, and receives rank j's part into out
// (out_splits[j] rows), in rank order. Empty splits: equal parts of in and out.
Work all_to_all(const at::Tensor& out, const at::Tensor& in, int32_t group, std::vector<int64_t> out_splits = {},
                std::vector<int64_t> in_splits = {});
// Synchronous, bounded by the collective timeout.
void barrier(int32_t group);
// Point to point inside `group` (pipeline stages: activations forward, their gradients back):
// `peer` is a rank of the group. Messages between two ranks with one tag arrive in the order
// they were sent. recv fills `out` (its shape and dtype agreed beforehand) once waited.
Work send(const at::Tensor& in, int32_t group, int32_t peer, int32_t tag = 0);
Work recv(const at::Tensor& out, int32_t group, int32_t peer, int32_t tag = 0);

// Bytes this rank sent on a group since the last reset_traffic(), per kind of collective, as the
// algorithms move them (N = group size, b = the tensor's bytes): ring all-reduce 2 (N-1)/N b;
// reduce-scatter (N-1)/N of the input; all-gather (N-1)/N of the output; broadcast b from the root
// (pipelined); all-to-all the rows sent to other ranks; send b. Counted when a collective is
// issued; groups of one send nothing.
struct Traffic {
  int64_t all_reduce = 0, reduce_scatter = 0, all_gather = 0, broadcast = 0;
  int64_t point_to_point = 0;  // send: the tensor's bytes (pipeline stages' activations and gradients)
  int64_t all_to_all = 0;      // MoE token dispatch (moe_token_dispatcher=alltoall)
  int64_t total() const { return all_reduce + reduce_scatter + all_gather + broadcast + point_to_point + all_to_all; }
};
Traffic traffic(int32_t group);
void reset_traffic();

// How long collectives took and how much of it the issuing thread waited, per group, since the
// last reset_comm_timing(): `in_flight_ms` is the union of the intervals from each collective's
// issue to its completion (overlapping collectives count once), `exposed_ms` the time spent
// blocked in wait() until the collective completed — communication not hidden behind computation
// (the thread's wake-up after the completion is not counted). Synchronous collectives are
// exposed for their whole duration.
struct CommTiming {
  double in_flight_ms = 0, exposed_ms = 0;
  int64_t collectives = 0;
};
CommTiming comm_timing(int32_t group);
// Several groups' together: the union of their intervals, the sum of the waits.
CommTiming comm_timing(const std::vector<int32_t>& groups);
void reset_comm_timing();

// A simulated link (distributed.simulated_link, a study tool, off by default): each collective on
// a group larger than one completes no earlier than latency + bytes / bandwidth after the link
// became free, bytes being what this rank sends (the traffic counters' figure), one message at a
// time per group, as on one link. The real transfer runs as usual, so a collective takes the
// longer of the two. A point-to-point message: the send books the link from its issue, and the
// receive sees the message latency + bytes / bandwidth after it really arrived (one clock per
// process: the sender's issue time is not the receiver's to read). Parsed from
// "<latency>,<bandwidth>", e.g. "25us,50GBps": latency in ns|us|ms|s, bandwidth in
// Bps|KBps|MBps|GBps (bytes, decimal) or bps|Kbps|Mbps|Gbps (bits).
struct SimulatedLink {
  double latency_s = 0, bytes_per_s = 0;  // bytes_per_s == 0: no link
  bool enabled() const { return bytes_per_s > 0; }
};
// Throws dtk::Error (one line naming distributed.simulated_link) on a malformed spec.
SimulatedLink parse_simulated_link(const std::string& spec);
void set_simulated_link(const SimulatedLink& link);

// World-wide MAX of `value` through a bounded collective (the identity for one process): a
// barrier that also carries a flag or a number. `what` names the wait in a failure.
int64_t world_max(int64_t value, const Topology& topo, const char* what);

// After a step every rank ran: throws this rank's `error` if it has one, else `others_failed`
// (default "<what>: another rank failed (its error is above)") if any rank failed.
void agree(const std::string& error, const Topology& topo, const char* what, const std::string& others_failed = "");

}  // namespace dtk::core
