// dtk/core/train/tied_gradients.hpp — tied embeddings across pipeline stages: the first stage's
// word embedding and the last stage's output weight (both listed with dtk_param_info.shared)
// have their gradients summed over the pipeline group after the strategy reduced them
// (Megatron's embedding-group all-reduce; stages in between add zeros of the agreed size).
#pragma once

#include <cstdint>
#include <string>

#include "dtk/core/components/components.hpp"
#include "dtk/core/launch/distributed.hpp"

namespace dtk::core {

class TiedGradients {
 public:
  // Checks the layout every stage lists (a collective over the world and the pipeline group).
  // A strategy that shards the tied weights over data-parallel ranks is refused: its pieces do not
  // line up between the stages. Inactive without pipeline stages or tied weights.
  TiedGradients(const ModelInstance& model, const OptimizerInstance& optimizer, const Topology& topo,
                const std::string& model_name, const std::string& strategy_name);
  bool active() const { return numel_ > 0; }
  // Sums the tied gradients the optimizer will step over the pipeline group.
  void sync(const OptimizerInstance& optimizer) const;

 private:
  int64_t numel_ = 0;  // elements of the tied weights each stage sums (0: none)
};

}  // namespace dtk::core
