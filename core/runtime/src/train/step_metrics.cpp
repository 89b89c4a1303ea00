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

// A routed expert's weight under expert parallelism: the other ranks of the expert-parallel group
// hold the other experts, so its sums are summed over that group too.
bool held_by_expert_rank(const Param& p, const Topology& topo) { return topo.ep_size > 1 && is_routed_expert(p.info); }

// Per parameter counted here, value(p) summed into one total: the experts' part over the
// expert-parallel group first, then everything over the model-parallel group.
template <typename Value>
at::Tensor model_total(const std::vector<Param>& params, const Topology& topo, const Value& value) {
  at::Tensor total = device_total(), experts = device_total();
  {
    at::NoGradGuard no_grad;
    for (const Param& p : params) {
      if (!counted_here(p, topo)) continue;
      const at::Tensor v = value(p);
      if (v.defined()) (held_by_expert_rank(p, topo) ? experts : total) += v.to(total.device(), at::kDouble);
    }
  }
  if (topo.ep_size > 1) {
    all_reduce(experts, DTK_GROUP_EXPERT_PARALLEL, DTK_REDUCE_SUM).wait();
    total += experts;
  }
  if (topo.tp_size * topo.pp_size > 1) all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM).wait();
  return total;
}

}  // namespace

double params_norm(const ModelInstance& model, StrategyInstance& strategy, const Topology& topo) {
  const bool partitioned = strategy.info().partitions_parameters != 0;
  if (partitioned) strategy.gather_parameters(true);
  // (Offloaded parameters live on the host: each sum moves to the training device.)
  const at::Tensor total =
      model_total(model.parameters(), topo, [](const Param& p) { return sum_of_squares(p.tensor); });
  if (partitioned) strategy.gather_parameters(false);
  return std::sqrt(total.item<double>());
}

double num_zeros_in_grad(const OptimizerInstance& optimizer, const StrategyInstance& strategy, const Topology& topo) {
  auto zeros = [](const Param& p) {
    const at::Tensor& g = p.tensor.grad();
    return g.defined() ? (g == 0).sum() : at::Tensor();
  };
  // A sharded strategy's (ZeRO's) shards: every rank's, over the world (each expert's shards are
  // on the ranks holding it: summed over the world as well, not again over expert parallelism).
  if (strategy.info().sharded_state != 0) {
    Topology alone = topo;
    alone.tp_size = alone.pp_size = alone.ep_size = 1;
    at::Tensor total = model_total(optimizer.params(), alone, zeros);
    if (topo.world_size > 1) all_reduce(total, DTK_GROUP_WORLD, DTK_REDUCE_SUM).wait();
    return total.item<double>();
  }
  return model_total(optimizer.params(), topo, zeros).item<double>();
}

MemorySample memory_sample(const OptimizerInstance& optimizer, const StrategyInstance& strategy, const Topology& topo) {
  MemorySample m;
  m.allocator = memory::stats();
  m.strategy = strategy.memory_usage();
  m.optimizer_on_host = strategy.info().optimizer_on_host != 0;
  // (Expert parallelism's experts reduce their gradients, and ZeRO gathers them, over the
  // expert-data-parallel ranks: the data-parallel group's traffic too.)
  m.data_parallel = traffic(DTK_GROUP_DATA_PARALLEL);
  const Traffic experts = traffic(DTK_GROUP_EXPERT_DATA_PARALLEL);
  m.data_parallel.all_reduce += experts.all_reduce;
  m.data_parallel.reduce_scatter += experts.reduce_scatter;
  m.data_parallel.all_gather += experts.all_gather;
  m.tensor_parallel = traffic(DTK_GROUP_TENSOR_PARALLEL);
  m.pipeline_parallel = traffic(DTK_GROUP_PIPELINE_PARALLEL);
  m.expert_parallel = traffic(DTK_GROUP_EXPERT_PARALLEL);
  m.context_parallel = traffic(DTK_GROUP_CONTEXT_PARALLEL);
  m.ep_size = topo.ep_size;
  m.cp_size = topo.cp_size;
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
