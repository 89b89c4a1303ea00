#include "dtk/core/optim/lr_schedule.hpp"

#include <algorithm>
#include <cmath>

#include "dtk/core/config/config.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

namespace {

// DeepSpeed's lr_schedules.py. Its scheduler starts at last_batch_iteration -1 and steps after
// each update, so the update DTK counts as `step` (from 0) runs at DeepSpeed's step - 1; before
// its first step WarmupLR and WarmupDecayLR give their minimum, WarmupCosineLR 0. The warm-up is
// at least 2 steps (DeepSpeed's max(2, warmup_num_steps)), and ends at step < warm-up.
double deepspeed_learning_rate(int64_t step, const LrParams& p) {
  const double it = static_cast<double>(step - 1);
  if (it < 0) return p.style == "WarmupCosineLR" ? 0.0 : p.init_lr;
  const double warmup = std::max(2.0, p.warmup_iters);
  if (it < warmup) {
    const double gamma = p.warmup_style == "log" ? std::log(it + 1) / std::log(warmup) : it / warmup;
    return p.init_lr + (p.max_lr - p.init_lr) * gamma;
  }
  if (p.style == "WarmupLR") return p.max_lr;
  const double total = static_cast<double>(p.decay_iters), span = std::max(1.0, total - warmup);
  if (p.style == "WarmupDecayLR") return p.min_lr + (p.max_lr - p.min_lr) * std::max(0.0, (total - it) / span);
  const double progress = std::min(1.0, (it - warmup + 1) / span);  // WarmupCosineLR
  return p.min_lr + (p.max_lr - p.min_lr) * (1 + std::cos(M_PI * progress)) / 2;
}

}  // namespace

// Megatron-DeepSpeed's get_lr with token counts: the warm-up in tokens or steps, the decay in
// tokens or steps. The decay's token origin is the token warm-up, or where the step warm-up ended
// (-1 until then; 0 without a warm-up, where Megatron-DeepSpeed fails on its unset value).
double learning_rate(const SchedulePosition& at, const LrParams& p) {
  if (is_deepspeed_style(p.style)) return deepspeed_learning_rate(at.step, p);
  const double step = static_cast<double>(at.step), tokens = static_cast<double>(at.tokens);
  const auto warm = [&](double done, double length) { return p.init_lr + (p.max_lr - p.init_lr) * done / length; };
  if (p.warmup_tokens) {
    if (*p.warmup_tokens > 0 && at.tokens <= *p.warmup_tokens)
      return warm(tokens, static_cast<double>(*p.warmup_tokens));
  } else if (p.warmup_iters > 0 && step <= p.warmup_iters) {
    return warm(step, p.warmup_iters);
  }
  if (p.style == "constant") return p.max_lr;
  if (p.decay_tokens ? at.tokens > *p.decay_tokens : at.step > p.decay_iters)
    return p.min_lr;  // Megatron checks this before every decay style
  // The warm-up's end in tokens, once the schedule has one (Megatron-DeepSpeed's lr_warmup_tokens).
  const std::optional<double> warmup_end =
      p.warmup_tokens             ? std::optional<double>(static_cast<double>(*p.warmup_tokens))
      : at.warmup_end_tokens >= 0 ? std::optional<double>(static_cast<double>(at.warmup_end_tokens))
                                  : std::nullopt;
  if (p.style == "inverse-square-root") {
    const double rate = warmup_end ? p.max_lr * std::sqrt(std::max(*warmup_end, 1.0)) / std::sqrt(std::max(tokens, 1.0))
                                   : p.max_lr * std::sqrt(std::max(p.warmup_iters * p.step_samples, 1.0)) /
                                         std::sqrt(std::max(step * p.step_samples, 1.0));
    return std::max(p.min_lr, rate);
  }
  double ratio = 1.0;
  if (p.decay_tokens) {
    const double origin = warmup_end.value_or(0.0), length = static_cast<double>(*p.decay_tokens) - origin;
    ratio = length > 0 ? (tokens - origin) / length : 1.0;
  } else {
    const double decay = static_cast<double>(p.decay_iters);
    ratio = decay > p.warmup_iters ? (step - p.warmup_iters) / (decay - p.warmup_iters) : 1.0;
  }
  double coeff = 0;
  if (p.style == "linear") {
    coeff = 1.0 - ratio;
  } else if (p.style == "WSD") {
    // Megatron's WSD measures its anneal from the decay's end, not from the warm-up.
    const double decay = static_cast<double>(p.decay_iters);
    const double anneal_start = decay - static_cast<double>(p.wsd_decay_iters);
    if (step <= anneal_start) {
      coeff = 1.0;
    } else {
      const double r = (step - anneal_start) / static_cast<double>(p.wsd_decay_iters);
      if (p.wsd_style == "linear")
        coeff = 1.0 - r;
      else if (p.wsd_style == "cosine")
        coeff = 0.5 * (std::cos(M_PI * r) + 1.0);
      else if (p.wsd_style == "minus_sqrt")
        coeff = 1.0 - std::sqrt(r);
      else  // exponential
        coeff = 2.0 * std::pow(0.5, r) - 1.0;
    }
  } else {
    coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0);  // cosine
  }
  return p.min_lr + coeff * (p.max_lr - p.min_lr);
}

