// Collectives over this process's group layout (dtk/core/comm/comm.hpp): groups of size one are the
// identity (no store, no process group); larger groups run on the Gloo process groups that
// init_distributed (distributed.cpp) created and installed here.
//
// What Gloo lacks is built here:
//   AVG          SUM followed by a division by the group size (Gloo has no AVG reduction).
//   bf16         copies (all_gather, broadcast) move bf16 bits as fp16; reductions run on an fp32
//                copy rounded back once (Gloo in LibTorch 1.13 has no bf16 type).
//   reduce_scatter  a ring over point-to-point send/recv (comm/ring.cpp): c10d's Gloo emulates it
//                with an all-reduce, twice the traffic at best; the ring sends (N-1)/N of the input,
//                the bandwidth-optimal volume. Other backends (NCCL) use their native one.
//
// CUDA tensors (train.device=cuda): with distributed.backend=nccl the collectives go to the
// group's NCCL communicator (comm/nccl_backend.cpp), finished on the device; otherwise (Gloo, and
// point-to-point messages, which NCCL's stream order cannot tag) they run on host copies, copied
// back when the collective completed.
#include <glog/logging.h>
#include <torch/csrc/api/include/torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <dtk/plugin.hpp>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <typeindex>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/comm/peer_processes.hpp"
#include "dtk/core/timeline/trace.hpp"
#include "dtk/host/error.hpp"
#include "nccl_backend.hpp"
#include "ring.hpp"
#include "timing.hpp"

// An issued collective: a c10d work, or a task on the communication thread (ring collectives),
// or neither for an identity collective; `then` finishes the result on this rank (AVG division,
// copy back into a non-contiguous or bf16 tensor) once the collective completed.
// Timing (comm.hpp CommTiming): issue time, the backend's completion time (set from its thread),
// and when the simulated link, if any, lets the collective complete.
struct dtk_comm_work {
  c10::intrusive_ptr<c10d::Work> work;
  std::shared_future<void> task;
  int64_t group_size = 1;
  std::function<void()> then;
  // An NCCL collective (nccl_backend.hpp): makes LibTorch's stream wait for it on the device. The
  // host does not block, so its time is not in CommTiming (nor in the trace): that is the GPU's
  // timeline (Nsight Systems), not the host's.
  std::function<void()> device_finish;
  std::string what;
  int32_t group = -1;
  int64_t issued_ns = 0, link_done_ns = 0;
  // A receive under the simulated link: the message's bytes, booked on the link when the data
  // arrived (the sender's clock is not this process's to read).
  int64_t link_bytes_on_arrival = 0;
  bool synchronous = false;  // waited right after the issue: exposed from the issue on
  std::shared_ptr<std::atomic<int64_t>> done_ns = std::make_shared<std::atomic<int64_t>>(0);
};

