#include "dtk/core/train/run_schedule.hpp"

#include <cmath>
#include <cstdio>
#include <vector>

#include "dtk/core/config/config.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace {

// Every length in samples, an iteration count times the (final) global batch; the decay defaults
// to train_samples (Megatron's lr_decay_samples) and the weight-decay schedule spans it.
void count_samples(const config::RunConfig& cfg, const BatchPlan& plan, LearningRateSchedule& schedule) {
  LrParams p = schedule.params();
  const int64_t gbs = plan.global_batch_size(), samples = cfg.train().train_samples();
  const auto& lr = cfg.lr();
  p.decay_iters = lr.lr_decay_samples() > 0 ? lr.lr_decay_samples()
                  : lr.lr_decay_iters() > 0 ? lr.lr_decay_iters() * gbs
                                            : samples;
  p.warmup_iters = lr.lr_warmup_fraction() > 0  ? lr.lr_warmup_fraction() * static_cast<double>(p.decay_iters)
                   : lr.lr_warmup_samples() > 0 ? static_cast<double>(lr.lr_warmup_samples())
                                                : static_cast<double>(lr.lr_warmup_iters() * gbs);
  p.wsd_decay_iters = lr.lr_wsd_decay_iters() * gbs;
  p.wd_incr_iters = static_cast<double>(samples);
  schedule.set_params(p);
}

// Megatron's sample lengths as whole numbers of iterations.
void samples_to_iterations(const config::RunConfig& cfg, const BatchPlan& plan, LearningRateSchedule& schedule) {
  LrParams p = schedule.params();
  const int64_t gbs = plan.global_batch_size();
  auto in_iterations = [gbs](int64_t samples, const char* name) {
    if (samples % gbs != 0)
      throw HostError(std::string("config: lr.") + name + " (" + std::to_string(samples) +
                      ") is not a whole number of global batches of " + std::to_string(gbs) +
                      " samples (without a batch-size ramp-up the schedule counts iterations)");
    return samples / gbs;
  };
  const auto& lr = cfg.lr();
  if (lr.lr_decay_samples() > 0) p.decay_iters = in_iterations(lr.lr_decay_samples(), "lr_decay_samples");
  if (lr.lr_warmup_samples() > 0)
    p.warmup_iters = static_cast<double>(in_iterations(lr.lr_warmup_samples(), "lr_warmup_samples"));
  schedule.set_params(p);
}

// The checks validate_config could not make before the global batch was known.
void check_sample_lengths(const BatchPlan& plan, const LrParams& l) {
  const std::string unit = plan.ramps_up() ? " samples" : " iterations";  // a ramp-up's schedule counts samples
  const std::string gbs = std::to_string(plan.global_batch_size());
  const std::string decay =
      std::to_string(l.decay_iters) + unit +
      (plan.ramps_up() ? " (train.train_samples, or lr.lr_decay_iters x global batch " + gbs + ")"
                       : " (train.train_samples / global batch " + gbs + ", or lr.lr_decay_iters)");
  if (l.style != "constant" && !is_deepspeed_style(l.style) && l.warmup_iters >= static_cast<double>(l.decay_iters))
    throw HostError("config: the warm-up (" + std::to_string(static_cast<int64_t>(std::ceil(l.warmup_iters))) + unit +
                    ") is not shorter than the decay, " + decay);
  if (l.style == "WSD" && l.wsd_decay_iters > l.decay_iters)
    throw HostError("config: lr.lr_wsd_decay_iters (" + std::to_string(l.wsd_decay_iters) +
                    ") is longer than the decay, " + decay);
}

