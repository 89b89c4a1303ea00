#include "dtk/core/batch_plan.hpp"

#include <algorithm>
#include <string>

#include "dtk/host/plugin_host.hpp"

namespace dtk::core {

using host::HostError;

BatchPlan::BatchPlan(const config::RunConfig& cfg, const Topology& topo)
    : mbs_(cfg.train().micro_batch_size()),
      train_iters_(cfg.train().train_iters()),  // or from train_samples, below
      eval_iters_(cfg.eval().eval_iters()),
      seq_length_(cfg.train().seq_length()),
      dp_rank_(topo.dp_rank),
      dp_size_(topo.dp_size) {
  const auto& t = cfg.train();
  const int64_t accumulation = t.gradient_accumulation_steps();
  if (accumulation < 0) throw HostError("config: train.gradient_accumulation_steps must be >= 0 (0 = from the batch sizes)");
  gbs_ = t.global_batch_size() > 0 ? t.global_batch_size() : mbs_ * dp_size_ * std::max<int64_t>(accumulation, 1);
  if (gbs_ % (mbs_ * dp_size_) != 0)
    throw HostError("config: global_batch_size " + std::to_string(gbs_) + " is not divisible by micro_batch_size x " +
                    "data-parallel size = " + std::to_string(mbs_ * dp_size_));
  num_micro_ = gbs_ / (mbs_ * dp_size_);
  if (accumulation > 0 && num_micro_ != accumulation)
    throw HostError("config: train.global_batch_size " + std::to_string(gbs_) + " = micro_batch_size " +
                    std::to_string(mbs_) + " x data-parallel size " + std::to_string(dp_size_) + " x " +
                    std::to_string(num_micro_) + " micro-batches, but train.gradient_accumulation_steps is " +
                    std::to_string(accumulation) + " (DeepSpeed's train_batch_size check)");
  if (t.train_samples() > 0) {
    // Megatron: iterations = train_samples // global_batch_size.
    train_iters_ = t.train_samples() / gbs_;
    if (train_iters_ <= 0)
      throw HostError("config: train.train_samples " + std::to_string(t.train_samples()) +
                      " is less than one global batch (" + std::to_string(gbs_) + ")");
  }
  const int64_t eval_interval = cfg.eval().eval_interval();
  num_evals_ = (eval_interval > 0 ? train_iters_ / eval_interval : 0) + 1;
  // Sample counts are products of user numbers: refuse values whose products overflow int64.
  const int64_t limit = int64_t{1} << 40;
  if (gbs_ > limit / std::max<int64_t>(1, train_iters_) ||
      gbs_ > limit / std::max<int64_t>(1, (num_evals_ + 1) * eval_iters_))
    throw HostError("config: train_iters x global_batch_size (or the evaluation sample count) is too large");
}

}  // namespace dtk::core
