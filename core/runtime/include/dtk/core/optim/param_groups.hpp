// dtk/core/optim/param_groups.hpp — which optimizer group each parameter goes to (Megatron's
// get_param_groups with no_weight_decay_cond, scale_lr_cond and lr_mult), decided by name alone so
// that every rank, every strategy and every resume agree on a parameter's group.
#pragma once

#include <dtk/model.hpp>

#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "dtk_config.pb.h"

namespace dtk::core {

// One optimizer group: its weight decay at the end of the weight-decay schedule, its
// learning-rate multiplier, and (a rule's max_lr/min_lr) its own schedule peak and floor.
struct GroupSpec {
  std::string label;  // "weight decay", "no weight decay", "rule 0 ("bias$"), weight decay", ...
  double weight_decay = 0, lr_scale = 1;
  std::optional<double> max_lr, min_lr;
  bool own_schedule() const { return max_lr || min_lr; }
};

// The groups of a run, in the fixed order of abi.h: 0 = weights that decay, 1 = parameters that
// do not (dtk_param_info.no_weight_decay: biases, norm weights), then two per lr.param_rules
// entry (its decaying and its non-decaying parameters). The first rule whose `match` is found
// in a parameter's name decides; an unmatched parameter stays in group 0 or 1.
class ParamGroups {
 public:
  // end_weight_decay: the weight decay at the end of the schedule (lr.weight_decay when constant).
  ParamGroups(const config::LrSchedule& lr, double end_weight_decay);
  const std::vector<GroupSpec>& specs() const { return specs_; }
  // Whether a group has its own peak or floor: the optimizer then gets every group's rate.
  bool own_schedules() const;
  size_t group_of(const std::string& name, bool no_weight_decay) const;
  // One line per non-empty group: its settings and its members (names that differ only in a
  // layer number are shown once as "layers.*." with a count).
  std::vector<std::string> describe(const std::vector<Param>& params) const;
  // Throws HostError for a rule that matches none of `params` (a typo would otherwise change
  // nothing without a word). Pass the whole model's parameters.
  void require_every_rule_matches(const std::vector<Param>& params) const;

 private:
  std::vector<GroupSpec> specs_;
  std::vector<std::regex> rules_;
  std::vector<std::string> patterns_;
};

}  // namespace dtk::core
