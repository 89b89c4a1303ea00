// step_capture.cpp — see dtk/core/device/step_capture.hpp: the capture extension the layers ask
// and the CPU probe.
#include "dtk/core/device/step_capture.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <utility>

#include <dtk/tensor.hpp>  // unwrap, TensorHandle
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace capture {
namespace {

struct State {
  std::atomic<bool> recording{false};
  std::atomic<int64_t> recording_id{0};  // counts Recordings; reported only while one lives
  std::mutex mu;
  std::vector<DeferredCheck> checks;
  RecordedSeeds* seeds = nullptr;
  bool kernels_run = true;
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

int64_t recording_id() { return state().recording.load() ? state().recording_id.load() : 0; }

// Called from plugin frames (the backward's threads too): nothing may throw out of it, and ctx is
// released once on every path that does not keep it (hand_out releases or keeps it itself).
dtk_tensor* seed_slot(uint64_t (*draw)(void*), void* ctx, void (*release)(void*)) {
  if (!release) return nullptr;  // nothing could give ctx back
  if (!draw) {
    release(ctx);
    return nullptr;
  }
  try {
    std::unique_lock<std::mutex> lock(state().mu);
    if (state().recording.load() && state().seeds)
      return state().seeds->hand_out(draw, ctx, release, state().kernels_run);
  } catch (...) {
  }
  release(ctx);
  return nullptr;
}

}  // namespace

const dtk_capture_ext* extension() {
  static const dtk_capture_ext ext{dtk_capture_ext_STRUCT_SIZE, &capturing, &defer_check, &recording_id, &seed_slot};
  return &ext;
}

RecordedSeeds::RecordedSeeds(const at::Device& device)
    : table_(at::zeros({kCapacity}, at::TensorOptions().dtype(at::kLong).device(device))) {
  slots_.reserve(kCapacity);  // so that keeping a slot cannot fail (hand_out)
}

RecordedSeeds::~RecordedSeeds() { forget(); }

void RecordedSeeds::forget() {
  for (const Slot& s : slots_) s.release(s.ctx);
  slots_.clear();
  handed_ = 0;
}

void RecordedSeeds::put(size_t k, uint64_t value) {
  if (table_.is_cpu())
    table_.data_ptr<int64_t>()[k] = static_cast<int64_t>(value);
  else
    table_.narrow(0, static_cast<int64_t>(k), 1).fill_(static_cast<int64_t>(value));
}

void RecordedSeeds::draw() {
  handed_ = 0;
  if (slots_.empty()) return;
  const auto n = static_cast<int64_t>(slots_.size());
  if (table_.is_cpu()) {
    for (size_t k = 0; k < slots_.size(); ++k) put(k, slots_[k].draw(slots_[k].ctx));
    return;
  }
  // One copy from pinned memory, ordered on the stream before the replay that reads it (and after
  // the previous replay, which read the last values); the caching host allocator keeps the
  // buffer until the copy is done.
  at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* v = host.data_ptr<int64_t>();
  for (size_t k = 0; k < slots_.size(); ++k) v[k] = static_cast<int64_t>(slots_[k].draw(slots_[k].ctx));
  table_.narrow(0, 0, n).copy_(host, /*non_blocking=*/true);
}

dtk_tensor* RecordedSeeds::hand_out(uint64_t (*draw)(void*), void* ctx, void (*release)(void*),
                                    bool kernels_run) noexcept {
  const size_t k = handed_;
  const bool known = k < slots_.size();  // the recording's slot k, drawn for this replay already
  dtk_tensor* out = nullptr;
  try {
    if (!known && k >= static_cast<size_t>(kCapacity)) throw std::length_error("seed table full");
    // What can fail comes first, while nothing holds ctx: the handle, then a new slot's value.
    out = wrap(table_.narrow(0, static_cast<int64_t>(k), 1));
    if (!known && kernels_run) put(k, draw(ctx));
  } catch (...) {
    if (out) dtk::release(out);
    release(ctx);
    return nullptr;
  }
  if (known)
    release(ctx);
  else
    slots_.push_back({draw, ctx, release});  // reserved: does not throw
  ++handed_;
  return out;
}

Recording::Recording(RecordedSeeds* seeds, bool kernels_run) {
  if (state().recording.exchange(true)) throw HostError("internal: two step recordings at once");
  std::lock_guard<std::mutex> lock(state().mu);
  state().checks.clear();
  state().recording_id.fetch_add(1);
  state().seeds = seeds;
  state().kernels_run = kernels_run;
  if (seeds) seeds->restart();
}

Recording::~Recording() {
  {
    std::lock_guard<std::mutex> lock(state().mu);
    state().seeds = nullptr;
  }
  state().recording.store(false);
}

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
