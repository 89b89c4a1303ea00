// causal_lm.cpp — the "causal_lm" step plugin: Megatron-LM pretrain_gpt.py's forward_step.
//
//   get_batch:   text [b, s+1] -> tokens = text[:, :-1], labels = text[:, 1:]; inside a
//                tensor-parallel group TP rank 0 holds the batch and broadcasts it (sizes, then
//                data), so other ranks may receive an empty batch map.
//   get_ltor_masks_and_position_ids(reset_position_ids, reset_attention_mask, eod_mask_loss):
//                loss mask (times the batch's "loss_mask" [b, s] when the dataset gives one:
//                gpt_indexed's padding labels), position ids, and (only when reset_attention_mask asks for one) a
//                [b, 1, s, s] bool attention mask, true = masked. Without a custom mask no
//                "attention_mask" is passed, so the model may use its fused causal path.
//   loss_func:   loss = sum(per_token_loss * loss_mask) / sum(loss_mask); metric "lm loss" is
//                its value averaged over the data-parallel group. When the host asks for a summed
//                loss (--calculate-per-token-loss, ABI 2.8): the numerator alone, sum(loss_mask)
//                as the token count, and "lm loss" as the ratio of both summed over the group.
//   context parallelism (ABI 2.20, get_batch_on_this_cp_rank): every rank of the group reads the
//                same micro-batch and keeps its share of each sequence (dtk/context_parallel.hpp):
//                tokens, labels, loss mask and position ids; the attention mask stays whole. The
//                mean loss divides this rank's sum by the group's token count and multiplies by
//                cp, since the strategy averages the gradients over the data- and context-parallel
//                ranks together (Megatron's loss * context_parallel_size).
//   pipeline:    on a stage that is not the last (post_process false) the model returns its
//                hidden states, which are the step's result (the host sends them on; Megatron's
//                forward_step returns the output tensor and applies loss_func on the last stage).
#include <dtk/context_parallel.hpp>
#include <dtk/step.hpp>

#include <vector>

namespace dtk::causal_lm {
namespace {

class CausalLM : public Step {
 public:
  explicit CausalLM(const BuildContext& ctx)
      : tp_rank_(ctx.tp_rank),
        tp_size_(std::max(1, ctx.tp_size)),
        dp_size_(std::max(1, ctx.dp_size)),
        cp_rank_(ctx.cp_rank),
        cp_size_(std::max(1, ctx.cp_size)),
        device_(ctx.device),
        post_process_(ctx.post_process) {
    const Options& o = ctx.options;
    reset_position_ids_ = o.get_bool("reset_position_ids");
    reset_attention_mask_ = o.get_bool("reset_attention_mask");
    eod_mask_loss_ = o.get_bool("eod_mask_loss");
    eod_ = o.get_int("eod_token");
    if (eod_ < 0) throw Error("causal_lm: option 'eod_token' must be a token id (>= 0), got " + std::to_string(eod_));
  }

  at::Tensor forward_step(const ModelHandle& model, const TensorList& batch, const Metrics& metrics) override {
    return run(model, batch, metrics, nullptr);
  }
  at::Tensor forward_step_summed(const ModelHandle& model, const TensorList& batch, const Metrics& metrics,
                                 at::Tensor* num_tokens) override {
    return run(model, batch, metrics, num_tokens);
  }

