// dtk/core/device/step_capture.hpp — train.cuda_graphs: each micro-batch's forward and backward
// recorded once into a CUDA graph and replayed, so the host launches one graph instead of about a
// thousand kernels and the GPU runs them without the gaps between launches.
//
//   capture::Recording   what the layers see while the step is recorded (dtk.ext.capture.v1:
//                        capturing() and the checks they defer instead of reading the device)
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

// While one lives, capturing() is true for every thread (the backward runs on autograd's
// threads on a GPU) and defer_check collects here. One at a time.
class Recording {
 public:
  Recording();
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
