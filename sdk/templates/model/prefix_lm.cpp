// template_prefix_lm — an example model plugin built out of tree against the installed DTK SDK.
//
// A small causal language model, small enough to read in one sitting, that trains with the
// shipped `causal_lm` step (and any step that keeps its contract, below):
//
//   x   = E[tokens] + P[position_ids]                   token and learned position embeddings
//   c_t = mean(x_1 .. x_t)                              causal: position t sees only its prefix
//   h   = c + W_down silu(W_gate n) * (W_up n),  n = RMSNorm(c)        one SwiGLU block
//   logits = RMSNorm(h) W_out^T;  loss_t = cross_entropy(logits_t, labels_t)
//
// The model-step contract (docs/plugin-guide.md, "Contracts"):
//   inputs   "tokens" [b, s] int64, "position_ids" [b, s] int64, optional "labels" [b, s] int64,
//            optional "attention_mask" (this model is causal by construction and refuses a mask)
//   outputs  with labels: "loss" [b, s], the per-token loss (the step masks and averages it);
//            without labels: "logits" [b, s, vocab]
// Every trainable tensor is listed by parameters() (the host checks this on the first step).
#include <dtk/layers/dropout.hpp>          // seeded_generator (dtk::layers)
#include <dtk/layers/tensor_parallel.hpp>  // ParamFactory, check_id_range, padded_vocab_size
#include <dtk/model.hpp>

#include <ATen/ATen.h>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_int("vocab_size", "50257", "Tokens the model can read (padded up to a multiple of 128 for speed)."),
    dtk::opt_int("hidden_size", "64", "Width of the embeddings and the block."),
    dtk::opt_int("ffn_hidden_size", "0", "Width of the SwiGLU block (0: 4 x hidden_size)."),
    dtk::opt_int("max_position_embeddings", "0", "Positions the model learns (0: the run's seq_length)."),
    dtk::opt_float("init_method_std", "0.02", "Standard deviation of the normal initialisation."),
};

class PrefixLM : public dtk::Model {
 public:
  explicit PrefixLM(const dtk::BuildContext& ctx) : seq_(ctx.seq_length) {
    const dtk::Options& o = ctx.options;
    // Refuse what this model cannot do, at build time, with the reason: the host prefixes
    // "model plugin 'template_prefix_lm': create: ".
    if (ctx.tp_size > 1 || ctx.pp_size > 1)
      throw dtk::Error("tensor and pipeline parallelism are not implemented in this template (see "
                       "plugins/models/llama for a model that splits over TP ranks): run with size 1",
                       DTK_ERR_UNSUPPORTED);
    vocab_ = o.get_int("vocab_size");
    hidden_ = o.get_int("hidden_size");
    ffn_ = o.get_int("ffn_hidden_size") > 0 ? o.get_int("ffn_hidden_size") : 4 * hidden_;
    positions_ = o.get_int("max_position_embeddings") > 0 ? o.get_int("max_position_embeddings") : seq_;
    const double std = o.get_float("init_method_std");
    if (vocab_ <= 0 || hidden_ <= 0) throw dtk::Error("options 'vocab_size' and 'hidden_size' must be positive");
    if (!(std > 0)) throw dtk::Error("option 'init_method_std' must be positive");
    padded_vocab_ = dtk::layers::padded_vocab_size(vocab_, 128, 1);

    // Seeded initialisation (the SDK's helper): every weight is drawn in fp32 on the CPU from a
    // generator seeded by the run's seed, in a fixed order, then moved to the run's device and
    // dtype: the same weights on every device and rank, and again on a rerun.
    dtk::layers::ParamFactory f{ctx.params_dtype, ctx.device, dtk::layers::seeded_generator(ctx.seed)};
    word_ = f.param(f.normal({padded_vocab_, hidden_}, std));
    position_ = f.param(f.normal({positions_, hidden_}, std));
    norm1_ = f.ones({hidden_});
    gate_ = f.param(f.normal({ffn_, hidden_}, std));
    up_ = f.param(f.normal({ffn_, hidden_}, std));
    down_ = f.param(f.normal({hidden_, ffn_}, std));
    norm2_ = f.ones({hidden_});
    output_ = f.param(f.normal({padded_vocab_, hidden_}, std));
  }