namespace dtk::core {
namespace {

struct CommState {
  std::mutex mu;
  Topology topo;
  ProcessGroups groups;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  std::vector<std::string> rank_addresses;  // set_rank_addresses
  std::vector<std::string> rank_processes;  // set_rank_processes
  std::set<std::type_index> futureless_types;  // works whose getFuture() throws (watch)
};

CommState& state() {
  static CommState* s = new CommState();  // never destroyed: worker threads may outlive main
  return *s;
}

// Traffic counters per group (dtk/core/comm/comm.hpp).
enum TrafficKind {
  kAllReduce = 0,
  kReduceScatter = 1,
  kAllGather = 2,
  kBroadcast = 3,
  kPointToPoint = 4,
  kAllToAll = 5,
  kTrafficKinds = 6
};
std::atomic<int64_t> g_traffic[kNumGroups][kTrafficKinds];

// Counts `bytes` this rank sends and books the simulated link for `link_bytes` of them.
void count_bytes(dtk_comm_work& w, TrafficKind kind, int64_t bytes, int64_t link_bytes) {
  const int32_t group = w.group;
  if (group < 0 || group >= static_cast<int32_t>(kNumGroups)) return;
  g_traffic[group][kind] += bytes;
  w.link_done_ns = comm_timing_detail::reserve_link(group, link_bytes, w.issued_ns);
}

// Counts what this rank sends and books the simulated link for `link_share` of the tensor's bytes
// (a broadcast's receivers wait for the message too).
void count(dtk_comm_work& w, TrafficKind kind, const at::Tensor& t, double share, double link_share = -1) {
  const double bytes = static_cast<double>(t.numel() * t.element_size());
  count_bytes(w, kind, static_cast<int64_t>(share * bytes),
              static_cast<int64_t>((link_share < 0 ? share : link_share) * bytes));
}

// Whether works of this dynamic type have no future, and learning that one has none (LibTorch
// 1.13's Gloo send and receive works throw from getFuture()). Asked once per type: LibTorch builds
// each of its errors with a symbolised backtrace, a few milliseconds of dladdr scans over its
// symbol tables, which a pipeline paid on every send and receive.
bool has_no_future(const c10d::Work& work) {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().futureless_types.count(typeid(work)) > 0;
}
void mark_no_future(const c10d::Work& work) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().futureless_types.insert(typeid(work));
}

// Notes when the backend finished (from its thread); without a future, wait() notes it.
void watch(dtk_comm_work& w) {
  if (has_no_future(*w.work)) return;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  try {
    future = w.work->getFuture();
  } catch (const std::exception&) {
    mark_no_future(*w.work);
    return;
  }
  auto done = w.done_ns;
  future->addCallback([done](c10::ivalue::Future&) { *done = trace::now_ns(); });
}
double ring_share(int64_t n) { return static_cast<double>(n - 1) / static_cast<double>(n); }

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// The size of `group`, refusing an unknown one.
int64_t checked_size(int32_t group) {
  const int32_t n = group_size(group);
  if (n <= 0) throw dtk::Error("unknown process group " + std::to_string(group), DTK_ERR_INVALID_ARGUMENT);
  return n;
}

// The process group behind `group`, or null for a size-one group. Throws when a larger group
// has none (the distributed backend was not initialized).
c10::intrusive_ptr<GroupBackend> pg_of(int32_t group) {
  if (checked_size(group) == 1) return {};
  auto pg = process_group(group);
  if (!pg)
    throw dtk::Error("process group " + std::to_string(group) + " has no backend (distributed not initialized)",
                     DTK_ERR_COMM);
  return pg;
}

// "rank 1 at 192.168.77.2" (or "one of ranks 2, 3 at ...") for the first peer address in a
// backend's error, e.g. Gloo's "Connection closed by peer [192.168.77.2]:36484"; "" if none.
std::string peer_of(const std::string& message) {
  std::vector<std::string> addresses;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    addresses = state().rank_addresses;
  }
  for (size_t open = message.find('['); open != std::string::npos; open = message.find('[', open + 1)) {
    const size_t close = message.find(']', open);
    if (close == std::string::npos) break;
    const std::string address = message.substr(open + 1, close - open - 1);
    std::string ranks;
    std::vector<int> candidates;
    int n = 0;
    for (size_t r = 0; r < addresses.size(); ++r)
      if (addresses[r] == address)
        ranks += (n++ ? ", " : "") + std::to_string(r), candidates.push_back(static_cast<int>(r));
    if (n == 1) return "rank " + ranks + " at " + address;
    if (n > 1) {
      // Ranks of one machine share its address: the one whose process ended is the peer.
      std::vector<int> ended = ended_ranks(candidates);
      // A killed peer's sockets close while its process is still exiting (not yet a zombie):
      // give it a moment to be marked ended. An error path; at most a second.
      for (int tries = 0; ended.empty() && tries < 50; ++tries) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        ended = ended_ranks(candidates);
      }
      if (ended.size() == 1) return "rank " + std::to_string(ended[0]) + " at " + address + ", whose process has ended";
      return "one of ranks " + ranks + " at " + address;
    }
  }
  return "";
}

}  // namespace

std::string describe_comm_error(const std::exception& e) {
  const auto* ce = dynamic_cast<const c10::Error*>(&e);
  const std::string message = dtk::one_line(ce ? ce->what_without_backtrace() : e.what());
  const std::string peer = peer_of(message);
  return peer.empty() ? message : message + " (the peer: " + peer + ")";
}

