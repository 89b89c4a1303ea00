// dtk/module_hooks.hpp — fires a strategy's per-module hooks (abi.h dtk_module_hooks, ZeRO-3)
// around a model's modules, in forward and, through autograd functions, in backward.
//
//   class MyModel : public dtk::Model {
//     void set_module_hooks(const dtk_module_hooks* h) override { hooks_.set(h); }
//     TensorList forward(const TensorList& in) override {
//       at::Tensor h = hooks_.run(0, tokens, [&](const at::Tensor& x) { return embed(x); });
//       for (i...) h = hooks_.run(i + 1, h, [&](const at::Tensor& x) { return layers_[i](x); });
//       ...
//     }
//     dtk::ModuleHooks hooks_;
//   };
//
// run(i, input, body):
//   forward   pre_forward(i), body(input), post_forward(i);
//   backward  (only when grad mode is on and the output requires grad)
//             pre_backward(i) when the gradient reaches the module's output;
//             post_backward(i) when the gradient w.r.t. the module's input is computed, or — for
//             a module whose input needs no gradient (an embedding of token ids) — at the end of
//             the backward pass, after every gradient was computed.
// Inside an activation-recomputing autograd function, call run() from the code that is rerun
// in backward: the recomputation then fires pre/post_forward again followed by the backward
// hooks, the order abi.h documents.
//
// Parameters that come and go (ZeRO-3): a strategy may release a module's parameters after its
// forward and gather them again in pre_backward. Backward must then read each parameter through
// the parameter tensor itself, which is what autograd does for a parameter saved directly, but
// not for a view of it saved in forward (at::linear saves weight.t(), which keeps the forward's
// storage alive and bypasses the release). dtk::linear below is at::linear with that property;
// use it for every product with a weight. Element-wise uses of a parameter (bias adds, LayerNorm
// weights passed directly) save nothing or the parameter itself and need nothing special.
#pragma once

#include <dtk/gemm.hpp>
#include <dtk/model.hpp>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <memory>
#include <utility>
#include <vector>

namespace dtk {

class ModuleHooks {
 public:
  // Copies the table (nullptr removes the hooks). Earlier tables stay alive: a backward pass
  // recorded under them still fires them.
  void set(const dtk_module_hooks* hooks) {
    if (!hooks) {
      current_.reset();
      return;
    }
    current_ =
        std::make_shared<const dtk_module_hooks>(read_struct(hooks, dtk_module_hooks_STRUCT_SIZE_2_0, "module hooks"));
    history_.push_back(current_);
  }
  bool active() const { return current_ != nullptr; }
  // The current table (nullptr without hooks), for code that fires hooks itself (fire()), e.g.
  // a schedule that interleaves several modules. Alive as long as this object.
  const dtk_module_hooks* table() const { return current_.get(); }

  template <class F>
  at::Tensor run(int32_t index, const at::Tensor& input, F&& body) const {
    if (!current_) return body(input);
    const dtk_module_hooks* h = current_.get();
    fire(h, &dtk_module_hooks::pre_forward, index, "pre_forward");
    const bool graph = at::GradMode::is_enabled();
    const bool post_on_input = graph && input.defined() && input.requires_grad();
    at::Tensor x = post_on_input ? PostBackward::apply(input, h, index) : input;
    at::Tensor out = body(x);
    fire(h, &dtk_module_hooks::post_forward, index, "post_forward");
    if (graph && out.requires_grad()) out = PreBackward::apply(out, h, index, !post_on_input);
    return out;
  }

  using HookFn = dtk_status* (*dtk_module_hooks::*)(void*, int32_t);
  static void fire(const dtk_module_hooks* h, HookFn fn, int32_t index, const char* what) {
    if (!(h->*fn)) return;
    if (dtk_status* s = (h->*fn)(h->ctx, index)) {
      const std::string message = dtk_status_get_message(s);
      const int32_t code = dtk_status_get_code(s);
      dtk_status_release(s);
      throw Error("module " + std::to_string(index) + ": " + what + " hook: " + message, code);
    }
  }

