// cuda_kernels.cpp — see cuda_kernels.hpp. Compiled into dtk::layers everywhere; the kernel calls
// exist where the build has CUDA and a CUDA LibTorch (the GPU machine), and CI compiles that half
// against Debian's c10/cuda headers too (dtk_torch_cuda_compile_check).
#include "cuda_kernels.hpp"

#include "dropout_rows.hpp"

#include <ATen/ATen.h>

#include <dtk/plugin.hpp>

#if DTK_HAVE_CUDA && DTK_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "dtk/cuda/attention.hpp"
#include "dtk/cuda/bias_gelu.hpp"
#include "dtk/cuda/cross_entropy.hpp"
#include "dtk/cuda/dropout.hpp"
#include "dtk/cuda/layer_norm.hpp"
#include "dtk/cuda/rms_norm.hpp"
#include "dtk/cuda/rotary.hpp"
#include "dtk/cuda/swiglu.hpp"
#endif

namespace dtk::layers::gpu {

#if DTK_HAVE_CUDA && DTK_TORCH_CUDA
namespace {

// The norms' kernels index rows in 32 bits (their check_shape refuses more).
constexpr int64_t kMaxRows = 0x7fffffffLL;

bool element_type(at::ScalarType t, dtk::cuda::ElementType* out) {
  switch (t) {
    case at::kFloat: *out = dtk::cuda::ElementType::kFloat32; return true;
    case at::kBFloat16: *out = dtk::cuda::ElementType::kBFloat16; return true;
    case at::kHalf: *out = dtk::cuda::ElementType::kFloat16; return true;
    default: return false;
  }
}

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// A defined mask as the kernels take it.
dtk::cuda::DropoutBits bits_of(const DropoutMask& mask) {
  dtk::cuda::DropoutBits bits;
  bits.seed = mask.seed;
  // A recorded step's seed: read on the device from the slot the host fills before each replay.
  if (mask.seed_slot.defined()) {
    if (!mask.seed_slot.is_cuda() || mask.seed_slot.scalar_type() != at::kLong)
      throw Error("dropout: a recorded mask's seed slot must be an int64 tensor on the GPU its kernel runs on");
    bits.seed_at = reinterpret_cast<const uint64_t*>(mask.seed_slot.data_ptr<int64_t>());
  }
  bits.threshold = mask.threshold();
  bits.scale = mask.scale();
  bits.offset = mask.offset;
  bits.row_numel = mask.row_numel;
  bits.run_numel = mask.run_numel;
  return bits;
}

}  // namespace

bool cross_entropy_applies(const at::Device& device, at::ScalarType type) {
  dtk::cuda::ElementType unused;
  return device.is_cuda() && element_type(type, &unused);
}

bool cross_entropy_rows(const at::Tensor& logits, const at::Tensor& col, const at::Tensor& max, const at::Tensor& sum,
                        const at::Tensor& loss, bool grads) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  if (!logits.is_cuda() || logits.dim() != 2 || logits.stride(1) != 1 || !element_type(logits.scalar_type(), &type))
    return false;
  const at::Tensor c = col.to(at::kLong).contiguous();
  if (!max.is_contiguous() || !sum.is_contiguous() || !loss.is_contiguous() || max.scalar_type() != at::kFloat ||
      sum.scalar_type() != at::kFloat || loss.scalar_type() != at::kFloat)
    return false;
  const c10::cuda::CUDAGuard guard(logits.device());
  dtk::cuda::cross_entropy_rows(logits.data_ptr(), type, logits.size(0), logits.size(1), logits.stride(0),
                                c.data_ptr<int64_t>(), max.data_ptr<float>(), sum.data_ptr<float>(),
                                loss.data_ptr<float>(), grads, stream_of(logits));
  return true;
}

bool rms_norm_applies(const at::Tensor& x, const at::Tensor& weight) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  const int64_t hidden = x.dim() > 0 ? x.size(-1) : 0;
  return x.is_cuda() && weight.defined() && weight.device() == x.device() && weight.scalar_type() == x.scalar_type() &&
         element_type(x.scalar_type(), &type) && weight.dim() == 1 && weight.size(0) == hidden && hidden > 0 &&
         hidden <= dtk::cuda::kRmsNormMaxHidden && x.numel() / hidden <= kMaxRows;
}

