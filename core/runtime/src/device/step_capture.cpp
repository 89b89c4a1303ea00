// step_capture.cpp — see dtk/core/device/step_capture.hpp: the capture extension the layers ask
// and the CPU probe.
#include "dtk/core/device/step_capture.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <atomic>
#include <mutex>
#include <utility>

#include <dtk/tensor.hpp>  // unwrap, TensorHandle
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace capture {
namespace {

struct State {
  std::atomic<bool> recording{false};
  std::mutex mu;
  std::vector<DeferredCheck> checks;
};
State& state() {
  static State s;
  return s;
}

int32_t capturing() { return state().recording.load() ? 1 : 0; }

// Called from plugin frames (the backward's threads too): nothing may throw out of it.
void defer_check(dtk_tensor* failed, const char* message) {
  TensorHandle owned(failed);
  if (!failed) return;
  try {
    std::lock_guard<std::mutex> lock(state().mu);
    state().checks.push_back({unwrap(failed), message ? message : "a deferred check failed"});
  } catch (...) {
  }
}

}  // namespace

const dtk_capture_ext* extension() {
  static const dtk_capture_ext ext{dtk_capture_ext_STRUCT_SIZE, &capturing, &defer_check};
  return &ext;
}

Recording::Recording() {
  if (state().recording.exchange(true)) throw HostError("internal: two step recordings at once");
  std::lock_guard<std::mutex> lock(state().mu);
  state().checks.clear();
}

Recording::~Recording() { state().recording.store(false); }

std::vector<DeferredCheck> Recording::take() {
  std::lock_guard<std::mutex> lock(state().mu);
  return std::exchange(state().checks, {});
}

}  // namespace capture

namespace {

// Host reads counted while the probe replays: item() (ATen's _local_scalar_dense) and the ops
// whose output size depends on the data, which wait for the device on a GPU. (A copy to the CPU
// cannot be seen on the CPU: there it is no op at all.)
std::atomic<int64_t> g_probe_reads{0};

std::unique_ptr<at::ObserverContext> count_host_read(const at::RecordFunction& fn) {
  static const char* const kReads[] = {"aten::_local_scalar_dense", "aten::nonzero",      "aten::masked_select",
                                       "aten::_unique2",            "aten::unique_dim",   "aten::unique_consecutive",
                                       "aten::repeat_interleave",   "aten::nonzero_numpy"};
  const std::string name = fn.name();
  for (const char* read : kReads)
    if (name == read) g_probe_reads.fetch_add(1);
  return nullptr;
}

class ProbeRecorder final : public StepRecorder {
 public:
  void record(const std::function<void()>&) override {}
  void replay(const std::function<void()>& body) override {
    g_probe_reads.store(0);
    // The CPU's backward runs on this thread, so a thread-local observer sees the whole step.
    const at::CallbackHandle handle =
        at::addThreadLocalCallback(at::RecordFunctionCallback(&count_host_read).needsInputs(false));
    try {
      body();
    } catch (...) {
      at::removeCallback(handle);
      throw;
    }
    at::removeCallback(handle);
    if (const int64_t reads = g_probe_reads.load(); reads > 0)
      throw HostError("train.cuda_graphs probe: the recorded step read device values on the host " +
                      std::to_string(reads) + " time(s) (item(), nonzero, ...): a CUDA graph could not record it");
  }
  bool replays_body() const override { return true; }
};

}  // namespace

std::unique_ptr<StepRecorder> make_probe_recorder() { return std::make_unique<ProbeRecorder>(); }

}  // namespace dtk::core