// LRRangeTest's growth and OneCycle's decay after the cycle are monotonic: a negative
// lr_range_test_step_rate or decay_lr_rate is taken (DeepSpeed takes it) while the rate of the
// run's last update is a finite number >= 0; past that it would divide by zero or turn negative.
void check_cycle_rate(const LrParams& p, int64_t train_iters) {
  if (!is_deepspeed_cycle_style(p.style) || train_iters <= 0) return;
  const double last = learning_rate(train_iters - 1, p);
  if (std::isfinite(last) && last >= 0) return;
  char text[320];
  std::snprintf(
      text, sizeof text,
      "config: lr.%s %g takes %s's rate to %.6g by update %lld of the run's %lld: make it positive, or end the "
      "run sooner",
      p.style == "OneCycle" ? "decay_lr_rate" : "lr_range_test_step_rate",
      p.style == "OneCycle" ? p.cycle.decay_lr_rate : p.cycle.range_step_rate, p.style.c_str(), last,
      static_cast<long long>(train_iters), static_cast<long long>(train_iters));
  throw HostError(text);
}

// What differs between the checkpoint's schedule and this run's, one entry each.
std::vector<std::string> schedule_differences(const LrParams& saved, const LrParams& now) {
  std::vector<std::string> differ;
  auto num = [&](const char* name, double a, double b) {
    if (a == b) return;
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s %.9g (checkpoint) vs %.9g (this run)", name, a, b);
    differ.emplace_back(buf);
  };
  auto str = [&](const char* name, const std::string& a, const std::string& b) {
    if (a != b) differ.push_back(std::string(name) + " " + a + " (checkpoint) vs " + b + " (this run)");
  };
  // LRRangeTest and OneCycle read no warm-up or decay length (a longer run resumes, as in
  // DeepSpeed); LRRangeTest has no floor.
  const bool cyclic = saved.style == now.style && is_deepspeed_cycle_style(now.style);
  num("lr.lr", saved.max_lr, now.max_lr);
  if (!cyclic || now.style == "OneCycle") num("lr.min_lr", saved.min_lr, now.min_lr);
  if (!cyclic) {
    num("lr.lr_warmup_init", saved.init_lr, now.init_lr);
    num("warm-up iterations", saved.warmup_iters, now.warmup_iters);
    num("decay iterations (lr.lr_decay_iters, or train.train_iters when 0)", static_cast<double>(saved.decay_iters),
        static_cast<double>(now.decay_iters));
  }
  str("lr.lr_decay_style", saved.style, now.style);
  if (!cyclic) str("warm-up style (lr.lr_warmup_style)", saved.warmup_style, now.warmup_style);
  if (saved.has_wd) {  // Megatron's _check_and_set covers the weight-decay schedule as well
    str("lr.weight_decay_incr_style", saved.wd_style, now.wd_style);
    num("start weight decay (lr.start_weight_decay, or lr.weight_decay when constant)", saved.start_wd, now.start_wd);
    num("end weight decay (lr.end_weight_decay, or lr.weight_decay when constant)", saved.end_wd, now.end_wd);
    if (saved.wd_style != "constant" || now.wd_style != "constant")
      num("weight-decay iterations (train.train_iters)", saved.wd_incr_iters, now.wd_incr_iters);
  }
  auto count = [&](const char* name, const std::optional<int64_t>& a, const std::optional<int64_t>& b) {
    const auto text = [](const std::optional<int64_t>& v) { return v ? std::to_string(*v) : std::string("unset"); };
    if (a != b) differ.push_back(std::string(name) + " " + text(a) + " (checkpoint) vs " + text(b) + " (this run)");
  };
  count("lr.lr_warmup_tokens", saved.warmup_tokens, now.warmup_tokens);
  count("lr.lr_decay_tokens", saved.decay_tokens, now.decay_tokens);
  if (cyclic) {
    const CycleParams &a = saved.cycle, &b = now.cycle;
    if (now.style == "LRRangeTest") {
      num("lr.lr_range_test_step_size", a.range_step_size, b.range_step_size);
      num("lr.lr_range_test_step_rate", a.range_step_rate, b.range_step_rate);
      num("lr.lr_range_test_staircase", a.range_staircase, b.range_staircase);
    } else {
      num("lr.cycle_first_step_size", a.first_step, b.first_step);
      num("lr.cycle_second_step_size", a.second_step, b.second_step);
      num("lr.cycle_first_stair_count", static_cast<double>(a.first_stairs), static_cast<double>(b.first_stairs));
      num("lr.cycle_second_stair_count", static_cast<double>(a.second_stairs), static_cast<double>(b.second_stairs));
      num("lr.decay_step_size", a.decay_step, b.decay_step);
      num("lr.decay_lr_rate", a.decay_lr_rate, b.decay_lr_rate);
      num("lr.cycle_momentum", a.momentum, b.momentum);
      num("lr.cycle_min_mom", a.min_mom, b.min_mom);
      num("lr.cycle_max_mom", a.max_mom, b.max_mom);
      num("lr.decay_mom_rate", a.decay_mom_rate, b.decay_mom_rate);
    }
  }
  if (saved.style == "WSD" && now.style == "WSD") {
    str("lr.lr_wsd_decay_style", saved.wsd_style, now.wsd_style);
    num("lr.lr_wsd_decay_iters", static_cast<double>(saved.wsd_decay_iters), static_cast<double>(now.wsd_decay_iters));
  }
  return differ;
}

}  // namespace

