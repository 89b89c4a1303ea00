#include "dtk/core/train/batch_plan.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "dtk/core/config/config.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace {

// The global batch: train.global_batch_size, or (when 0) micro_batch_size x data-parallel size x
// train.gradient_accumulation_steps (DeepSpeed's way of giving it). Checked here, before anything
// divides by it, in the order a user fixes them: accumulation, divisibility, agreement.
int64_t checked_global_batch(const config::TrainingConfig& t, int64_t mbs, int64_t dp_size) {
  const int64_t accumulation = t.gradient_accumulation_steps();
  if (accumulation < 0)
    throw HostError("config: train.gradient_accumulation_steps must be >= 0 (0 = from the batch sizes)");
  const int64_t gbs =
      t.global_batch_size() > 0 ? t.global_batch_size() : mbs * dp_size * std::max<int64_t>(accumulation, 1);
  if (gbs % (mbs * dp_size) != 0)
    throw HostError("config: global_batch_size " + std::to_string(gbs) + " is not divisible by micro_batch_size x " +
                    "data-parallel size = " + std::to_string(mbs * dp_size));
  const int64_t num_micro = gbs / (mbs * dp_size);
  if (accumulation > 0 && num_micro != accumulation)
    throw HostError("config: train.global_batch_size " + std::to_string(gbs) + " = micro_batch_size " +
                    std::to_string(mbs) + " x data-parallel size " + std::to_string(dp_size) + " x " +
                    std::to_string(num_micro) + " micro-batches, but train.gradient_accumulation_steps is " +
                    std::to_string(accumulation) + " (DeepSpeed's train_batch_size check)");
  return gbs;
}

// train.rampup_batch_size against the run: whole micro-batches on every rank, a ramp-up that ends
// inside train_samples, and a table of bounded size.
void check_rampup(const config::TrainingConfig& t, const RampUp& r, int64_t unit) {
  if (r.start % unit != 0 || r.increment % unit != 0)
    throw HostError("config: train.rampup_batch_size '" + t.rampup_batch_size() + "': START and INCREMENT must be " +
                    "multiples of micro_batch_size x data-parallel size = " + std::to_string(unit) +
                    " (every global batch of the ramp-up is whole micro-batches on every rank)");
  // The ramp-up must end inside the run (Megatron would overshoot train_samples instead); this
  // also bounds the table built from it.
  if (r.samples >= t.train_samples())
    throw HostError("config: train.rampup_batch_size '" + t.rampup_batch_size() + "' ramps up over " +
                    std::to_string(r.samples) + " samples, not fewer than train.train_samples " +
                    std::to_string(t.train_samples()));
  if (r.samples / r.start > 100'000'000)
    throw HostError("config: train.rampup_batch_size '" + t.rampup_batch_size() +
                    "' means more than 100 million ramp-up iterations");
}

// Megatron's calculator and update_train_iters: the ramp-up's iterations run while the samples
// consumed before them are <= SAMPLES. Appends, per iteration, the samples and (one rank's)
// micro-batches consumed after it to the tables, which start as {0}.
void tabulate_rampup(const RampUp& r, int64_t gbs, int64_t unit, std::vector<int64_t>& consumed_after,
                     std::vector<int64_t>& micro_after) {
  const double per_increment = static_cast<double>(r.samples) / static_cast<double>((gbs - r.start) / r.increment);
  auto batch_at = [&](int64_t consumed) {
    if (consumed > r.samples) return gbs;
    return r.start + static_cast<int64_t>(static_cast<double>(consumed) / per_increment) * r.increment;
  };
  for (int64_t consumed = 0; consumed <= r.samples;) {
    const int64_t batch = batch_at(consumed);
    consumed += batch;
    consumed_after.push_back(consumed);
    micro_after.push_back(micro_after.back() + batch / unit);
  }
}

