// The host services table. Collectives run through this process's group layout: groups of
// size one are the identity (no store, no process group); larger groups run on the Gloo
// process groups that init_distributed (distributed.cpp) created.
//
// Gloo in LibTorch 1.13 has no AVG reduction and no reduce_scatter: AVG is SUM followed by a
// division by the group size, and reduce_scatter is an all_reduce of a copy of the input
// followed by a copy of this rank's chunk into the output (size(group) times the traffic of a
// native reduce-scatter; correct, not optimal).
#include "dtk/core/services.hpp"

#include <glog/logging.h>
#include <torch/csrc/api/include/torch/version.h>
#include <dtk/tensor.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <mutex>

#include "dtk/core/config.hpp"
#include "dtk/core/distributed.hpp"
#include "dtk/host/plugin_host.hpp"

// A finished (or in-flight) collective. `work` is null for an identity collective; `then`
// finishes the result on this rank (AVG division, reduce-scatter chunk copy, copy back into a
// non-contiguous tensor) once the c10d work completed.
struct dtk_comm_work {
  c10::intrusive_ptr<c10d::Work> work;
  std::function<void()> then;
  std::string what;
};

namespace dtk::core {
namespace {

struct State {
  config::RunConfig cfg;
  Topology topo;
  std::mutex mu;
};

State& state() {
  static State* s = new State();  // never destroyed: plugins may log during exit
  return *s;
}

void log_fn(void*, int32_t level, const char* plugin, const char* file, int32_t line, const char* message) {
  const char* base = file ? file : "plugin";
  const int line_no = line > 0 ? line : 0;
  const std::string prefix = plugin ? std::string("[") + plugin + "] " : std::string();
  switch (level) {
    case DTK_LOG_DEBUG:
      if (VLOG_IS_ON(1)) google::LogMessage(base, line_no, google::GLOG_INFO).stream() << prefix << message;
      break;
    case DTK_LOG_WARNING:
      google::LogMessage(base, line_no, google::GLOG_WARNING).stream() << prefix << message;
      break;
    case DTK_LOG_ERROR:
      google::LogMessage(base, line_no, google::GLOG_ERROR).stream() << prefix << message;
      break;
    default:
      google::LogMessage(base, line_no, google::GLOG_INFO).stream() << prefix << message;
  }
}

int32_t group_rank(const Topology& t, int32_t group) {
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
    default:
      return -1;
  }
}

int32_t group_size(const Topology& t, int32_t group) {
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
    default:
      return -1;
  }
}

dtk_status* check_group(int32_t group) {
  if (group_size(state().topo, group) <= 0)
    return host::make_status(DTK_ERR_INVALID_ARGUMENT, ("unknown process group " + std::to_string(group)).c_str());
  return nullptr;
}

// The process group behind `group`, or null for a size-one group. Throws when a larger group
// has none (the distributed backend was not initialized).
c10::intrusive_ptr<c10d::ProcessGroup> pg_of(int32_t group) {
  if (group_size(state().topo, group) == 1) return {};
  auto pg = process_group(group);
  if (!pg)
    throw dtk::Error("process group " + std::to_string(group) + " has no backend (distributed not initialized)",
                     DTK_ERR_COMM);
  return pg;
}

std::string comm_error(const std::exception& e) {
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) return dtk::one_line(ce->what_without_backtrace());
  return dtk::one_line(e.what());
}

// Waits for `w` (bounded), then runs its finishing step.
void complete(dtk_comm_work& w, std::chrono::milliseconds timeout) {
  if (w.work) {
    try {
      w.work->wait(timeout);
    } catch (const std::exception& e) {
      throw dtk::Error(w.what + " failed: " + comm_error(e) + " (timeout " + std::to_string(timeout.count()) + " ms)",
                       DTK_ERR_COMM);
    }
    w.work.reset();
  }
  if (w.then) {
    auto then = std::move(w.then);
    w.then = nullptr;
    then();
  }
}

