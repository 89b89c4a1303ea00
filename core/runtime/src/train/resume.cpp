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
                    ") and ramp-up (train.rampup_batch_size)");
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

}  // namespace

TrainProgress resume_from_checkpoint(const config::RunConfig& cfg, const BatchPlan& plan, const Topology& topo,
                                     TrainingParts& parts, LearningRateSchedule& schedule, GradScaler& scaler,
                                     const std::function<void(const std::string&)>& print) {
  const auto& ck = cfg.checkpoint();
  const std::string& dir = ck.load();
  if (dir.empty()) return TrainProgress{};
  LoadOptions what;
  what.optimizer = !ck.no_load_optim() && !ck.finetune();
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
    return TrainProgress{};
  }
  if (!what.optimizer) {
    // Megatron's --no-load-optim skips the scheduler's state with the optimizer's.
    progress.scheduler_step = 0;
    progress.grad_scaler.reset();
    progress.schedule.reset();
    print(" checkpoint.no_load_optim: optimizer state, loss scaler and learning-rate schedule start fresh");
  }
  if (progress.schedule) reconcile_resumed_schedule(*progress.schedule, ck, dir, schedule, print);
  check_progress(progress, plan, dir);
  print(" loaded checkpoint from " + dir + " at iteration " + std::to_string(progress.iteration));
  restore_scaler(progress, scaler, print);
  return progress;
}

}  // namespace dtk::core
