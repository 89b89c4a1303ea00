// dtk/core/checkpoint/checkpoint.hpp — Megatron-layout checkpoints.
//
//   {save}/latest_checkpointed_iteration.txt          the iteration of the newest complete checkpoint
//   {save}/iter_0000004/mp_rank_00/model_optim_rng.pt  one file per tensor-parallel rank
//   {save}/iter_0000004/SHA256SUMS                     each file's SHA-256 (`sha256sum -c SHA256SUMS`)
//
// Each file is a LibTorch pickle (torch::pickle_save, the zip format of torch.save) of a dict:
//   "model" {name: tensor}, "optimizer" {name: tensor}, "strategy" {name: tensor},
//   "iteration", "consumed_train_samples", "consumed_valid_samples", "scheduler_step" (int), the
//   token-counted scheduler's "scheduler_tokens", "scheduler_warmup_end_tokens" (int),
//   "rng" (the host's default CPU generator state, uint8), "tensor_model_parallel_size",
//   "config" (the RunConfig in text format), "dtk_version", "num_floating_point_operations_so_far"
//   (a float, as Megatron's). A save without the optimizer's state
//   (SaveOptions) has empty "optimizer" and "strategy" dicts, no "opt_param_scheduler" or
//   "grad_scaler", and "no_save_optim": True; one without the RNG's has no "rng" ("cuda_rng").
// Python opens it with torch.load(path).
//
// Atomicity: the ranks write into {save}/iter_X.tmp-<pid of rank 0>/, fsync every file, then
// world rank 0 renames (atomically exchanges, when replacing) the directory into place and
// rewrites latest_checkpointed_iteration.txt through a temporary file + fsync + rename. A crash at
// any point leaves the previous checkpoint or the new one, never a half one; leftover *.tmp-*
// entries of a crashed save are never read (load follows the tracker file) and may be deleted.
//
// Data-parallel rank 0 writes model_optim_rng.pt. A strategy whose state is sharded over
// data-parallel ranks (dtk_strategy_info.sharded_state: zero) also has every DP rank write
//   {save}/iter_0000004/mp_rank_00/optim_dp_rank_001.pt
// ("optimizer", "strategy", "param_slices": name -> [offset, numel, full_numel], "data_parallel_rank",
// "data_parallel_size"), the main file then recording "optimizer_shards" and empty "optimizer" and
// "strategy" dicts. Loading re-partitions such state for this rank's layout (checkpoint_shards.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtk/core/components/components.hpp"
#include "dtk/core/optim/grad_scaler.hpp"
#include "dtk/core/optim/lr_schedule.hpp"
#include "dtk/core/components/services.hpp"
#include "dtk/core/checkpoint/layout.hpp"

