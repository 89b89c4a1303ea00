#include "dtk/core/flops.hpp"

#include <set>

namespace dtk::core {

ModelStats model_stats(const std::vector<Param>& params, const dtk_model_info& info) {
  ModelStats s;
  std::set<const void*> seen;
  for (const auto& p : params) {
    // A tied tensor listed twice is counted once (Megatron counts unique parameters).
    const void* key = p.tensor.unsafeGetTensorImpl();
    if (!seen.insert(key).second) continue;
    s.num_parameters += p.tensor.numel();
  }
  const double n = static_cast<double>(s.num_parameters);
  const double attn = static_cast<double>(info.num_layers) * static_cast<double>(info.hidden_size) *
                      static_cast<double>(info.seq_length);
  const double mult = info.recompute ? 8.0 : 6.0;
  s.flops_per_token = mult * n + mult * attn;
  return s;
}

}  // namespace dtk::core
