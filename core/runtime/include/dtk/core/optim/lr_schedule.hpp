// dtk/core/optim/lr_schedule.hpp — Megatron's OptimizerParamScheduler learning rate.
#pragma once

#include <cstdint>
#include <string>

#include "dtk_config.pb.h"

namespace dtk::core {

// Megatron's get_lr, in iterations (Megatron counts samples; every length there is a multiple of
// the global batch size, so the ratios are the same):
//   warm-up: init_lr -> max_lr linearly over warmup iterations (steps <= warmup);
//   then constant, or past decay_iters min_lr, or inverse-square-root, linear, cosine or WSD
//   decay to min_lr. WSD keeps max_lr until the last wsd_decay_iters of decay_iters, then decays
//   as wsd_style: exponential, linear, cosine or minus_sqrt.
// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR (deepspeed_learning_rate) as styles too.
struct LrParams {
  double max_lr = 0, min_lr = 0, init_lr = 0;
  double warmup_iters = 0;  // lr_warmup_iters, or lr_warmup_fraction x decay_iters
  int64_t decay_iters = 0;
  std::string style = "cosine";
  std::string warmup_style = "linear";  // or DeepSpeed's "log"
  std::string wsd_style = "exponential";
  int64_t wsd_decay_iters = 0;
  // Megatron's get_wd: start_wd -> end_wd as wd_style ("constant", "linear", "cosine") over
  // wd_incr_iters (the whole run), then end_wd. has_wd: false for a checkpoint written before
  // DTK saved it (nothing to compare on resume).
  double start_wd = 0, end_wd = 0;
  std::string wd_style = "constant";
  double wd_incr_iters = 0;
  bool has_wd = true;
};
double learning_rate(int64_t step, const LrParams& p);

double weight_decay(int64_t step, const LrParams& p);
// The common case (no init_lr, no WSD).
double learning_rate(int64_t step, double max_lr, double min_lr, int64_t warmup_iters, int64_t decay_iters,
                     const std::string& style);

// The schedule of one run. As Megatron's scheduler, its step starts at 0 and advances only after
// a successful optimizer update (a skipped iteration keeps the rate).
class LearningRateSchedule {
 public:
  // train_iters: the run's length (the weight-decay schedule spans it).
  LearningRateSchedule(const config::LrSchedule& lr, int64_t train_iters);
  double rate(int64_t step) const { return learning_rate(step, params_); }
  // The weight decay at `step` relative to its end value (the optimizer groups' weight_decay):
  // dtk_optimizer_step_args.weight_decay_scale. 1 for a constant schedule.
  double weight_decay_scale(int64_t step) const {
    return reference_wd_ > 0 ? weight_decay(step, params_) / reference_wd_ : 1.0;
  }
  // The weight decay the optimizer groups were built with (the config's end value).
  double reference_weight_decay() const { return reference_wd_; }
  bool weight_decay_varies() const { return params_.wd_style != "constant" && params_.start_wd != params_.end_wd; }
  const LrParams& params() const { return params_; }
  // The checkpoint's schedule, on request (a checkpoint without a weight-decay schedule keeps
  // this run's; one whose weight decay is not a multiple of the groups' is refused).
  void set_params(const LrParams& p);

 private:
  LrParams params_;
  double reference_wd_ = 0;
};

}  // namespace dtk::core
