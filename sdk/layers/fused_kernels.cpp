// fused_kernels.cpp — see dtk/layers/fused_kernels.hpp.
#include <dtk/layers/fused_kernels.hpp>

#include <dtk/comma_list.hpp>

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
  for (const std::string& name : comma_items(list)) {
    if (name.empty()) continue;  // "" and stray commas name no kernel
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
