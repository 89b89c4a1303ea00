// rotary.cpp — see rotary.hpp.
#include <dtk/layers/rotary.hpp>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include "cuda_kernels.hpp"

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FusedRotary : public torch::autograd::Function<FusedRotary> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    RECORD_FUNCTION("dtk::rotary", std::vector<c10::IValue>());
    ctx->save_for_backward({cos, sin});
    return gpu::rotary_forward(x, cos, sin);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("dtk::rotary_backward", std::vector<c10::IValue>());
    const auto saved = ctx->get_saved_variables();
    return {gpu::rotary_backward(grad[0], saved[0], saved[1]), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor apply_rotary_ops(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t dim = cos.size(-1), half = dim / 2;
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor rot = xf.narrow(-1, 0, dim);
  const at::Tensor rotated_half = at::cat({rot.narrow(-1, half, half).neg(), rot.narrow(-1, 0, half)}, -1);
  at::Tensor out = rot * cos + rotated_half * sin;
  if (dim < x.size(-1)) out = at::cat({out, xf.narrow(-1, dim, x.size(-1) - dim)}, -1);
  return out.to(x.scalar_type());
}

at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const FusedKernels& kernels) {
  // The angles carry no gradient (a function of the positions).
  if (kernels.rotary && gpu::rotary_applies(x, cos, sin)) return FusedRotary::apply(x, cos.detach(), sin.detach());
  return apply_rotary_ops(x, cos, sin);
}

}  // namespace dtk::layers