double weight_decay(int64_t it, const LrParams& p) {
  const double step = static_cast<double>(it);
  if (step > p.wd_incr_iters || p.wd_style == "constant") return p.end_wd;
  const double ratio = p.wd_incr_iters > 0 ? step / p.wd_incr_iters : 1.0;
  const double coeff = p.wd_style == "linear" ? ratio : 0.5 * (std::cos(M_PI * (1.0 - ratio)) + 1.0);  // cosine
  return p.start_wd + coeff * (p.end_wd - p.start_wd);
}

double learning_rate(int64_t step, double max_lr, double min_lr, int64_t warmup_iters, int64_t decay_iters,
                     const std::string& style) {
  LrParams p;
  p.max_lr = max_lr, p.min_lr = min_lr, p.warmup_iters = static_cast<double>(warmup_iters);
  p.decay_iters = decay_iters, p.style = style;
  return learning_rate(step, p);
}

LearningRateSchedule::LearningRateSchedule(const config::LrSchedule& lr, int64_t train_iters) {
  params_.max_lr = lr.lr();
  params_.min_lr = lr.min_lr();
  params_.init_lr = lr.lr_warmup_init();
  params_.decay_iters = lr.lr_decay_iters() > 0 ? lr.lr_decay_iters() : train_iters;
  params_.warmup_iters = lr.lr_warmup_fraction() > 0
                             ? lr.lr_warmup_fraction() * static_cast<double>(params_.decay_iters)
                             : static_cast<double>(lr.lr_warmup_iters());
  params_.style = lr.lr_decay_style();
  params_.warmup_style = warmup_style_of(lr);
  if (!lr.lr_wsd_decay_style().empty()) params_.wsd_style = lr.lr_wsd_decay_style();
  params_.wsd_decay_iters = lr.lr_wsd_decay_iters();
  // Megatron: a constant style decays by weight_decay throughout; the others need both ends.
  params_.wd_style = lr.weight_decay_incr_style().empty() ? "constant" : lr.weight_decay_incr_style();
  const bool constant = params_.wd_style == "constant";
  params_.start_wd = constant ? lr.weight_decay() : lr.start_weight_decay();
  params_.end_wd = constant ? lr.weight_decay() : lr.end_weight_decay();
  params_.wd_incr_iters = static_cast<double>(train_iters);
  if (lr.has_lr_warmup_tokens()) params_.warmup_tokens = lr.lr_warmup_tokens();
  if (lr.has_lr_decay_tokens()) params_.decay_tokens = lr.lr_decay_tokens();
  reference_wd_ = params_.end_wd;
}

double LearningRateSchedule::rate(const SchedulePosition& at, double max_lr, double min_lr) const {
  LrParams p = params_;
  p.max_lr = max_lr, p.min_lr = min_lr;
  return learning_rate(at, p);
}

void LearningRateSchedule::advance(SchedulePosition& at, int64_t increment, int64_t tokens_before) const {
  at.step += increment;
  at.tokens = tokens_before;
  // Megatron-DeepSpeed records the tokens when its steps reach the warm-up's end (exactly there;
  // DTK at the first update at or past it, which is the same update whenever Megatron's is defined).
  if (params_.decay_tokens && !params_.warmup_tokens && params_.warmup_iters > 0 && at.warmup_end_tokens < 0 &&
      static_cast<double>(at.step) >= params_.warmup_iters)
    at.warmup_end_tokens = at.tokens;
}

void LearningRateSchedule::set_params(const LrParams& p) {
  const LrParams mine = params_;
  params_ = p;
  params_.step_samples = mine.step_samples;  // this run's unit (the checkpoint's plan is the same)
  if (!p.has_wd) {
    params_.start_wd = mine.start_wd, params_.end_wd = mine.end_wd;
    params_.wd_style = mine.wd_style, params_.wd_incr_iters = mine.wd_incr_iters, params_.has_wd = true;
  }
  if (reference_wd_ == 0 && (params_.start_wd > 0 || params_.end_wd > 0))
    throw host::HostError(
        "checkpoint.use_checkpoint_opt_param_scheduler: the checkpoint's schedule decays weights but this run's "
        "lr.weight_decay is 0, so its optimizer groups have none; set lr.weight_decay (or the schedule's ends)");
}

}  // namespace dtk::core