 private:
  // `num_tokens` null: Megatron's mean loss; else (--calculate-per-token-loss) the summed loss, the
  // tokens it counts there, and "lm loss" as the ratio of the data-parallel group's sums.
  at::Tensor run(const ModelHandle& model, const TensorList& batch, const Metrics& metrics, at::Tensor* num_tokens) {
    // ---- get_batch --------------------------------------------------------------------------
    at::Tensor data_mask;  // the dataset's loss mask ("loss_mask", [b, s]; padding labels 0), if it gives one
    at::Tensor text = broadcast_text(batch, &data_mask);
    if (text.dim() != 2 || text.size(1) < 2)
      throw Error("causal_lm: 'text' must be [batch, seq_length + 1] with seq_length >= 1, got " + shape_str(text));
    text = text.to(device_, at::kLong);
    const int64_t s = text.size(1) - 1;
    at::Tensor tokens = text.narrow(1, 0, s).contiguous();
    at::Tensor labels = text.narrow(1, 1, s).contiguous();

    // ---- get_ltor_masks_and_position_ids ---------------------------------------------------
    at::Tensor loss_mask = at::ones(tokens.sizes(), tokens.options().dtype(at::kFloat));
    if (eod_mask_loss_) loss_mask.masked_fill_(tokens == eod_, 0.0);
    if (data_mask.defined()) {
      if (data_mask.sizes() != tokens.sizes())
        throw Error("causal_lm: 'loss_mask' must be [batch, seq_length] " + shape_str(tokens) + ", got " +
                    shape_str(data_mask));
      loss_mask.mul_(data_mask.to(device_, at::kFloat));
    }
    at::Tensor position_ids = at::arange(s, tokens.options()).unsqueeze(0).expand_as(tokens).contiguous();
    at::Tensor attention_mask;
    if (reset_position_ids_ || reset_attention_mask_) {
      // Keep the causal mask as "1 = may attend" while editing, like Megatron, then invert.
      at::Tensor allowed;
      if (reset_attention_mask_)
        allowed = at::ones({tokens.size(0), s, s}, tokens.options().dtype(at::kBool)).tril().contiguous();
      at::Tensor tokens_cpu = tokens.to(at::kCPU);
      at::Tensor pos_cpu = position_ids.to(at::kCPU);
      auto tok = tokens_cpu.accessor<int64_t, 2>();
      auto pos = pos_cpu.accessor<int64_t, 2>();
      for (int64_t b = 0; b < tokens.size(0); ++b) {
        int64_t prev = 0;
        for (int64_t i = 0; i < s; ++i) {
          if (tok[b][i] != eod_) continue;
          if (reset_attention_mask_ && i + 1 < s)
            allowed[b].narrow(0, i + 1, s - i - 1).narrow(1, 0, i + 1).fill_(false);
          if (reset_position_ids_) {
            for (int64_t j = i + 1; j < s; ++j) pos[b][j] -= i + 1 - prev;
            prev = i + 1;
          }
        }
      }
      position_ids = pos_cpu.to(tokens.device());
      if (reset_attention_mask_) attention_mask = allowed.logical_not().unsqueeze(1);
    }

    // ---- get_batch_on_this_cp_rank -------------------------------------------------------------
    if (cp_size_ > 1) {
      for (at::Tensor* t : {&tokens, &labels, &loss_mask, &position_ids})
        *t = context_parallel_share(*t, 1, cp_rank_, cp_size_);
    }

    // ---- forward ------------------------------------------------------------------------------
    TensorList inputs{{"tokens", tokens}, {"position_ids", position_ids}, {"labels", labels}};
    if (attention_mask.defined()) inputs.emplace_back("attention_mask", attention_mask);
    TensorList out = model.forward(inputs);
    if (!post_process_) return get(out, "hidden_states");  // a pipeline stage before the last
    const at::Tensor& losses = get(out, "loss");
    if (losses.sizes() != labels.sizes())
      throw Error("causal_lm: model returned 'loss' " + shape_str(losses) + ", expected per-token " +
                  shape_str(labels));

    // ---- loss_func ------------------------------------------------------------------------
    at::Tensor lm = loss_mask.reshape({-1});
    at::Tensor loss_sum = (losses.to(at::kFloat).reshape({-1}) * lm).sum();
    if (num_tokens) {
      *num_tokens = lm.sum();
      // [loss sum, tokens] summed over the data-parallel group: the host divides their sums.
      at::Tensor reported = at::stack({loss_sum.detach(), *num_tokens});
      if (dp_size_ > 1) Comm::all_reduce(reported, DTK_GROUP_DATA_PARALLEL, DTK_REDUCE_SUM);
      metrics.put_ratio("lm loss", reported[0], reported[1]);
      return loss_sum;
    }
    at::Tensor count = lm.sum();
    if (cp_size_ > 1) {  // the sequence's tokens on every rank of the group, and the average's factor
      Comm::all_reduce(count, DTK_GROUP_CONTEXT_PARALLEL, DTK_REDUCE_SUM);
      count.div_(cp_size_);
    }
    at::Tensor loss = loss_sum / count;
    at::Tensor reported = loss.detach().clone().reshape({1});
    if (dp_size_ > 1) Comm::all_reduce(reported, DTK_GROUP_DATA_PARALLEL, DTK_REDUCE_AVG);
    metrics.put("lm loss", reported);  // read by the host once per iteration
    return loss;
  }

