#include "dtk/core/optim/grad_scaler.hpp"

#include <algorithm>
#include <cmath>

namespace dtk::core {

GradScaler::GradScaler(double initial_scale, double min_scale, int64_t growth_interval, int64_t hysteresis)
    : kind_(Kind::kDynamic), min_scale_(min_scale), growth_interval_(growth_interval), hysteresis_(hysteresis) {
  state_.scale = initial_scale;
  state_.hysteresis_tracker = hysteresis;
}

GradScaler::GradScaler(const config::TrainingConfig& t) {
  if (t.params_dtype() == "fp16" || t.dynamic_loss_scale()) {
    // Megatron's defaults: --initial-loss-scale 2**32, --min-loss-scale 1, --loss-scale-window
    // 1000, --hysteresis 2.
    *this = GradScaler(t.initial_loss_scale() > 0 ? t.initial_loss_scale() : std::ldexp(1.0, 32),
                       t.min_loss_scale() > 0 ? t.min_loss_scale() : 1.0,
                       t.loss_scale_window() > 0 ? t.loss_scale_window() : 1000,
                       t.hysteresis() > 0 ? t.hysteresis() : 2);
    // Megatron: a static --loss-scale wins over the dynamic scaler.
  }
  if (t.loss_scale() > 0) {
    kind_ = Kind::kStatic;
    state_ = State{t.loss_scale(), 0, 0};
  }
}

void GradScaler::update(bool found_inf) {
  if (kind_ != Kind::kDynamic) return;
  if (found_inf) {
    state_.growth_tracker = 0;
    state_.hysteresis_tracker -= 1;
    if (state_.hysteresis_tracker <= 0) state_.scale = std::max(state_.scale * kBackoffFactor, min_scale_);
    return;
  }
  state_.growth_tracker += 1;
  if (state_.growth_tracker == growth_interval_) {
    state_.growth_tracker = 0;
    state_.hysteresis_tracker = hysteresis_;
    state_.scale *= kGrowthFactor;
  }
}

}  // namespace dtk::core
