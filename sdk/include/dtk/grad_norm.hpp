// dtk/grad_norm.hpp — the arithmetic of Megatron's global gradient norm and clipping
// (clip_grad_norm_fp32), for strategy plugins: the sum of squares of many gradients in fp64, and
// the scaling of all of them by the clip coefficient. On a GPU each is one multi-tensor pass (a
// few kernel launches for the whole model, not several per parameter), and the norm stays on the
// device until the strategy reads it: one host synchronisation per step.
//
// The GPU pass needs the plugin built with dtk_add_plugin(... CUDA) (DTK_HAVE_CUDA and
// DTK_TORCH_CUDA); without it GPU tensors take LibTorch ops per tensor, with the same result.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if DTK_HAVE_CUDA && DTK_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dtk/cuda/squares.hpp"
#endif

namespace dtk {

// The sum of the squares of t's elements, accumulated in fp64, as a 0-d fp64 tensor on t's device
// (add them up and call .item() once: one host sync). For Megatron's global gradient norm. Each
// fp32 square is exact in fp64, so the result hardly depends on how the elements are split (ZeRO's
// partitions vs ddp's parameters: norms equal to ~1e-15, which bf16 training needs, since a
// clip coefficient differing in its last fp32 bit changes which way parameters round). On the
// CPU a contiguous fp32 tensor is read once in fixed 64K-element blocks on the intra-op
// threads (t.to(kDouble).pow(2).sum() made two fp64 copies: 170 ms for a 30M-parameter model's
// clipping, 10x this); elsewhere fp64 copies of 1M-element slices. NaN and Inf propagate.
inline at::Tensor sum_of_squares(const at::Tensor& t) {
  const at::Tensor flat = t.reshape({-1});
  const int64_t n = flat.numel();
  if (flat.device().is_cpu() && flat.scalar_type() == at::kFloat && flat.is_contiguous()) {
    constexpr int64_t kBlock = 1 << 16;
    const float* x = flat.data_ptr<float>();
    std::vector<double> partial(static_cast<size_t>((n + kBlock - 1) / kBlock), 0.0);
    at::parallel_for(0, static_cast<int64_t>(partial.size()), 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        double acc = 0;
        for (int64_t i = b * kBlock, end = std::min(n, i + kBlock); i < end; ++i)
          acc += static_cast<double>(x[i]) * static_cast<double>(x[i]);
        partial[static_cast<size_t>(b)] = acc;
      }
    });
    double total = 0;
    for (double p : partial) total += p;
    return at::scalar_tensor(total, at::kDouble);
  }
  at::Tensor total = at::zeros({}, flat.options().dtype(at::kDouble));
  constexpr int64_t kSlice = 1 << 20;
  for (int64_t i = 0; i < n; i += kSlice) {
    const at::Tensor d = flat.narrow(0, i, std::min(kSlice, n - i)).to(at::kDouble);
    total += d.dot(d);
  }
  return total;
}

#if DTK_HAVE_CUDA && DTK_TORCH_CUDA
namespace grad_norm_detail {
// The tensors as dtk::cuda::sum_of_squares takes them, or false when one is not a contiguous
// fp32/bf16/fp16 tensor on `device`.
inline bool as_squares(const std::vector<at::Tensor>& tensors, const at::Device& device,
                       std::vector<dtk::cuda::SquaresTensor>* out) {
  for (const at::Tensor& t : tensors) {
    if (t.device() != device || !t.is_contiguous()) return false;
    dtk::cuda::ElementType type;
    if (t.scalar_type() == at::kFloat)
      type = dtk::cuda::ElementType::kFloat32;
    else if (t.scalar_type() == at::kBFloat16)
      type = dtk::cuda::ElementType::kBFloat16;
    else if (t.scalar_type() == at::kHalf)
      type = dtk::cuda::ElementType::kFloat16;
    else
      return false;
    out->push_back({t.data_ptr(), t.numel(), type});
  }
  return true;
}
}  // namespace grad_norm_detail
#endif

// The sum of the squares of every element of `tensors`, in fp64, as a 0-d fp64 tensor on their
// device (0 on `device` when there are none). The per-tensor sums are added in the order given,
// so on the CPU the result equals adding sum_of_squares(t) one by one. On a GPU (plugins built
// with CUDA) one multi-tensor pass: a few launches for any number of tensors, deterministic.
inline at::Tensor sum_of_squares(const std::vector<at::Tensor>& tensors, const at::Device& device) {
  if (tensors.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
#if DTK_HAVE_CUDA && DTK_TORCH_CUDA
  const at::Device on = tensors.front().device();
  std::vector<dtk::cuda::SquaresTensor> list;
  if (on.is_cuda() && grad_norm_detail::as_squares(tensors, on, &list)) {
    const c10::cuda::CUDAGuard guard(on);
    const int64_t work = dtk::cuda::sum_of_squares_workspace(list);
    at::Tensor space = at::empty({work + 1}, at::TensorOptions().dtype(at::kDouble).device(on));
    double* base = space.data_ptr<double>();
    dtk::cuda::sum_of_squares(list, base, base + work, c10::cuda::getCurrentCUDAStream(on.index()).stream());
    return space[work];
  }
#endif
  at::Tensor total;
  for (const at::Tensor& t : tensors) {
    at::Tensor sq = sum_of_squares(t);
    total = total.defined() ? total + sq : sq;
  }
  return total;
}

// t *= coeff for every tensor: one multi-tensor launch per device and dtype on a GPU (LibTorch's
// _foreach_mul_), the same products as t.mul_(coeff) one by one.
inline void scale_all(const std::vector<at::Tensor>& tensors, double coeff) {
  if (!tensors.empty()) at::_foreach_mul_(tensors, coeff);
}

}  // namespace dtk
