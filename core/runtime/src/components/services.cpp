// The host services table (dtk_host_services) every plugin receives: the glog bridge
// (log_bridge.cpp), statuses, the communication table — a thin adapter from the ABI's
// dtk_collective_args to the C++ communication API of dtk/core/comm/comm.hpp — RNG seeds, tensor
// release, device services (device_services.cpp) and extensions.
#include "dtk/core/components/services.hpp"

#include <torch/csrc/api/include/torch/version.h>

#include <dtk/tensor.hpp>

#include <mutex>
#include <string>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/device/step_capture.hpp"
#include "dtk/core/optim/aux_loss.hpp"
#include "dtk/core/timeline/trace.hpp"
#include "dtk/host/plugin_host.hpp"
#include "log_bridge.hpp"

namespace dtk::core {
namespace {

struct State {
  std::mutex mu;
  config::RunConfig cfg;
};

State& state() {
  static State* s = new State();  // never destroyed: plugins may log during exit
  return *s;
}

dtk_status* error(int32_t code, const std::string& message) { return host::make_status(code, message.c_str()); }

// ---------------------------------------------------------------------------------------------
// The ABI's communication table over comm.hpp
// ---------------------------------------------------------------------------------------------

// Checks what every collective reads: the args' size, the group, async without a work pointer
// and the reserved priority (a 2.0 host refuses a value it would otherwise silently ignore).
dtk_status* check_args(const dtk_collective_args* a, const char* what) {
  if (!DTK_STRUCT_COVERS(dtk_collective_args, a, 2_0))
    return error(DTK_ERR_ABI, std::string(what) + ": collective args missing or smaller than ABI 2.0's " +
                                  std::to_string(dtk_collective_args_STRUCT_SIZE_2_0) + " bytes");
  if (group_size(a->group) <= 0)
    return error(DTK_ERR_INVALID_ARGUMENT, "unknown process group " + std::to_string(a->group));
  if (a->async && !a->work)
    return error(DTK_ERR_INVALID_ARGUMENT, std::string(what) + ": async without a work pointer");
  if (a->priority != 0)
    return error(DTK_ERR_UNSUPPORTED, std::string(what) + ": priority is reserved and must be 0 in ABI 2.0");
  return nullptr;
}

// Finishes an issued collective now, or hands it out as the caller's [new] work handle.
void finish(Work work, const dtk_collective_args* a) {
  if (a->async)
    *a->work = work.release();
  else
    work.wait_synchronous();
}

dtk_status* abi_all_reduce(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "all_reduce")) return s;
  if (!a->tensor) return error(DTK_ERR_INVALID_ARGUMENT, "all_reduce: null tensor");
  return dtk::guard([&] { finish(all_reduce(dtk::unwrap(a->tensor), a->group, a->op), a); });
}

dtk_status* abi_broadcast(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "broadcast")) return s;
  if (!a->tensor) return error(DTK_ERR_INVALID_ARGUMENT, "broadcast: bad tensor or source rank");
  return dtk::guard([&] { finish(broadcast(dtk::unwrap(a->tensor), a->group, a->root), a); });
}

dtk_status* abi_all_gather(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "all_gather")) return s;
  if (!a->output || !a->tensor) return error(DTK_ERR_INVALID_ARGUMENT, "all_gather: null tensor");
  return dtk::guard([&] { finish(all_gather(dtk::unwrap(a->output), dtk::unwrap(a->tensor), a->group), a); });
}

dtk_status* abi_reduce_scatter(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "reduce_scatter")) return s;
  if (!a->output || !a->tensor) return error(DTK_ERR_INVALID_ARGUMENT, "reduce_scatter: null tensor");
  return dtk::guard(
      [&] { finish(reduce_scatter(dtk::unwrap(a->output), dtk::unwrap(a->tensor), a->group, a->op), a); });
}

