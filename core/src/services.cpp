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

dtk_status* check_async(int32_t async, dtk_comm_work** work) {
  if (async && !work) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "async collective without a work pointer");
  return nullptr;
}

dtk_status* all_reduce(void*, int32_t group, dtk_tensor* t, int32_t op, int32_t async, dtk_comm_work** work) {
  if (dtk_status* s = check_group(group)) return s;
  if (dtk_status* s = check_async(async, work)) return s;
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

dtk_status* broadcast(void*, int32_t group, dtk_tensor* t, int32_t src, int32_t async, dtk_comm_work** work) {
  if (dtk_status* s = check_group(group)) return s;
  if (dtk_status* s = check_async(async, work)) return s;
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
    throw dtk::Error(std::string(what) + ": tensors " + dtk::Model::shape_str(big) + " and " +
                         dtk::Model::shape_str(small) + " do not fit a group of " + std::to_string(size) +
                         " (first dimension x group size, same dtype)",
                     DTK_ERR_INVALID_ARGUMENT);
}

dtk_status* all_gather(void*, int32_t group, dtk_tensor* out, dtk_tensor* in, int32_t async, dtk_comm_work** work) {
  if (dtk_status* s = check_group(group)) return s;
  if (dtk_status* s = check_async(async, work)) return s;
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

dtk_status* reduce_scatter(void*, int32_t group, dtk_tensor* out, dtk_tensor* in, int32_t op, int32_t async,
                           dtk_comm_work** work) {
  if (dtk_status* s = check_group(group)) return s;
  if (dtk_status* s = check_async(async, work)) return s;
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

dtk_status* barrier(void*, int32_t group) {
  if (dtk_status* s = check_group(group)) return s;
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
// Megatron's layout: global = pp * (dp_size * tp_size) + dp * tp_size + tp.
int32_t comm_global_rank(void*, int32_t group, int32_t r) {
  const Topology& t = state().topo;
  const int32_t n = group_size(t, group);
  if (n <= 0 || r < 0 || r >= n) return -1;
  int tp = t.tp_rank, dp = t.dp_rank, pp = t.pp_rank;
  switch (group) {
    case DTK_GROUP_WORLD:
      return r;
    case DTK_GROUP_DATA_PARALLEL:
      dp = r;
      break;
    case DTK_GROUP_TENSOR_PARALLEL:
      tp = r;
      break;
    case DTK_GROUP_PIPELINE_PARALLEL:
      pp = r;
      break;
    case DTK_GROUP_MODEL_PARALLEL:
      pp = r / t.tp_size, tp = r % t.tp_size;
      break;
  }
  return pp * t.dp_size * t.tp_size + dp * t.tp_size + tp;
}

uint64_t rng_seed(void*, int32_t stream) {
  const State& s = state();
  const uint64_t seed = s.cfg.train().seed();
  // Megatron: default = seed + 100 * pp_rank; tensor-parallel = that + 2718 + tp_rank.
  switch (stream) {
    case DTK_RNG_TENSOR_PARALLEL:
      return seed + 100 * static_cast<uint64_t>(s.topo.pp_rank) + 2718 + static_cast<uint64_t>(s.topo.tp_rank);
    case DTK_RNG_DATA:
      return seed;
    default:
      return seed + 100 * static_cast<uint64_t>(s.topo.pp_rank);
  }
}

dtk_status* config_get(void*, const char* key, const char** value) {
  if (!key || !value) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "config_get: null argument");
  // The result is borrowed until this thread's next call: one buffer per thread, so a dataset's
  // loader thread and the training thread never share it.
  thread_local std::string last_value;
  State& s = state();
  try {
    std::lock_guard<std::mutex> lock(s.mu);
    last_value = config_value(s.cfg, key);
  } catch (const std::exception& e) {
    return host::make_status(DTK_ERR_NOT_FOUND, e.what());
  }
  *value = last_value.c_str();
  return nullptr;
}

void tensor_release(dtk_tensor* t) { dtk::release(t); }

const dtk_comm_services kComm = {
    sizeof(dtk_comm_services), nullptr,     &comm_rank, &comm_size,
    &comm_global_rank,         &all_reduce, &broadcast, &all_gather,
    &reduce_scatter,           &barrier,    &wait,      &work_release,
};

const dtk_host_services kServices = {
    sizeof(dtk_host_services), DTK_ABI_MAJOR, DTK_ABI_MINOR, "0.1.0",     TORCH_VERSION,   nullptr, &log_fn,
    &host::make_status,        &kComm,        &rng_seed,     &config_get, &tensor_release,
};

}  // namespace

const char* host_torch_version() { return TORCH_VERSION; }
const dtk_host_services* host_services() { return &kServices; }
void set_run_config(const config::RunConfig& cfg) {
  std::lock_guard<std::mutex> lock(state().mu);
  state().cfg = cfg;
}
const Topology& topology() { return state().topo; }

int64_t world_max(int64_t value, const Topology& topo, const char* what) {
  if (topo.world_size == 1) return value;
  at::Tensor t = at::full({1}, value, at::kLong);
  dtk_tensor handle{t};
  host::check_status(all_reduce(nullptr, DTK_GROUP_WORLD, &handle, DTK_REDUCE_MAX, 0, nullptr), what);
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
