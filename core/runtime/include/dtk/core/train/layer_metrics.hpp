// dtk/core/train/layer_metrics.hpp — what the model's layers record for the log during an
// iteration (dtk.ext.aux_loss.v1's record: an MoE router's load-balancing and z-losses), reduced
// as Megatron-LM's MoE metrics tracker reduces them and added to the iteration's metrics.
#pragma once

#include <string>
#include <vector>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/logging/training_log.hpp"

namespace dtk::core {

class LayerMetrics {
 public:
  // `active`: the model may record (it has experts); the same on every rank, from the config.
  explicit LayerMetrics(bool active) : active_(active) {}

  // After an iteration's forward and backward passes, on every rank: each name's values summed
  // over the iteration and this rank's layers, divided by the micro-batches, summed over the
  // model-parallel ranks (tensor x pipeline) and averaged over the data-parallel ones, added to
  // `metrics`. The names are agreed on the first call (ranks whose stage records nothing take
  // part with zeros); a name first recorded later is refused.
  void collect(int64_t num_micro, const Topology& topo, MetricAverager& metrics);

 private:
  void agree_names(std::vector<std::string> mine, const Topology& topo);

  bool active_ = false, agreed_ = false;
  std::vector<std::string> names_;  // sorted
};

}  // namespace dtk::core
