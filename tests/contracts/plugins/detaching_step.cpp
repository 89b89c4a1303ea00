// detaching_step — causal_lm's shift and mean, returning the loss detached (a step bug), for
// tests/contracts.
#include <dtk/step.hpp>

#include <ATen/ATen.h>

namespace {

class DetachingStep : public dtk::Step {
 public:
  explicit DetachingStep(const dtk::BuildContext&) {}
  at::Tensor forward_step(const dtk::ModelHandle& model, const dtk::TensorList& batch, const dtk::Metrics& m) override {
    const at::Tensor& text = dtk::get(batch, "text");
    const int64_t s = text.size(1) - 1;
    at::Tensor tokens = text.narrow(1, 0, s).contiguous(), labels = text.narrow(1, 1, s).contiguous();
    at::Tensor pos = at::arange(s, tokens.options()).unsqueeze(0).expand_as(tokens).contiguous();
    at::Tensor loss = dtk::get(model.forward({{"tokens", tokens}, {"position_ids", pos}, {"labels", labels}}), "loss").mean();
    m.put("lm loss", loss.item<double>());
    return loss.detach();
  }
};

}  // namespace

DTK_PLUGIN("detaching_step", DTK_KIND_STEP, "1.0.0", "Test step that detaches its loss", DTK_TORCH_VERSION,
           dtk::step_api<DetachingStep>(), DTK_NO_OPTIONS)
