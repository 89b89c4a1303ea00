// dtk/core/train/run_schedule.hpp — the learning-rate schedule of one run in the units its batch
// plan counts, and the choice between it and a resumed checkpoint's.
//
// With a batch-size ramp-up Megatron's scheduler counts samples (iterations differ in size), so
// every length is in samples; without one every iteration is one global batch and the schedule
// counts iterations, a sample length then being a whole number of global batches.
#pragma once

#include <functional>
#include <string>

#include "dtk/core/optim/lr_schedule.hpp"
#include "dtk/core/train/batch_plan.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

// The run's schedule from cfg.lr() and the plan; throws HostError for lengths that cannot be
// (a warm-up not shorter than the decay, a sample count that is no whole number of batches).
LearningRateSchedule make_run_schedule(const config::RunConfig& cfg, const BatchPlan& plan);
// OneCycle's momentum decay moves beta1 by decay_mom_rate x (updates past the cycle /
// decay_step_size) of cycle_max_mom; Adam needs it in [0, 1) at every update of the run (1 -
// beta1^t is the bias correction's divisor). For a run that hands the optimizer the betas, with
// the schedule that runs (a checkpoint's, on request). DeepSpeed does not check.
void check_cycled_momentum(const LrParams& p, int64_t train_iters);

// Megatron's OptimizerParamScheduler._check_and_set on load: the schedule must be the one the
// checkpoint in `dir` trained with (what decides the rates; the WSD fields only under WSD) unless
// checkpoint.override_opt_param_scheduler (this run's) or use_checkpoint_opt_param_scheduler (the
// checkpoint's, set into `schedule`) says which. `print` tells the user which was taken.
void reconcile_resumed_schedule(const LrParams& saved, const config::CheckpointConfig& ck, const std::string& dir,
                                LearningRateSchedule& schedule, const std::function<void(const std::string&)>& print);

}  // namespace dtk::core
