// dtk/core/train/sequence_parallel_gradients.hpp — sequence parallelism's gradient sum: a
// replicated parameter read on each tensor-parallel rank's rows of the sequence (norms,
// row-parallel biases, the position embedding: dtk_param_info.sequence_parallel) has a partial
// gradient on each rank; after the strategy reduced them over data-parallel ranks, their sum over
// the tensor-parallel group is the gradient (Megatron's finalize_model_grads, the all-reduce of
// the layer-norm and sequence-parallel gradients), one collective per step.
#pragma once

#include <cstdint>
#include <vector>

#include "dtk/core/components/components.hpp"
#include "dtk/core/launch/distributed.hpp"

namespace dtk::core {

// Sums `grads` over `group` in place, in one fp32 all-reduce (Gloo has no bf16) of `numel`
// elements on the training device (zeros when this rank has none: every member must take part).
void sum_gradients_over_group(const std::vector<at::Tensor>& grads, int32_t group, int64_t numel);
// The gradients of the optimizer's tensors whose info `flagged` selects (zeros where a tensor has
// none yet), in the optimizer's order.
std::vector<at::Tensor> flagged_gradients(const OptimizerInstance& optimizer, int32_t dtk_param_info::*flagged);

class SequenceParallelGradients {
 public:
  // Inactive at tensor-parallel size 1 or without flagged parameters.
  SequenceParallelGradients(const OptimizerInstance& optimizer, const Topology& topo);
  bool active() const { return numel_ > 0; }
  void sync(const OptimizerInstance& optimizer) const;

 private:
  int64_t numel_ = 0;  // elements of the flagged tensors the optimizer holds
};

}  // namespace dtk::core
