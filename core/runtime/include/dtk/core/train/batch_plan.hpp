// dtk/core/train/batch_plan.hpp — how samples become micro-batches: Megatron's batch sizes.
//
//   global batch (gbs) = micro_batch_size (mbs) x data-parallel size (dp) x micro-batches per step
//   iteration i consumes the samples [consumed_before(i), consumed_before(i + 1)) of the split;
//   which samples those are (its micro-batch m of DP rank r reads the m-th after
//   consumed_before(i)) is the sampler's: sample_order.hpp.
//
// With train.rampup_batch_size (Megatron's RampupBatchsizeNumMicroBatches) the global batch of
// an iteration depends on the samples consumed before it: START + INCREMENT x floor(consumed /
// (SAMPLES / increments)) while consumed <= SAMPLES, then gbs. The ramp-up's iterations are
// tabulated; after it every iteration has gbs samples. With train.step_batch_size_schedule
// (Megatron's StepBatchsizeNumMicroBatchesCalculator) the global batch of an iteration is the
// schedule's for the samples consumed before it; the iterations until the last step begins are
// tabulated the same way, and validation and test use the configured global batch
// (micro_batch_size x data-parallel size, Megatron's default under a schedule).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtk/core/components/services.hpp"
#include "dtk/core/config/curriculum.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

class BatchPlan {
 public:
  // Every batch-size check of a run in one place; throws HostError naming the field.
  BatchPlan(const config::RunConfig& cfg, const Topology& topo);

  int64_t micro_batch_size() const { return mbs_; }
  // The configured global batch: every iteration's without a ramp-up or a schedule, the one a
  // ramp-up reaches, and validation's and test's.
  int64_t global_batch_size() const { return gbs_; }
  int64_t micro_batches_per_step() const { return num_micro_; }
  // The global batch changes during the run (a ramp-up or a schedule): the learning-rate
  // schedule counts samples.
  bool ramps_up() const { return varying_batch_; }
  bool steps_batch() const { return scheduled_; }  // train.step_batch_size_schedule
  // The tabulated iterations (of the ramp-up, or before the schedule's last step).
  int64_t ramp_iterations() const { return static_cast<int64_t>(ramp_consumed_.size()) - 1; }
  // "16 from iteration 1, 32 from iteration 5": where the training batch changes, for the log.
  std::string describe_batch_steps() const;
  // The most micro-batches an iteration of this run has (what the pipeline keeps in flight).
  int64_t most_micro_batches() const;
  // Under a step schedule: each batch the run reaches from iteration `first_iteration` on must be
  // whole micro-batches on every rank; throws HostError naming the entry. A run without
  // checkpoint.load or train.consumed_samples is checked from iteration 1 by the constructor; one
  // with them by resume.cpp, from the iteration it resumes at.
  void check_batches_from(int64_t first_iteration) const;
  // A step of train.step_batch_size_schedule the run reaches, and the first iteration it gives.
  struct ReachedStep {
    std::string entry;
    int64_t batch = 0, first_iteration = 0;
  };

  // Iterations count from 1. Samples and micro-batches (of one DP rank) before iteration i, and
  // the global batch of iteration i.
  int64_t consumed_before(int64_t i) const;
  int64_t micro_batches_before(int64_t i) const;
  int64_t global_batch_of(int64_t i) const { return consumed_before(i + 1) - consumed_before(i); }
  int64_t micro_batches_of(int64_t i) const { return micro_batches_before(i + 1) - micro_batches_before(i); }
  // The run's length: what sizes the data and the schedules.
  int64_t train_iters() const { return train_iters_; }
  // The iteration training ends after: train_iters, or the first iteration that brings the
  // consumed tokens to train.train_tokens (Megatron-DeepSpeed's second loop condition).
  int64_t final_iteration() const { return final_iteration_; }
  bool ends_on_tokens() const { return final_iteration_ < train_iters_; }
  // Tokens consumed before iteration i: each sample counts the tokens its iteration trains on,
  // seq_length, or the curriculum's length (train.curriculum_schedule), as Megatron-DeepSpeed counts.
  int64_t tokens_before(int64_t i) const;
  int64_t eval_iters() const { return eval_iters_; }
  // What every sample holds (and validation and test use); training iteration i trains on the
  // first seq_length_of(i) tokens of each.
  int64_t seq_length() const { return seq_length_; }
  int64_t seq_length_of(int64_t i) const { return curriculum_.length_of(i); }
  const SequenceCurriculum& curriculum() const { return curriculum_; }

