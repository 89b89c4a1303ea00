// llama_model.cpp — the "llama" model plugin: Megatron-LM's GPTModel configured as Llama 2
// (DeepSpeed-Domino's pretrain_llama_7b.sh: --position-embedding-type rope --swiglu
// --normalization RMSNorm --disable-bias-linear, optionally --group-query-attention; with
// add_qkv_bias Qwen2's layers, with qk_layernorm and kv_channels Qwen3's), built only
// from the SDK (dtk/model.hpp, dtk/module_hooks.hpp, dtk/layers) exactly as a third-party plugin.
//
//   tokens -> word embedding -> dropout
//     -> N x [ x + dropout(attn(RMSNorm(x))) ; x + dropout(swiglu_mlp(RMSNorm(x))) ]  (llama_layer.hpp)
//     -> final RMSNorm -> logits = h W_out^T (untied by default)
//     -> with labels: per-token vocab-parallel cross entropy (fused with the output layer)
//
// Positions enter only through the rotary embedding of queries and keys (no position table), so
// any position can be evaluated; `position_ids` from the step decide them (Megatron's
// --reset-position-ids works unchanged).
//
// Modules for a strategy's per-module hooks (ZeRO-3), in forward order: the embedding (first
// stage), each layer, the output layer (last stage). Initialisation, dropout streams and the
// checkpoint state follow the gpt plugin's rules (docs/models.md), so TP=N is the TP=1 model cut
// in pieces and a resumed run draws the same dropout masks.
//
// domino_chunks >= 2 runs the embedding, the layers and the output layer with the SDK's Domino
// schedule (dtk/layers/domino.hpp), as the gpt plugin does: the same arithmetic as plain tensor
// parallelism on row slices of the micro-batch, with the all-reduces overlapping other chunks.
//
// All of that but the layer (llama_layer.hpp), the options and the final RMSNorm is the SDK's
// decoder-LM base (dtk/layers/decoder_lm.hpp), shared with gpt.
#include <algorithm>
#include <dtk/layers/decoder_lm.hpp>

#include <memory>

#include "llama_layer.hpp"

namespace dtk::llama {
namespace {

// The llama3 scaling's parameters: read only with rope_scaling=llama3 (the host refuses another
// value than the default without it).
constexpr dtk_option_spec kRopeScalingOptions[] = {
    only_with("rope_scaling=llama3",
              opt_float("rope_scaling_factor", "8", "llama3 rope scaling: the factor low frequencies are divided by.")),
    only_with("rope_scaling=llama3",
              opt_float("rope_low_freq_factor", "1",
                        "llama3 rope scaling: wavelengths above rope_original_max_positions / this are scaled fully.")),
    only_with("rope_scaling=llama3",
              opt_float("rope_high_freq_factor", "4",
                        "llama3 rope scaling: wavelengths below rope_original_max_positions / this are kept.")),
    only_with("rope_scaling=llama3", opt_int("rope_original_max_positions", "8192",
                                             "llama3 rope scaling: the context length the model was first trained at "
                                             "(original_max_position_embeddings).")),
};

class LlamaModel : public DecoderLM {
 public:
  explicit LlamaModel(const BuildContext& ctx) : DecoderLM(ctx, "llama") {
    const Options& o = ctx.options;
    read_options(ctx, c_);
    c_.groups = option_or(o, "num_query_groups", c_.heads);
    // Megatron's default with --swiglu: 2/3 of 4h, rounded down to a multiple of 64.
    // (Bounded so that a hidden_size past validate's range cannot overflow the default.)
    const int64_t hidden = std::min<int64_t>(c_.hidden, int64_t{1} << 40);
    c_.ffn = option_or(o, "ffn_hidden_size", (4 * hidden * 2 / 3) / 64 * 64);
    c_.rotary_base = o.get_float("rotary_base");
    c_.rotary_percent = o.get_float("rotary_percent");
    c_.bias = o.get_bool("add_bias_linear");
    c_.qkv_bias = o.get_bool("add_qkv_bias");
    c_.qk_layernorm = o.get_bool("qk_layernorm");
    c_.rope_scaling.llama3 = o.get_string("rope_scaling") == "llama3";
    c_.rope_scaling.factor = o.get_float("rope_scaling_factor");
    c_.rope_scaling.low_freq_factor = o.get_float("rope_low_freq_factor");
    c_.rope_scaling.high_freq_factor = o.get_float("rope_high_freq_factor");
    c_.rope_scaling.original_max_positions = o.get_int("rope_original_max_positions");
    validate(ctx, c_);
    validate_llama();
    rotary_ = std::make_unique<Rotary>(c_.rotary_dim(), c_.rotary_base, c_.rope_scaling);
    build(ctx, c_,
          {{{"final_norm.weight", c_.norm_init()}},
           /*layer_positions=*/true,
           /*context_parallel=*/true,
           /*context_parallel_all_gather=*/true});
  }