std::pair<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(x.scalar_type(), &type);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  at::Tensor y = at::empty_like(xc);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const c10::cuda::CUDAGuard guard(x.device());
  dtk::cuda::rms_norm_forward(xc.data_ptr(), wc.data_ptr(), type, rows, hidden, eps, y.data_ptr(),
                              rstd.data_ptr<float>(), stream_of(x));
  return {y, rstd};
}

std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x,
                                                    const at::Tensor& weight, const at::Tensor& rstd) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(x.scalar_type(), &type);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), gc = dy.to(x.scalar_type()).contiguous();
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  at::Tensor dx = at::empty_like(xc);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor partial = at::empty({dtk::cuda::rms_norm_backward_blocks(rows, hidden), hidden}, f32);
  at::Tensor dweight = at::empty({hidden}, f32);
  const c10::cuda::CUDAGuard guard(x.device());
  dtk::cuda::rms_norm_backward(gc.data_ptr(), xc.data_ptr(), wc.data_ptr(), type, rows, hidden,
                               rstd.data_ptr<float>(), dx.data_ptr(), partial.data_ptr<float>(),
                               dweight.data_ptr<float>(), stream_of(x));
  return {dx, dweight.to(weight.scalar_type())};
}

namespace {
// x and residual: one shape, type and device (any strides: they are made contiguous).
bool same_as(const at::Tensor& x, const at::Tensor& residual) {
  return residual.device() == x.device() && residual.scalar_type() == x.scalar_type() &&
         residual.sizes() == x.sizes();
}
}  // namespace

bool add_rms_norm_applies(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight) {
  return rms_norm_applies(x, weight) && same_as(x, residual);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor& x, const at::Tensor& residual,
                                                                    const at::Tensor& weight, double eps) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(x.scalar_type(), &type);
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  at::Tensor sum = at::empty_like(xc), y = at::empty_like(xc);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  const c10::cuda::CUDAGuard guard(x.device());
  dtk::cuda::add_rms_norm_forward(xc.data_ptr(), rc.data_ptr(), wc.data_ptr(), type, rows, hidden, eps,
                                  sum.data_ptr(), y.data_ptr(), rstd.data_ptr<float>(), stream_of(x));
  return {sum, y, rstd};
}

std::pair<at::Tensor, at::Tensor> add_rms_norm_backward(const at::Tensor& dy, const at::Tensor& dsum,
                                                        const at::Tensor& sum, const at::Tensor& weight,
                                                        const at::Tensor& rstd) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(sum.scalar_type(), &type);
  const at::Tensor hc = sum.contiguous(), wc = weight.contiguous();
  // dsum undefined: only the norm's output is used (a final norm), nothing to add.
  const at::Tensor gc = dy.to(sum.scalar_type()).contiguous();
  const at::Tensor sc = dsum.defined() ? dsum.to(sum.scalar_type()).contiguous() : at::Tensor();
  const void* sp = sc.defined() ? sc.data_ptr() : nullptr;
  const int64_t hidden = sum.size(-1), rows = sum.numel() / hidden;
  at::Tensor dx = at::empty_like(hc);
  const auto f32 = sum.options().dtype(at::kFloat);
  at::Tensor partial = at::empty({dtk::cuda::rms_norm_backward_blocks(rows, hidden), hidden}, f32);
  at::Tensor dweight = at::empty({hidden}, f32);
  const c10::cuda::CUDAGuard guard(sum.device());
  dtk::cuda::add_rms_norm_backward(gc.data_ptr(), sp, hc.data_ptr(), wc.data_ptr(), type, rows, hidden,
                                   rstd.data_ptr<float>(), dx.data_ptr(), partial.data_ptr<float>(),
                                   dweight.data_ptr<float>(), stream_of(sum));
  return {dx, dweight.to(weight.scalar_type())};
}