  // Samples each split must provide for the whole run (Megatron's train_val_test_num_samples):
  // validation runs every eval_interval iterations plus once at the end; test once.
  int64_t train_samples() const { return consumed_before(train_iters_ + 1); }
  // What the train split is asked for (Megatron's train_val_test_num_samples[0], part of its
  // cache names): train.train_samples itself in a run sized in samples (a partial global batch
  // after the last iteration included; under a step schedule the last iteration may read past
  // them, and the split must then hold what it reads), train_samples() otherwise.
  int64_t requested_train_samples() const {
    return skip_train_ ? 0 : samples_flag_ > 0 ? samples_flag_ : train_samples();
  }
  // eval.skip_train (Megatron's --skip-train): no training, one evaluation of each split.
  bool skip_train() const { return skip_train_; }
  // eval.full_validation: both evaluation splits are asked for whole (their count is then 0).
  int64_t valid_samples() const { return full_validation_ ? 0 : num_evals_ * eval_iters_ * gbs_; }
  int64_t test_samples() const { return full_validation_ ? 0 : eval_iters_ * gbs_; }
  bool full_validation() const { return full_validation_; }
  // eval.validation_sets (which need full validation): validation reads them, each a dataset of
  // its own, and the run's dataset is not asked for its validation split.
  bool has_validation_sets() const { return validation_sets_; }
  // dtk_dataset_context.whole_splits (ABI 2.17): bit (1 << split) for each split read whole.
  uint32_t whole_splits() const {
    if (!full_validation_) return 0u;
    return (validation_sets_ ? 0u : 1u << DTK_SPLIT_VALID) | (1u << DTK_SPLIT_TEST);
  }
  // Whether the loop validates after iteration i: every eval_interval iterations, the last
  // included, as Megatron's loop does; the run's final validation then reads the next samples (the
  // valid split holds train_iters / eval_interval + 1 evaluations for that). One rule for the loop
  // and for train.consumed_samples' continuation (how many validation samples a run consumed).
  bool validates_after(int64_t i) const { return eval_interval_ > 0 && i % eval_interval_ == 0; }
  int64_t validations_through(int64_t n) const { return eval_interval_ > 0 ? n / eval_interval_ : 0; }

 private:
  // The first iteration after which `samples` have been consumed.
  int64_t iteration_reaching(int64_t samples) const;
  // The first iteration after which `tokens` have been consumed (train_iters if none).
  int64_t iteration_reaching_tokens(int64_t tokens) const;
  void check_curriculum_split(const config::RunConfig& cfg, const Topology& topo) const;
  // The ramp-up's (schedule's) iterations q = 0..R (0-based): samples and micro-batches before
  // each; one entry ({0}) without either.
  std::vector<int64_t> ramp_consumed_{0}, ramp_micro_{0};
  std::vector<ReachedStep> reached_steps_;  // under a step schedule, in the order reached
  int64_t mbs_ = 1, gbs_ = 1, num_micro_ = 1;
  // The training batch after the table (gbs_, or the schedule's last batch) and its micro-batches.
  int64_t tail_gbs_ = 1, tail_micro_ = 1;
  bool varying_batch_ = false, scheduled_ = false, full_validation_ = false, skip_train_ = false,
       validation_sets_ = false;
  int64_t train_iters_ = 0, final_iteration_ = 0, eval_iters_ = 0, eval_interval_ = 0, num_evals_ = 1, seq_length_ = 0;
  int64_t dp_size_ = 1;
  int64_t samples_flag_ = 0;  // train.train_samples (0: the run is sized in iterations)
  SequenceCurriculum curriculum_;
  std::vector<int64_t> stage_tokens_;  // the tokens before each of the curriculum's stages
};

}  // namespace dtk::core