  // Megatron's broadcast_data: TP rank 0 sends the sizes, then the tokens (and the dataset's loss
  // mask when its batch has one).
  at::Tensor broadcast_text(const TensorList& batch, at::Tensor* mask) const {
    const at::Tensor* text = find(batch, "text");
    const at::Tensor* given_mask = find(batch, "loss_mask");
    if (tp_size_ <= 1) {
      if (!text) throw Error("causal_lm: the batch has no 'text' tensor", DTK_ERR_NOT_FOUND);
      if (given_mask) *mask = *given_mask;
      return *text;
    }
    // A bad batch on TP rank 0 is announced with sizes {-1, -1}, so the other TP ranks fail at
    // once with it instead of waiting in the data broadcast until the collective timeout.
    at::Tensor sizes = at::zeros({3}, at::TensorOptions().dtype(at::kLong).device(device_));
    std::string problem;
    if (tp_rank_ == 0) {
      if (!text)
        problem = "TP rank 0 got a batch without 'text'";
      else if (text->dim() != 2)
        problem = "'text' must be 2-D, got " + shape_str(*text);
      if (problem.empty())
        sizes.copy_(at::tensor({text->size(0), text->size(1), int64_t{given_mask != nullptr}}, at::kLong));
      else
        sizes.fill_(-1);
    }
    Comm::broadcast(sizes, DTK_GROUP_TENSOR_PARALLEL, 0);
    at::Tensor sizes_cpu = sizes.to(at::kCPU);
    const int64_t b = sizes_cpu[0].item<int64_t>(), n = sizes_cpu[1].item<int64_t>();
    if (!problem.empty()) throw Error("causal_lm: " + problem, DTK_ERR_INVALID_ARGUMENT);
    if (b < 0 || n < 0) throw Error("causal_lm: TP rank 0 could not broadcast the batch (its error is above)");
    at::Tensor data = tp_rank_ == 0 ? text->to(device_, at::kLong).contiguous().clone()
                                    : at::empty({b, n}, at::TensorOptions().dtype(at::kLong).device(device_));
    Comm::broadcast(data, DTK_GROUP_TENSOR_PARALLEL, 0);
    if (sizes_cpu[2].item<int64_t>() != 0) {
      *mask = tp_rank_ == 0 ? given_mask->to(device_, at::kFloat).contiguous().clone()
                            : at::empty({b, n - 1}, at::TensorOptions().dtype(at::kFloat).device(device_));
      Comm::broadcast(*mask, DTK_GROUP_TENSOR_PARALLEL, 0);
    }
    return data;
  }

  int32_t tp_rank_, tp_size_, dp_size_, cp_rank_, cp_size_;
  at::Device device_;
  bool post_process_ = true;
  bool reset_position_ids_ = false, reset_attention_mask_ = false, eod_mask_loss_ = false;
  int64_t eod_ = 50256;
};

const dtk_option_spec kOptions[] = {
    opt_bool("reset_position_ids", "false", "Restart position ids after each end-of-document token."),
    opt_bool("reset_attention_mask", "false", "Stop attention across end-of-document tokens (custom mask)."),
    opt_bool("eod_mask_loss", "false", "Exclude end-of-document tokens from the loss."),
    opt_int("eod_token", "50256", "Id of the end-of-document token (GPT-2: 50256)."),
};

}  // namespace
}  // namespace dtk::causal_lm

DTK_PLUGIN("causal_lm", DTK_KIND_STEP, "1.0.0",
           "Megatron pretrain_gpt forward step: shifted tokens/labels, LTOR masks, masked mean loss", DTK_TORCH_VERSION,
           dtk::step_api<dtk::causal_lm::CausalLM>(), dtk::causal_lm::kOptions)