// Runs a prepared collective synchronously or hands it out as a work handle.
void finish(std::unique_ptr<dtk_comm_work> w, int32_t async, dtk_comm_work** work) {
  if (async) {
    *work = w.release();
    return;
  }
  complete(*w, collective_timeout());
}

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
// that is copied back when the collective completes.
at::Tensor contiguous_buffer(const at::Tensor& t, std::function<void()>* copy_back) {
  if (t.is_contiguous()) return t;
  at::Tensor buf = t.contiguous();
  *copy_back = [t, buf] { t.copy_(buf); };
  return buf;
}

// Checks what every collective reads: the args' size, the group, async without a work pointer
// and the reserved priority (a 2.0 host refuses a value it would otherwise silently ignore).
dtk_status* check_args(const dtk_collective_args* a, const char* what) {
  if (!DTK_STRUCT_COVERS(dtk_collective_args, a, 2_0))
    return host::make_status(DTK_ERR_ABI, (std::string(what) + ": collective args missing or smaller than ABI 2.0's " +
                                           std::to_string(dtk_collective_args_STRUCT_SIZE_2_0) + " bytes")
                                              .c_str());
  if (dtk_status* s = check_group(a->group)) return s;
  if (a->async && !a->work)
    return host::make_status(DTK_ERR_INVALID_ARGUMENT, (std::string(what) + ": async without a work pointer").c_str());
  if (a->priority != 0)
    return host::make_status(DTK_ERR_UNSUPPORTED,
                             (std::string(what) + ": priority is reserved and must be 0 in ABI 2.0").c_str());
  return nullptr;
}

dtk_status* all_reduce(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "all_reduce")) return s;
  const int32_t group = a->group, op = a->op, async = a->async;
  dtk_comm_work** work = a->work;
  dtk_tensor* t = a->tensor;
  if (!t) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "all_reduce: null tensor");
  return dtk::guard([&] {
    at::NoGradGuard ng;
    const at::Tensor& x = dtk::unwrap(t);
    const c10d::ReduceOp rop = reduce_op(op);
    auto w = std::make_unique<dtk_comm_work>();
    w->what = "all_reduce on group " + std::to_string(group);
    if (auto pg = pg_of(group)) {
      std::function<void()> copy_back;
      at::Tensor buf = contiguous_buffer(x, &copy_back);
      std::vector<at::Tensor> v{buf};
      c10d::AllreduceOptions o;
      o.reduceOp = rop;
      o.timeout = collective_timeout();
      w->work = pg->allreduce(v, o);
      const int64_t n = pg->getSize();
      check_avg(op, buf);
      const bool avg = op == DTK_REDUCE_AVG;
      if (avg || copy_back)
        w->then = [buf, avg, n, copy_back] {
          at::NoGradGuard ng2;
          if (avg) divide_by(buf, n);
          if (copy_back) copy_back();
        };
    }
    finish(std::move(w), async, work);
  });
}

dtk_status* broadcast(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "broadcast")) return s;
  const int32_t group = a->group, src = a->root, async = a->async;
  dtk_comm_work** work = a->work;
  dtk_tensor* t = a->tensor;
  if (!t || src < 0 || src >= group_size(state().topo, group))
    return host::make_status(DTK_ERR_INVALID_ARGUMENT, "broadcast: bad tensor or source rank");
  return dtk::guard([&] {
    at::NoGradGuard ng;
    const at::Tensor& x = dtk::unwrap(t);
    auto w = std::make_unique<dtk_comm_work>();
    w->what = "broadcast on group " + std::to_string(group);
    if (auto pg = pg_of(group)) {
      std::function<void()> copy_back;
      at::Tensor buf = contiguous_buffer(x, &copy_back);
      std::vector<at::Tensor> v{buf};
      c10d::BroadcastOptions o;
      o.rootRank = src;
      o.timeout = collective_timeout();
      w->work = pg->broadcast(v, o);
      w->then = copy_back;
    }
    finish(std::move(w), async, work);
  });
}

