// rope_scaling.hpp — Llama 3.1's rotary frequency scaling ("llama3" rope scaling), in plain C++
// (no LibTorch) so the model tests compile it on its own and check it against the formula.
//
// Meta's llama3 / Hugging Face's _compute_llama3_parameters: for each inverse frequency f, with
// wavelen = 2 pi / f, low_wl = original / low_freq_factor, high_wl = original / high_freq_factor:
//   wavelen < high_wl   f unchanged (high frequencies: short-range positions)
//   wavelen > low_wl    f / factor  (low frequencies: stretched to the longer context)
//   otherwise           (1 - smooth) f / factor + smooth f,
//                       smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtk::llama {

struct RopeScaling {
  bool llama3 = false;  // option rope_scaling: "none" | "llama3"
  double factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_positions = 8192;
};

// The first problem with the options as one line naming the option ("" when they are usable).
std::string rope_scaling_problem(const RopeScaling& s);

// The scaled inverse frequencies (computed in double, returned in fp32 as the rotary table is).
std::vector<float> llama3_inv_freq(const std::vector<float>& inv_freq, const RopeScaling& s);

}  // namespace dtk::llama
