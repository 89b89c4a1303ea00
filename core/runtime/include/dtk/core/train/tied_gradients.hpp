// dtk/core/train/tied_gradients.hpp — tied embeddings across pipeline stages: the first stage's
// word embedding and the last stage's output weight (both listed with dtk_param_info.shared)
// have their gradients summed over the pipeline group after the strategy reduced them
// (Megatron's embedding-group all-reduce; stages in between add zeros of the agreed size). Under a
// sharding strategy each rank sums its shard, as Megatron's distributed optimizer all-reduces the
// embedding's gradient after the reduce-scatter.
#pragma once

#include <cstdint>
#include <string>

#include "dtk/core/components/components.hpp"
#include "dtk/core/launch/distributed.hpp"

namespace dtk::core {

class TiedGradients {
 public:
  // Checks the layout every stage lists (a collective over the world and the pipeline group).
  // A strategy may shard the tied weight over data-parallel ranks when it shards both copies alike
  // (zero gives it a bucket of its own): rank d of the first and of the last stage then sum the
  // same run of elements; runs that differ are refused, naming both. Inactive without pipeline
  // stages or tied weights, and on a rank that holds none of it.
  TiedGradients(const ModelInstance& model, const OptimizerInstance& optimizer, const Topology& topo,
                const std::string& model_name, const std::string& strategy_name);
  bool active() const { return numel_ > 0; }
  // Sums the tied gradients the optimizer will step over the pipeline group.
  void sync(const OptimizerInstance& optimizer) const;

 private:
  int64_t numel_ = 0;  // elements of the tied weight this rank's pipeline group sums (0: none)
};

}  // namespace dtk::core
