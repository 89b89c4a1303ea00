// dtk/core/train/resume.hpp — Megatron's load_checkpoint at the end of setup_model_and_optimizer:
// the model, optimizer and strategy state of checkpoint.load, then what the loop resumes from
// (iteration, consumed samples, scheduler step, loss scaler), checked against this run's plan and
// learning-rate schedule. --finetune starts a run of its own from the weights; --no-load-optim
// starts the optimizer, the scaler and the schedule fresh.
#pragma once

#include <functional>
#include <string>

#include "dtk/core/checkpoint/checkpoint.hpp"
#include "dtk/core/optim/grad_scaler.hpp"
#include "dtk/core/optim/lr_schedule.hpp"
#include "dtk/core/train/batch_plan.hpp"
#include "dtk/core/train/run_setup.hpp"

namespace dtk::core {

// Where the loop starts: iteration 0 without checkpoint.load. `print` writes the run's lines.
TrainProgress resume_from_checkpoint(const config::RunConfig& cfg, const BatchPlan& plan, const Topology& topo,
                                     TrainingParts& parts, LearningRateSchedule& schedule, GradScaler& scaler,
                                     const std::function<void(const std::string&)>& print);

}  // namespace dtk::core
