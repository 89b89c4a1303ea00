// prefix_lm_step — a step of a user's own whose attention mask is not causal (a prefix language
// model's: the first 3/8 of each sequence's positions see each other, the rest only the keys
// before them), for tests/context_parallel: under a2a context parallelism it trains as one process
// does; under all_gather, whose chunks of queries never read the keys after their own end, it is
// one `dtk: error:` line instead of a different model.
#include <dtk/context_parallel.hpp>
#include <dtk/step.hpp>

#include <ATen/ATen.h>

namespace {

class PrefixLmStep : public dtk::Step {
 public:
  explicit PrefixLmStep(const dtk::BuildContext& ctx)
      : cp_rank_(ctx.cp_rank), cp_size_(std::max(1, ctx.cp_size)), dp_size_(ctx.dp_size) {}
  at::Tensor forward_step(const dtk::ModelHandle& model, const dtk::TensorList& batch, const dtk::Metrics& m) override {
    const at::Tensor& text = dtk::get(batch, "text");
    const int64_t s = text.size(1) - 1, prefix = 3 * s / 8;
    at::Tensor tokens = text.narrow(1, 0, s).contiguous(), labels = text.narrow(1, 1, s).contiguous();
    at::Tensor pos = at::arange(s, tokens.options()).unsqueeze(0).expand_as(tokens).contiguous();
    // Allowed: the key at or before the query, or both in the prefix. [1, 1, s, s], true = masked.
    const at::Tensor i = at::arange(s, tokens.options()).unsqueeze(1), j = at::arange(s, tokens.options()).unsqueeze(0);
    const at::Tensor mask = j.le(i).logical_or(i.lt(prefix).logical_and(j.lt(prefix))).logical_not().view({1, 1, s, s});
    // Each rank's share of the positions (the mask stays whole: the model takes the rows it needs).
    for (at::Tensor* t : {&tokens, &labels, &pos}) *t = dtk::context_parallel_share(*t, 1, cp_rank_, cp_size_);
    const at::Tensor loss =
        dtk::get(
            model.forward({{"tokens", tokens}, {"position_ids", pos}, {"labels", labels}, {"attention_mask", mask}}),
            "loss")
            .to(at::kFloat)
            .mean();
    // The logged loss: the mean over the data- and context-parallel ranks (causal_lm's report).
    at::Tensor reported = loss.detach().clone().reshape({1});
    if (dp_size_ > 1) dtk::Comm::all_reduce(reported, DTK_GROUP_DATA_PARALLEL, DTK_REDUCE_AVG);
    m.put("lm loss", reported);
    return loss;
  }

 private:
  int32_t cp_rank_, cp_size_, dp_size_;
};

}  // namespace

DTK_PLUGIN("prefix_lm_step", DTK_KIND_STEP, "1.0.0", "Test step with a prefix language model's (non-causal) mask",
           DTK_TORCH_VERSION, dtk::step_api<PrefixLmStep>(), DTK_NO_OPTIONS)
