// dtk/core/optim/grad_scaler.hpp — loss scaling, as Megatron's grad scalers
// (megatron/core/optimizer/grad_scaler.py): the loss is multiplied by scale() before backward,
// the gradients are divided by it before the update, and an iteration whose gradients overflowed
// is skipped.
#pragma once

#include <cstdint>

#include "dtk_config.pb.h"

namespace dtk::core {

class GradScaler {
 public:
  // What a checkpoint keeps of a dynamic scaler (Megatron's grad_scaler state_dict).
  struct State {
    double scale = 1;
    int64_t growth_tracker = 0;
    int64_t hysteresis_tracker = 0;
  };
  enum class Kind { kNone, kStatic, kDynamic };

  // From train.*: dynamic for fp16 (or train.dynamic_loss_scale), static for loss_scale > 0,
  // otherwise none (scale 1, nothing to do).
  explicit GradScaler(const config::TrainingConfig& train);
  GradScaler(double initial_scale, double min_scale, int64_t growth_interval, int64_t hysteresis);  // dynamic

  Kind kind() const { return kind_; }
  bool dynamic() const { return kind_ == Kind::kDynamic; }
  double scale() const { return state_.scale; }

  // DynamicGradScaler.update: an overflow resets growth and counts down the hysteresis; when it
  // runs out the scale backs off (x0.5, not below the minimum). growth_interval clean iterations
  // in a row double it and restore the hysteresis. A static scaler never changes.
  void update(bool found_inf);

  const State& state() const { return state_; }
  void load(const State& s) { state_ = s; }

 private:
  static constexpr double kGrowthFactor = 2.0, kBackoffFactor = 0.5;
  Kind kind_ = Kind::kNone;
  double min_scale_ = 1;
  int64_t growth_interval_ = 1000, hysteresis_ = 2;
  State state_;
};

}  // namespace dtk::core
