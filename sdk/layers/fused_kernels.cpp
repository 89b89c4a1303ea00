// fused_kernels.cpp — see dtk/layers/fused_kernels.hpp.
#include <dtk/layers/fused_kernels.hpp>

#include <algorithm>
#include <stdexcept>

namespace dtk::layers {

FusedKernels unfused_kernels(const std::string& list) {
  FusedKernels k;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    std::string name = list.substr(start, comma - start);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    start = comma + 1;
    if (name.empty()) continue;
    if (name == "all") k = {false, false, false, false, false};
    else if (name == "add_norm") k.add_norm = false;
    else if (name == "rms_norm") k.rms_norm = false;
    else if (name == "bias_gelu") k.bias_gelu = false;
    else if (name == "swiglu") k.swiglu = false;
    else if (name == "rotary") k.rotary = false;
    else throw std::invalid_argument("unknown kernel '" + name + "' (" + kFusedKernelNames + ", all)");
  }
  return k;
}

}  // namespace dtk::layers
