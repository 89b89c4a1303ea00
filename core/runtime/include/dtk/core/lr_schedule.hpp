// dtk/core/lr_schedule.hpp — Megatron's OptimizerParamScheduler learning rate.
#pragma once

#include <cstdint>
#include <string>

#include "dtk_config.pb.h"

namespace dtk::core {

// Linear warmup over warmup_iters, then constant, linear, cosine or inverse-square-root decay
// to min_lr over decay_iters (Megatron's get_lr, step = the scheduler's step count).
double learning_rate(int64_t step, double max_lr, double min_lr, int64_t warmup_iters, int64_t decay_iters,
                     const std::string& style);

// The schedule of one run. As Megatron's scheduler, its step starts at 0 and advances only after
// a successful optimizer update (a skipped iteration keeps the rate).
class LearningRateSchedule {
 public:
  LearningRateSchedule(const config::LrSchedule& lr, int64_t train_iters);
  double rate(int64_t step) const;

 private:
  double max_lr_, min_lr_;
  int64_t warmup_iters_, decay_iters_;
  std::string style_;
};

}  // namespace dtk::core
