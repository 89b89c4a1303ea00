// dtk/core/train/hooks.hpp — points where a caller may look at or change what the training loop
// computes. Empty in a normal run; `dtk train` fills them only from DTK_TEST_* variables of its
// environment (apps/dtk/test_hooks.cpp), so no test hook lives in the loop's own code.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>

namespace dtk::core {

struct TrainerHooks {
  // The scaled loss of micro-batch `m` of `iteration` on the last pipeline stage, before its
  // backward; returns the tensor to run the backward from (tests make the gradients infinite).
  std::function<at::Tensor(int64_t iteration, int64_t m, const at::Tensor& scaled_loss)> scaled_loss;
  // train.cuda_graphs on the CPU: the probe stands in for the CUDA graph (replays run the recorded
  // body again with capturing() on and fail on any host read), so CI runs the captured path.
  bool cuda_graph_probe = false;
};

}  // namespace dtk::core