namespace {

c10d::ReduceOp reduce_op(int32_t op) {
  switch (op) {
    case DTK_REDUCE_SUM:
    case DTK_REDUCE_AVG:
      return c10d::ReduceOp::SUM;
    case DTK_REDUCE_MAX:
      return c10d::ReduceOp::MAX;
    case DTK_REDUCE_MIN:
      return c10d::ReduceOp::MIN;
    default:
      throw dtk::Error("unknown reduce op " + std::to_string(op), DTK_ERR_INVALID_ARGUMENT);
  }
}

void divide_by(const at::Tensor& t, int64_t n) { t.div_(static_cast<double>(n)); }

// An average of integers has no single right rounding (floor? truncation as NCCL?): refused.
void check_avg(int32_t op, const at::Tensor& t) {
  if (op == DTK_REDUCE_AVG && !at::isFloatingType(t.scalar_type()))
    throw dtk::Error("AVG reduction needs a floating-point tensor (reduce integers with SUM)",
                     DTK_ERR_INVALID_ARGUMENT);
}

// Gloo needs dense contiguous buffers: a non-contiguous tensor is reduced in a contiguous copy
// that is copied back when the collective completes. A bf16 tensor is reduced in an fp32 copy
// (Gloo has no bf16 type), rounded back once.
at::Tensor contiguous_buffer(const at::Tensor& t, std::function<void()>* copy_back) {
  const bool bf16 = t.scalar_type() == at::kBFloat16;
  if (t.is_contiguous() && !bf16) return t;
  at::Tensor buf = bf16 ? t.to(at::kFloat).contiguous() : t.contiguous();
  *copy_back = [t, buf] { t.copy_(buf); };
  return buf;
}

// Copies move bits: a bf16 tensor travels as fp16 (same size; Gloo has neither bf16 nor int16 and
// copies fp16 without reading it).
at::Tensor bits(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t; }

// A tensor a copy collective writes into: `t` when contiguous, else a contiguous copy that is copied
// into `t` when the collective completes (set in *copy_back).
at::Tensor receiving_buffer(const at::Tensor& t, std::function<void()>* copy_back) {
  if (t.is_contiguous()) return t;
  at::Tensor buf = t.contiguous();
  *copy_back = [t, buf] { t.copy_(buf); };
  return buf;
}

// Shapes: output = [size * n, rest...] where input = [n, rest...] (reduce_scatter: swapped).
void check_gather_shapes(const char* what, const at::Tensor& big, const at::Tensor& small, int64_t size) {
  bool ok = big.dim() >= 1 && big.dim() == small.dim() && big.size(0) == size * small.size(0) &&
            big.scalar_type() == small.scalar_type();
  for (int64_t d = 1; ok && d < big.dim(); ++d) ok = big.size(d) == small.size(d);
  if (!ok)
    throw dtk::Error(std::string(what) + ": tensors " + shape_str(big) + " and " + shape_str(small) +
                         " do not fit a group of " + std::to_string(size) +
                         " (first dimension x group size, same dtype)",
                     DTK_ERR_INVALID_ARGUMENT);
}

std::unique_ptr<dtk_comm_work> pending(const char* what, int32_t group) {
  auto w = std::make_unique<dtk_comm_work>();
  w->what = std::string(what) + " on group " + std::to_string(group);
  w->group = group;
  w->issued_ns = trace::now_ns();
  return w;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Groups
// ---------------------------------------------------------------------------------------------

const Topology& topology() { return state().topo; }

void set_topology(const Topology& t) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().topo = t;
}

int32_t group_rank(int32_t group) {
  const Topology& t = state().topo;
  switch (group) {
    case DTK_GROUP_WORLD:
      return t.world_rank;
    case DTK_GROUP_DATA_PARALLEL:
      return t.dp_rank;
    case DTK_GROUP_TENSOR_PARALLEL:
      return t.tp_rank;
    case DTK_GROUP_PIPELINE_PARALLEL:
      return t.pp_rank;
    case DTK_GROUP_MODEL_PARALLEL:
      return t.pp_rank * t.tp_size + t.tp_rank;
    case DTK_GROUP_EXPERT_PARALLEL:
      return t.ep_rank();
    case DTK_GROUP_EXPERT_DATA_PARALLEL:
      return t.edp_rank();
    case DTK_GROUP_CONTEXT_PARALLEL:
      return t.cp_rank();
    default:
      return -1;
  }
}

int32_t group_size(int32_t group) {
  const Topology& t = state().topo;
  switch (group) {
    case DTK_GROUP_WORLD:
      return t.world_size;
    case DTK_GROUP_DATA_PARALLEL:
      return t.dp_size;
    case DTK_GROUP_TENSOR_PARALLEL:
      return t.tp_size;
    case DTK_GROUP_PIPELINE_PARALLEL:
      return t.pp_size;
    case DTK_GROUP_MODEL_PARALLEL:
      return t.pp_size * t.tp_size;
    case DTK_GROUP_EXPERT_PARALLEL:
      return t.ep_size;
    case DTK_GROUP_EXPERT_DATA_PARALLEL:
      return t.edp_size();
    case DTK_GROUP_CONTEXT_PARALLEL:
      return t.cp_size;
    default:
      return -1;
  }
}

c10::intrusive_ptr<GroupBackend> process_group(int32_t group) {
  if (group < 0 || group >= static_cast<int32_t>(kNumGroups)) return {};
  std::lock_guard<std::mutex> lock(state().mu);
  return state().groups[static_cast<size_t>(group)];
}

std::chrono::milliseconds collective_timeout() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().timeout;
}

