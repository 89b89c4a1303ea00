// dtk/layers/fused_kernels.hpp — which of DTK's fused GPU kernels a layer function may use.
// Each function of norms.hpp, activations.hpp and rotary.hpp that has a kernel takes a
// FusedKernels, every kernel on by default, and so does attention.hpp's fused_attention_applies; a
// decoder model passes its config's (the option `unfused_kernels`, DecoderConfig::kernels;
// Megatron's --no-bias-gelu-fusion, --no-bias-swiglu-fusion, --no-bias-dropout-fusion and
// --no-rope-fusion map to it). A kernel
// turned off, the function runs its LibTorch-op reference instead: a way out for a kernel in
// doubt, and a way to measure what each kernel is worth in one run (tools/gpu_check.sh's
// variants). The CPU runs the references always, so on the CPU the choice changes nothing.
#pragma once

#include <string>

namespace dtk::layers {

struct FusedKernels {
  bool add_norm = true;   // add_layer_norm, add_rms_norm: the residual add and the norm in one kernel
  bool bias_add = true;   // add_bias_dropout_layer_norm: a branch's bias and dropout in it too (needs add_norm)
  bool rms_norm = true;   // rms_norm: DTK's RMSNorm kernel (LayerNorm alone is always ATen's kernel)
  bool bias_gelu = true;  // bias_gelu, column_linear_gelu: the bias add and GELU in one kernel
  bool swiglu = true;     // swiglu: silu(gate) * up in one kernel
  bool rotary = true;     // apply_rotary: DTK's rotary kernel
  bool attention = true;  // fused_attention: DTK's attention kernel where attention dropout is on
};

// The names unfused_kernels() takes, as the option's help lists them.
inline constexpr const char* kFusedKernelNames = "add_norm, bias_add, rms_norm, bias_gelu, swiglu, rotary, attention";

// The kernels left on when those in `list` are turned off: names of FusedKernels' fields separated
// by commas (spaces allowed), "all" for every one, "" for none. Throws std::invalid_argument
// naming an unknown name.
FusedKernels unfused_kernels(const std::string& list);

}  // namespace dtk::layers
