// gpt_model.cpp — the "gpt" model plugin: Megatron-LM's GPTModel (megatron/model/gpt_model.py,
// language_model.py, transformer.py) on ATen, built from the tensor-parallel blocks of
// tensor_parallel.hpp.
//
//   tokens, position_ids -> word + position embedding -> dropout
//     -> N x [ x + dropout(attn(LN(x))) ; x + dropout(mlp(LN(x))) ]   (pre-LayerNorm)
//     -> final LN -> logits = h W_emb^T (tied) or h W_out^T (untied)
//     -> with labels: per-token vocab-parallel cross entropy
//
// Layout inside the plugin is [batch, seq, hidden] (Megatron uses [seq, batch, hidden]; the math
// is identical). The fused QKV weight follows Megatron's layout: output rows grouped per head as
// [q_h | k_h | v_h], so splitting rows across TP ranks splits whole heads.
//
// Dropout draws from two generators owned by the model, as Megatron's RNG tracker does: hidden
// and embedding dropout from the DEFAULT stream, attention dropout from the TENSOR_PARALLEL
// stream (differs per TP rank). Full activation recomputation (recompute_activations=full)
// wraps each layer in dtk::layers::recompute, an autograd function that keeps only the layer input, then reruns
// the layer in backward with clones of the generators taken before the forward, so the dropout
// masks are the same ones.
//
// Modules (for a strategy's per-module hooks, ZeRO-3): the embedding (first stage), each
// transformer layer, and the output layer (final LN + logits + loss, last stage), indexed in
// forward order. Hooks fire through dtk::ModuleHooks, inside the recomputed code as well.
//
// domino_chunks >= 2 runs the layers with DeepSpeed-Domino's schedule instead (dtk/layers/domino.hpp): the
// micro-batch split into chunks whose tensor-parallel all-reduces overlap each other's compute.
//
// The embedding, stage split, tied/untied output, recompute, Domino, generation, parameters and
// modules are the SDK's decoder-LM base (dtk/layers/decoder_lm.hpp); this file is GPT's options
// and its final LayerNorm, the layer is layer.hpp.
#include <algorithm>
#include <dtk/layers/decoder_lm.hpp>

#include <memory>

#include "layer.hpp"

namespace dtk::gpt {
namespace {

class GPTModel : public DecoderLM {
 public:
  explicit GPTModel(const BuildContext& ctx) : DecoderLM(ctx, "gpt") {
    const Options& o = ctx.options;
    read_options(ctx, c_);
    // (Bounded so that a hidden_size past validate's range cannot overflow the default.)
    c_.ffn = option_or(o, "ffn_hidden_size", 4 * std::min<int64_t>(c_.hidden, int64_t{1} << 40));
    c_.max_pos = option_or(o, "max_position_embeddings", c_.seq);
    c_.openai_gelu = o.get_bool("openai_gelu");
    validate(ctx, c_);
    build(ctx, c_,
          {{{"final_layernorm.weight", c_.norm_init()}, {"final_layernorm.bias", 0.0}},
           /*layer_positions=*/false,
           /*context_parallel=*/true,
           /*context_parallel_all_gather=*/true});
  }

 private:
  std::unique_ptr<DecoderLayer> make_layer(int64_t index, ParamFactory& f) override {
    return std::make_unique<Layer>(c_, index, tp_, f);
  }
  at::Tensor final_norm(const at::Tensor& x) const override {
    return layer_norm(x, c_.norm_gain(final_norm_[0]), final_norm_[1], c_.eps);
  }
  at::Tensor final_add_norm(const ResidualStream& x) const override {
    if (!x.branch.defined()) return final_norm(x.stream);
    const auto [h, normed] =
        add_bias_dropout_layer_norm(x.stream, x.branch, x.branch_bias, x.branch_keep, c_.norm_gain(final_norm_[0]),
                                    final_norm_[1], c_.eps, c_.kernels);
    return normed;
  }

  Config c_;
};

const dtk_option_spec kOptions[] = {
    opt_int("num_layers", "12", "Number of transformer layers (whole model, all pipeline stages)."),
    opt_int("hidden_size", "768", "Transformer hidden size."),
    opt_int("num_attention_heads", "12", "Number of attention heads."),
    opt_int("ffn_hidden_size", "0", "MLP inner size; 0 = 4 x hidden_size."),
    opt_int("seq_length", "0", "Sequence length; 0 = the run's train.seq_length."),
    opt_int("max_position_embeddings", "0", "Rows of the position embedding; 0 = seq_length."),
    opt_int("vocab_size", "50257", "Vocabulary size before padding (GPT-2 BPE: 50257)."),
    opt_int("make_vocab_size_divisible_by", "128",
            "Pad the vocabulary to a multiple of this x tensor-parallel size (Megatron)."),
    opt_float("hidden_dropout", "0.1", "Dropout on embeddings and on each residual branch."),
    opt_float("attention_dropout", "0.1", "Dropout on the attention probabilities."),
    opt_float("init_method_std", "0.02", "Std of the normal init; output projections use std / sqrt(2 x num_layers)."),
    opt_float("layernorm_epsilon", "1e-5", "LayerNorm epsilon."),
    opt_bool("apply_layernorm_1p", "false",
             "Zero-centred norm weights (Megatron's --apply-layernorm-1p): each LayerNorm multiplies by 1 + w, w "
             "starting at 0."),
    opt_bool("openai_gelu", "false",
             "GELU's tanh approximation (Megatron's --openai-gelu, GPT-2's and Hugging Face's gelu_new) instead of the "
             "exact erf GELU."),
    opt_bool("untie_embeddings_and_output_weights", "false",
             "Use a separate output layer instead of the word-embedding weight."),
    dtk::layers::kWindowSizeOption,
    dtk::layers::kWindowAttnSkipFreqOption,
    dtk::layers::kRecomputeActivationsOption,
    dtk::layers::kRecomputeModulesOption,
    dtk::layers::kRecomputeMethodOption,
    dtk::layers::kRecomputeNumLayersOption,
    opt_bool("fused_lm_head", "true",
             "Compute the output layer and its cross entropy chunk by chunk without the whole [tokens, vocabulary] "
             "logits (false: Megatron's logits, then vocab-parallel cross entropy)."),
    dtk::layers::kLmHeadChunkTokensOption,
    dtk::layers::kCrossEntropyImplOption,
    dtk::layers::kUnfusedKernelsOption,
    DTK_LAYERS_MOE_OPTIONS,
    opt_int("domino_chunks", "1",
            "Domino: split each micro-batch into this many chunks whose tensor-parallel all-reduces "
            "overlap the other chunks' compute (DeepSpeed-Domino); 1 = plain tensor parallelism."),
};

}  // namespace
}  // namespace dtk::gpt

DTK_PLUGIN("gpt", DTK_KIND_MODEL, "1.0.0", "Megatron-LM GPT (pre-LN, learned positions, tensor-parallel ready)",
           DTK_TORCH_VERSION, dtk::model_api<dtk::gpt::GPTModel>(), dtk::gpt::kOptions)
