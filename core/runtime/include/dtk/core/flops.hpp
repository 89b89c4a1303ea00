// dtk/core/flops.hpp — parameter count and the FLOPs model behind the TFLOP/s in the log.
#pragma once

#include <dtk/model.hpp>  // dtk::Param

#include <cstdint>
#include <vector>

namespace dtk::core {

// Parameter count (tied weights once) and training FLOPs per token:
// 6N + 6*L*h*s without recomputation, 8N + 8*L*h*s with full recomputation.
struct ModelStats {
  int64_t num_parameters = 0;
  double flops_per_token = 0;
};
ModelStats model_stats(const std::vector<Param>& params, const dtk_model_info& info);

}  // namespace dtk::core