bool add_layer_norm_applies(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& residual_bias,
                            const at::Tensor& w, const at::Tensor& b) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  const int64_t hidden = x.dim() > 0 ? x.size(-1) : 0;
  const auto param_fits = [&](const at::Tensor& p) {
    return p.defined() && p.device() == x.device() && p.scalar_type() == x.scalar_type() && p.dim() == 1 &&
           p.size(0) == hidden;
  };
  return x.is_cuda() && element_type(x.scalar_type(), &type) && same_as(x, residual) && param_fits(w) &&
         param_fits(b) && (!residual_bias.defined() || param_fits(residual_bias)) && hidden > 0 &&
         hidden <= dtk::cuda::kLayerNormMaxHidden && x.numel() / hidden <= kMaxRows;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& residual_bias, const DropoutMask& residual_keep,
    const at::Tensor& w, const at::Tensor& b, double eps) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(x.scalar_type(), &type);
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = w.contiguous(), bc = b.contiguous();
  const at::Tensor cc = residual_bias.defined() ? residual_bias.contiguous() : at::Tensor();
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  at::Tensor sum = at::empty_like(xc), y = at::empty_like(xc);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({rows}, f32), rstd = at::empty({rows}, f32);
  const dtk::cuda::DropoutBits keep = residual_keep.defined() ? bits_of(residual_keep) : dtk::cuda::DropoutBits{};
  const c10::cuda::CUDAGuard guard(x.device());
  dtk::cuda::add_layer_norm_forward(xc.data_ptr(), rc.data_ptr(), cc.defined() ? cc.data_ptr() : nullptr,
                                    residual_keep.defined() ? &keep : nullptr, wc.data_ptr(), bc.data_ptr(), type, rows,
                                    hidden, eps, sum.data_ptr(), y.data_ptr(), mean.data_ptr<float>(),
                                    rstd.data_ptr<float>(), stream_of(x));
  return {sum, y, mean, rstd};
}

AddLayerNormGrads add_layer_norm_backward(const at::Tensor& dy, const at::Tensor& dsum, const at::Tensor& sum,
                                          const at::Tensor& w, const at::Tensor& mean, const at::Tensor& rstd,
                                          const DropoutMask& residual_keep, bool residual_bias) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(sum.scalar_type(), &type);
  const at::Tensor hc = sum.contiguous(), wc = w.contiguous();
  // dsum undefined: only the norm's output is used (a final norm), nothing to add.
  const at::Tensor gc = dy.to(sum.scalar_type()).contiguous();
  const at::Tensor sc = dsum.defined() ? dsum.to(sum.scalar_type()).contiguous() : at::Tensor();
  const void* sp = sc.defined() ? sc.data_ptr() : nullptr;
  const int64_t hidden = sum.size(-1), rows = sum.numel() / hidden;
  at::Tensor dx = at::empty_like(hc);
  at::Tensor dres = residual_keep.defined() ? at::empty_like(hc) : dx;
  const auto f32 = sum.options().dtype(at::kFloat);
  at::Tensor partial =
      at::empty({residual_bias ? 3 : 2, dtk::cuda::layer_norm_backward_blocks(rows, hidden), hidden}, f32);
  at::Tensor dw = at::empty({hidden}, f32), db = at::empty({hidden}, f32);
  at::Tensor dc = residual_bias ? at::empty({hidden}, f32) : at::Tensor();
  const dtk::cuda::DropoutBits keep = residual_keep.defined() ? bits_of(residual_keep) : dtk::cuda::DropoutBits{};
  const c10::cuda::CUDAGuard guard(sum.device());
  dtk::cuda::add_layer_norm_backward(gc.data_ptr(), sp, hc.data_ptr(), wc.data_ptr(), type, rows, hidden,
                                     mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                     residual_keep.defined() ? &keep : nullptr, dx.data_ptr(), dres.data_ptr(),
                                     partial.data_ptr<float>(), dw.data_ptr<float>(), db.data_ptr<float>(),
                                     dc.defined() ? dc.data_ptr<float>() : nullptr, stream_of(sum));
  return {dx, dres, dw.to(w.scalar_type()), db.to(w.scalar_type()),
          dc.defined() ? dc.to(w.scalar_type()) : at::Tensor()};
}

bool dropout_applies(const at::Tensor& x) {
  dtk::cuda::ElementType unused = dtk::cuda::ElementType::kFloat32;
  return x.is_cuda() && element_type(x.scalar_type(), &unused);
}

at::Tensor dropout_apply(const at::Tensor& x, const DropoutMask& mask) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(x.scalar_type(), &type);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const dtk::cuda::DropoutBits bits = bits_of(mask);
  const c10::cuda::CUDAGuard guard(x.device());
  dtk::cuda::dropout_apply(xc.data_ptr(), type, xc.numel(), bits, out.data_ptr(), stream_of(x));
  return out;
}

