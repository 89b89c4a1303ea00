#include "dtk/core/config/curriculum.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace {

const char* const kSchedules = "fixed_linear, fixed_root or fixed_discrete";

// A field of one schedule set under another (DeepSpeed reads only its own schedule's keys).
void refuse_unused(bool set, const char* field, const std::string& schedule) {
  if (set)
    throw HostError(std::string("config: ") + field + " does nothing under train.curriculum_schedule " +
                    (schedule.empty() ? "\"\" (off)" : schedule) + ": drop it");
}

}  // namespace

std::vector<int64_t> parse_curriculum_list(const std::string& text, const char* field) {
  std::vector<int64_t> out;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ',' || text[i] == ' ') {
      ++i;
      continue;
    }
    const size_t end = text.find_first_of(", ", i);
    const std::string item = text.substr(i, end == std::string::npos ? std::string::npos : end - i);
    char* stop = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &stop, 10);
    if (stop == item.c_str() || *stop != '\0' || errno == ERANGE || v < 1)
      throw HostError(std::string("config: ") + field + " '" + text + "': '" + item +
                      "' is not a positive whole number (a list like \"64,128,256\")");
    out.push_back(v);
    i = end == std::string::npos ? text.size() : end;
  }
  return out;
}

SequenceCurriculum::SequenceCurriculum(const config::TrainingConfig& t, int64_t last_iteration)
    : schedule_(t.curriculum_schedule()),
      seq_length_(t.seq_length()),
      min_(t.curriculum_min_difficulty()),
      max_(t.curriculum_max_difficulty() > 0 ? t.curriculum_max_difficulty() : t.seq_length()),
      total_step_(t.curriculum_total_step()),
      difficulty_step_(t.curriculum_difficulty_step()),
      root_degree_(t.curriculum_root_degree()) {
  const bool fixed = schedule_ == "fixed_linear" || schedule_ == "fixed_root";
  const bool discrete = schedule_ == "fixed_discrete";
  if (schedule_ == "custom")
    throw HostError(
        "config: train.curriculum_schedule custom is DeepSpeed's schedule given as a Python function "
        "(set_custom_curriculum_learning_schedule): use " +
        std::string(kSchedules));
  if (!schedule_.empty() && !fixed && !discrete)
    throw HostError("config: train.curriculum_schedule must be " + std::string(kSchedules) + " (or \"\": off), got '" +
                    schedule_ + "'");
  refuse_unused(schedule_.empty() && t.curriculum_min_difficulty() != 0, "train.curriculum_min_difficulty", schedule_);
  refuse_unused(schedule_.empty() && t.curriculum_max_difficulty() != 0, "train.curriculum_max_difficulty", schedule_);
  refuse_unused(!fixed && total_step_ != 0, "train.curriculum_total_step", schedule_);
  refuse_unused(!fixed && difficulty_step_ != 0, "train.curriculum_difficulty_step", schedule_);
  refuse_unused(schedule_ != "fixed_root" && root_degree_ != 0, "train.curriculum_root_degree", schedule_);
  refuse_unused(!discrete && !t.curriculum_discrete_difficulty().empty(), "train.curriculum_discrete_difficulty",
                schedule_);
  refuse_unused(!discrete && !t.curriculum_discrete_max_step().empty(), "train.curriculum_discrete_max_step",
                schedule_);
  if (!active()) return;
  if (min_ < 1)
    throw HostError("config: train.curriculum_min_difficulty must be set (>= 1; DeepSpeed's min_difficulty), got " +
                    std::to_string(min_));
  if (t.curriculum_max_difficulty() < 0)
    throw HostError("config: train.curriculum_max_difficulty must be >= 1 (0 = train.seq_length), got " +
                    std::to_string(t.curriculum_max_difficulty()));
  if (max_ > seq_length_)
    throw HostError("config: train.curriculum_max_difficulty (" + std::to_string(max_) +
                    ") is longer than train.seq_length (" + std::to_string(seq_length_) +
                    "): a sample holds seq_length tokens; set it to seq_length or less");
  if (fixed) {
    if (total_step_ < 1)
      throw HostError("config: train.curriculum_total_step must be >= 1 under " + schedule_ + ", got " +
                      std::to_string(total_step_));
    if (difficulty_step_ < 1)
      throw HostError("config: train.curriculum_difficulty_step must be >= 1 under " + schedule_ + ", got " +
                      std::to_string(difficulty_step_));
    // Every length below max would round down to 0 (and the rounding stays exact in a double).
    if (min_ < max_ && difficulty_step_ > max_)
      throw HostError("config: train.curriculum_difficulty_step (" + std::to_string(difficulty_step_) +
                      ") is larger than train.curriculum_max_difficulty (" + std::to_string(max_) +
                      "): every length below it would round down to 0");
    if (schedule_ == "fixed_root" && !(root_degree_ > 0 && std::isfinite(root_degree_)))
      throw HostError("config: train.curriculum_root_degree must be positive under fixed_root (2: square root)");
    if (schedule_ == "fixed_linear") root_degree_ = 1;  // DeepSpeed's fixed_linear is fixed_root of degree 1
    work_out_fixed_stages(std::max<int64_t>(1, last_iteration));
  } else {
    discrete_difficulty_ =
        parse_curriculum_list(t.curriculum_discrete_difficulty(), "train.curriculum_discrete_difficulty");
    discrete_max_step_ = parse_curriculum_list(t.curriculum_discrete_max_step(), "train.curriculum_discrete_max_step");
    if (discrete_max_step_.empty() || discrete_difficulty_.size() != discrete_max_step_.size() + 1)
      throw HostError(
          "config: train.curriculum_discrete_difficulty needs one length more than "
          "train.curriculum_discrete_max_step has steps (the last length holds after the last step), got " +
          std::to_string(discrete_difficulty_.size()) + " and " + std::to_string(discrete_max_step_.size()));
    for (size_t k = 1; k < discrete_max_step_.size(); ++k)
      if (discrete_max_step_[k] <= discrete_max_step_[k - 1])
        throw HostError("config: train.curriculum_discrete_max_step '" + t.curriculum_discrete_max_step() +
                        "' must increase (a step no later than the one before is never reached)");
    work_out_discrete_stages(std::max<int64_t>(1, last_iteration));
  }
  check_lengths();
}

