// dtk/layers/rotary.hpp — rotary position embeddings (Megatron's non-interleaved RoPE: the first
// and second halves of the rotated channels pair up) applied to queries or keys, for any model
// plugin. On a GPU one kernel each way (dtk/cuda/rotary.hpp) where the build has it; elsewhere
// LibTorch ops in fp32. Both give the same fp32 arithmetic, rounded once to x's type.
#pragma once

#include <ATen/core/Tensor.h>
#include <dtk/layers/fused_kernels.hpp>

namespace dtk::layers {

// x: [b, s, heads, head_dim]; cos, sin: fp32 [b, s, 1, dim] (each token's angles, dim <= head_dim,
// even). Channels [0, dim) rotate: x cos + rotate_half(x) sin; the rest pass through.
at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const FusedKernels& kernels = {});

// The same as LibTorch ops on any device: the reference the GPU kernel is tested against.
at::Tensor apply_rotary_ops(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace dtk::layers