// Megatron's StepBatchsizeNumMicroBatchesCalculator: each iteration's batch is that of the last
// step whose first sample the samples consumed before it reach. Tabulates the iterations before
// the last step begins or the run's samples are consumed (update_train_iters stops at the first
// iteration reaching train_samples, overshooting it); each batch reached is whole micro-batches on
// every rank and none is smaller than the one before (Megatron's loop asserts "Number of
// microbatches should not decrease"). Returns the iterations after the table that finish
// train_samples at the last batch. Each step reached is added to `reached` with its first
// iteration: whether its batch divides into this run's micro-batches is checked from the
// iteration the run starts at (BatchPlan::check_batches_from).
int64_t tabulate_steps(const std::vector<BatchStep>& steps, int64_t train_samples, int64_t unit,
                       std::vector<int64_t>& consumed_after, std::vector<int64_t>& micro_after,
                       std::vector<BatchPlan::ReachedStep>& reached) {
  const auto check = [&](const BatchStep& s, int64_t iteration) {
    if (s.batch > (int64_t{1} << 40))
      throw HostError("config: train.step_batch_size_schedule entry '" + s.entry + "': global batch " +
                      std::to_string(s.batch) + " is too large");
    reached.push_back({s.entry, s.batch, iteration});
  };
  const int64_t last_start = std::min(steps.back().first_sample, train_samples);
  size_t k = 0;  // the step of the next iteration
  const BatchStep* previous = nullptr;
  const auto reach = [&](const BatchStep& s, int64_t iteration) {
    if (previous == &s) return;
    check(s, iteration);
    if (previous && s.batch < previous->batch)
      throw HostError("config: train.step_batch_size_schedule entry '" + s.entry + "': global batch " +
                      std::to_string(s.batch) + " (from iteration " + std::to_string(iteration) +
                      ") is smaller than the " + std::to_string(previous->batch) +
                      " before it (Megatron asserts that the number of micro-batches never decreases)");
    previous = &s;
  };
  for (int64_t consumed = 0; consumed < last_start;) {
    while (k + 1 < steps.size() && consumed >= steps[k + 1].first_sample) ++k;
    reach(steps[k], static_cast<int64_t>(consumed_after.size()));
    if (consumed_after.size() > 10'000'000 || consumed > (int64_t{1} << 62))
      throw HostError("config: train.step_batch_size_schedule means more than 10 million iterations before '" +
                      steps.back().entry + "'");
    consumed += steps[k].batch;
    consumed_after.push_back(consumed);
    micro_after.push_back(micro_after.back() + steps[k].batch / unit);
  }
  const int64_t rest = train_samples - consumed_after.back(), tail = steps.back().batch;
  if (rest <= 0) return 0;
  reach(steps.back(), static_cast<int64_t>(consumed_after.size()));
  return rest / tail + (rest % tail != 0 ? 1 : 0);
}

// Megatron without a ramp-up: iterations = train_samples // global_batch_size.
int64_t iterations_from_samples(int64_t train_samples, int64_t gbs) {
  const int64_t iters = train_samples / gbs;
  if (iters <= 0)
    throw HostError("config: train.train_samples " + std::to_string(train_samples) +
                    " is less than one global batch (" + std::to_string(gbs) + ")");
  return iters;
}

}  // namespace

