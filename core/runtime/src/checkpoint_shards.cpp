#include "dtk/core/checkpoint_shards.hpp"

#include <algorithm>

#include "dtk/host/plugin_host.hpp"

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
  any_ = true;
}

void StateAssembler::add_to(Entries& out, const TensorList& state, const SliceMap& saved) {
  at::NoGradGuard no_grad;
  SliceMap names = names_;  // every parameter name either layout knows
  names.insert(saved.begin(), saved.end());
  for (const auto& [key, value] : state) {
    const std::string param = param_of_key(key, names);
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& e) { return e.first == key; });
    if (param.empty()) {  // not a parameter's (an optimizer's "step"): the first file's
      if (it == out.end()) out.emplace_back(key, Entry{"", value, 0});
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
      if (it == out.end()) out.emplace_back(key, Entry{"", value, 0});
      continue;
    }
    const ParamSlice& dst = want->second;
    if (src.full_numel != dst.full_numel)
      throw HostError("state '" + key + "' is of a parameter of " + std::to_string(src.full_numel) +
                      " elements, this model's '" + param + "' has " + std::to_string(dst.full_numel));
    if (it == out.end()) {
      out.emplace_back(key, Entry{param, at::zeros({dst.numel}, value.options().device(at::kCPU)), 0});
      it = out.end() - 1;
    }
    const int64_t lo = std::max(src.offset, dst.offset);
    const int64_t hi = std::min(src.offset + src.numel, dst.offset + dst.numel);
    if (lo >= hi) continue;
    it->second.value.narrow(0, lo - dst.offset, hi - lo)
        .copy_(value.reshape({-1}).narrow(0, lo - src.offset, hi - lo));
    it->second.covered += hi - lo;
  }
}

bool StateAssembler::complete() const {
  if (!any_) return false;
  for (const Entries* entries : {&optimizer_, &strategy_})
    for (const auto& [key, e] : *entries)
      if (!e.param.empty() && e.covered != wanted_.at(e.param).numel) return false;
  return true;
}

TensorList StateAssembler::finish(const Entries& entries) const {
  TensorList out;
  for (const auto& [key, e] : entries) {
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
