// dtk/core/config/curriculum.hpp — curriculum learning by sequence length: DeepSpeed's
// CurriculumScheduler (deepspeed/runtime/data_pipeline/curriculum_scheduler.py, the "legacy"
// curriculum_learning section) as Megatron-DeepSpeed applies it: iteration i trains on the first
// L(i) tokens of every sample, L(i) = update_difficulty(i).
//
// The length is a function of the iteration alone, worked out once for the whole run as the
// iterations where it changes (stages). So a resumed run trains the lengths the uninterrupted one
// did, and the token counts (lr.lr_*_tokens, train.train_tokens) are sums over the stages.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dtk_config.pb.h"

namespace dtk::core {

class SequenceCurriculum {
 public:
  // Off (every iteration trains seq_length tokens) unless train.curriculum_schedule is set. The
  // stages are worked out through iteration `last_iteration`. Throws HostError naming the field
  // for settings DeepSpeed rejects and for a length outside [1, seq_length].
  SequenceCurriculum(const config::TrainingConfig& t, int64_t last_iteration);
  // No curriculum: every iteration trains seq_length tokens.
  static SequenceCurriculum off(int64_t seq_length);

  bool active() const { return !schedule_.empty(); }
  // The tokens of each sample iteration i (from 1) trains on.
  int64_t length_of(int64_t iteration) const;

  struct Stage {
    int64_t first_iteration = 1, length = 0;  // from first_iteration until the next stage's
  };
  const std::vector<Stage>& stages() const { return stages_; }
  // "fixed_linear from 64 to 1024 over 3000 iterations (multiples of 8)": for the start line.
  std::string describe() const;

  // DeepSpeed's get_difficulty(step) (before update_difficulty's rule that the length stays once
  // it reaches max_difficulty).
  int64_t difficulty(int64_t step) const;

 private:
  void work_out_fixed_stages(int64_t last_iteration);
  void work_out_discrete_stages(int64_t last_iteration);
  void check_lengths() const;
  void add_stage(int64_t first_iteration, int64_t length);
  SequenceCurriculum() = default;

  std::string schedule_;  // "" = off
  int64_t seq_length_ = 0, min_ = 0, max_ = 0, total_step_ = 0, difficulty_step_ = 1;
  double root_degree_ = 1;
  std::vector<int64_t> discrete_difficulty_, discrete_max_step_;
  std::vector<Stage> stages_;
};

// "64,128 256" -> {64, 128, 256}: a curriculum list field (commas or spaces), each a positive
// whole number; throws HostError naming `field`.
std::vector<int64_t> parse_curriculum_list(const std::string& text, const char* field);

}  // namespace dtk::core