namespace dtk::core {

struct TrainProgress {
  int64_t iteration = 0;
  int64_t consumed_train_samples = 0;
  int64_t consumed_valid_samples = 0;
  // The learning-rate scheduler's position (saved as "scheduler_step", "scheduler_tokens" and
  // "scheduler_warmup_end_tokens"; a checkpoint older than token counting reads tokens -1).
  SchedulePosition scheduler;
  // A dynamic loss scaler's state (Megatron's optimizer 'grad_scaler' entry): saved when the run
  // has one, restored when the checkpoint has it.
  std::optional<GradScaler::State> grad_scaler;
  // The learning-rate schedule the run trained with (Megatron's opt_param_scheduler entry), to
  // refuse resuming with another one unless told which to use; absent in older checkpoints.
  std::optional<LrParams> schedule;
  // The floating-point operations trained so far, by the FLOPs model of the log line (Megatron's
  // "num_floating_point_operations_so_far"; 0 in older checkpoints): progress.txt's count.
  double floating_point_operations = 0;
};

// What load_checkpoint restores besides the model: Megatron's --no-load-optim (optimizer state and
// loss scaler start fresh; fp32 master weights still load, they are weights) and --no-load-rng.
struct LoadOptions {
  bool optimizer = true;
  bool rng = true;
  // Each file's SHA-256 checked against the iteration's SHA256SUMS (checkpoint.no_verify_checksums
  // turns it off); checkpoints without a manifest load unverified.
  bool verify = true;
  // checkpoint.fallback: when the tracker's iteration cannot be loaded on some rank (damaged,
  // missing, incomplete), the newest older complete one is loaded instead, and said so.
  bool fallback = false;
};

// What save_checkpoint writes besides the model and the progress: Megatron's --no-save-optim
// leaves out the optimizer plugin's state, the strategy's (fp32 masters), the loss scaler and the
// schedule (the main file then records "no_save_optim": true); --no-save-rng the generators'
// states ("rng", "cuda_rng"). keep_last > 0: older iterations beyond the newest keep_last are
// removed after publication (never the tracker's; checkpoint_catalog.hpp).
struct SaveOptions {
  bool optimizer = true;
  bool rng = true;
  int64_t keep_last = 0;
};

struct SaveReport {
  std::string dir;     // the iteration directory
  double megabytes = 0;  // this rank's file (all TP ranks' files summed on world rank 0)
  double seconds = 0;
  double blocked_seconds = 0;    // an AsyncSave's: the time training waited for it (seconds otherwise)
  std::vector<int64_t> removed;  // iterations removed by keep_last (world rank 0)
};

// Called by every rank (collective: bounded world barriers around the write). Only data-parallel
// rank 0 of each tensor-parallel rank writes. Throws HostError naming the path on failure. What
// wrote the checkpoint is recorded with it: the resolved config (`config_text`: plugins, their
// options, the parallel layout), `writers` (each plugin's name, version and ABI) and DTK's
// version. Each file's SHA-256 goes into the iteration's SHA256SUMS (sha256sum's format) before the
// directory is published.
SaveReport save_checkpoint(const std::string& save_dir, const TrainProgress& progress, const ModelInstance& model,
                           const OptimizerInstance& optimizer, StrategyInstance& strategy,
                           const std::string& config_text, const std::vector<std::string>& writers,
                           const Topology& topo, const SaveOptions& what = {});

// checkpoint.async_save (Megatron's --async-save): a save whose files a background thread writes
// while training goes on. Starting it is collective and copies the state out (to host memory, as
// save_checkpoint does before writing); the thread only writes files (no collective, no tensor of
// the run). Every rank then calls written_everywhere() at the same points (collective) and
// finish() once, when it said true or to wait: finish publishes as save_checkpoint does (same
// files, same atomicity) and reports. Destroyed unfinished (an error elsewhere), it waits for the
// thread and publishes nothing: the tracker keeps naming the last complete checkpoint and the
// temporary directory goes at a later save or load (remove_stale_temporaries).
class AsyncSave {
 public:
  AsyncSave(const std::string& save_dir, const TrainProgress& progress, const ModelInstance& model,
            const OptimizerInstance& optimizer, StrategyInstance& strategy, const std::string& config_text,
            const std::vector<std::string>& writers, const Topology& topo, const SaveOptions& what = {});
  ~AsyncSave();
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;

  int64_t iteration() const;
  // Collective: whether every rank's thread has written its files (never waits for them).
  bool written_everywhere();
  // Collective: waits for this rank's thread, then publishes. SaveReport.seconds is this rank's
  // writing time; blocked_seconds what the caller spent in the constructor and in finish. Throws
  // HostError (every rank) when a rank's write or the publication failed.
  SaveReport finish();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Called by every rank (collective). Restores model (strict), optimizer, strategy and the host
// RNG from this rank's file and returns the progress counters. Every bad input is one HostError
// naming the file (or tensor); so is a checkpoint saved without the optimizer's (the RNG's) state
// when `what` asks for it. With what.fallback, each iteration skipped is described in
// `skipped` ("iteration 8: <why>; falling back to iteration 6").
TrainProgress load_checkpoint(const std::string& load_dir, ModelInstance& model, OptimizerInstance& optimizer,
                              StrategyInstance& strategy, const Topology& topo, const LoadOptions& what = {},
                              std::vector<std::string>* skipped = nullptr);

// A weights-only checkpoint at iteration 0 written by one process (tensor-parallel size 1): what
// `dtk import hf` produces, loaded with checkpoint.finetune=true (or no_load_optim). Same layout,
// SHA256SUMS and atomic publication as save_checkpoint; `save_dir` gets its tracker.
void write_weights_checkpoint(const std::string& save_dir, const TensorList& model_state,
                              const std::string& config_text, const std::vector<std::string>& writers);

// Removes the temporaries of saves whose process has died (`iter_N.tmp-HOST-PID` directories,
// `latest_checkpointed_iteration.txt.tmp-HOST-PID` files of this machine, and the older
// `.tmp-PID` form): a crash or a full disk otherwise leaves them forever. A live process's are
// kept. Called by world rank 0 before each save and when loading. Returns how many went.
int remove_stale_temporaries(const std::string& dir);

}  // namespace dtk::core
