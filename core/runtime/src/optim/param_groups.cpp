#include "dtk/core/optim/param_groups.hpp"

#include "dtk/core/config/param_rule_regex.hpp"

#include "dtk/host/error.hpp"

#include <algorithm>
#include <cstdio>
#include <map>

namespace dtk::core {

ParamGroups::ParamGroups(const config::LrSchedule& lr, double end_weight_decay) {
  char buf[64];
  auto label = [&](const std::string& what, double wd, double lr_scale, const config::ParamRule* rule = nullptr) {
    std::snprintf(buf, sizeof buf, " (weight decay %.6g, lr x %.6g", wd, lr_scale);
    std::string text = what + buf;
    if (rule && rule->has_max_lr()) std::snprintf(buf, sizeof buf, ", max_lr %.6g", rule->max_lr()), text += buf;
    if (rule && rule->has_min_lr()) std::snprintf(buf, sizeof buf, ", min_lr %.6g", rule->min_lr()), text += buf;
    return text + ")";
  };
  specs_.push_back({label("decay", end_weight_decay, 1), end_weight_decay, 1});
  specs_.push_back({label("no decay", 0, 1), 0, 1});
  for (int i = 0; i < lr.param_rules_size(); ++i) {
    const auto& r = lr.param_rules(i);
    rules_.push_back(param_rule_regex(r.match()));
    patterns_.push_back(r.match());
    const double lr_scale = r.has_lr_mult() ? r.lr_mult() : 1.0;
    const std::string who = "rule " + std::to_string(i) + " \"" + r.match() + "\"";
    // wd_mult replaces the parameter's own decay (1 for weights, 0 for biases and norms).
    for (const bool no_wd : {false, true}) {
      const double wd = end_weight_decay * (r.has_wd_mult() ? r.wd_mult() : (no_wd ? 0.0 : 1.0));
      GroupSpec spec{label(who + (no_wd ? ", a no-decay parameter" : ""), wd, lr_scale, &r), wd, lr_scale, {}, {}};
      if (r.has_max_lr()) spec.max_lr = r.max_lr();
      if (r.has_min_lr()) spec.min_lr = r.min_lr();
      specs_.push_back(std::move(spec));
    }
  }
}

bool ParamGroups::own_schedules() const {
  return std::any_of(specs_.begin(), specs_.end(), [](const GroupSpec& s) { return s.own_schedule(); });
}

size_t ParamGroups::group_of(const std::string& name, bool no_weight_decay) const {
  for (size_t i = 0; i < rules_.size(); ++i)
    if (std::regex_search(name, rules_[i])) return 2 + 2 * i + (no_weight_decay ? 1 : 0);
  return no_weight_decay ? 1 : 0;
}

void ParamGroups::require_every_rule_matches(const std::vector<Param>& params) const {
  for (size_t i = 0; i < rules_.size(); ++i) {
    bool any = false;
    for (const Param& p : params) any = any || std::regex_search(p.name, rules_[i]);
    if (!any)
      throw host::HostError("config: lr.param_rules[" + std::to_string(i) + "]: '" + patterns_[i] +
                            "' matches no parameter of the model (its names look like '" +
                            (params.empty() ? std::string("?") : params.back().name) + "')");
  }
}

std::vector<std::string> ParamGroups::describe(const std::vector<Param>& params) const {
  static const std::regex layer_number(R"(\.layers\.\d+\.)");
  std::vector<std::vector<std::pair<std::string, int>>> members(specs_.size());  // pattern, count (first-seen order)
  std::vector<int64_t> elements(specs_.size(), 0);
  for (const Param& p : params) {
    const size_t g = group_of(p.name, p.info.no_weight_decay != 0);
    const std::string pattern = std::regex_replace(p.name, layer_number, ".layers.*.");
    auto& list = members[g];
    auto it = std::find_if(list.begin(), list.end(), [&](const auto& m) { return m.first == pattern; });
    if (it == list.end())
      list.emplace_back(pattern, 1);
    else
      ++it->second;
    elements[g] += p.tensor.numel();
  }
  std::vector<std::string> out;
  for (size_t g = 0; g < specs_.size(); ++g) {
    if (members[g].empty()) continue;
    size_t count = 0;
    std::string names;
    for (const auto& [pattern, n] : members[g]) {
      count += static_cast<size_t>(n);
      names += (names.empty() ? "" : ", ") + pattern + (n > 1 ? " (x" + std::to_string(n) + ")" : "");
    }
    out.push_back(" > optimizer group " + std::to_string(g) + ", " + specs_[g].label + ": " + std::to_string(count) +
                  " tensors, " + std::to_string(elements[g]) + " elements: " + names);
  }
  return out;
}

}  // namespace dtk::core
