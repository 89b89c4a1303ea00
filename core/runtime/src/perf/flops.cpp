#include "dtk/core/perf/flops.hpp"

#include <ATen/ATen.h>

#include "dtk/core/comm/comm.hpp"

namespace dtk::core {

ModelStats model_stats(const std::vector<Param>& params, const dtk_model_info& info, int64_t seq_length, int tp_size,
                       int pp_rank, int pp_size) {
  ModelStats s;
  for (const auto& p : params) {  // each tensor once (ModelInstance checks it)
    s.num_parameters += p.tensor.numel();
    if (p.info.shared && pp_rank != 0) continue;  // the last stage's copy of a tied weight
    s.model_parameters += p.tensor.numel() * (p.info.tensor_parallel ? tp_size : 1);
  }
  if (pp_size > 1) {
    at::Tensor n = at::tensor({s.model_parameters}, at::kLong);
    all_reduce(n, DTK_GROUP_PIPELINE_PARALLEL, DTK_REDUCE_SUM).wait();
    s.model_parameters = n.item<int64_t>();
  }
  s.passes = info.recompute ? 4 : 3;
  const double c = s.passes, n = static_cast<double>(s.model_parameters);
  const double lhs =
      static_cast<double>(info.num_layers) * static_cast<double>(info.hidden_size) * static_cast<double>(seq_length);
  s.flops_per_token = 2 * c * n + 4 * c * lhs;
  return s;
}

}  // namespace dtk::core
