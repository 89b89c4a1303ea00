#include "dtk/core/flops.hpp"

#include <set>

namespace dtk::core {

ModelStats model_stats(const std::vector<Param>& params, const dtk_model_info& info, int tp_size) {
  ModelStats s;
  std::set<const void*> seen;
  for (const auto& p : params) {
    // A tied tensor listed twice is counted once (Megatron counts unique parameters).
    const void* key = p.tensor.unsafeGetTensorImpl();
    if (!seen.insert(key).second) continue;
    s.num_parameters += p.tensor.numel();
    s.model_parameters += p.tensor.numel() * (p.info.tensor_parallel ? tp_size : 1);
  }
  s.passes = info.recompute ? 4 : 3;
  const double c = s.passes, n = static_cast<double>(s.model_parameters);
  const double lhs = static_cast<double>(info.num_layers) * static_cast<double>(info.hidden_size) *
                     static_cast<double>(info.seq_length);
  s.flops_per_token = 2 * c * n + 4 * c * lhs;
  return s;
}

}  // namespace dtk::core