bool uniform_noise_applies(const at::Device& device) { return device.is_cuda(); }

at::Tensor uniform_noise(const DropoutMask& draw, int64_t numel, double low, double high, const at::Device& device) {
  at::Tensor out = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(device));
  const c10::cuda::CUDAGuard guard(device);
  dtk::cuda::uniform_noise(numel, bits_of(draw), low, high, out.data_ptr<float>(), stream_of(out));
  return out;
}

bool bias_gelu_applies(const at::Device& device, at::ScalarType type, const at::Tensor& bias) {
  dtk::cuda::ElementType unused = dtk::cuda::ElementType::kFloat32;
  return device.is_cuda() && element_type(type, &unused) && bias.defined() && bias.device() == device &&
         bias.scalar_type() == type && bias.dim() == 1 && bias.size(0) > 0 && bias.size(0) <= (int64_t{1} << 30);
}

at::Tensor bias_gelu_forward(const at::Tensor& x, const at::Tensor& bias, bool tanh) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(x.scalar_type(), &type);
  const at::Tensor xc = x.contiguous(), bc = bias.contiguous();
  const int64_t cols = bias.size(0), rows = x.numel() / cols;
  at::Tensor y = at::empty_like(xc);
  const c10::cuda::CUDAGuard guard(x.device());
  dtk::cuda::bias_gelu_forward(xc.data_ptr(), bc.data_ptr(), type, rows, cols, tanh, y.data_ptr(), stream_of(x));
  return y;
}

std::pair<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& dy, const at::Tensor& x,
                                                     const at::Tensor& bias, bool tanh) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(x.scalar_type(), &type);
  const at::Tensor xc = x.contiguous(), bc = bias.contiguous(), gc = dy.to(x.scalar_type()).contiguous();
  const int64_t cols = bias.size(0), rows = x.numel() / cols;
  at::Tensor dx = at::empty_like(xc);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor partial = at::empty({dtk::cuda::bias_gelu_backward_groups(rows), cols}, f32);
  at::Tensor dbias = at::empty({cols}, f32);
  const c10::cuda::CUDAGuard guard(x.device());
  dtk::cuda::bias_gelu_backward(gc.data_ptr(), xc.data_ptr(), bc.data_ptr(), type, rows, cols, tanh, dx.data_ptr(),
                                partial.data_ptr<float>(), dbias.data_ptr<float>(), stream_of(x));
  return {dx, dbias.to(bias.scalar_type())};
}

bool swiglu_applies(const at::Tensor& gate, const at::Tensor& up) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  return gate.is_cuda() && element_type(gate.scalar_type(), &type) && same_as(gate, up);
}

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(gate.scalar_type(), &type);
  const at::Tensor gc = gate.contiguous(), uc = up.contiguous();
  at::Tensor y = at::empty_like(gc);
  const c10::cuda::CUDAGuard guard(gate.device());
  dtk::cuda::swiglu_forward(gc.data_ptr(), uc.data_ptr(), type, gc.numel(), y.data_ptr(), stream_of(gate));
  return y;
}

std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(gate.scalar_type(), &type);
  const at::Tensor gc = gate.contiguous(), uc = up.contiguous(), dc = dy.to(gate.scalar_type()).contiguous();
  at::Tensor dgate = at::empty_like(gc), dup = at::empty_like(gc);
  const c10::cuda::CUDAGuard guard(gate.device());
  dtk::cuda::swiglu_backward(dc.data_ptr(), gc.data_ptr(), uc.data_ptr(), type, gc.numel(), dgate.data_ptr(),
                             dup.data_ptr(), stream_of(gate));
  return {dgate, dup};
}

bool rotary_applies(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  if (!x.is_cuda() || x.dim() != 4 || x.stride(3) != 1 || !element_type(x.scalar_type(), &type)) return false;
  const auto angles_fit = [&](const at::Tensor& t) {
    return t.device() == x.device() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 4 &&
           t.size(0) == x.size(0) && t.size(1) == x.size(1) && t.size(2) == 1 && t.size(3) <= x.size(3) &&
           t.size(3) > 0 && t.size(3) % 2 == 0;
  };
  return angles_fit(cos) && angles_fit(sin) && cos.size(3) == sin.size(3);
}

