#include "dtk/core/train/resume.hpp"

#include <cstdio>
#include <vector>

#include "dtk/core/train/run_schedule.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace {

// The checkpoint's progress must be one this run's plan reaches: the same global batch and ramp-up.
void check_progress(const TrainProgress& progress, const BatchPlan& plan, const std::string& dir) {
  if (progress.iteration < 0 || progress.iteration > plan.train_iters())
    throw HostError("checkpoint in " + dir + " is at iteration " + std::to_string(progress.iteration) +
                    (progress.iteration < 0 ? "" : ", beyond train.train_iters " + std::to_string(plan.train_iters())));
  const int64_t gbs = plan.global_batch_size();
  if (progress.consumed_train_samples != plan.consumed_before(progress.iteration + 1) ||
      progress.consumed_valid_samples % gbs != 0)
    throw HostError("checkpoint in " + dir + " consumed " + std::to_string(progress.consumed_train_samples) +
                    " train samples in " + std::to_string(progress.iteration) +
                    " iterations: resuming needs the same global batch size (" + std::to_string(gbs) +
                    "), ramp-up (train.rampup_batch_size) and schedule (train.step_batch_size_schedule)");
}

void restore_scaler(const TrainProgress& progress, GradScaler& scaler,
                    const std::function<void(const std::string&)>& print) {
  if (!scaler.dynamic()) return;
  if (progress.grad_scaler) {
    scaler.load(*progress.grad_scaler);
    return;
  }
  char buf[160];
  std::snprintf(buf, sizeof buf, " the checkpoint has no loss-scaler state: the scale starts at %.6g", scaler.scale());
  print(buf);
}

// The scheduler's position after iterations 1..n all updated (a run that came from elsewhere, or
// a checkpoint from before DTK counted tokens, has no record of skipped ones).
SchedulePosition replayed_position(int64_t n, const BatchPlan& plan, const LearningRateSchedule& schedule) {
  SchedulePosition at;
  for (int64_t i = 1; i <= n; ++i)
    schedule.advance(at, plan.ramps_up() ? plan.global_batch_of(i) : 1, plan.tokens_before(i));
  return at;
}

// train.consumed_samples: where a run that consumed that many samples stood after its last
// iteration N, as this run's own loop would have left it (scheduler position, validation samples).
TrainProgress continuation_of(int64_t consumed, const BatchPlan& plan, const LearningRateSchedule& schedule) {
  int64_t n = 0;
  while (n < plan.train_iters() && plan.consumed_before(n + 1) < consumed) ++n;
  if (plan.consumed_before(n + 1) != consumed) {
    std::string why = "config: train.consumed_samples " + std::to_string(consumed) + " is ";
    if (consumed > plan.train_samples())
      why += "beyond this run's " + std::to_string(plan.train_samples()) + " training samples";
    else
      why += "not at an iteration boundary: iteration " + std::to_string(n - 1) + " ends at " +
             std::to_string(plan.consumed_before(n)) + " samples, iteration " + std::to_string(n) + " at " +
             std::to_string(plan.consumed_before(n + 1));
    throw HostError(why);
  }
  TrainProgress p;
  p.iteration = n;
  p.consumed_train_samples = consumed;
  p.scheduler = replayed_position(n, plan, schedule);
  p.consumed_valid_samples = plan.validations_through(n) * plan.eval_iters() * plan.global_batch_size();
  return p;
}

TrainProgress load_progress(const config::RunConfig& cfg, const BatchPlan& plan, const Topology& topo,
                            TrainingParts& parts, LearningRateSchedule& schedule, GradScaler& scaler,
                            const std::function<void(const std::string&)>& print) {
  const auto& ck = cfg.checkpoint();
  const std::string& dir = ck.load();
  if (dir.empty()) return TrainProgress{};
  LoadOptions what;
  // eval.skip_train updates nothing: the model alone (as Megatron, which builds no optimizer then).
  const bool skip_train = cfg.eval().skip_train();
  what.optimizer = !ck.no_load_optim() && !ck.finetune() && !skip_train;
  what.rng = !ck.no_load_rng() && !ck.finetune();
  what.verify = !ck.no_verify_checksums();
  what.fallback = ck.fallback();
  std::vector<std::string> skipped;
  TrainProgress progress = load_checkpoint(dir, *parts.model, *parts.optimizer, *parts.strategy, topo, what, &skipped);
  for (const auto& s : skipped) print(" checkpoint.fallback: " + s);
  if (ck.finetune()) {
    // Megatron's --finetune: the weights, and a run of its own from iteration 0.
    print(" finetuning from the model of " + dir + " at iteration " + std::to_string(progress.iteration) +
          ": optimizer, scheduler and RNG start fresh, training starts at iteration 0");
    // The operations trained so far stay (Megatron reads them under --finetune too).
    TrainProgress fresh;
    fresh.floating_point_operations = progress.floating_point_operations;
    return fresh;
  }
  if (skip_train) {  // the Trainer starts its validation at the split's first sample
    print(" loaded the model of " + dir + " at iteration " + std::to_string(progress.iteration) +
          " to evaluate it (eval.skip_train)");
    return progress;
  }
  if (!what.optimizer) {
    // Megatron's --no-load-optim skips the scheduler's state with the optimizer's.
    progress.scheduler = SchedulePosition{};
    progress.grad_scaler.reset();
    progress.schedule.reset();
    print(" checkpoint.no_load_optim: optimizer state, loss scaler and learning-rate schedule start fresh");
  }
  if (progress.schedule) reconcile_resumed_schedule(*progress.schedule, ck, dir, schedule, print);
  check_progress(progress, plan, dir);
  if (progress.scheduler.tokens <
      0) {  // a checkpoint from before DTK counted tokens: its steps, tokens as if none was skipped
    const int64_t steps = progress.scheduler.step;
    progress.scheduler = replayed_position(progress.iteration, plan, schedule);
    progress.scheduler.step = steps;
  }
  print(" loaded checkpoint from " + dir + " at iteration " + std::to_string(progress.iteration));
  restore_scaler(progress, scaler, print);
  return progress;
}

}  // namespace

TrainProgress resume_from_checkpoint(const config::RunConfig& cfg, const BatchPlan& plan, const Topology& topo,
                                     TrainingParts& parts, LearningRateSchedule& schedule, GradScaler& scaler,
                                     const std::function<void(const std::string&)>& print) {
  const int64_t consumed = cfg.train().consumed_samples();
  if (consumed > 0 && !cfg.checkpoint().load().empty() && !cfg.checkpoint().finetune())
    throw HostError("config: train.consumed_samples continues a run from weights without DTK progress (a fresh "
                    "model, or checkpoint.load with checkpoint.finetune=true); the checkpoint in " +
                    cfg.checkpoint().load() + " resumes on its own count of consumed samples");
  TrainProgress progress = load_progress(cfg, plan, topo, parts, schedule, scaler, print);
  if (consumed > 0) {
    progress = continuation_of(consumed, plan, schedule);
    print(" train.consumed_samples: continuing a run that consumed " + std::to_string(consumed) +
          " train samples; training starts after iteration " + std::to_string(progress.iteration) +
          " (learning-rate schedule and sample order from there)");
  }
  // The batches this run still trains (a step schedule's may be reached on other ranks than the
  // ones that trained the first iterations; batch_plan.hpp).
  plan.check_batches_from(progress.iteration + 1);
  return progress;
}

}  // namespace dtk::core
