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
// LRRangeTest and OneCycle below keep DeepSpeed's float arithmetic in its order, so the rates
// are DeepSpeed's to the last bit. Their update `step` runs at DeepSpeed's last_batch_iteration
// step - 1, where they look at batch_iteration = last_batch_iteration + 1 = step.

// LRRangeTest: min_lr x (1 + step_rate x interval), the interval continuous or in whole steps.
double range_test_rate(int64_t step, const LrParams& p) {
  const CycleParams& c = p.cycle;
  double interval = static_cast<double>(step) / c.range_step_size;
  if (c.range_staircase) interval = std::floor(interval);
  return p.max_lr * (1 + c.range_step_rate * interval);
}

// OneCycle's position in its cycle, 0 (the floor of the rate) to 1 (its peak), at
// batch_iteration `b`: OneCycle._get_scale_factor, stairs included.
double cycle_scale(int64_t step, const CycleParams& c) {
  const double b = static_cast<double>(step), total = c.first_step + c.second_step;
  const double step_ratio = c.first_step / total;
  const double cycle = std::floor(1 + b / total);
  const double x = 1. + b / total - cycle;
  double scale = 0;
  int64_t stairs = 0;
  if (x <= step_ratio) {
    scale = x / step_ratio, stairs = c.first_stairs;
  } else {
    scale = (x - 1) / (step_ratio - 1), stairs = c.second_stairs;
  }
  if (stairs > 0) {  // DeepSpeed counts the stairs from the whole batch offset, not from `scale`
    const double in_cycle = std::fmod(b, total);
    const double position = in_cycle <= c.first_step ? in_cycle * static_cast<double>(stairs) / c.first_step
                                                     : (total - in_cycle) * static_cast<double>(stairs) / c.second_step;
    scale = std::floor(position) / static_cast<double>(stairs);
  }
  return scale;
}

// After the cycle: the updates past it over decay_step (DeepSpeed's decay_interval); nullopt when
// that decay is off (decay_step 0, or its rate 0: math.isclose(rate, 0) is rate == 0).
std::optional<double> decay_interval(int64_t step, const CycleParams& c, double rate) {
  if (c.decay_step == 0 || rate == 0) return std::nullopt;
  const double past = static_cast<double>(step - 1) - (c.first_step + c.second_step) + 1;
  return past / c.decay_step;
}

bool in_cycle(int64_t step, const CycleParams& c) {
  return static_cast<double>(step - 1) < c.first_step + c.second_step;
}

double one_cycle_rate(int64_t step, const LrParams& p) {
  const CycleParams& c = p.cycle;
  if (in_cycle(step, c)) return p.min_lr + (p.max_lr - p.min_lr) * cycle_scale(step, c);
  const auto interval = decay_interval(step, c, c.decay_lr_rate);
  return interval ? p.min_lr / (1 + c.decay_lr_rate * *interval) : p.min_lr;
}

double deepspeed_learning_rate(int64_t step, const LrParams& p) {
  if (p.style == "LRRangeTest") return range_test_rate(step, p);
  if (p.style == "OneCycle") return one_cycle_rate(step, p);
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

// OneCycle's momentum: its constructor sets beta1 cycle_min_mom for the first update; then
// cycle_max_mom less the cycle's scale of the span, and after the cycle cycle_max_mom x
// (1 + decay_mom_rate x interval). beta2 is 0.99 throughout (OneCycle pairs each momentum with it).
std::optional<AdamBetas> cycled_betas(int64_t step, const LrParams& p) {
  if (!cycles_momentum(p)) return std::nullopt;
  const CycleParams& c = p.cycle;
  constexpr double kBeta2 = 0.99;
  if (step <= 0) return AdamBetas{c.min_mom, kBeta2};
  if (in_cycle(step, c)) return AdamBetas{c.max_mom - (c.max_mom - c.min_mom) * cycle_scale(step, c), kBeta2};
  const auto interval = decay_interval(step, c, c.decay_mom_rate);
  return AdamBetas{interval ? c.max_mom * (1 + c.decay_mom_rate * *interval) : c.max_mom, kBeta2};
}

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

CycleParams cycle_params(const config::LrSchedule& lr) {
  CycleParams c;
  if (lr.has_lr_range_test_step_size()) c.range_step_size = static_cast<double>(lr.lr_range_test_step_size());
  if (lr.has_lr_range_test_step_rate()) c.range_step_rate = lr.lr_range_test_step_rate();
  c.range_staircase = lr.lr_range_test_staircase();
  if (lr.has_cycle_first_step_size()) c.first_step = static_cast<double>(lr.cycle_first_step_size());
  c.second_step = lr.has_cycle_second_step_size() ? static_cast<double>(lr.cycle_second_step_size()) : c.first_step;
  c.first_stairs = lr.cycle_first_stair_count();
  c.second_stairs = lr.has_cycle_second_stair_count() ? lr.cycle_second_stair_count() : c.first_stairs;
  c.decay_step = static_cast<double>(lr.decay_step_size());
  c.decay_lr_rate = lr.decay_lr_rate(), c.decay_mom_rate = lr.decay_mom_rate();
  c.momentum = !lr.has_cycle_momentum() || lr.cycle_momentum();
  if (lr.has_cycle_min_mom()) c.min_mom = lr.cycle_min_mom();
  if (lr.has_cycle_max_mom()) c.max_mom = lr.cycle_max_mom();
  return c;
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
  params_.cycle = cycle_params(lr);
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
