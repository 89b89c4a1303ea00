#include "dtk/core/checkpoint/checkpoint_shards.hpp"

#include <glog/logging.h>

#include <algorithm>
#include <cctype>
#include <set>

#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

SliceMap slices_of(const std::vector<Param>& params) {
  SliceMap out;
  for (const Param& p : params) {
    const bool shard = p.info.full_numel > 0;
    out[p.name] = ParamSlice{shard ? p.info.shard_offset : 0, p.tensor.numel(), shard ? p.info.full_numel : p.tensor.numel()};
  }
  return out;
}

std::string param_of_key(const std::string& key, const std::map<std::string, ParamSlice>& names) {
  // Candidate starts: the key's start and after every '.'; candidate ends: the key's end and
  // before every '.'. The longest candidate that is a name wins.
  std::vector<size_t> starts{0}, ends;
  for (size_t i = 0; i < key.size(); ++i)
    if (key[i] == '.') starts.push_back(i + 1), ends.push_back(i);
  ends.push_back(key.size());
  std::string best;
  for (size_t s : starts)
    for (size_t e : ends)
      if (e > s && e - s > best.size()) {
        std::string candidate = key.substr(s, e - s);
        if (names.count(candidate)) best = std::move(candidate);
      }
  return best;
}

StateAssembler::StateAssembler(const std::vector<Param>& wanted, const std::vector<std::string>& model_params)
    : wanted_(slices_of(wanted)), names_(wanted_) {
  for (const Param& p : wanted) shape_[p.name] = p.tensor.sizes().vec();
  for (const std::string& n : model_params) names_.emplace(n, ParamSlice{});
}

void StateAssembler::add(const TensorList& optimizer, const TensorList& strategy, const SliceMap& saved) {
  add_to(optimizer_, optimizer, saved);
  add_to(strategy_, strategy, saved);
}

void StateAssembler::add_to(Entries& out, const TensorList& state, const SliceMap& saved) {
  at::NoGradGuard no_grad;
  SliceMap names = names_;  // every parameter name either layout knows
  names.insert(saved.begin(), saved.end());
  for (const auto& [key, value] : state) {
    const std::string param = param_of_key(key, names);
    auto found = out.index.find(key);
    Entry* entry = found == out.index.end() ? nullptr : &out.list[found->second].second;
    auto keep_first = [&](Entry e) {
      if (entry) return;
      out.index[key] = out.list.size();
      out.list.emplace_back(key, std::move(e));
    };
    if (param.empty()) {  // not a parameter's (an optimizer's "step"): the first file's
      keep_first(Entry{"", value, 0});
      continue;
    }
    const auto want = wanted_.find(param);
    if (want == wanted_.end()) continue;  // a parameter this rank does not step
    // The run of the parameter this entry holds: the file's shard, or (a replicated save, which
    // lists nothing) all of it. An entry of another size is per parameter, not per element (a
    // per-parameter step count): the first file's.
    const auto have = saved.find(param);
    const ParamSlice src =
        have != saved.end() ? have->second : ParamSlice{0, want->second.full_numel, want->second.full_numel};
    if (value.numel() != src.numel) {
      keep_first(Entry{"", value, 0});
      continue;
    }
    const ParamSlice& dst = want->second;
    if (src.full_numel != dst.full_numel)
      throw HostError("state '" + key + "' is of a parameter of " + std::to_string(src.full_numel) +
                      " elements, this model's '" + param + "' has " + std::to_string(dst.full_numel));
    if (!entry) {
      keep_first(Entry{param, at::zeros({dst.numel}, value.options().device(at::kCPU)), 0});
      entry = &out.list.back().second;
    }
    const int64_t lo = std::max(src.offset, dst.offset);
    const int64_t hi = std::min(src.offset + src.numel, dst.offset + dst.numel);
    if (lo >= hi) continue;
    if (entry->covered + (hi - lo) > dst.numel)
      throw HostError("state '" + key + "': saved shards of '" + param + "' overlap");
    entry->value.narrow(0, lo - dst.offset, hi - lo).copy_(value.reshape({-1}).narrow(0, lo - src.offset, hi - lo));
    entry->covered += hi - lo;
  }
}

// The kinds of per-parameter state ("g*.{}.exp_avg") and the wanted parameters each one lacks.
void StateAssembler::warn_missing(const Entries& entries) const {
  std::map<std::string, std::set<std::string>> has;  // kind -> parameters
  for (const auto& [key, e] : entries.list) {
    if (e.param.empty()) continue;
    std::string kind = key;
    kind.replace(kind.find(e.param), e.param.size(), "{}");
    if (kind.size() > 1 && kind[0] == 'g' && std::isdigit(static_cast<unsigned char>(kind[1])))
      kind = "g*" + kind.substr(kind.find('.'));  // the group index differs between parameters
    has[kind].insert(e.param);
  }
  for (const auto& [kind, params] : has)
    for (const auto& [name, slice] : wanted_)
      if (!params.count(name))
        LOG(WARNING) << "checkpoint: no '" << kind << "' state for '" << name << "' (" << params.size()
                     << " other parameters have it): it starts fresh";
}

TensorList StateAssembler::finish(const Entries& entries) const {
  warn_missing(entries);
  TensorList out;
  for (const auto& [key, e] : entries.list) {
    if (e.param.empty()) {
      out.emplace_back(key, e.value);
      continue;
    }
    const int64_t need = wanted_.at(e.param).numel;
    if (e.covered != need)
      throw HostError("state '" + key + "' covers " + std::to_string(e.covered) + " of the " + std::to_string(need) +
                      " elements this rank needs of '" + e.param + "' (a data-parallel shard file is missing?)");
    out.emplace_back(key, e.value.view(shape_.at(e.param)));
  }
  return out;
}

}  // namespace dtk::core
