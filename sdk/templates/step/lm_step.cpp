// template_lm_step — an example forward-step plugin built out of tree against the installed DTK SDK.
//
// Megatron's forward_step for a causal language model, minus what the shipped causal_lm adds
// (tensor-parallel batch broadcast, document resets), plus one knob of its own: the first
// `loss_skip_tokens` positions of every sample are left out of the loss (they see too short a
// prefix to predict well; a common choice when fine-tuning on fixed-length windows).
//
// The step contract (docs/plugin-guide.md, "Contracts"):
//   batch    every buffer the dataset put, collated: here "text" [b, seq_length + 1] int64
//   model    gets "tokens", "position_ids", "labels" [b, s]; returns "loss" [b, s] per token
//   returns  the scalar loss, attached to the model's outputs; the host scales it by
//            1 / micro-batches (and the loss scale) and runs backward
//   metrics  name -> value of this micro-batch, averaged over data-parallel ranks here; the host
//            averages them over the micro-batches of an iteration for the log and TensorBoard
#include <dtk/step.hpp>

#include <ATen/ATen.h>

#include <cmath>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_int("loss_skip_tokens", "0", "Leave the first N positions of every sample out of the loss."),
};

class LmStep : public dtk::Step {
 public:
  explicit LmStep(const dtk::BuildContext& ctx)
      : skip_(ctx.options.get_int("loss_skip_tokens")), dp_size_(ctx.dp_size), device_(ctx.device) {
    if (ctx.tp_size > 1)
      throw dtk::Error("tensor parallelism needs the batch broadcast from TP rank 0 (see plugins/steps/causal_lm): "
                       "this template runs at tensor_model_parallel_size 1",
                       DTK_ERR_UNSUPPORTED);
    if (skip_ < 0 || skip_ >= ctx.seq_length)
      throw dtk::Error("option 'loss_skip_tokens' must be in [0, seq_length), got " + std::to_string(skip_));
  }

  at::Tensor forward_step(const dtk::ModelHandle& model, const dtk::TensorList& batch,
                          const dtk::Metrics& metrics) override {
    const at::Tensor* found = dtk::find(batch, "text");
    if (!found) throw dtk::Error("the batch has no 'text' buffer (the dataset's samples must put one)");
    at::Tensor text = found->to(device_, at::kLong);
    const int64_t s = text.size(1) - 1;
    at::Tensor tokens = text.narrow(1, 0, s).contiguous(), labels = text.narrow(1, 1, s).contiguous();
    at::Tensor position_ids = at::arange(s, tokens.options()).unsqueeze(0).expand_as(tokens).contiguous();

    // An error thrown by the model reaches the user as "step plugin 'template_lm_step':
    // forward_step: model plugin '<model>': forward: ...": nothing to catch here.
    dtk::TensorList out = model.forward({{"tokens", tokens}, {"position_ids", position_ids}, {"labels", labels}});
    const at::Tensor& per_token = dtk::get(out, "loss");  // [b, s]
    at::Tensor loss = per_token.narrow(1, skip_, s - skip_).to(at::kFloat).mean();

    at::Tensor reported = loss.detach().clone().reshape({1});
    if (dp_size_ > 1) dtk::Comm::all_reduce(reported, DTK_GROUP_DATA_PARALLEL, DTK_REDUCE_AVG);
    // As tensors: the host reads them once per iteration instead of waiting for the device here.
    metrics.put("lm loss", reported);
    metrics.put("lm ppl", reported.exp());
    return loss;
  }

 private:
  int64_t skip_;
  int32_t dp_size_;
  at::Device device_;
};

}  // namespace

DTK_PLUGIN("template_lm_step", DTK_KIND_STEP, "0.1.0", "Out-of-tree example: causal LM loss that skips the first tokens",
           DTK_TORCH_VERSION, dtk::step_api<LmStep>(), kOptions)
