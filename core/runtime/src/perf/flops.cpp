#include "dtk/core/perf/flops.hpp"

#include <ATen/ATen.h>

#include <cmath>

#include "dtk/core/comm/comm.hpp"

namespace dtk::core {

ModelStats model_stats(const std::vector<Param>& params, const dtk_model_info& info, int64_t seq_length, int tp_size,
                       int pp_rank, int pp_size, int ep_size) {
  ModelStats s;
  int64_t experts = 0;  // the whole model's expert weights
  double read = 0;      // ... and what one token reads of them: each at topk of its layer's experts
  const bool moe = num_experts(info) > 0;
  for (const auto& p : params) {  // each tensor once (ModelInstance checks it)
    s.num_parameters += p.tensor.numel();
    if (p.info.shared && pp_rank != 0) continue;  // the last stage's copy of a tied weight
    const bool expert = moe && is_routed_expert(p.info);
    // Each expert-parallel rank holds as many experts as every other, each expert its own.
    const int64_t whole = p.tensor.numel() * (p.info.tensor_parallel ? tp_size : 1) * (expert ? ep_size : 1);
    s.model_parameters += whole;
    if (!expert) continue;
    experts += whole;
    read += static_cast<double>(whole) * info.moe_router_topk /
            static_cast<double>(routed_layer_experts(p.info, info.num_experts));
  }
  if (pp_size > 1) {  // (doubles hold these counts exactly up to 2^53)
    at::Tensor n =
        at::tensor({static_cast<double>(s.model_parameters), static_cast<double>(experts), read}, at::kDouble);
    all_reduce(n, DTK_GROUP_PIPELINE_PARALLEL, DTK_REDUCE_SUM).wait();
    s.model_parameters = std::llround(n[0].item<double>());
    experts = std::llround(n[1].item<double>());
    read = n[2].item<double>();
  }
  s.active_parameters = s.model_parameters;
  if (moe) s.active_parameters -= experts - std::llround(read);
  s.passes = info.recompute ? 4 : 3;
  const double c = s.passes, n = static_cast<double>(s.active_parameters);
  const double width = static_cast<double>(attention_width(info));  // of the scores and the context
  const double lhs = static_cast<double>(info.num_layers) * width * static_cast<double>(seq_length);
  s.flops_per_token = 2 * c * n + 4 * c * lhs;
  s.attention_flops_per_position = 4 * c * static_cast<double>(info.num_layers) * width;
  return s;
}

}  // namespace dtk::core
