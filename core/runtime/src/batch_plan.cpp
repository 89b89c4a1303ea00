#include "dtk/core/batch_plan.hpp"

#include <algorithm>
#include <string>

#include "dtk/host/plugin_host.hpp"

namespace dtk::core {

using host::HostError;

BatchPlan::BatchPlan(const config::RunConfig& cfg, const Topology& topo)
    : mbs_(cfg.train().micro_batch_size()),
      train_iters_(cfg.train().train_iters()),
      eval_iters_(cfg.eval().eval_iters()),
      seq_length_(cfg.train().seq_length()),
      dp_rank_(topo.dp_rank),
      dp_size_(topo.dp_size) {
  gbs_ = cfg.train().global_batch_size() > 0 ? cfg.train().global_batch_size() : mbs_ * dp_size_;
  if (gbs_ % (mbs_ * dp_size_) != 0)
    throw HostError("config: global_batch_size " + std::to_string(gbs_) + " is not divisible by micro_batch_size x " +
                    "data-parallel size = " + std::to_string(mbs_ * dp_size_));
  num_micro_ = gbs_ / (mbs_ * dp_size_);
  const int64_t eval_interval = cfg.eval().eval_interval();
  num_evals_ = (eval_interval > 0 ? train_iters_ / eval_interval : 0) + 1;
  // Sample counts are products of user numbers: refuse values whose products overflow int64.
  const int64_t limit = int64_t{1} << 40;
  if (gbs_ > limit / std::max<int64_t>(1, train_iters_) ||
      gbs_ > limit / std::max<int64_t>(1, (num_evals_ + 1) * eval_iters_))
    throw HostError("config: train_iters x global_batch_size (or the evaluation sample count) is too large");
}

}  // namespace dtk::core