BatchPlan::BatchPlan(const config::RunConfig& cfg, const Topology& topo)
    : mbs_(cfg.train().micro_batch_size()),
      train_iters_(cfg.train().train_iters()),  // or from train_samples, below
      eval_iters_(cfg.eval().eval_iters()),
      seq_length_(cfg.train().seq_length()),
      dp_size_(topo.data_size()),  // the ranks reading different samples (not context-parallel ones)
      samples_flag_(cfg.train().train_samples()),
      curriculum_(SequenceCurriculum::off(seq_length_)) {
  const auto& t = cfg.train();
  gbs_ = checked_global_batch(t, mbs_, dp_size_);
  num_micro_ = gbs_ / (mbs_ * dp_size_);
  tail_gbs_ = gbs_, tail_micro_ = num_micro_;
  if (!t.step_batch_size_schedule().empty()) {
    varying_batch_ = scheduled_ = true;
    const std::vector<BatchStep> steps = parse_step_batch_schedule(t.step_batch_size_schedule(), seq_length_);
    const int64_t unit = mbs_ * dp_size_;
    const int64_t tail_iters =
        tabulate_steps(steps, t.train_samples(), unit, ramp_consumed_, ramp_micro_, reached_steps_);
    tail_gbs_ = steps.back().batch, tail_micro_ = std::max<int64_t>(1, tail_gbs_ / unit);
    train_iters_ = static_cast<int64_t>(ramp_consumed_.size()) - 1 + tail_iters;
    // A run that may resume checks the batches from where it resumes (resume.cpp), as Megatron's
    // calculator checks the current one: a resume on more data-parallel ranks past an early batch
    // they do not divide trains. Any other run checks them all now.
    if (cfg.checkpoint().load().empty() && t.consumed_samples() == 0) check_batches_from(1);
  } else if (!t.rampup_batch_size().empty()) {
    varying_batch_ = true;
    const RampUp r = parse_rampup(t.rampup_batch_size());
    const int64_t unit = mbs_ * dp_size_;
    check_rampup(t, r, unit);
    tabulate_rampup(r, gbs_, unit, ramp_consumed_, ramp_micro_);
    // After the ramp-up, the rest of train_samples in whole global batches.
    const int64_t ramp_iters = static_cast<int64_t>(ramp_consumed_.size()) - 1;
    if (t.train_samples() < ramp_consumed_.back())
      throw HostError("config: train.train_samples " + std::to_string(t.train_samples()) + " ends inside the ramp-up (" +
                      std::to_string(ramp_consumed_.back()) + " samples in " + std::to_string(ramp_iters) +
                      " iterations, train.rampup_batch_size '" + t.rampup_batch_size() + "')");
    train_iters_ = ramp_iters + (t.train_samples() - ramp_consumed_.back()) / gbs_;
  } else if (t.train_samples() > 0) {
    train_iters_ = iterations_from_samples(t.train_samples(), gbs_);
  }
  eval_interval_ = cfg.eval().eval_interval();
  full_validation_ = cfg.eval().full_validation();
  skip_train_ = cfg.eval().skip_train();
  validation_sets_ = cfg.eval().validation_sets_size() > 0;
  // Megatron with --skip-train: eval_iters batches of each split, once.
  num_evals_ = (eval_interval_ > 0 && !skip_train_ ? train_iters_ / eval_interval_ : 0) + 1;
  // Sample counts are products of user numbers: refuse values whose products overflow int64.
  const int64_t limit = int64_t{1} << 40;
  const int64_t most = std::max(gbs_, train_iters_ > ramp_iterations() ? tail_gbs_ : 0);  // a batch the run reaches
  if (most > limit / std::max<int64_t>(1, train_iters_) ||
      gbs_ > limit / std::max<int64_t>(1, (num_evals_ + 1) * eval_iters_))
    throw HostError("config: train_iters x global_batch_size (or the evaluation sample count) is too large");
  if (seq_length_ > 0 && consumed_before(train_iters_ + 1) > std::numeric_limits<int64_t>::max() / seq_length_)
    throw HostError("config: the run's token count (train samples x train.seq_length) is too large");
  if (!t.curriculum_schedule().empty()) {
    curriculum_ = SequenceCurriculum(t, train_iters_);  // its lengths through the run
    check_curriculum_split(cfg, topo);
    const std::vector<SequenceCurriculum::Stage>& stages = curriculum_.stages();
    stage_tokens_.assign(1, 0);
    for (size_t k = 1; k < stages.size(); ++k)
      stage_tokens_.push_back(stage_tokens_.back() + (consumed_before(stages[k].first_iteration) -
                                                      consumed_before(stages[k - 1].first_iteration)) *
                                                         stages[k - 1].length);
  }
  final_iteration_ = train_iters_;
  if (t.train_tokens() > 0 && seq_length_ > 0) final_iteration_ = iteration_reaching_tokens(t.train_tokens());
}

// Sequence parallelism splits every length the curriculum gives over the tensor-parallel ranks;
// context parallelism into 2 x cp chunks.
void BatchPlan::check_curriculum_split(const config::RunConfig& cfg, const Topology& topo) const {
  if (topo.cp_size > 1)
    for (const SequenceCurriculum::Stage& s : curriculum_.stages())
      if (s.length % (2 * topo.cp_size) != 0)
        throw HostError("config: distributed.context_parallel_size " + std::to_string(topo.cp_size) +
                        " splits each sequence into " + std::to_string(2 * topo.cp_size) +
                        " equal chunks, and train.curriculum_schedule gives " + std::to_string(s.length) +
                        " from iteration " + std::to_string(s.first_iteration) + ": make each length a multiple of " +
                        std::to_string(2 * topo.cp_size));
  if (!cfg.distributed().sequence_parallel() || topo.tp_size <= 1) return;
  for (const SequenceCurriculum::Stage& s : curriculum_.stages())
    if (s.length % topo.tp_size != 0)
      throw HostError(
          "config: distributed.sequence_parallel splits each sequence length over the tensor-parallel size " +
          std::to_string(topo.tp_size) + ", and train.curriculum_schedule gives " + std::to_string(s.length) +
          " from iteration " + std::to_string(s.first_iteration) +
          ": make train.curriculum_difficulty_step (or each length) a multiple of " + std::to_string(topo.tp_size));
}