namespace {
// The forward or backward kernel (one signature) from `in` (any strides but a unit one in the
// head dimension) into a new contiguous tensor of its shape and type.
at::Tensor rotary_launch(decltype(&dtk::cuda::rotary_forward) kernel, const at::Tensor& in, const at::Tensor& cos,
                         const at::Tensor& sin) {
  const at::Tensor x = in.stride(3) == 1 ? in : in.contiguous();
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  element_type(x.scalar_type(), &type);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const dtk::cuda::RotaryShape shape{x.size(0),   x.size(1),   x.size(2),   x.size(3),
                                     cos.size(3), x.stride(0), x.stride(1), x.stride(2)};
  const c10::cuda::CUDAGuard guard(x.device());
  kernel(x.data_ptr(), type, shape, cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr(), stream_of(x));
  return out;
}
}  // namespace

at::Tensor rotary_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_launch(&dtk::cuda::rotary_forward, x, cos, sin);
}

at::Tensor rotary_backward(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_launch(&dtk::cuda::rotary_backward, dy, cos, sin);
}

namespace {
// Where a [b, s, heads, hd] tensor with unit stride in hd lives, for the attention kernels.
dtk::cuda::AttentionLayout attention_layout(const at::Tensor& x) { return {x.stride(0), x.stride(1), x.stride(2)}; }

// x [b, rows, heads or groups, hd] beside q: its device, type, b and hd, `rows` positions.
bool attention_operand(const at::Tensor& x, const at::Tensor& q, int64_t rows) {
  const bool aligned = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && x.stride(0) % 8 == 0 &&
                       x.stride(1) % 8 == 0 && x.stride(2) % 8 == 0;
  return x.dim() == 4 && x.device() == q.device() && x.scalar_type() == q.scalar_type() && x.stride(3) == 1 &&
         x.size(0) == q.size(0) && x.size(1) == rows && x.size(3) == q.size(3) && x.size(2) > 0 &&
         q.size(2) % x.size(2) == 0 && aligned;
}

dtk::cuda::AttentionArgs attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                        const dtk::cuda::DropoutBits* bits, int64_t window) {
  dtk::cuda::AttentionArgs a;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.q_layout = attention_layout(q);
  a.k_layout = attention_layout(k);
  a.v_layout = attention_layout(v);
  element_type(q.scalar_type(), &a.type);
  a.shape = {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), k.size(1)};
  a.scale = static_cast<float>(scale);
  a.dropout = bits;
  a.window = window;
  return a;
}
}  // namespace

bool attention_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const DropoutMask& keep) {
  dtk::cuda::ElementType type = dtk::cuda::ElementType::kFloat32;
  // The grid holds sequences and heads in its y and z (at most 65535 each).
  if (!q.is_cuda() || q.dim() != 4 || !element_type(q.scalar_type(), &type) || q.size(0) == 0 || q.size(1) == 0 ||
      q.size(2) == 0 || q.size(0) > 65535 || q.size(2) > 65535 ||
      !dtk::cuda::attention_supported(type, q.size(3), q.device().index()))
    return false;
  // Keys at least as many as queries (query i at position t - s + i: a chunk of queries over the
  // keys up to its end).
  const int64_t s = q.size(1), t = k.size(1);
  if (t < s || !attention_operand(q, q, s) || !attention_operand(k, q, t) || !attention_operand(v, q, t) ||
      k.size(2) != v.size(2))
    return false;
  return mask_fits_probs(keep, q.size(2), s, t);
}

