// dtk/core/train/step_metrics.hpp — what the log reports of a step besides its loss: Megatron's
// params norm and zeros in the gradients (both collectives over the groups that hold the
// model's pieces) and the memory a rank holds.
#pragma once

#include "dtk/core/components/components.hpp"
#include "dtk/core/launch/distributed.hpp"
#include "dtk/core/logging/training_log.hpp"

namespace dtk::core {

// Megatron's calc_params_l2_norm: every parameter once (a tensor-parallel shard on each TP rank,
// a replicated tensor on TP rank 0 only, tied weights once), summed over the model-parallel group.
// Under ZeRO-3 the parameters are gathered for it (a collective, at log intervals only).
double params_norm(const ModelInstance& model, StrategyInstance& strategy, const Topology& topo);

// Megatron's count_zeros_fp32: zero entries of the gradients the optimizer steps, every element of
// the model once; under a sharded strategy (ZeRO) each data-parallel rank counts its own shard,
// else one DP rank's (replicated) gradients stand for all. Tied tensors count once.
double num_zeros_in_grad(const OptimizerInstance& optimizer, const StrategyInstance& strategy, const Topology& topo);

// What this rank holds at the end of the step, before the gradients are cleared.
MemorySample memory_sample(const OptimizerInstance& optimizer, const StrategyInstance& strategy, const Topology& topo);

}  // namespace dtk::core