void BatchPlan::check_batches_from(int64_t first_iteration) const {
  const int64_t unit = mbs_ * dp_size_;
  for (size_t k = 0; k < reached_steps_.size(); ++k) {
    const ReachedStep& s = reached_steps_[k];
    const int64_t last = k + 1 < reached_steps_.size() ? reached_steps_[k + 1].first_iteration - 1 : train_iters_;
    if (last < first_iteration || s.batch % unit == 0) continue;
    throw HostError("config: train.step_batch_size_schedule entry '" + s.entry + "': global batch " +
                    std::to_string(s.batch) + " (from iteration " +
                    std::to_string(std::max(s.first_iteration, first_iteration)) +
                    ") is not divisible by micro_batch_size x data-parallel size = " + std::to_string(unit));
  }
}

int64_t BatchPlan::iteration_reaching_tokens(int64_t tokens) const {
  if (!curriculum_.active())
    return std::min(train_iters_, iteration_reaching(tokens / seq_length_ + (tokens % seq_length_ != 0 ? 1 : 0)));
  if (tokens_before(train_iters_ + 1) < tokens) return train_iters_;
  int64_t lo = 0, hi = train_iters_;  // tokens_before(lo + 1) < tokens <= tokens_before(hi + 1)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (tokens_before(mid + 1) < tokens ? lo : hi) = mid;
  }
  return std::max<int64_t>(1, hi);
}

int64_t BatchPlan::tokens_before(int64_t i) const {
  if (!curriculum_.active()) return consumed_before(i) * seq_length_;
  // The last stage that began before iteration i, and the tokens before it began.
  const std::vector<SequenceCurriculum::Stage>& stages = curriculum_.stages();
  const auto after =
      std::upper_bound(stages.begin(), stages.end(), i - 1,
                       [](int64_t n, const SequenceCurriculum::Stage& s) { return n < s.first_iteration; });
  if (after == stages.begin()) return 0;
  const size_t k = static_cast<size_t>(after - stages.begin()) - 1;
  return stage_tokens_[k] + (consumed_before(i) - consumed_before(stages[k].first_iteration)) * stages[k].length;
}

int64_t BatchPlan::iteration_reaching(int64_t samples) const {
  if (samples <= ramp_consumed_.back())  // within the table: consumed_before(q + 1) is ramp_consumed_[q]
    return std::max<int64_t>(
        1, std::lower_bound(ramp_consumed_.begin(), ramp_consumed_.end(), samples) - ramp_consumed_.begin());
  const int64_t r = static_cast<int64_t>(ramp_consumed_.size()) - 1, rest = samples - ramp_consumed_.back();
  return r + rest / tail_gbs_ + (rest % tail_gbs_ != 0 ? 1 : 0);  // (no rounding sum to overflow near int64's end)
}

int64_t BatchPlan::consumed_before(int64_t i) const {
  const int64_t q = i - 1, r = static_cast<int64_t>(ramp_consumed_.size()) - 1;
  return q <= r ? ramp_consumed_[q] : ramp_consumed_[r] + (q - r) * tail_gbs_;
}

int64_t BatchPlan::micro_batches_before(int64_t i) const {
  const int64_t q = i - 1, r = static_cast<int64_t>(ramp_micro_.size()) - 1;
  return q <= r ? ramp_micro_[q] : ramp_micro_[r] + (q - r) * tail_micro_;
}

int64_t BatchPlan::most_micro_batches() const {
  int64_t most = train_iters_ > ramp_iterations() ? tail_micro_ : 0;
  for (size_t q = 1; q < ramp_micro_.size(); ++q) most = std::max(most, ramp_micro_[q] - ramp_micro_[q - 1]);
  return std::max<int64_t>(1, most);
}

std::string BatchPlan::describe_batch_steps() const {
  std::string out;
  int64_t shown = 0;
  for (int64_t i = 1; i <= train_iters_; ++i) {
    const int64_t batch = global_batch_of(i);
    if (batch == shown) {
      if (i > ramp_iterations()) break;  // constant from here on
      continue;
    }
    out += (out.empty() ? "" : ", ") + std::to_string(batch) + " from iteration " + std::to_string(i);
    shown = batch;
  }
  return out;
}

}  // namespace dtk::core
