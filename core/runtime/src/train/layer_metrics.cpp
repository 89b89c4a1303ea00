#include "dtk/core/train/layer_metrics.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <set>

#include "dtk/core/device/cuda_support.hpp"
#include "dtk/core/logging/step_metrics.hpp"
#include "dtk/core/optim/aux_loss.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

namespace {

constexpr int64_t kNameBytes = 1024;  // every name a rank records, '\n'-separated

}  // namespace

// One all-gather over the world of each rank's names (a fixed-size buffer of characters).
void LayerMetrics::agree_names(std::vector<std::string> mine, const Topology& topo) {
  std::string joined;
  for (const auto& n : mine) joined += n + "\n";
  if (static_cast<int64_t>(joined.size()) > kNameBytes)
    throw host::HostError("the model's layers record metrics with names longer than " + std::to_string(kNameBytes) +
                          " characters in all");
  at::Tensor buffer = at::zeros({kNameBytes}, at::kInt);
  for (size_t i = 0; i < joined.size(); ++i) buffer[static_cast<int64_t>(i)] = static_cast<unsigned char>(joined[i]);
  std::set<std::string> all(mine.begin(), mine.end());
  if (topo.world_size > 1) {
    at::Tensor gathered = at::zeros({topo.world_size * kNameBytes}, at::kInt);
    all_gather(gathered, buffer, DTK_GROUP_WORLD).wait();
    const int32_t* c = gathered.data_ptr<int32_t>();
    std::string name;
    for (int64_t i = 0; i < gathered.numel(); ++i) {
      if (c[i] == 0) continue;
      if (c[i] == '\n') {
        all.insert(name);
        name.clear();
      } else {
        name += static_cast<char>(c[i]);
      }
    }
  }
  names_.assign(all.begin(), all.end());
  agreed_ = true;
}

void LayerMetrics::collect(int64_t num_micro, const Topology& topo, MetricAverager& metrics) {
  if (!active_) return;
  const auto recorded = aux_loss::take_recorded();
  if (!agreed_) {
    std::vector<std::string> mine;
    for (const auto& [name, value] : recorded) mine.push_back(name);
    agree_names(mine, topo);
  }
  if (names_.empty()) return;
  at::Tensor values;
  for (const auto& [name, value] : recorded) {
    const auto at = std::find(names_.begin(), names_.end(), name);
    if (at == names_.end())
      throw host::HostError("the model's layers recorded metric '" + name +
                            "' for the first time after the first iteration: every name must be recorded from "
                            "the first iteration on (dtk.ext.aux_loss.v1)");
    if (!values.defined()) values = at::zeros({static_cast<int64_t>(names_.size())}, value.options());
    values[at - names_.begin()] += value.reshape({});
  }
  // A rank that recorded nothing (a stage without such layers) takes part with zeros, on the
  // device the collectives of this run use.
  if (!values.defined())
    values = at::zeros({static_cast<int64_t>(names_.size())},
                       at::TensorOptions().dtype(at::kFloat).device(training_device()));
  if (topo.world_size > 1) {
    all_reduce(values, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM).wait();
    all_reduce(values, DTK_GROUP_DATA_PARALLEL, DTK_REDUCE_SUM).wait();
  }
  values = values / static_cast<double>(num_micro * topo.dp_size);
  StepMetrics step;
  for (size_t i = 0; i < names_.size(); ++i) step.tensors.emplace_back(names_[i], values[static_cast<int64_t>(i)]);
  metrics.add(step);
}

}  // namespace dtk::core
