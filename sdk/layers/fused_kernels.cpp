// fused_kernels.cpp — see dtk/layers/fused_kernels.hpp.
#include <dtk/layers/fused_kernels.hpp>

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace dtk::layers {

FusedKernels unfused_kernels(const std::string& list) {
  static const std::pair<const char*, bool FusedKernels::*> kNames[] = {
      {"add_norm", &FusedKernels::add_norm},  {"bias_add", &FusedKernels::bias_add},
      {"rms_norm", &FusedKernels::rms_norm},  {"bias_gelu", &FusedKernels::bias_gelu},
      {"swiglu", &FusedKernels::swiglu},      {"rotary", &FusedKernels::rotary},
      {"attention", &FusedKernels::attention}};
  FusedKernels k;
  for (size_t start = 0; start <= list.size();) {
    const size_t comma = std::min(list.find(',', start), list.size());
    std::string name = list.substr(start, comma - start);
    start = comma + 1;
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    if (name.empty()) continue;
    bool known = false;
    for (const auto& [known_name, field] : kNames) {
      if (name != known_name && name != "all") continue;
      k.*field = false;
      known = true;
    }
    if (!known) throw std::invalid_argument("unknown kernel '" + name + "' (" + kFusedKernelNames + ", all)");
  }
  return k;
}

}  // namespace dtk::layers
