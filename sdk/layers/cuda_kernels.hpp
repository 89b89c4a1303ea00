// cuda_kernels.hpp (private to dtk::layers) — the LibTorch side of DTK's own GPU kernels
// (core/cuda: dtk/cuda/cross_entropy.hpp, rms_norm.hpp, layer_norm.hpp, bias_gelu.hpp, swiglu.hpp, rotary.hpp,
// dropout.hpp, attention.hpp) for the layers. Each kernel has a LibTorch-op reference in the layer
// that calls it; a call here returns false (or `applies` is
// false) where the kernel does not apply: a CPU tensor, a build without CUDA (DTK_HAVE_CUDA) or
// without a CUDA LibTorch (DTK_TORCH_CUDA), a dtype or shape the kernel does not take. The
// caller then runs the reference.
#pragma once

#include <ATen/core/Tensor.h>

#include <dtk/layers/dropout.hpp>

#include <cstdint>

#include <tuple>
#include <utility>

namespace dtk::layers::gpu {

// The cross entropy of a chunk of logit rows [n, V] (fp32/bf16/fp16, unit stride in V) against
// `col` (int64 [n], -1 where the target is not in these columns), fp32 [n] max/sum/loss written;
// with `grads` the logits become softmax - onehot in place. False where it does not apply.
bool cross_entropy_rows(const at::Tensor& logits, const at::Tensor& col, const at::Tensor& max, const at::Tensor& sum,
                        const at::Tensor& loss, bool grads);
// Whether cross_entropy_rows runs on logits of `type` on `device`.
bool cross_entropy_applies(const at::Device& device, at::ScalarType type);

// RMSNorm (y = T(T(x r) w), r = rsqrt(mean x^2 + eps)) over the last dimension.
bool rms_norm_applies(const at::Tensor& x, const at::Tensor& weight);
// y (x's shape and type) and r (fp32, one per row).
std::pair<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps);
// dx (x's shape and type) and dweight (weight's type).
std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                    const at::Tensor& weight, const at::Tensor& rstd);

// The residual add and RMSNorm: sum = T(x + residual), y = rms_norm(sum); x and residual of one
// shape, type and device.
bool add_rms_norm_applies(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight);
// sum, y (x's shape and type) and r (fp32, one per row).
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor& x, const at::Tensor& residual,
                                                                    const at::Tensor& weight, double eps);
// The gradient of x and of residual (one tensor, x's shape and type) and dweight (weight's type),
// from dy (the norm's output's gradient) and dsum (the sum's).
std::pair<at::Tensor, at::Tensor> add_rms_norm_backward(const at::Tensor& dy, const at::Tensor& dsum,
                                                        const at::Tensor& sum, const at::Tensor& weight,
                                                        const at::Tensor& rstd);

// The residual add and LayerNorm: sum = T(x + residual), y = layer_norm(sum, w, b); x and
// residual of one shape, type and device, w and b [hidden] of their type. With residual_bias c
// (defined, [hidden] of their type): sum = T(x + T(residual + c)); with residual_keep (defined:
// a mask over the residual's elements in row-major order) the residual, biased or not, goes through
// the mask (apply_dropout's arithmetic) before the add.
bool add_layer_norm_applies(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& residual_bias,
                            const at::Tensor& w, const at::Tensor& b);
// sum, y (x's shape and type), mean and rstd (fp32, one per row).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& residual_bias, const DropoutMask& residual_keep,
    const at::Tensor& w, const at::Tensor& b, double eps);
struct AddLayerNormGrads {
  at::Tensor dx, dresidual;   // one tensor without the residual's dropout
  at::Tensor dw, db;          // w's type
  at::Tensor dresidual_bias;  // w's type, with `residual_bias`; else undefined
};
AddLayerNormGrads add_layer_norm_backward(const at::Tensor& dy, const at::Tensor& dsum, const at::Tensor& sum,
                                          const at::Tensor& w, const at::Tensor& mean, const at::Tensor& rstd,
                                          const DropoutMask& residual_keep, bool residual_bias);

// Bias + GELU: x [..., n] of `type` on `device`, bias [n] of that type and device (the caller
// checks that x's last dimension is the bias's size).
bool bias_gelu_applies(const at::Device& device, at::ScalarType type, const at::Tensor& bias);
// gelu(x + bias) (x's shape and type).
at::Tensor bias_gelu_forward(const at::Tensor& x, const at::Tensor& bias, bool tanh);
// dx (x's shape and type) and dbias (bias's type).
std::pair<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& bias, bool tanh);

// SwiGLU's silu(gate) * up: gate and up of one shape, type and device.
bool swiglu_applies(const at::Tensor& gate, const at::Tensor& up);
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up);
// dgate and dup (gate's shape and type).
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up);

// DTK's counter-based dropout (dtk/layers/dropout.hpp) in one pass: x * scale where the mask keeps
// an element (its uniform >= threshold), 0 elsewhere, in x's type. x of fp32/bf16/fp16 on a
// GPU (any layout: made contiguous).
bool dropout_applies(const at::Tensor& x);
at::Tensor dropout_apply(const at::Tensor& x, const DropoutMask& mask);
// Uniform(low, high) noise of a hashed draw (uniform_noise_on), fp32 [numel] on a GPU, in one pass.
bool uniform_noise_applies(const at::Device& device);
at::Tensor uniform_noise(const DropoutMask& draw, int64_t numel, double low, double high, const at::Device& device);

// Rotary embeddings (dtk/layers/rotary.hpp): x [b, s, heads, hd] (unit stride in hd), cos/sin
// fp32 [b, s, 1, dim] contiguous on x's device.
bool rotary_applies(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rotary_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// dx from dy (x's shape and type).
at::Tensor rotary_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin);

// Causal self-attention with DTK's dropout on the probabilities (dtk/cuda/attention.hpp): q [b, s,
// heads, hd], k and v [b, s, groups, hd] (heads a multiple of groups) of one type (bf16, fp16) on
// one GPU, hd 64 or 128 with unit stride, the other strides multiples of 8, 16-byte aligned; keep
// undefined or a mask of [b, heads, s, s] (or rows of one: a Domino chunk's).
bool attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const DropoutMask& keep);
// out [b, s, heads, hd] contiguous of q's type and lse fp32 [b, heads, s].
// window: a sliding window (keys before i - window masked too), -1 for none.
std::pair<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale, const DropoutMask& keep, int64_t window);
// dq, dk, dv (contiguous, of q's, k's and v's shapes) from dout (out's shape).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& dout, const at::Tensor& out,
                                                                  const at::Tensor& lse, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  double scale, const DropoutMask& keep,
                                                                  int64_t window);

}  // namespace dtk::layers::gpu
