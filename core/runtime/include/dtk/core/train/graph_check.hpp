// dtk/core/train/graph_check.hpp — checks of a model plugin's contract that read the autograd graph.
#pragma once

#include <dtk/model.hpp>

#include <string>
#include <vector>

namespace dtk::core {

// The leaf tensors the loss's autograd graph accumulates gradients into (what backward would
// train) that are not among `params` (a model plugin's visit_parameters): such a tensor is never
// updated by the optimizer, reduced by the strategy or saved in a checkpoint. Returns "" when
// there is none, else one line, e.g. "2 tensors the loss trains are not listed by
// visit_parameters (the first: float [64, 64]): ...". The walk visits each graph node once.
std::string unlisted_trained_tensors(const at::Tensor& loss, const std::vector<Param>& params);

}  // namespace dtk::core