 private:
  std::unique_ptr<DecoderLayer> make_layer(int64_t index, ParamFactory& f) override {
    return std::make_unique<Layer>(c_, index, tp_, f, *rotary_);
  }
  at::Tensor final_norm(const at::Tensor& x) const override {
    return rms_norm(x, c_.norm_gain(final_norm_[0]), c_.eps, c_.kernels);
  }
  at::Tensor final_add_norm(const ResidualStream& x) const override {
    return x.branch.defined()
               ? add_rms_norm(x.stream, x.branch_value(), c_.norm_gain(final_norm_[0]), c_.eps, c_.kernels).second
               : final_norm(x.stream);
  }

  void validate_llama() const {
    if (c_.groups <= 0) fail("option 'num_query_groups' must be positive, got " + std::to_string(c_.groups));
    divisible("num_attention_heads", c_.heads, "num_query_groups", c_.groups);
    divisible("num_query_groups", c_.groups, "the tensor-parallel size", tp_.size);
    if (c_.cp.active() && !c_.cp.gathers_keys() && (c_.groups / tp_.size) % c_.cp.size != 0)
      fail("context parallelism " + std::to_string(c_.cp.size) +
           " by all-to-all gives each rank the whole sequence of 1 / cp of the key/value groups: num_query_groups / "
           "the tensor-parallel size (" +
           std::to_string(c_.groups) + " / " + std::to_string(tp_.size) + ") must divide by " +
           std::to_string(c_.cp.size) + " (distributed.cp_comm_type=all_gather has no such condition)");
    if (!(c_.rotary_percent > 0.0 && c_.rotary_percent <= 1.0))
      fail("option 'rotary_percent' must be in (0, 1], got " + std::to_string(c_.rotary_percent));
    if (c_.rotary_dim() % 2 != 0)
      fail("rotary_percent x head dim (" + std::to_string(c_.head_dim()) + ") = " + std::to_string(c_.rotary_dim()) +
           " channels must be even (they rotate in pairs)");
    if (!(c_.rotary_base > 0.0)) fail("option 'rotary_base' must be positive");
    const std::string rope = rope_scaling_problem(c_.rope_scaling);
    if (!rope.empty()) fail(rope + " (rope_scaling=llama3)");
  }