void check_cycled_momentum(const LrParams& p, int64_t train_iters) {
  if (!cycles_momentum(p) || train_iters <= 0) return;
  for (const int64_t step : {int64_t{0}, train_iters - 1}) {  // beta1 is monotonic after the cycle
    const double beta1 = cycled_betas(step, p)->beta1;
    if (beta1 >= 0 && beta1 < 1) continue;
    char text[320];
    std::snprintf(text, sizeof text,
                  "config: lr.decay_mom_rate %g takes OneCycle's beta1 to %.6g by update %lld of the run's %lld; Adam "
                  "needs it in [0, 1): lower lr.decay_mom_rate, or set lr.cycle_momentum=false",
                  p.cycle.decay_mom_rate, beta1, static_cast<long long>(step + 1), static_cast<long long>(train_iters));
    throw HostError(text);
  }
}

LearningRateSchedule make_run_schedule(const config::RunConfig& cfg, const BatchPlan& plan) {
  LearningRateSchedule schedule(cfg.lr(), plan.train_iters());
  if (plan.ramps_up())
    count_samples(cfg, plan, schedule);
  else if (cfg.lr().lr_decay_samples() > 0 || cfg.lr().lr_warmup_samples() > 0)
    samples_to_iterations(cfg, plan, schedule);
  if (cfg.train().train_samples() > 0) check_sample_lengths(plan, schedule.params());
  check_cycle_rate(schedule.params(), plan.train_iters());
  if (!plan.ramps_up()) {  // counted in iterations: each one global batch of samples
    LrParams p = schedule.params();
    p.step_samples = static_cast<double>(plan.global_batch_size());
    schedule.set_params(p);
  }
  return schedule;
}

void reconcile_resumed_schedule(const LrParams& saved, const config::CheckpointConfig& ck, const std::string& dir,
                                LearningRateSchedule& schedule, const std::function<void(const std::string&)>& print) {
  const std::vector<std::string> differ = schedule_differences(saved, schedule.params());
  if (differ.empty()) return;
  std::string list;
  for (const auto& d : differ) list += (list.empty() ? "" : "; ") + d;
  if (ck.override_opt_param_scheduler()) {
    print(" learning-rate schedule from this run's config (checkpoint.override_opt_param_scheduler): " + list);
  } else if (ck.use_checkpoint_opt_param_scheduler()) {
    schedule.set_params(saved);
    print(" learning-rate schedule from the checkpoint (checkpoint.use_checkpoint_opt_param_scheduler): " + list);
  } else {
    throw HostError("checkpoint in " + dir + " was trained with another learning-rate schedule: " + list +
                    "; set checkpoint.override_opt_param_scheduler=true to use this run's or "
                    "checkpoint.use_checkpoint_opt_param_scheduler=true to keep the checkpoint's");
  }
}

}  // namespace dtk::core
