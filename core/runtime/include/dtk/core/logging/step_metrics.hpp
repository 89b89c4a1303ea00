// dtk/core/logging/step_metrics.hpp — one micro-batch's metrics as its step reported them
// (dtk_metric_sink): numbers, and one-element tensors on the compute device (ABI 2.5) that stay
// there until the log asks for a mean (MetricAverager, training_log.hpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace dtk::core {

struct StepMetrics {
  std::vector<std::pair<std::string, double>> values;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
};

}  // namespace dtk::core
