// dtk/layers/norms.hpp — the normalisations of GPT (LayerNorm) and Llama (RMSNorm), for any model
// plugin. Megatron's arithmetic in fp32 whatever the parameters' type, the result in the input's
// type. On a GPU each is a fused kernel: LayerNorm is ATen's (it reads bf16/fp16 and computes in
// fp32 itself), RMSNorm DTK's own forward and backward kernels (dtk/cuda/rms_norm.hpp) where the
// build has CUDA; on the CPU, and wherever a kernel does not apply, LibTorch ops.
// add_layer_norm and add_rms_norm fuse the residual add before a norm (a pre-norm layer's
// `h = x + branch; norm(h)`) into DTK's kernels (dtk/cuda/layer_norm.hpp, rms_norm.hpp): one pass
// forward, one backward that also adds the residual stream's gradient; on the CPU, and wherever
// the kernels do not apply, exactly the add and the norm above. add_bias_dropout_layer_norm also
// takes the branch's bias and its dropout into the LayerNorm's kernel (Megatron's
// bias-dropout-add): a row-parallel product made without its bias
// (RowParallelLinear::forward_unbiased) hands it on with the mask drawn for the branch.
#pragma once

#include <ATen/core/Tensor.h>
#include <dtk/layers/dropout.hpp>
#include <dtk/layers/fused_kernels.hpp>

#include <utility>

namespace dtk::layers {

// LayerNorm over the last dimension with weight w and bias b.
at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps);

// RMSNorm over the last dimension (Megatron's RMSNorm, torch.nn.RMSNorm):
//   y = T(T(x / sqrt(mean(x^2) + eps)) * weight), the normalisation in fp32, T = x's type.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const FusedKernels& kernels = {});

// The same as LibTorch ops on any device: the reference the GPU kernel is tested against.
at::Tensor rms_norm_ops(const at::Tensor& x, const at::Tensor& weight, double eps);

// The residual add and the norm after it: {h, norm(h)} with h = x + residual. x and residual
// of one shape and type; the first result is the residual stream going on, the second the norm's
// output (gradients flow into both).
std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                 const at::Tensor& b, double eps, const FusedKernels& kernels = {});
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps, const FusedKernels& kernels = {});

// The residual add of a branch whose bias is still to add, and the LayerNorm after it:
// {h, layer_norm(h)} with h = x + (branch + branch_bias); branch_bias undefined: add_layer_norm.
// On a GPU one kernel (the bias's gradient, the column sums of the branch's, made in the
// backward's pass); elsewhere the ops: the bias add, then add_layer_norm.
std::pair<at::Tensor, at::Tensor> add_bias_layer_norm(const at::Tensor& x, const at::Tensor& branch,
                                                      const at::Tensor& branch_bias, const at::Tensor& w,
                                                      const at::Tensor& b, double eps,
                                                      const FusedKernels& kernels = {});
// The same with the branch's dropout: h = x + apply_dropout(branch + branch_bias, branch_keep)
// (branch_keep undefined: add_bias_layer_norm). On a GPU one kernel, which hashes the mask's bits
// itself forward and backward; elsewhere apply_dropout, then add_bias_layer_norm.
std::pair<at::Tensor, at::Tensor> add_bias_dropout_layer_norm(const at::Tensor& x, const at::Tensor& branch,
                                                              const at::Tensor& branch_bias,
                                                              const DropoutMask& branch_keep, const at::Tensor& w,
                                                              const at::Tensor& b, double eps,
                                                              const FusedKernels& kernels = {});
// Whether add_bias_dropout_layer_norm adds a branch's bias and applies its dropout in its kernel
// for a residual stream like x and a norm (w, b): a layer leaves a product's bias and dropout out
// only then. Elsewhere the product adds its bias (rounding once, as before: the CPU's losses do not
// move) and dropout runs on its own.
bool layer_norm_takes_branch_bias(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                  const FusedKernels& kernels);

// Their LibTorch-op references on any device (what the GPU kernels are tested against).
std::pair<at::Tensor, at::Tensor> add_layer_norm_ops(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& w, const at::Tensor& b, double eps);
std::pair<at::Tensor, at::Tensor> add_bias_layer_norm_ops(const at::Tensor& x, const at::Tensor& branch,
                                                          const at::Tensor& branch_bias, const at::Tensor& w,
                                                          const at::Tensor& b, double eps);
// The dropout through apply_dropout_ops (the mask's bits made by tensor operations).
std::pair<at::Tensor, at::Tensor> add_bias_dropout_layer_norm_ops(const at::Tensor& x, const at::Tensor& branch,
                                                                  const at::Tensor& branch_bias,
                                                                  const DropoutMask& branch_keep, const at::Tensor& w,
                                                                  const at::Tensor& b, double eps);
std::pair<at::Tensor, at::Tensor> add_rms_norm_ops(const at::Tensor& x, const at::Tensor& residual,
                                                   const at::Tensor& weight, double eps);

}  // namespace dtk::layers
