#include "dtk/core/train/step_metrics.hpp"

#include <ATen/ATen.h>
#include <dtk/strategy.hpp>  // sum_of_squares

#include <cmath>
#include <set>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/core/memory/memory.hpp"

namespace dtk::core {

namespace {

// Whether this rank counts `p`: a tensor-parallel shard on each TP rank, a replicated tensor on
// TP rank 0 only, a tied weight on the first stage only (each tensor is listed once: ModelInstance
// checks it).
bool counted_here(const Param& p, const Topology& topo) {
  if (!p.info.tensor_parallel && topo.tp_rank != 0) return false;
  return !(p.info.shared && topo.pp_rank != 0);
}

// Summed on the training device (one host sync at the end; every rank the same backend).
at::Tensor device_total() { return at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(training_device())); }

}  // namespace

double params_norm(const ModelInstance& model, StrategyInstance& strategy, const Topology& topo) {
  const bool partitioned = strategy.info().partitions_parameters != 0;
  if (partitioned) strategy.gather_parameters(true);
  at::Tensor total = device_total();
  {
    at::NoGradGuard no_grad;
    for (const Param& p : model.parameters())
      if (counted_here(p, topo))
        total += sum_of_squares(p.tensor).to(total.device());  // offloaded parameters live on the host
  }
  if (partitioned) strategy.gather_parameters(false);
  if (topo.tp_size * topo.pp_size > 1) all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM).wait();
  return std::sqrt(total.item<double>());
}

double num_zeros_in_grad(const OptimizerInstance& optimizer, const StrategyInstance& strategy, const Topology& topo) {
  at::Tensor total = device_total();
  {
    at::NoGradGuard no_grad;
    for (const Param& p : optimizer.params()) {
      const at::Tensor& g = p.tensor.grad();
      if (g.defined() && counted_here(p, topo)) total += (g == 0).sum().to(total.device(), at::kDouble);
    }
  }
  const bool sharded = strategy.info().sharded_state != 0;
  if (sharded && topo.world_size > 1)
    all_reduce(total, DTK_GROUP_WORLD, DTK_REDUCE_SUM).wait();
  else if (topo.tp_size * topo.pp_size > 1)
    all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM).wait();
  return total.item<double>();
}

MemorySample memory_sample(const OptimizerInstance& optimizer, const StrategyInstance& strategy, const Topology& topo) {
  MemorySample m;
  m.allocator = memory::stats();
  m.strategy = strategy.memory_usage();
  m.optimizer_on_host = strategy.info().optimizer_on_host != 0;
  m.data_parallel = traffic(DTK_GROUP_DATA_PARALLEL);
  m.tensor_parallel = traffic(DTK_GROUP_TENSOR_PARALLEL);
  m.pipeline_parallel = traffic(DTK_GROUP_PIPELINE_PARALLEL);
  m.dp_size = topo.dp_size;
  m.tp_size = topo.tp_size;
  m.pp_size = topo.pp_size;
  std::set<const void*> seen;  // count each storage once (views, shared buffers)
  for (const auto& [name, t] : optimizer.state_save()) {
    if (!t.defined() || !seen.insert(t.storage().data()).second) continue;
    m.optimizer_state_bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return m;
}

}  // namespace dtk::core
