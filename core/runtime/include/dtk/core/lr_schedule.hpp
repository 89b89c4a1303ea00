// dtk/core/lr_schedule.hpp — Megatron's OptimizerParamScheduler learning rate.
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
struct LrParams {
  double max_lr = 0, min_lr = 0, init_lr = 0;
  double warmup_iters = 0;  // lr_warmup_iters, or lr_warmup_fraction x decay_iters
  int64_t decay_iters = 0;
  std::string style = "cosine";
  std::string wsd_style = "exponential";
  int64_t wsd_decay_iters = 0;
};
double learning_rate(int64_t step, const LrParams& p);
// The common case (no init_lr, no WSD).
double learning_rate(int64_t step, double max_lr, double min_lr, int64_t warmup_iters, int64_t decay_iters,
                     const std::string& style);

// The schedule of one run. As Megatron's scheduler, its step starts at 0 and advances only after
// a successful optimizer update (a skipped iteration keeps the rate).
class LearningRateSchedule {
 public:
  LearningRateSchedule(const config::LrSchedule& lr, int64_t train_iters);
  double rate(int64_t step) const { return learning_rate(step, params_); }
  const LrParams& params() const { return params_; }
  void set_params(const LrParams& p) { params_ = p; }  // the checkpoint's schedule, on request

 private:
  LrParams params_;
};

}  // namespace dtk::core