  Config c_;
  std::unique_ptr<Rotary> rotary_;
};

const dtk_option_spec kOptions[] = {
    opt_int("num_layers", "32", "Number of transformer layers (whole model, all pipeline stages)."),
    opt_int("hidden_size", "4096", "Transformer hidden size."),
    opt_int("num_attention_heads", "32", "Number of query heads."),
    opt_int("num_query_groups", "0",
            "Key/value heads for grouped-query attention (Megatron's --num-query-groups); 0 = num_attention_heads "
            "(plain multi-head attention)."),
    opt_int("ffn_hidden_size", "0",
            "SwiGLU inner size; 0 = Megatron's default, 2/3 x 4 x hidden_size rounded down to 64."),
    opt_int("seq_length", "0", "Training sequence length; 0 = the run's train.seq_length."),
    opt_int("vocab_size", "32000", "Vocabulary size before padding (Llama's tokenizer: 32000; GPT-2 BPE: 50257)."),
    opt_int("make_vocab_size_divisible_by", "128",
            "Pad the vocabulary to a multiple of this x tensor-parallel size (Megatron)."),
    opt_float("rotary_base", "10000", "Base of the rotary embedding's frequencies (Megatron's --rotary-base)."),
    opt_float("rotary_percent", "1.0", "Fraction of each head's channels that rotate (Megatron's --rotary-percent)."),
    opt_enum("rope_scaling", "none", "none|llama3",
             "Llama 3.1's rotary frequency scaling: llama3 divides the low frequencies by rope_scaling_factor and "
             "blends the middle ones (Hugging Face's rope_scaling {rope_type: llama3}); none = plain rotary."),
    kRopeScalingOptions[0],
    kRopeScalingOptions[1],
    kRopeScalingOptions[2],
    kRopeScalingOptions[3],
    opt_float("hidden_dropout", "0.0", "Dropout on the embedding and on each residual branch."),
    opt_float("attention_dropout", "0.0", "Dropout on the attention probabilities."),
    opt_float("init_method_std", "0.02", "Std of the normal init; output projections use std / sqrt(2 x num_layers)."),
    opt_float("layernorm_epsilon", "1e-5", "RMSNorm epsilon (Megatron's --layernorm-epsilon / --norm-epsilon)."),
    opt_bool("apply_layernorm_1p", "false",
             "Zero-centred norm weights (Megatron's --apply-layernorm-1p): each RMSNorm multiplies by 1 + w, w "
             "starting at 0."),
    opt_bool("untie_embeddings_and_output_weights", "true",
             "A separate output layer (Llama's); false reads the word-embedding weight."),
    opt_bool("add_bias_linear", "false",
             "Biases on the attention and MLP projections (Megatron's default GPT layers; Llama has none, Megatron's "
             "--disable-bias-linear)."),
    opt_bool("add_qkv_bias", "false",
             "Biases on the query/key/value projection alone (Qwen2; Megatron's --add-qkv-bias); add_bias_linear "
             "gives every projection one."),
    opt_bool("qk_layernorm", "false",
             "RMSNorm of each query and key head over its channels before rotary, one weight per norm shared by the "
             "heads (Qwen3; Megatron's --qk-layernorm)."),
    opt_int("kv_channels", "0",
            "Channels of each attention head (Megatron's --kv-channels, Hugging Face's head_dim); 0 = hidden_size / "
            "num_attention_heads."),
    dtk::layers::kWindowSizeOption,
    dtk::layers::kWindowAttnSkipFreqOption,
    opt_bool("fused_lm_head", "true",
             "Compute the output layer and its cross entropy chunk by chunk without the whole [tokens, vocabulary] "
             "logits (false: the logits, then vocab-parallel cross entropy)."),
    dtk::layers::kLmHeadChunkTokensOption,
    dtk::layers::kCrossEntropyImplOption,
    dtk::layers::kUnfusedKernelsOption,
    dtk::layers::kRecomputeActivationsOption,
    dtk::layers::kRecomputeModulesOption,
    dtk::layers::kRecomputeMethodOption,
    dtk::layers::kRecomputeNumLayersOption,
    DTK_LAYERS_MOE_OPTIONS,
    opt_int("domino_chunks", "1",
            "Domino: split each micro-batch into this many chunks whose tensor-parallel all-reduces overlap the "
            "other chunks' compute (DeepSpeed-Domino); 1 = plain tensor parallelism."),
};

}  // namespace
}  // namespace dtk::llama

DTK_PLUGIN("llama", DTK_KIND_MODEL, "1.0.0",
           "Llama 2 as Megatron-LM builds it (RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases; "
           "tensor-parallel ready)",
           DTK_TORCH_VERSION, dtk::model_api<dtk::llama::LlamaModel>(), dtk::llama::kOptions)
