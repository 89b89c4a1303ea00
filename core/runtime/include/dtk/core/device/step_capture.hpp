// dtk/core/device/step_capture.hpp — train.cuda_graphs: each micro-batch's forward and backward
// recorded once into a CUDA graph and replayed, so the host launches one graph instead of about a
// thousand kernels and the GPU runs them without the gaps between launches.
//
//   capture::Recording   what the layers see while the step is recorded (dtk.ext.capture.v1:
//                        capturing() and the checks they defer instead of reading the device)
//   capture::RecordedSeeds  the dropout seeds the recorded step reads from the device, drawn
//                        anew by the host before each replay (seed_slot, ABI 2.6)
//   StepRecorder         records and replays one micro-batch: a CUDA graph (device/cuda_graph.cpp,
//                        a CUDA LibTorch), or on the CPU the probe that runs the recorded body again
//                        with capturing() on and fails on any host read (what CI proves)
//
// The schedule that uses them, and the start-up decision (cuda_graphs_refusal), are in
// train/captured.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <dtk/abi.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dtk::core {

namespace capture {

// The host's dtk.ext.capture.v1 table, handed to plugins by get_extension (services.cpp).
const dtk_capture_ext* extension();

// A check a layer left on the device (a bool flag) with the line that reports it.
struct DeferredCheck {
  at::Tensor failed;
  std::string message;
};

// The seeds of one recording: each slot a layer asked for while the body was recorded is a
// callback into the layer (drawing from its dropout generator) and an element of a fixed table on
// the compute device, which the recorded kernels read. Before each replay draw() calls every
// callback in the order the slots were handed out, so a replay's masks are those an uncaptured
// micro-batch draws at that point; a slot first handed out while the body runs for real (a replay
// that runs it again: the CPU probe) is drawn then.
class RecordedSeeds {
 public:
  static constexpr int64_t kCapacity = 4096;  // slots per recording (a mask or two per layer)
  explicit RecordedSeeds(const at::Device& device);
  ~RecordedSeeds();
  RecordedSeeds(const RecordedSeeds&) = delete;
  RecordedSeeds& operator=(const RecordedSeeds&) = delete;
  // A new recording: every slot released.
  void forget();
  // Before a replay: every slot drawn, in order, and the values put on the device in one copy.
  void draw();
  // dtk_capture_ext.seed_slot: the next slot of this pass over the body (the recording's own, or
  // a new one, drawn at once when `kernels_run`); nullptr when the table is full or the slot
  // could not be made. Takes ctx: keeps it with a new slot, releases it otherwise.
  dtk_tensor* hand_out(uint64_t (*draw)(void*), void* ctx, void (*release)(void*), bool kernels_run) noexcept;
  // A new pass over the body hands out the slots from the first again.
  void restart() { handed_ = 0; }

 private:
  struct Slot {
    uint64_t (*draw)(void*);
    void* ctx;
    void (*release)(void*);
  };
  void put(size_t k, uint64_t value);
  at::Tensor table_;  // [kCapacity] int64 on the compute device: its address is in the recording
  std::vector<Slot> slots_;
  size_t handed_ = 0;
};

// While one lives, capturing() is true for every thread (the backward runs on autograd's
// threads on a GPU), defer_check collects here, and seed_slot hands out `seeds`' slots (none
// without: a layer asking then fails the recording). `kernels_run`: the body's kernels run as it
// is recorded (the CPU probe's replays), so a new seed is drawn at once; a CUDA graph's recording
// only enqueues them. One at a time.
class Recording {
 public:
  explicit Recording(RecordedSeeds* seeds = nullptr, bool kernels_run = true);
  ~Recording();
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;
  std::vector<DeferredCheck> take();
};

}  // namespace capture

// Records and replays the forward and backward of one micro-batch on fixed input tensors.
class StepRecorder {
 public:
  virtual ~StepRecorder() = default;
  // Records `body` once (a CUDA graph enqueues its kernels without running them).
  virtual void record(const std::function<void()>& body) = 0;
  // Runs the recorded work once: the graph, or (the probe) `body` again.
  virtual void replay(const std::function<void()>& body) = 0;
  // Whether replay runs `body` (the probe) or only what record kept (a graph).
  virtual bool replays_body() const = 0;
};

// A CUDA graph on `device` (nullptr in a build without a CUDA LibTorch).
std::unique_ptr<StepRecorder> make_cuda_graph_recorder(int device);
// The CPU probe: record does nothing; replay runs body with capturing() on and throws naming
// the count when it read a device value on the host (ATen's _local_scalar_dense).
std::unique_ptr<StepRecorder> make_probe_recorder();

}  // namespace dtk::core
