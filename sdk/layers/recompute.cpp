#include <dtk/layers/recompute.hpp>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The block travels with the graph in a capsule, freed with it.
struct BlockHolder : public torch::CustomClassHolder {
  explicit BlockHolder(RecomputedBlock b) : block(std::move(b)) {}
  RecomputedBlock block;
};

struct Recomputed : public torch::autograd::Function<Recomputed> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, DropoutRng* rng, const RecomputedBlock* block) {
    DropoutRng before = rng->clone();
    ctx->saved_data["hidden_gen"] = before.hidden;
    ctx->saved_data["attention_gen"] = before.attention;
    ctx->saved_data["block"] = c10::IValue::make_capsule(c10::make_intrusive<BlockHolder>(*block));
    ctx->save_for_backward({x});
    at::NoGradGuard no_grad;
    return (*block)(x, *rng);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    // A clone of the saved states: a second backward (retain_graph) reruns identically.
    DropoutRng rng = DropoutRng{ctx->saved_data["hidden_gen"].toGenerator(), ctx->saved_data["attention_gen"].toGenerator()}.clone();
    const auto holder = c10::static_intrusive_pointer_cast<BlockHolder>(ctx->saved_data["block"].toCapsule());
    at::Tensor input = x.detach().requires_grad_(true);
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      out = holder->block(input, rng);
    }
    torch::autograd::backward({out}, {grad[0]});
    return {input.grad(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor recompute(const at::Tensor& x, DropoutRng& rng, RecomputedBlock block) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return block(x, rng);
  return Recomputed::apply(x, &rng, &block);
}

}  // namespace dtk::layers