// Shapes: output = [size * n, rest...] where input = [n, rest...] (reduce_scatter: swapped).
void check_gather_shapes(const char* what, const at::Tensor& big, const at::Tensor& small, int64_t size) {
  bool ok = big.dim() >= 1 && big.dim() == small.dim() && big.size(0) == size * small.size(0) &&
            big.scalar_type() == small.scalar_type();
  for (int64_t d = 1; ok && d < big.dim(); ++d) ok = big.size(d) == small.size(d);
  if (!ok)
    throw dtk::Error(std::string(what) + ": tensors " + dtk::shape_str(big) + " and " + dtk::shape_str(small) +
                         " do not fit a group of " + std::to_string(size) +
                         " (first dimension x group size, same dtype)",
                     DTK_ERR_INVALID_ARGUMENT);
}

dtk_status* all_gather(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "all_gather")) return s;
  const int32_t group = a->group, async = a->async;
  dtk_comm_work** work = a->work;
  dtk_tensor *out = a->output, *in = a->tensor;
  if (!out || !in) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "all_gather: null tensor");
  return dtk::guard([&] {
    at::NoGradGuard ng;
    const at::Tensor& o = dtk::unwrap(out);
    const at::Tensor& i = dtk::unwrap(in);
    const int64_t n = group_size(state().topo, group);
    check_gather_shapes("all_gather", o, i, n);
    auto w = std::make_unique<dtk_comm_work>();
    w->what = "all_gather on group " + std::to_string(group);
    if (auto pg = pg_of(group)) {
      std::function<void()> copy_back;
      at::Tensor buf = contiguous_buffer(o, &copy_back);
      std::vector<std::vector<at::Tensor>> outs(1);
      for (const at::Tensor& c : buf.chunk(n, 0)) outs[0].push_back(c);  // views: rank order
      std::vector<at::Tensor> ins{i.contiguous()};
      c10d::AllgatherOptions opt;
      opt.timeout = collective_timeout();
      w->work = pg->allgather(outs, ins, opt);
      w->then = copy_back;
    } else {
      o.copy_(i);
    }
    finish(std::move(w), async, work);
  });
}

dtk_status* reduce_scatter(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "reduce_scatter")) return s;
  const int32_t group = a->group, op = a->op, async = a->async;
  dtk_comm_work** work = a->work;
  dtk_tensor *out = a->output, *in = a->tensor;
  if (!out || !in) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "reduce_scatter: null tensor");
  return dtk::guard([&] {
    at::NoGradGuard ng;
    const at::Tensor& o = dtk::unwrap(out);
    const at::Tensor& i = dtk::unwrap(in);
    const int64_t n = group_size(state().topo, group);
    check_gather_shapes("reduce_scatter", i, o, n);
    const c10d::ReduceOp rop = reduce_op(op);
    auto w = std::make_unique<dtk_comm_work>();
    w->what = "reduce_scatter on group " + std::to_string(group);
    if (auto pg = pg_of(group)) {
      // Emulated (Gloo has no reduce_scatter in 1.13): all_reduce a copy, keep our chunk.
      at::Tensor buf = i.contiguous().clone();
      std::vector<at::Tensor> v{buf};
      c10d::AllreduceOptions opt;
      opt.reduceOp = rop;
      opt.timeout = collective_timeout();
      w->work = pg->allreduce(v, opt);
      const int64_t rank = pg->getRank();
      check_avg(op, buf);
      const bool avg = op == DTK_REDUCE_AVG;
      w->then = [o, buf, rank, n, avg] {
        at::NoGradGuard ng2;
        at::Tensor chunk = buf.narrow(0, rank * (buf.size(0) / n), buf.size(0) / n);
        if (avg) divide_by(chunk, n);
        o.copy_(chunk);
      };
    } else {
      o.copy_(i);
    }
    finish(std::move(w), async, work);
  });
}

