// dtk/core/optim/lr_schedule.hpp — Megatron's OptimizerParamScheduler learning rate.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "dtk_config.pb.h"

namespace dtk::core {

// Megatron's get_lr, in iterations (Megatron counts samples; every length there is a multiple of
// the global batch size, so the ratios are the same):
//   warm-up: init_lr -> max_lr linearly over warmup iterations (steps <= warmup);
//   then constant, or past decay_iters min_lr, or inverse-square-root, linear, cosine or WSD
//   decay to min_lr. WSD keeps max_lr until the last wsd_decay_iters of decay_iters, then decays
//   as wsd_style: exponential, linear, cosine or minus_sqrt.
// DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest and OneCycle
// (deepspeed_learning_rate) as styles too.

// DeepSpeed's LRRangeTest and OneCycle (lr_schedules.py; the config's lr.lr_range_test_* and
// lr.cycle_* / decay_*, DeepSpeed's defaults when unset). LRRangeTest starts at max_lr (lr.lr),
// OneCycle cycles between min_lr and max_lr.
struct CycleParams {
  double range_step_size = 2000, range_step_rate = 1;
  bool range_staircase = false;
  double first_step = 2000, second_step = 2000;  // the cycle's rising and falling halves
  int64_t first_stairs = 0, second_stairs = 0;   // 0: continuous
  double decay_step = 0, decay_lr_rate = 0, decay_mom_rate = 0;
  bool momentum = true;  // cycle Adam's beta1 (an optimizer with betas only)
  double min_mom = 0.8, max_mom = 0.9;
};

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
  // Megatron-DeepSpeed's token-counted warm-up and decay (lr_warmup_tokens, lr_decay_tokens);
  // unset: counted in steps.
  std::optional<int64_t> warmup_tokens, decay_tokens;
  // Samples per step when the schedule counts iterations (the global batch; 1 when it counts
  // samples): Megatron counts samples, and inverse-square-root's max(warm-up, 1) and max(step, 1)
  // differ in the two units without a warm-up. This run's plan, not saved.
  double step_samples = 1;
  CycleParams cycle;  // LRRangeTest, OneCycle
};

// Adam's betas for one update (dtk_optimizer_step_args.has_betas).
struct AdamBetas {
  double beta1 = 0, beta2 = 0;
};
// OneCycle's betas at `step` when it cycles momentum: beta1 against the rate, beta2 0.99.
std::optional<AdamBetas> cycled_betas(int64_t step, const LrParams& p);
// Whether the schedule hands the optimizer its betas (OneCycle with cycle_momentum).
inline bool cycles_momentum(const LrParams& p) { return p.style == "OneCycle" && p.cycle.momentum; }

// Where the scheduler stands (Megatron's num_steps and num_tokens): the updates it has followed
// (samples during a ramp-up) and the tokens consumed before the last of them (Megatron-DeepSpeed
// steps its scheduler before it adds the iteration's tokens). warmup_end_tokens: under a
// token-counted decay after a step-counted warm-up, the tokens at the update that completed the
// warm-up (Megatron-DeepSpeed's lr_warmup_tokens, set then); -1 before it.
struct SchedulePosition {
  int64_t step = 0;
  int64_t tokens = 0;
  int64_t warmup_end_tokens = -1;
};
double learning_rate(const SchedulePosition& at, const LrParams& p);
inline double learning_rate(int64_t step, const LrParams& p) { return learning_rate(SchedulePosition{step}, p); }

double weight_decay(int64_t step, const LrParams& p);
// The config's LRRangeTest and OneCycle settings, DeepSpeed's defaults where unset.
CycleParams cycle_params(const config::LrSchedule& lr);
// The common case (no init_lr, no WSD).
double learning_rate(int64_t step, double max_lr, double min_lr, int64_t warmup_iters, int64_t decay_iters,
                     const std::string& style);

// The schedule of one run. As Megatron's scheduler, its step starts at 0 and advances only after
// a successful optimizer update (a skipped iteration keeps the rate).
class LearningRateSchedule {
 public:
  // train_iters: the run's length (the weight-decay schedule spans it).
  LearningRateSchedule(const config::LrSchedule& lr, int64_t train_iters);
  double rate(const SchedulePosition& at) const { return learning_rate(at, params_); }
  double rate(int64_t step) const { return rate(SchedulePosition{step}); }  // no tokens consumed
  // This update's Adam betas when the schedule sets them (OneCycle's momentum cycling).
  std::optional<AdamBetas> betas(const SchedulePosition& at) const { return cycled_betas(at.step, params_); }
  // The rate of a parameter group with its own peak and floor (lr.param_rules max_lr/min_lr;
  // Megatron-LM's param-group max_lr/min_lr): the same schedule between them.
  double rate(const SchedulePosition& at, double max_lr, double min_lr) const;
  // Megatron's scheduler step after a successful update: `increment` steps (1, or the global
  // batch's samples during a ramp-up), `tokens_before` consumed before the update's iteration.
  void advance(SchedulePosition& at, int64_t increment, int64_t tokens_before) const;
  // Whether the schedule counts tokens anywhere (the trainer then tells it what was consumed).
  bool counts_tokens() const { return params_.warmup_tokens || params_.decay_tokens; }
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