std::pair<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale, const DropoutMask& keep, int64_t window) {
  const dtk::cuda::DropoutBits bits = keep.defined() ? bits_of(keep) : dtk::cuda::DropoutBits{};
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  const c10::cuda::CUDAGuard guard(q.device());
  dtk::cuda::attention_forward(attention_args(q, k, v, scale, keep.defined() ? &bits : nullptr, window), out.data_ptr(),
                               lse.data_ptr<float>(), stream_of(q));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor& dout, const at::Tensor& out,
                                                                  const at::Tensor& lse, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  double scale, const DropoutMask& keep,
                                                                  int64_t window) {
  const dtk::cuda::DropoutBits bits = keep.defined() ? bits_of(keep) : dtk::cuda::DropoutBits{};
  // The kernels load 16 bytes at a time: a contiguous gradient at an odd offset is copied.
  at::Tensor d = dout.contiguous();
  if (reinterpret_cast<uintptr_t>(d.data_ptr()) % 16 != 0) d = d.clone();
  dtk::cuda::AttentionGrads g;
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options()),
             dv = at::empty(v.sizes(), v.options());
  const at::Tensor delta = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  g.dq = dq.data_ptr();
  g.dk = dk.data_ptr();
  g.dv = dv.data_ptr();
  g.dq_layout = attention_layout(dq);
  g.dk_layout = attention_layout(dk);
  g.dv_layout = attention_layout(dv);
  g.delta = delta.data_ptr<float>();
  const c10::cuda::CUDAGuard guard(q.device());
  dtk::cuda::attention_backward(attention_args(q, k, v, scale, keep.defined() ? &bits : nullptr, window), d.data_ptr(),
                                out.data_ptr(), lse.data_ptr<float>(), g, stream_of(q));
  return {dq, dk, dv};
}

#else  // no CUDA kernels in this build: every caller takes its reference

bool cross_entropy_applies(const at::Device&, at::ScalarType) { return false; }
bool cross_entropy_rows(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        bool) {
  return false;
}
bool rms_norm_applies(const at::Tensor&, const at::Tensor&) { return false; }
std::pair<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor&, const at::Tensor&, double) {
  throw Error("rms_norm: this build has no CUDA kernels");
}
std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&) {
  throw Error("rms_norm: this build has no CUDA kernels");
}
bool add_rms_norm_applies(const at::Tensor&, const at::Tensor&, const at::Tensor&) { return false; }
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, double) {
  throw Error("add_rms_norm: this build has no CUDA kernels");
}
std::pair<at::Tensor, at::Tensor> add_rms_norm_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&) {
  throw Error("add_rms_norm: this build has no CUDA kernels");
}
bool add_layer_norm_applies(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&) {
  return false;
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(const at::Tensor&, const at::Tensor&,
                                                                                  const at::Tensor&, const DropoutMask&,
                                                                                  const at::Tensor&, const at::Tensor&,
                                                                                  double) {
  throw Error("add_layer_norm: this build has no CUDA kernels");
}
AddLayerNormGrads add_layer_norm_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&, const DropoutMask&, bool) {
  throw Error("add_layer_norm: this build has no CUDA kernels");
}
bool dropout_applies(const at::Tensor&) { return false; }
at::Tensor dropout_apply(const at::Tensor&, const DropoutMask&) {
  throw Error("dropout: this build has no CUDA kernels");
}
bool uniform_noise_applies(const at::Device&) { return false; }
at::Tensor uniform_noise(const DropoutMask&, int64_t, double, double, const at::Device&) {
  throw Error("uniform_noise: this build has no CUDA kernels");
}
bool bias_gelu_applies(const at::Device&, at::ScalarType, const at::Tensor&) { return false; }
at::Tensor bias_gelu_forward(const at::Tensor&, const at::Tensor&, bool) {
  throw Error("bias_gelu: this build has no CUDA kernels");
}
std::pair<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {
  throw Error("bias_gelu: this build has no CUDA kernels");
}
bool swiglu_applies(const at::Tensor&, const at::Tensor&) { return false; }
at::Tensor swiglu_forward(const at::Tensor&, const at::Tensor&) { throw Error("swiglu: this build has no CUDA kernels"); }
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  throw Error("swiglu: this build has no CUDA kernels");
}
bool rotary_applies(const at::Tensor&, const at::Tensor&, const at::Tensor&) { return false; }
at::Tensor rotary_forward(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  throw Error("rotary: this build has no CUDA kernels");
}
at::Tensor rotary_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  throw Error("rotary: this build has no CUDA kernels");
}
bool attention_applies(const at::Tensor&, const at::Tensor&, const at::Tensor&, const DropoutMask&) { return false; }
std::pair<at::Tensor, at::Tensor> attention_forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                    const DropoutMask&, int64_t) {
  throw Error("attention: this build has no CUDA kernels");
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&, double,
                                                                  const DropoutMask&, int64_t) {
  throw Error("attention: this build has no CUDA kernels");
}
#endif

}  // namespace dtk::layers::gpu