dtk_status* barrier(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "barrier")) return s;
  const int32_t group = a->group;
  return dtk::guard([&] {
    if (auto pg = pg_of(group)) {
      auto w = std::make_unique<dtk_comm_work>();
      w->what = "barrier on group " + std::to_string(group);
      c10d::BarrierOptions o;
      o.timeout = collective_timeout();
      w->work = pg->barrier(o);
      complete(*w, collective_timeout());
    }
  });
}

dtk_status* wait(void*, dtk_comm_work* w, int64_t timeout_ms) {
  if (!w) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "wait: null work handle");
  return dtk::guard(
      [&] { complete(*w, timeout_ms > 0 ? std::chrono::milliseconds(timeout_ms) : collective_timeout()); });
}
void work_release(void*, dtk_comm_work* w) { delete w; }

int32_t comm_rank(void*, int32_t group) { return group_rank(state().topo, group); }
int32_t comm_size(void*, int32_t group) { return group_size(state().topo, group); }
uint64_t rng_seed(void*, int32_t stream) {
  const State& s = state();
  const uint64_t seed = s.cfg.train().seed();
  // Megatron: default = seed + 100 * pp_rank; tensor-parallel = that + 2718 + tp_rank.
  switch (stream) {
    case DTK_RNG_TENSOR_PARALLEL:
      return seed + 100 * static_cast<uint64_t>(s.topo.pp_rank) + 2718 + static_cast<uint64_t>(s.topo.tp_rank);
    default:
      return seed + 100 * static_cast<uint64_t>(s.topo.pp_rank);
  }
}

void tensor_release(dtk_tensor* t) { dtk::release(t); }

// No host extensions in ABI 2.0 (abi.h rule 8): every id is unknown.
const void* get_extension(const char* id) {
  (void)id;
  return nullptr;
}

const dtk_comm_services kComm = {
    dtk_comm_services_STRUCT_SIZE,
    nullptr,
    &comm_rank,
    &comm_size,
    &all_reduce,
    &broadcast,
    &all_gather,
    &reduce_scatter,
    &barrier,
    &wait,
    &work_release,
};

}  // namespace

const char* host_torch_version() { return TORCH_VERSION; }
// A function-local static: the device table comes from another translation unit.
const dtk_host_services* host_services() {
  static const dtk_host_services services = {
      dtk_host_services_STRUCT_SIZE,
      DTK_ABI_MAJOR,
      DTK_ABI_MINOR,
      "0.1.0",
      TORCH_VERSION,
      nullptr,
      &log_fn,
      &host::make_status,
      &kComm,
      &rng_seed,
      &tensor_release,
      device_services(),
      &get_extension,
  };
  return &services;
}
void set_run_config(const config::RunConfig& cfg) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().cfg = cfg;
}
const Topology& topology() { return state().topo; }

int64_t world_max(int64_t value, const Topology& topo, const char* what) {
  if (topo.world_size == 1) return value;
  at::Tensor t = at::full({1}, value, at::kLong);
  dtk_tensor handle{t};
  dtk_collective_args a{};
  a.struct_size = dtk_collective_args_STRUCT_SIZE;
  a.group = DTK_GROUP_WORLD;
  a.op = DTK_REDUCE_MAX;
  a.tensor = &handle;
  host::check_status(all_reduce(nullptr, &a), what);
  return t.item<int64_t>();
}

void agree(const std::string& error, const Topology& topo, const char* what, const std::string& others_failed) {
  const int64_t failed = world_max(error.empty() ? 0 : 1, topo, what);
  if (!error.empty()) throw host::HostError(error);
  if (failed)
    throw host::HostError(others_failed.empty() ? std::string(what) + ": another rank failed (its error is above)"
                                                : others_failed);
}
void set_topology(const Topology& t) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().topo = t;
}

}  // namespace dtk::core
