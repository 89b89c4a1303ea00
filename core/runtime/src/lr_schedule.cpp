#include "dtk/core/lr_schedule.hpp"

#include <algorithm>
#include <cmath>

namespace dtk::core {

double learning_rate(int64_t it, double max_lr, double min_lr, int64_t warmup, int64_t decay_iters,
                     const std::string& style) {
  if (warmup > 0 && it <= warmup) return max_lr * static_cast<double>(it) / static_cast<double>(warmup);
  if (style == "constant") return max_lr;
  if (it > decay_iters) return min_lr;  // Megatron checks this before every decay style
  if (style == "inverse-square-root") {
    const double w = static_cast<double>(std::max<int64_t>(warmup, 1));
    return std::max(min_lr, max_lr * std::sqrt(w) / std::sqrt(static_cast<double>(std::max<int64_t>(it, 1))));
  }
  const double ratio =
      decay_iters > warmup ? static_cast<double>(it - warmup) / static_cast<double>(decay_iters - warmup) : 1.0;
  double coeff = 0;
  if (style == "linear")
    coeff = 1.0 - ratio;
  else
    coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0);  // cosine
  return min_lr + coeff * (max_lr - min_lr);
}

LearningRateSchedule::LearningRateSchedule(const config::LrSchedule& lr, int64_t train_iters)
    : max_lr_(lr.lr()),
      min_lr_(lr.min_lr()),
      warmup_iters_(lr.lr_warmup_iters()),
      decay_iters_(lr.lr_decay_iters() > 0 ? lr.lr_decay_iters() : train_iters),
      style_(lr.lr_decay_style()) {}

double LearningRateSchedule::rate(int64_t step) const {
  return learning_rate(step, max_lr_, min_lr_, warmup_iters_, decay_iters_, style_);
}

}  // namespace dtk::core