void install_process_groups(const Topology& topology, ProcessGroups groups, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().topo = topology;
  state().groups = std::move(groups);
  state().timeout = timeout;
}

void set_rank_addresses(std::vector<std::string> addresses) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().rank_addresses = std::move(addresses);
}

namespace {
std::string host_name() {
  char name[256] = {0};
  if (::gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}
}  // namespace

std::string this_process_identity() { return host_name() + " " + std::to_string(::getpid()); }

void set_rank_processes(std::vector<std::string> identities) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().rank_processes = std::move(identities);
}

std::vector<int> ended_ranks(const std::vector<int>& ranks) {
  std::vector<std::string> processes;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    processes = state().rank_processes;
  }
  const std::string here = host_name() + " ";
  std::vector<int> ended;
  for (int r : ranks) {
    if (r < 0 || static_cast<size_t>(r) >= processes.size() || processes[r].rfind(here, 0) != 0) continue;
    const std::string pid = processes[r].substr(here.size());
    // /proc/PID/stat: "PID (comm) S ...": gone, or Z (zombie) / X (dead).
    std::ifstream stat("/proc/" + pid + "/stat");
    std::string text;
    std::getline(stat, text);
    const size_t close = text.rfind(')');
    const char state_char = close != std::string::npos && close + 2 < text.size() ? text[close + 2] : '?';
    if (!stat || text.empty() || state_char == 'Z' || state_char == 'X') ended.push_back(r);
  }
  return ended;
}

void release_process_groups() {
  std::lock_guard<std::mutex> lock(state().mu);
  for (auto& g : state().groups) g.reset();
}

// ---------------------------------------------------------------------------------------------
// Work
// ---------------------------------------------------------------------------------------------

Work::Work(std::unique_ptr<dtk_comm_work> work) : work_(std::move(work)) {}
Work::Work(Work&& other) noexcept : work_(std::move(other.work_)) {}
Work::~Work() {
  if (!work_) return;
  try {
    complete(*work_, collective_timeout());
  } catch (const std::exception& e) {
    LOG(ERROR) << e.what();
  }
}

void Work::wait(std::chrono::milliseconds timeout) {
  if (!work_) return;
  std::unique_ptr<dtk_comm_work> w = std::move(work_);
  complete(*w, timeout);
}

void Work::wait_synchronous() {
  if (work_) work_->synchronous = true;
  wait();
}

dtk_comm_work* Work::release() { return work_.release(); }

void Work::discard(dtk_comm_work* work) {
  // An abandoned NCCL collective still gets LibTorch's stream to wait for it (no host wait): the
  // buffers it holds go back to the caching allocator only after the device is done with them.
  if (work && work->device_finish) {
    try {
      work->device_finish();
    } catch (const std::exception& e) {
      LOG(ERROR) << work->what << ": " << e.what();
    }
  }
  delete work;
}

