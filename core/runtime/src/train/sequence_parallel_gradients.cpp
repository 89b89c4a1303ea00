#include "dtk/core/train/sequence_parallel_gradients.hpp"

#include <ATen/ATen.h>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/device/cuda_support.hpp"

namespace dtk::core {

void sum_gradients_over_group(const std::vector<at::Tensor>& grads, int32_t group, int64_t numel) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> parts;
  for (const at::Tensor& g : grads) parts.push_back(g.reshape({-1}).to(at::kFloat));
  // On the training device even without a gradient here: every member must pick the same backend.
  at::Tensor flat = parts.empty() ? at::zeros({numel}, at::TensorOptions().dtype(at::kFloat).device(training_device()))
                                  : at::cat(parts).to(training_device());  // ZeRO-Offload's host partitions too
  all_reduce(flat, group, DTK_REDUCE_SUM).wait();
  int64_t offset = 0;
  for (const at::Tensor& g : grads) {
    g.copy_(flat.narrow(0, offset, g.numel()).view(g.sizes()));
    offset += g.numel();
  }
}

std::vector<at::Tensor> flagged_gradients(const OptimizerInstance& optimizer, int32_t dtk_param_info::*flagged) {
  std::vector<at::Tensor> grads;
  for (const Param& p : optimizer.params())
    if (p.info.*flagged) {
      at::Tensor& g = p.tensor.mutable_grad();
      if (!g.defined()) g = at::zeros_like(p.tensor);
      grads.push_back(g);
    }
  return grads;
}

SequenceParallelGradients::SequenceParallelGradients(const OptimizerInstance& optimizer, const Topology& topo) {
  if (topo.tp_size <= 1) return;
  for (const Param& p : optimizer.params())
    if (p.info.sequence_parallel) numel_ += p.tensor.numel();
}

void SequenceParallelGradients::sync(const OptimizerInstance& optimizer) const {
  sum_gradients_over_group(flagged_gradients(optimizer, &dtk_param_info::sequence_parallel), DTK_GROUP_TENSOR_PARALLEL,
                           numel_);
}

}  // namespace dtk::core