int64_t SequenceCurriculum::difficulty(int64_t step) const {
  if (schedule_ == "fixed_discrete") {
    for (size_t k = 0; k < discrete_max_step_.size(); ++k)
      if (step <= discrete_max_step_[k]) return discrete_difficulty_[k];
    return discrete_difficulty_.back();
  }
  // Python's float arithmetic, in its order: (step / total) ** (1 / degree) * (max - min) + min,
  // floored, rounded down to a multiple of difficulty_step, at most max.
  const double x = std::pow(static_cast<double>(step) / static_cast<double>(total_step_), 1.0 / root_degree_);
  const double v = x * static_cast<double>(max_ - min_) + static_cast<double>(min_);
  if (v >= static_cast<double>(max_) + static_cast<double>(difficulty_step_)) return max_;  // (and no int64 overflow)
  int64_t d = static_cast<int64_t>(std::floor(v));
  d -= d % difficulty_step_;
  return std::min(d, max_);
}

void SequenceCurriculum::add_stage(int64_t first_iteration, int64_t length) {
  if (stages_.empty() || stages_.back().length != length) stages_.push_back({first_iteration, length});
}

// DeepSpeed's update_difficulty: the length starts at min_difficulty and follows get_difficulty
// while it is below max_difficulty (so a min at or above max never changes). The fixed schedules
// never fall, so the next stage starts at the first iteration whose difficulty is larger: a
// search, not a walk over every iteration.
void SequenceCurriculum::work_out_fixed_stages(int64_t last_iteration) {
  if (min_ >= max_) return add_stage(1, min_);
  int64_t s = 1, v = difficulty(1);
  add_stage(1, v);
  while (v < max_ && s < last_iteration) {
    if (difficulty(last_iteration) == v) break;
    int64_t lo = s, hi = last_iteration;  // difficulty(lo) == v < difficulty(hi)
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (difficulty(mid) == v ? lo : hi) = mid;
    }
    s = hi, v = difficulty(hi);
    add_stage(s, v);
  }
}

void SequenceCurriculum::work_out_discrete_stages(int64_t last_iteration) {
  if (min_ >= max_) return add_stage(1, min_);
  int64_t first = 1;
  for (size_t k = 0; k < discrete_difficulty_.size(); ++k) {
    add_stage(first, discrete_difficulty_[k]);
    if (discrete_difficulty_[k] >= max_) break;  // DeepSpeed stops updating there
    // The run ends within this length: the later ones are never trained (nor checked).
    if (k == discrete_max_step_.size() || discrete_max_step_[k] >= last_iteration) break;
    first = discrete_max_step_[k] + 1;
  }
}

void SequenceCurriculum::check_lengths() const {
  for (const Stage& s : stages_) {
    if (s.length >= 1 && s.length <= seq_length_) continue;
    std::string why;
    if (s.length < 1 && schedule_ != "fixed_discrete")
      why = " (train.curriculum_min_difficulty " + std::to_string(min_) +
            " rounded down to a multiple of train.curriculum_difficulty_step " + std::to_string(difficulty_step_) + ")";
    throw HostError("config: train.curriculum_schedule " + schedule_ + " gives a sequence length of " +
                    std::to_string(s.length) + " at iteration " + std::to_string(s.first_iteration) + why +
                    "; every length must be 1 to train.seq_length (" + std::to_string(seq_length_) + ")");
  }
}

SequenceCurriculum SequenceCurriculum::off(int64_t seq_length) {
  SequenceCurriculum c;
  c.seq_length_ = seq_length;
  return c;
}

int64_t SequenceCurriculum::length_of(int64_t iteration) const {
  if (!active()) return seq_length_;
  const auto after = std::upper_bound(stages_.begin(), stages_.end(), iteration,
                                      [](int64_t i, const Stage& s) { return i < s.first_iteration; });
  return after == stages_.begin() ? stages_.front().length : std::prev(after)->length;
}

std::string SequenceCurriculum::describe() const {
  if (!active()) return "";
  std::string text = "curriculum (train.curriculum_schedule " + schedule_ + "): sequence length " +
                     std::to_string(stages_.front().length) + " at iteration 1";
  if (stages_.size() > 1)
    text += ", " + std::to_string(stages_.back().length) + " from iteration " +
            std::to_string(stages_.back().first_iteration) + " (" + std::to_string(stages_.size()) + " lengths)";
  return text + "; validation and test at " + std::to_string(seq_length_);
}

}  // namespace dtk::core