  dtk::TensorList forward(const dtk::TensorList& inputs) override {
    const at::Tensor& tokens = dtk::get(inputs, "tokens");
    const at::Tensor& position_ids = dtk::get(inputs, "position_ids");
    if (dtk::find(inputs, "attention_mask"))
      throw dtk::Error("this model is causal by construction and takes no 'attention_mask' (turn off the step's "
                       "reset_attention_mask)",
                       DTK_ERR_UNSUPPORTED);
    // An id outside the table would read out of bounds: one line naming the input and the limit.
    dtk::layers::check_id_range("template_prefix_lm", "tokens", tokens, padded_vocab_, "the padded vocabulary");
    dtk::layers::check_id_range("template_prefix_lm", "position_ids", position_ids, positions_,
                                "max_position_embeddings");

    at::Tensor x = at::embedding(word_, tokens) + at::embedding(position_, position_ids);  // [b, s, h]
    const int64_t s = x.size(1);
    at::Tensor count = at::arange(1, s + 1, x.options()).view({1, s, 1});
    at::Tensor c = x.cumsum(1) / count;  // the mean of each prefix
    at::Tensor n = rms_norm(c, norm1_);
    at::Tensor h = c + at::linear(at::silu(at::linear(n, gate_)) * at::linear(n, up_), down_);
    at::Tensor logits = at::linear(rms_norm(h, norm2_), output_);  // [b, s, padded vocab]

    const at::Tensor* labels = dtk::find(inputs, "labels");
    if (!labels) return {{"logits", logits}};
    // Per-token loss in fp32, shaped like the labels: the step applies its mask and averages.
    at::Tensor loss = at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, padded_vocab_}),
                                             labels->reshape({-1}), {}, at::Reduction::None);
    return {{"loss", loss.view(labels->sizes())}};
  }

  // Every trainable tensor, each once, with what the host and strategies read about it
  // (abi.h dtk_param_info): norm weights are excluded from weight decay; nothing here is
  // split over TP ranks (tensor_parallel 0, partition_dim -1) or tied (shared 0).
  std::vector<dtk::Param> parameters() override {
    std::vector<dtk::Param> out;
    auto add = [&](const char* name, const at::Tensor& t, bool no_decay) {
      dtk::Param p;
      p.name = name;
      p.tensor = t;
      p.info.no_weight_decay = no_decay ? 1 : 0;
      out.push_back(std::move(p));
    };
    add("embedding.word", word_, false);
    add("embedding.position", position_, false);
    add("block.norm.weight", norm1_, true);
    add("block.gate.weight", gate_, false);
    add("block.up.weight", up_, false);
    add("block.down.weight", down_, false);
    add("final_norm.weight", norm2_, true);
    add("output.weight", output_, false);
    return out;
  }

  void set_training(bool training) override { training_ = training; }  // no dropout: nothing changes

  // What the host reads (docs/plugin-guide.md): layers, hidden size, heads and seq_length for the
  // FLOP count and the memory estimate, vocab_size (padded) as the last fallback of the token-id
  // check and for generation, recompute for the FLOP count.
  dtk_model_info info() override {
    dtk_model_info i{};
    i.num_layers = 1;
    i.hidden_size = hidden_;
    i.num_attention_heads = 1;
    i.ffn_hidden_size = ffn_;
    i.seq_length = seq_;
    i.vocab_size = padded_vocab_;
    return i;
  }

 private:
  static at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight) {
    at::Tensor xf = x.to(at::kFloat);
    return (xf * at::rsqrt(xf.pow(2).mean(-1, true) + 1e-5)).to(x.scalar_type()) * weight;
  }

  int64_t seq_, vocab_ = 0, hidden_ = 0, ffn_ = 0, positions_ = 0, padded_vocab_ = 0;
  bool training_ = true;
  at::Tensor word_, position_, norm1_, gate_, up_, down_, norm2_, output_;
};

}  // namespace

DTK_PLUGIN("template_prefix_lm", DTK_KIND_MODEL, "0.1.0",
           "Out-of-tree example: a causal prefix-mean language model with one SwiGLU block", DTK_TORCH_VERSION,
           dtk::model_api<PrefixLM>(), kOptions)
