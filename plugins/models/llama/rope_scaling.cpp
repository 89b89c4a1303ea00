// rope_scaling.cpp — see rope_scaling.hpp.
#include "rope_scaling.hpp"

#include <cmath>
#include <cstdio>

namespace dtk::llama {

std::string rope_scaling_problem(const RopeScaling& s) {
  if (!s.llama3) return "";
  auto text = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return std::string(buf);
  };
  if (!(s.factor > 0.0)) return "option 'rope_scaling_factor' must be positive, got " + text(s.factor);
  if (!(s.low_freq_factor > 0.0)) return "option 'rope_low_freq_factor' must be positive, got " + text(s.low_freq_factor);
  if (!(s.high_freq_factor > s.low_freq_factor))
    return "option 'rope_high_freq_factor' (" + text(s.high_freq_factor) +
           ") must be greater than 'rope_low_freq_factor' (" + text(s.low_freq_factor) + ")";
  if (s.original_max_positions <= 0)
    return "option 'rope_original_max_positions' must be positive, got " + std::to_string(s.original_max_positions);
  return "";
}

std::vector<float> llama3_inv_freq(const std::vector<float>& inv_freq, const RopeScaling& s) {
  const double pi = 3.14159265358979323846, original = static_cast<double>(s.original_max_positions);
  const double low_wavelen = original / s.low_freq_factor, high_wavelen = original / s.high_freq_factor;
  std::vector<float> out;
  out.reserve(inv_freq.size());
  for (float f32 : inv_freq) {
    const double f = f32, wavelen = 2.0 * pi / f;
    double scaled = f;
    if (wavelen > low_wavelen) {
      scaled = f / s.factor;
    } else if (!(wavelen < high_wavelen)) {
      const double smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      scaled = (1.0 - smooth) * f / s.factor + smooth * f;
    }
    out.push_back(static_cast<float>(scaled));
  }
  return out;
}

}  // namespace dtk::llama