void Work::complete(dtk_comm_work& w, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) timeout = collective_timeout();
  static const char* const kGroupNames[kNumGroups] = {
      "world",          "data parallel",   "tensor parallel",      "pipeline parallel",
      "model parallel", "expert parallel", "expert data parallel", "context parallel"};
  const std::string limit =
      " (" + std::string(w.group >= 0 && w.group < static_cast<int32_t>(kNumGroups) ? kGroupNames[w.group] : "?") +
      " group, timeout " + std::to_string(timeout.count()) + " ms)";
  const bool timed = w.work || w.task.valid();
  const int64_t wait_start = w.synchronous ? w.issued_ns : trace::now_ns();
  if (w.work) {
    try {
      w.work->wait(timeout);
    } catch (const std::exception& e) {
      throw dtk::Error(w.what + " failed: " + describe_comm_error(e) + limit, DTK_ERR_COMM);
    }
    w.work.reset();
  }
  if (w.task.valid()) {
    // A ring task makes 2 (N - 1) message waits, each bounded by the timeout, and may queue behind
    // one more in-flight task: this bound covers both without cutting a slow, healthy ring short.
    const auto bound = timeout * (4 * std::max<int64_t>(1, w.group_size)) + std::chrono::seconds(5);
    if (w.task.wait_for(bound) != std::future_status::ready)
      throw dtk::Error(w.what + " failed: timed out" + limit, DTK_ERR_COMM);
    try {
      w.task.get();
    } catch (const std::exception& e) {
      throw dtk::Error(w.what + " failed: " + describe_comm_error(e) + limit, DTK_ERR_COMM);
    }
    w.task = {};
  }
  if (w.device_finish) {
    auto finish = std::move(w.device_finish);
    w.device_finish = nullptr;
    try {
      finish();
    } catch (const std::exception& e) {
      throw dtk::Error(w.what + " failed: " + dtk::one_line(e.what()) + limit, DTK_ERR_COMM);
    }
  }
  if (timed) {
    int64_t done = w.done_ns->load();
    if (done == 0) done = trace::now_ns();
    if (w.link_bytes_on_arrival > 0)
      w.link_done_ns = comm_timing_detail::reserve_link(w.group, w.link_bytes_on_arrival, done);
    if (w.link_done_ns > done) {
      // The simulated link's delay is a wait like any other: bounded by the timeout.
      const int64_t left = w.link_done_ns - trace::now_ns();
      if (left > std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count())
        throw dtk::Error(w.what + " failed: the simulated link (distributed.simulated_link) needs " +
                             std::to_string(left / 1000000) + " ms more" + limit,
                         DTK_ERR_COMM);
      if (left > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(left));
      done = w.link_done_ns;
    }
    const int64_t wait_end = trace::now_ns();
    // Exposed is the time blocked while the collective was in flight: the thread's wake-up after
    // the completion (a sleep's overshoot, a busy machine's scheduling delay) is not communication,
    // and counting it let a loaded machine report more exposed than in-flight time.
    const int64_t blocked = std::max<int64_t>(0, std::min(wait_end, std::max(done, wait_start)) - wait_start);
    comm_timing_detail::record(w.group, w.issued_ns, done, blocked);
    if (trace::active()) {
      trace::collective(w.what, w.group, w.issued_ns, done);
      trace::span(("wait " + w.what).c_str(), "wait", wait_start, wait_end);
    }
  }
  if (w.then) {
    auto then = std::move(w.then);
    w.then = nullptr;
    then();
  }
}

// ---------------------------------------------------------------------------------------------
// Collectives
// ---------------------------------------------------------------------------------------------

namespace {
// A CUDA tensor on a group larger than one without an NCCL communicator: the collective runs on
// host copies (Gloo moves host memory), and the result is copied back once it completed.
bool on_host(const at::Tensor& t, int32_t group) {
  return t.defined() && t.is_cuda() && group_size(group) > 1 && !nccl_backend::handles(t, group);
}
// The same for an output/input pair: host copies unless both go to NCCL (a CUDA output with a host
// input, or the reverse, is staged too).
bool on_host(const at::Tensor& out, const at::Tensor& in, int32_t group) {
  return on_host(out, group) || on_host(in, group) || (group_size(group) > 1 && out.is_cuda() != in.is_cuda());
}
Work then_copy_back(Work w, const at::Tensor& device, const at::Tensor& host) {
  dtk_comm_work* raw = w.release();
  auto first = std::move(raw->then);
  raw->then = [first, device, host] {
    at::NoGradGuard ng;
    if (first) first();
    device.copy_(host);
  };
  return Work(std::unique_ptr<dtk_comm_work>(raw));
}
at::Tensor host_copy(const at::Tensor& t) { return t.to(at::kCPU); }
}  // namespace

Work all_reduce(const at::Tensor& x, int32_t group, int32_t op) {
  at::NoGradGuard ng;
  const c10d::ReduceOp rop = reduce_op(op);
  if (on_host(x, group)) {
    const at::Tensor h = host_copy(x);
    return then_copy_back(all_reduce(h, group, op), x, h);
  }
  auto w = pending("all_reduce", group);
  if (nccl_backend::handles(x, group)) {
    checked_size(group);
    check_avg(op, x);  // as on Gloo: AVG of integers is refused
    w->device_finish = nccl_backend::all_reduce(x, group, op);
    count(*w, kAllReduce, x, 2 * ring_share(group_size(group)));
  } else if (auto pg = pg_of(group)) {
    std::function<void()> copy_back;
    at::Tensor buf = contiguous_buffer(x, &copy_back);
    std::vector<at::Tensor> v{buf};
    c10d::AllreduceOptions o;
    o.reduceOp = rop;
    o.timeout = collective_timeout();
    w->work = pg->allreduce(v, o);
    watch(*w);
    const int64_t n = pg->getSize();
    count(*w, kAllReduce, buf, 2 * ring_share(n));
    check_avg(op, buf);
    const bool avg = op == DTK_REDUCE_AVG;
    if (avg || copy_back)
      w->then = [buf, avg, n, copy_back] {
        at::NoGradGuard ng2;
        if (avg) divide_by(buf, n);
        if (copy_back) copy_back();
      };
  }
  return Work(std::move(w));
}