 private:
  using AutogradContext = torch::autograd::AutogradContext;
  using variable_list = torch::autograd::variable_list;

  // Identity in forward; in backward fires pre_backward (and queues post_backward for the end
  // of the backward pass when the module's input has no gradient to wait for).
  struct PreBackward : public torch::autograd::Function<PreBackward> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const dtk_module_hooks* h, int32_t index,
                              bool queue_post) {
      ctx->saved_data["hooks"] = reinterpret_cast<int64_t>(h);
      ctx->saved_data["index"] = static_cast<int64_t>(index);
      ctx->saved_data["queue_post"] = queue_post;
      return x.view_as(x);
    }
    static variable_list backward(AutogradContext* ctx, variable_list grad) {
      const auto* h = reinterpret_cast<const dtk_module_hooks*>(ctx->saved_data["hooks"].toInt());
      const auto index = static_cast<int32_t>(ctx->saved_data["index"].toInt());
      fire(h, &dtk_module_hooks::pre_backward, index, "pre_backward");
      if (ctx->saved_data["queue_post"].toBool())
        torch::autograd::Engine::get_default_engine().queue_callback(
            [h, index] { fire(h, &dtk_module_hooks::post_backward, index, "post_backward"); });
      return {grad[0], at::Tensor(), at::Tensor(), at::Tensor()};
    }
  };

  // Identity in forward on the module's input; in backward fires post_backward.
  struct PostBackward : public torch::autograd::Function<PostBackward> {
    static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const dtk_module_hooks* h, int32_t index) {
      ctx->saved_data["hooks"] = reinterpret_cast<int64_t>(h);
      ctx->saved_data["index"] = static_cast<int64_t>(index);
      return x.view_as(x);
    }
    static variable_list backward(AutogradContext* ctx, variable_list grad) {
      const auto* h = reinterpret_cast<const dtk_module_hooks*>(ctx->saved_data["hooks"].toInt());
      fire(h, &dtk_module_hooks::post_backward, static_cast<int32_t>(ctx->saved_data["index"].toInt()),
           "post_backward");
      return {grad[0], at::Tensor(), at::Tensor()};
    }
  };

  std::shared_ptr<const dtk_module_hooks> current_;
  std::vector<std::shared_ptr<const dtk_module_hooks>> history_;
};

namespace detail {
// With and without bias: an undefined tensor cannot be an input of a custom autograd function.
template <bool kBias>
struct LinearFunction : public torch::autograd::Function<LinearFunction<kBias>> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias) {
    ctx->save_for_backward({x, weight});
    return linear_product(x, weight, kBias ? bias : at::Tensor());
  }
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    return forward(ctx, x, weight, at::Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    // The products autograd forms for at::linear's mm(x, weight.t()) (dtk/gemm.hpp); the weight's
    // gradient is formed as g^T x, already in the weight's [out, in] layout.
    const at::Tensor g = grad[0].reshape({-1, grad[0].size(-1)});
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) gx = dtk::mm(g, weight).view(x.sizes());
    if (ctx->needs_input_grad(1)) gw = dtk::mm(g.t(), x.reshape({-1, x.size(-1)}));
    if (!kBias) return {gx, gw};
    if (ctx->needs_input_grad(2)) gb = g.sum(0);
    return {gx, gw, gb};
  }
};
}  // namespace detail

// y = x W^T + b, as at::linear (its products through dtk/gemm.hpp), saving the weight parameter
// itself for backward so a strategy may release it in between (see the file comment).
// x [..., in], weight [out, in], bias [out] or undefined.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = at::Tensor()) {
  if (!at::GradMode::is_enabled()) return linear_product(x, weight, bias);
  if (bias.defined()) return detail::LinearFunction<true>::apply(x, weight, bias);
  return detail::LinearFunction<false>::apply(x, weight);
}

}  // namespace dtk
