// The pretrain pipeline, top to bottom, as Megatron's pretrain():
//   initialize -> setup model, strategy, optimizer -> build data iterators   (Trainer's constructor)
//   -> train loop (micro-batches: forward step + backward; reduce grads; clip; optimizer step;
//      log; periodic evaluation and checkpoint)                               (Trainer::train)
//   -> final evaluation on valid and test                                    (Trainer::final_evaluation)
// The pieces: core/trainer (the loop), core/batch_plan (batch sizes, sampler), core/batch_loader
// (prefetched micro-batches), core/lr_schedule, core/flops, core/training_log (log line,
// TensorBoard), core/checkpoint, core/components (one wrapper per plugin kind).
#include "dtk/core/train/pretrain.hpp"

#include <cstdio>
#include <filesystem>

#include "dtk/core/checkpoint/checkpoint_model.hpp"
#include "dtk/core/checkpoint/layout.hpp"
#include "dtk/core/launch/distributed.hpp"
#include "dtk/core/timeline/trace.hpp"
#include "dtk/core/train/exit_conditions.hpp"
#include "dtk/core/train/trainer.hpp"
#include "dtk/host/plugin_host.hpp"

namespace dtk::core {

namespace {

// Bench mode (train.bench_steps) runs the first perf_warmup_steps + bench_steps iterations of
// the configured run: the same learning-rate schedule (its decay length stays that of the full
// run), no evaluation, no checkpoint.
config::RunConfig bench_config(const config::RunConfig& cfg) {
  config::RunConfig run = cfg;
  const auto& t = cfg.train();
  if (t.bench_steps() <= 0) return run;
  if (t.bench_steps() < 0 || t.perf_warmup_steps() < 0)
    throw host::HostError("config: train.bench_steps and train.perf_warmup_steps must be >= 0");
  if (t.train_samples() > 0)
    throw host::HostError("config: train.bench_steps runs the first iterations of a run given by train.train_iters; "
                          "drop train.train_samples");
  if (!cfg.checkpoint().load().empty())
    throw host::HostError("config: train.bench_steps measures a fresh run; drop checkpoint.load");
  if (cfg.eval().skip_train())
    throw host::HostError("config: train.bench_steps measures training; drop eval.skip_train");
  if (cfg.lr().lr_decay_iters() == 0) run.mutable_lr()->set_lr_decay_iters(t.train_iters());
  run.mutable_train()->set_train_iters(t.perf_warmup_steps() + t.bench_steps());
  run.mutable_train()->set_train_tokens(0);  // bench_steps decides the length, as it does over train_iters
  run.mutable_eval()->set_eval_interval(0);
  run.mutable_eval()->set_eval_iters(0);
  run.mutable_eval()->set_full_validation(false);
  run.mutable_eval()->clear_validation_sets();  // (they read whole sets, which need full validation)
  run.mutable_checkpoint()->clear_save();
  run.mutable_checkpoint()->set_save_interval(0);
  return run;
}

// checkpoint.load_if_present: a load folder with nothing in it yet is no load at all. Returns the
// line that says so, "" when the run loads as configured.
std::string start_fresh_without_checkpoint(config::RunConfig* run) {
  const auto& ck = run->checkpoint();
  if (!ck.load_if_present() || ck.load().empty() || ck.finetune() || ck.use_checkpoint_args()) return "";
  namespace fs = std::filesystem;
  std::error_code ec;
  // Anything else (a file, a folder that cannot be read, a save begun) is the load's to report.
  const bool exists = fs::exists(ck.load(), ec);
  if (ec) return "";
  if (exists) {
    if (!fs::is_directory(ck.load(), ec) || fs::exists(checkpoint_tracker_file(ck.load()), ec) || ec) return "";
    fs::directory_iterator entries(ck.load(), ec);
    if (ec) return "";
    // (A crashed save's temporary, iter_N.tmp-..., is garbage the save cleans up: not a save.)
    for (const auto& entry : entries)
      if (iteration_of(entry.path().filename().string()) >= 0) return "";
  }
  const std::string line = "checkpoint.load '" + ck.load() +
                           "' holds no checkpoint yet: the run starts from scratch (checkpoint.load_if_present)";
  run->mutable_checkpoint()->clear_load();
  run->mutable_checkpoint()->clear_fallback();  // (a fallback needs a load: there is none to fall back from)
  return line;
}

}  // namespace

int pretrain(const config::RunConfig& cfg, host::PluginHost& plugins, TrainerHooks hooks) {
  // From here a signal of train.save_on_signals is handled: before the loop it ends the run with a
  // line saying so, in the loop it saves and stops (exit_conditions.hpp).
  const StartupSignals signals(cfg.train());
  config::RunConfig run = bench_config(cfg);
  if (run.eval().skip_train()) {
    // Megatron's --skip-train saves nothing and writes its evaluations to no TensorBoard (which
    // may be the training run's folder).
    run.mutable_checkpoint()->clear_save();
    run.mutable_checkpoint()->set_save_interval(0);
    run.mutable_logging()->clear_tensorboard_dir();
  }
  if (const std::string fresh = start_fresh_without_checkpoint(&run);
      !fresh.empty() && launch_env_from_environment().rank == 0)
    std::fprintf(stderr, "dtk: note: %s\n", fresh.c_str());
  // The checkpoint's model against this run's, before anything is built (checkpoint_model.hpp).
  const std::string adopted = reconcile_checkpoint_model(run, plugins);
  if (!adopted.empty() && launch_env_from_environment().rank == 0) {
    std::printf("%s\n", adopted.c_str());
    std::fflush(stdout);
  }
  // Nothing is written into a folder holding another run's checkpoints unless asked.
  if (const std::string other = save_folder_owner_difference(run, plugins); !other.empty())
    throw host::HostError(other);
  Trainer trainer(run, plugins, std::move(hooks));
  trainer.train();
  if (!trainer.stopped_early()) trainer.final_evaluation();
  shutdown_distributed();
  // After the final save, evaluation and shutdown: the trace is lost, nothing else is.
  if (const std::string failed = trace::failed_write(); !failed.empty())
    throw host::HostError("logging.trace_file: could not write " + failed + " (the run itself completed)");
  return 0;
}

}  // namespace dtk::core
