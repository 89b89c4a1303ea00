// The host services table. Collectives run through this process's group layout; a
// single-process run has groups of size one, where every collective is the identity (the
// multi-process c10d backend plugs in behind the same table).
#include "dtk/core/services.hpp"

#include <glog/logging.h>
#include <torch/csrc/api/include/torch/version.h>
#include <dtk/tensor.hpp>

#include <mutex>

#include "dtk/core/config.hpp"
#include "dtk/host/plugin_host.hpp"

// A finished (or in-flight) collective.
struct dtk_comm_work {
  bool done = true;
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
  if (group_size(state().topo, group) != 1)
    return host::make_status(DTK_ERR_UNSUPPORTED,
                             "multi-process collectives need the distributed backend (not initialized)");
  return nullptr;
}

dtk_status* finish(int32_t async, dtk_comm_work** work) {
  if (async) {
    if (!work) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "async collective without a work pointer");
    *work = new dtk_comm_work{};
  }
  return nullptr;
}

// Size-one groups: all-reduce/broadcast are the identity; gather/scatter copy.
dtk_status* all_reduce(void*, int32_t group, dtk_tensor* t, int32_t, int32_t async, dtk_comm_work** work) {
  if (dtk_status* s = check_group(group)) return s;
  if (!t) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "all_reduce: null tensor");
  return finish(async, work);
}
dtk_status* broadcast(void*, int32_t group, dtk_tensor* t, int32_t src, int32_t async, dtk_comm_work** work) {
  if (dtk_status* s = check_group(group)) return s;
  if (!t || src != 0) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "broadcast: bad tensor or source rank");
  return finish(async, work);
}
dtk_status* copy_collective(const char* what, int32_t group, dtk_tensor* out, dtk_tensor* in, int32_t async,
                            dtk_comm_work** work) {
  if (dtk_status* s = check_group(group)) return s;
  return dtk::guard([&] {
    const at::Tensor& o = dtk::unwrap(out);
    const at::Tensor& i = dtk::unwrap(in);
    if (o.sizes() != i.sizes()) throw dtk::Error(std::string(what) + ": output and input shapes differ");
    at::NoGradGuard ng;
    o.copy_(i);
    dtk::check(finish(async, work));
  });
}
dtk_status* all_gather(void*, int32_t group, dtk_tensor* out, dtk_tensor* in, int32_t async, dtk_comm_work** work) {
  return copy_collective("all_gather", group, out, in, async, work);
}
dtk_status* reduce_scatter(void*, int32_t group, dtk_tensor* out, dtk_tensor* in, int32_t, int32_t async,
                           dtk_comm_work** work) {
  return copy_collective("reduce_scatter", group, out, in, async, work);
}
dtk_status* barrier(void*, int32_t group) { return check_group(group); }
dtk_status* wait(void*, dtk_comm_work* w, int64_t) {
  if (!w) return host::make_status(DTK_ERR_INVALID_ARGUMENT, "wait: null work handle");
  return nullptr;
}
void work_release(void*, dtk_comm_work* w) { delete w; }

int32_t comm_rank(void*, int32_t group) { return group_rank(state().topo, group); }
int32_t comm_size(void*, int32_t group) { return group_size(state().topo, group); }
int32_t comm_global_rank(void*, int32_t group, int32_t r) {
  return group_size(state().topo, group) == 1 && r == 0 ? state().topo.world_rank : -1;
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

}  // namespace dtk::core
