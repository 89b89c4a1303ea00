#include "dtk/core/train/batch_plan.hpp"

#include <algorithm>
#include <string>

#include "dtk/core/config/config.hpp"
#include "dtk/host/error.hpp"

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
  if (!t.rampup_batch_size().empty()) {
    const RampUp r = parse_rampup(t.rampup_batch_size());
    const int64_t unit = mbs_ * dp_size_;
    if (r.start % unit != 0 || r.increment % unit != 0)
      throw HostError("config: train.rampup_batch_size '" + t.rampup_batch_size() + "': START and INCREMENT must be " +
                      "multiples of micro_batch_size x data-parallel size = " + std::to_string(unit) +
                      " (every global batch of the ramp-up is whole micro-batches on every rank)");
    // The ramp-up must end inside the run (Megatron would overshoot train_samples instead); this
    // also bounds the table below.
    if (r.samples >= t.train_samples())
      throw HostError("config: train.rampup_batch_size '" + t.rampup_batch_size() + "' ramps up over " +
                      std::to_string(r.samples) + " samples, not fewer than train.train_samples " +
                      std::to_string(t.train_samples()));
    if (r.samples / r.start > 100'000'000)
      throw HostError("config: train.rampup_batch_size '" + t.rampup_batch_size() +
                      "' means more than 100 million ramp-up iterations");
    // Megatron's calculator and update_train_iters: the ramp-up's iterations run while the samples
    // consumed before them are <= SAMPLES; the rest of train_samples in whole global batches.
    const double per_increment = static_cast<double>(r.samples) / static_cast<double>((gbs_ - r.start) / r.increment);
    auto batch_at = [&](int64_t consumed) {
      if (consumed > r.samples) return gbs_;
      return r.start + static_cast<int64_t>(static_cast<double>(consumed) / per_increment) * r.increment;
    };
    for (int64_t consumed = 0; consumed <= r.samples;) {
      const int64_t batch = batch_at(consumed);
      consumed += batch;
      ramp_consumed_.push_back(consumed);
      ramp_micro_.push_back(ramp_micro_.back() + batch / unit);
    }
    const int64_t ramp_iters = static_cast<int64_t>(ramp_consumed_.size()) - 1;
    if (t.train_samples() < ramp_consumed_.back())
      throw HostError("config: train.train_samples " + std::to_string(t.train_samples()) + " ends inside the ramp-up (" +
                      std::to_string(ramp_consumed_.back()) + " samples in " + std::to_string(ramp_iters) +
                      " iterations, train.rampup_batch_size '" + t.rampup_batch_size() + "')");
    train_iters_ = ramp_iters + (t.train_samples() - ramp_consumed_.back()) / gbs_;
  } else if (t.train_samples() > 0) {
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

int64_t BatchPlan::consumed_before(int64_t i) const {
  const int64_t q = i - 1, r = static_cast<int64_t>(ramp_consumed_.size()) - 1;
  return q <= r ? ramp_consumed_[q] : ramp_consumed_[r] + (q - r) * gbs_;
}

int64_t BatchPlan::micro_batches_before(int64_t i) const {
  const int64_t q = i - 1, r = static_cast<int64_t>(ramp_micro_.size()) - 1;
  return q <= r ? ramp_micro_[q] : ramp_micro_[r] + (q - r) * num_micro_;
}

int64_t BatchPlan::train_sample_index(int64_t first_iteration, int64_t k, int64_t j) const {
  const int64_t K = micro_batches_before(first_iteration) + k;  // this rank's micro-batches from the start
  int64_t q = 0, m = 0;  // the 0-based iteration of micro-batch K, and K's place in it
  if (K >= ramp_micro_.back()) {
    const int64_t r = static_cast<int64_t>(ramp_micro_.size()) - 1;
    q = r + (K - ramp_micro_.back()) / num_micro_;
    m = (K - ramp_micro_.back()) % num_micro_;
  } else {
    q = static_cast<int64_t>(std::upper_bound(ramp_micro_.begin(), ramp_micro_.end(), K) - ramp_micro_.begin()) - 1;
    m = K - ramp_micro_[q];
  }
  return consumed_before(q + 1) + m * mbs_ * dp_size_ + dp_rank_ * mbs_ + j;
}

}  // namespace dtk::core