Work broadcast(const at::Tensor& x, int32_t group, int32_t root) {
  at::NoGradGuard ng;
  if (root < 0 || root >= checked_size(group))
    throw dtk::Error("broadcast: bad tensor or source rank", DTK_ERR_INVALID_ARGUMENT);
  if (on_host(x, group)) {
    const at::Tensor h = host_copy(x);
    return then_copy_back(broadcast(h, group, root), x, h);
  }
  auto w = pending("broadcast", group);
  if (nccl_backend::handles(x, group)) {
    w->device_finish = nccl_backend::broadcast(x, group, root);
    count(*w, kBroadcast, x, group_rank(group) == root ? 1.0 : 0.0, 1.0);
  } else if (auto pg = pg_of(group)) {
    std::function<void()> copy_back;
    const at::Tensor buf = receiving_buffer(x, &copy_back);
    std::vector<at::Tensor> v{bits(buf)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = collective_timeout();
    w->work = pg->broadcast(v, o);
    watch(*w);
    count(*w, kBroadcast, buf, pg->getRank() == root ? 1.0 : 0.0, 1.0);
    w->then = copy_back;
  }
  return Work(std::move(w));
}

namespace {
// A point-to-point message needs a tensor and another rank of the group.
void check_peer(const char* what, const at::Tensor& x, int32_t group, int32_t peer) {
  const int64_t size = checked_size(group);
  if (!x.defined() || peer < 0 || peer >= size || peer == group_rank(group))
    throw dtk::Error(std::string(what) + ": bad tensor or peer rank " + std::to_string(peer) + " (group of " +
                         std::to_string(size) + ")",
                     DTK_ERR_INVALID_ARGUMENT);
}
}  // namespace

Work send(const at::Tensor& x, int32_t group, int32_t peer, int32_t tag) {
  at::NoGradGuard ng;
  check_peer("send", x, group, peer);
  if (x.is_cuda()) return send(host_copy(x), group, peer, tag);  // the host copy lives until the send completed
  auto w = pending(("send to rank " + std::to_string(peer)).c_str(), group);
  if (auto pg = pg_of(group)) {
    const at::Tensor buf = bits(x.contiguous());
    std::vector<at::Tensor> v{buf};
    w->work = pg->send(v, peer, tag);
    watch(*w);
    count(*w, kPointToPoint, buf, 1.0);
    w->then = [buf] {};  // the message's memory lives until the send completed
  }
  return Work(std::move(w));
}

Work recv(const at::Tensor& x, int32_t group, int32_t peer, int32_t tag) {
  at::NoGradGuard ng;
  check_peer("recv", x, group, peer);
  if (x.is_cuda()) {
    const at::Tensor h = at::empty(x.sizes(), x.options().device(at::kCPU));
    return then_copy_back(recv(h, group, peer, tag), x, h);
  }
  auto w = pending(("recv from rank " + std::to_string(peer)).c_str(), group);
  if (auto pg = pg_of(group)) {
    std::function<void()> copy_back;
    at::Tensor buf = x;
    if (!x.is_contiguous()) {
      buf = at::empty_like(x, at::MemoryFormat::Contiguous);
      copy_back = [x, buf] { x.copy_(buf); };
    }
    std::vector<at::Tensor> v{bits(buf)};
    w->work = pg->recv(v, peer, tag);
    watch(*w);
    w->link_bytes_on_arrival = static_cast<int64_t>(buf.numel() * buf.element_size());
    w->then = [buf, copy_back] {
      if (copy_back) copy_back();
    };
  }
  return Work(std::move(w));
}

Work all_gather(const at::Tensor& o, const at::Tensor& i, int32_t group) {
  at::NoGradGuard ng;
  const int64_t n = checked_size(group);
  check_gather_shapes("all_gather", o, i, n);
  if (on_host(o, i, group)) {
    const at::Tensor h = at::empty(o.sizes(), o.options().device(at::kCPU));
    return then_copy_back(all_gather(h, host_copy(i), group), o, h);
  }
  auto w = pending("all_gather", group);
  if (nccl_backend::handles(o, group) && i.is_cuda()) {
    w->device_finish = nccl_backend::all_gather(o, i, group);
    count(*w, kAllGather, o, ring_share(n));
  } else if (auto pg = pg_of(group)) {
    std::function<void()> copy_back;
    const at::Tensor buf = receiving_buffer(o, &copy_back);
    std::vector<std::vector<at::Tensor>> outs(1);
    for (const at::Tensor& c : bits(buf).chunk(n, 0)) outs[0].push_back(c);  // views: rank order
    std::vector<at::Tensor> ins{bits(i.contiguous())};
    c10d::AllgatherOptions opt;
    opt.timeout = collective_timeout();
    w->work = pg->allgather(outs, ins, opt);
    watch(*w);
    count(*w, kAllGather, o, ring_share(n));
    w->then = copy_back;
  } else {
    o.copy_(i);
  }
  return Work(std::move(w));
}

Work reduce_scatter(const at::Tensor& o, const at::Tensor& i, int32_t group, int32_t op) {
  at::NoGradGuard ng;
  const int64_t n = checked_size(group);
  check_gather_shapes("reduce_scatter", i, o, n);
  const c10d::ReduceOp rop = reduce_op(op);
  check_avg(op, i);
  if (on_host(o, i, group)) {
    const at::Tensor h = at::empty(o.sizes(), o.options().device(at::kCPU));
    return then_copy_back(reduce_scatter(h, host_copy(i), group, op), o, h);
  }
  auto w = pending("reduce_scatter", group);
  if (nccl_backend::handles(o, group) && i.is_cuda()) {
    count(*w, kReduceScatter, i, ring_share(n));
    w->device_finish = nccl_backend::reduce_scatter(o, i, group, op);
    return Work(std::move(w));
  }
  auto pg = pg_of(group);
  if (!pg) {
    o.copy_(i);
    return Work(std::move(w));
  }
  const bool avg = op == DTK_REDUCE_AVG;
  count(*w, kReduceScatter, i, ring_share(n));
  // The result lands in a contiguous buffer of the output's dtype (fp32 for bf16), copied into
  // the output when the collective completes.
  std::function<void()> copy_back;
  const at::Tensor out = contiguous_buffer(o, &copy_back);
  const at::Tensor in = out.scalar_type() == i.scalar_type() ? i.contiguous() : i.to(out.scalar_type()).contiguous();
  if (pg->getBackendName() == "gloo") {
    const uint32_t tag = ring::next_tag(group);
    const auto timeout = collective_timeout();
    w->group_size = n;
    // The task keeps the group and both buffers alive until it ran.
    auto done = w->done_ns;
    w->task = ring::run_async([pg, out, in, rop, tag, timeout, done] {
      ring::reduce_scatter(*pg, out, in, rop, tag, timeout);
      *done = trace::now_ns();
    });
  } else {
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> ins(1);
    for (const at::Tensor& c : in.chunk(n, 0)) ins[0].push_back(c);
    c10d::ReduceScatterOptions opt;
    opt.reduceOp = rop;
    opt.timeout = collective_timeout();
    w->work = pg->reduce_scatter(outs, ins, opt);
    watch(*w);
  }
  if (avg || copy_back)
    w->then = [out, avg, n, copy_back] {
      at::NoGradGuard ng2;
      if (avg) divide_by(out, n);
      if (copy_back) copy_back();
    };
  return Work(std::move(w));
}

namespace {
// Shapes of an all-to-all: same dtype and trailing dimensions, one split per group rank, none
// negative, summing to each tensor's rows. Empty splits become equal parts (refused where the
// rows do not divide).
void check_all_to_all(const at::Tensor& out, const at::Tensor& in, int64_t size, std::vector<int64_t>& out_splits,
                      std::vector<int64_t>& in_splits) {
  bool ok =
      out.defined() && in.defined() && out.dim() >= 1 && out.dim() == in.dim() && out.scalar_type() == in.scalar_type();
  for (int64_t d = 1; ok && d < out.dim(); ++d) ok = out.size(d) == in.size(d);
  if (!ok)
    throw dtk::Error("all_to_all: tensors " + (out.defined() ? shape_str(out) : "(none)") + " and " +
                         (in.defined() ? shape_str(in) : "(none)") + " differ past the first dimension or in dtype",
                     DTK_ERR_INVALID_ARGUMENT);
  for (auto [splits, t, name] :
       {std::tuple<std::vector<int64_t>*, const at::Tensor*, const char*>{&out_splits, &out, "output"},
        {&in_splits, &in, "input"}}) {
    if (splits->empty()) {
      if (t->size(0) % size != 0)
        throw dtk::Error(std::string("all_to_all: the ") + name + "'s " + std::to_string(t->size(0)) +
                             " rows do not split equally over a group of " + std::to_string(size),
                         DTK_ERR_INVALID_ARGUMENT);
      splits->assign(static_cast<size_t>(size), t->size(0) / size);
      continue;
    }
    int64_t sum = 0;
    bool valid = static_cast<int64_t>(splits->size()) == size;
    for (int64_t s : *splits) valid = valid && s >= 0, sum += s;
    if (!valid || sum != t->size(0))
      throw dtk::Error(std::string("all_to_all: the ") + name + " splits (" + std::to_string(splits->size()) +
                           " of them, summing to " + std::to_string(sum) + ") are not one per rank of a group of " +
                           std::to_string(size) + " summing to its " + std::to_string(t->size(0)) + " rows",
                       DTK_ERR_INVALID_ARGUMENT);
  }
}
}  // namespace

Work all_to_all(const at::Tensor& o, const at::Tensor& i, int32_t group, std::vector<int64_t> out_splits,
                std::vector<int64_t> in_splits) {
  at::NoGradGuard ng;
  const int64_t n = checked_size(group);
  check_all_to_all(o, i, n, out_splits, in_splits);
  if (on_host(o, i, group)) {
    const at::Tensor h = at::empty(o.sizes(), o.options().device(at::kCPU));
    return then_copy_back(all_to_all(h, host_copy(i), group, out_splits, in_splits), o, h);
  }
  auto w = pending("all_to_all", group);
  // What leaves this rank: every part but its own.
  const int64_t row_bytes = i.size(0) > 0 ? i.numel() / i.size(0) * i.element_size() : 0;
  const int64_t sent = (i.size(0) - in_splits[static_cast<size_t>(group_rank(group))]) * row_bytes;
  if (nccl_backend::handles(o, group) && i.is_cuda()) {
    count_bytes(*w, kAllToAll, sent, sent);
    w->device_finish = nccl_backend::all_to_all(o, i, group, out_splits, in_splits);
  } else if (auto pg = pg_of(group)) {
    std::function<void()> copy_back;
    const at::Tensor buf = receiving_buffer(o, &copy_back);
    at::Tensor out = bits(buf), in = bits(i.contiguous());
    c10d::AllToAllOptions opt;
    opt.timeout = collective_timeout();
    w->work = pg->alltoall_base(out, in, out_splits, in_splits, opt);
    watch(*w);
    count_bytes(*w, kAllToAll, sent, sent);
    w->then = [copy_back, in] {  // the input lives until the exchange completed
      if (copy_back) copy_back();
    };
  } else {
    o.copy_(i);
  }
  return Work(std::move(w));
}

void barrier(int32_t group) {
  if (auto pg = pg_of(group)) {
    auto w = pending("barrier", group);
    w->group = -1;  // not a transfer: no link time, no communication timing
    c10d::BarrierOptions o;
    o.timeout = collective_timeout();
    w->work = pg->barrier(o);
    Work(std::move(w)).wait();
  }
}

Traffic traffic(int32_t group) {
  Traffic t;
  if (group < 0 || group >= static_cast<int32_t>(kNumGroups)) return t;
  t.all_reduce = g_traffic[group][kAllReduce];
  t.reduce_scatter = g_traffic[group][kReduceScatter];
  t.all_gather = g_traffic[group][kAllGather];
  t.broadcast = g_traffic[group][kBroadcast];
  t.point_to_point = g_traffic[group][kPointToPoint];
  t.all_to_all = g_traffic[group][kAllToAll];
  return t;
}

void reset_traffic() {
  for (auto& g : g_traffic)
    for (auto& k : g) k = 0;
}

// ---------------------------------------------------------------------------------------------
// Agreement
// ---------------------------------------------------------------------------------------------

int64_t world_max(int64_t value, const Topology& topo, const char* what) {
  if (topo.world_size == 1) return value;
  at::Tensor t = at::full({1}, value, at::kLong);
  try {
    all_reduce(t, DTK_GROUP_WORLD, DTK_REDUCE_MAX).wait();
  } catch (const std::exception& e) {
    throw host::HostError(std::string(what) + ": " + e.what());
  }
  return t.item<int64_t>();
}

void agree(const std::string& error, const Topology& topo, const char* what, const std::string& others_failed) {
  const int64_t failed = world_max(error.empty() ? 0 : 1, topo, what);
  if (!error.empty()) throw host::HostError(error);
  if (failed)
    throw host::HostError(others_failed.empty() ? std::string(what) + ": another rank failed (its error is above)"
                                                : others_failed);
}

}  // namespace dtk::core