// ABI 2.19's splits (NULL, or args from an earlier plugin: equal parts), one per group rank.
std::vector<int64_t> splits_of(const dtk_collective_args* a, const int64_t* dtk_collective_args::*field) {
  if (!DTK_HAS_FIELD(dtk_collective_args, a, input_splits) || !(a->*field)) return {};
  const int32_t n = group_size(a->group);
  return std::vector<int64_t>(a->*field, a->*field + n);
}

dtk_status* abi_all_to_all(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "all_to_all")) return s;
  if (!a->output || !a->tensor) return error(DTK_ERR_INVALID_ARGUMENT, "all_to_all: null tensor");
  return dtk::guard([&] {
    finish(
        all_to_all(dtk::unwrap(a->output), dtk::unwrap(a->tensor), a->group,
                   splits_of(a, &dtk_collective_args::output_splits), splits_of(a, &dtk_collective_args::input_splits)),
        a);
  });
}

dtk_status* abi_barrier(void*, const dtk_collective_args* a) {
  if (dtk_status* s = check_args(a, "barrier")) return s;
  return dtk::guard([&] { barrier(a->group); });
}

dtk_status* abi_wait(void*, dtk_comm_work* w, int64_t timeout_ms) {
  if (!w) return error(DTK_ERR_INVALID_ARGUMENT, "wait: null work handle");
  return dtk::guard([&] { Work::complete(*w, std::chrono::milliseconds(timeout_ms)); });
}

void abi_work_release(void*, dtk_comm_work* w) { Work::discard(w); }

int32_t abi_rank(void*, int32_t group) { return group_rank(group); }
int32_t abi_size(void*, int32_t group) { return group_size(group); }

const dtk_comm_services kComm = {
    dtk_comm_services_STRUCT_SIZE,
    nullptr,
    &abi_rank,
    &abi_size,
    &abi_all_reduce,
    &abi_broadcast,
    &abi_all_gather,
    &abi_reduce_scatter,
    &abi_barrier,
    &abi_wait,
    &abi_work_release,
    &abi_all_to_all,
};

// ---------------------------------------------------------------------------------------------
// Seeds, tensors, extensions
// ---------------------------------------------------------------------------------------------

uint64_t rng_seed(void*, int32_t stream) {
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(state().mu);
    seed = state().cfg.train().seed();
  }
  const Topology& t = topology();
  // Megatron: default = seed + 100 * pp_rank; tensor-parallel = that + 2718 + tp_rank.
  switch (stream) {
    case DTK_RNG_TENSOR_PARALLEL:
      return seed + 100 * static_cast<uint64_t>(t.pp_rank) + 2718 + static_cast<uint64_t>(t.tp_rank);
    default:
      return seed + 100 * static_cast<uint64_t>(t.pp_rank);
  }
}

void tensor_release(dtk_tensor* t) { dtk::release(t); }

// Host extensions (abi.h rule 8): the timeline (dtk.ext.trace.v1, since 2.1), what the layers
// see while a step is recorded into a CUDA graph (dtk.ext.capture.v1, since 2.5) and the factor
// of a layer's own loss (dtk.ext.aux_loss.v1, since 2.9).
const void* get_extension(const char* id) {
  if (id && std::string(id) == DTK_EXT_TRACE_V1) return trace::extension();
  if (id && std::string(id) == DTK_EXT_CAPTURE_V1) return capture::extension();
  if (id && std::string(id) == DTK_EXT_AUX_LOSS_V1) return aux_loss::extension();
  return nullptr;
}

}  // namespace

const char* host_torch_version() { return TORCH_VERSION; }

// A function-local static: the device table comes from another translation unit.
const dtk_host_services* host_services() {
  static const dtk_host_services services = {
      dtk_host_services_STRUCT_SIZE,
      DTK_ABI_MAJOR,
      DTK_ABI_MINOR,
      DTK_VERSION,
      TORCH_VERSION,
      nullptr,
      &log_to_glog,
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

}  // namespace dtk::core
