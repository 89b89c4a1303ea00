// template_tiny_decoder — a decoder-only transformer LM on the SDK's decoder-LM base
// (dtk/layers/decoder_lm.hpp), the way the shipped gpt and llama plugins are built. The base
// brings the word and learned position embeddings, the pipeline stage split and the layers'
// numbering, tied or untied output weight, seeded initialisation, full recompute, the fused
// output layer with its vocab-parallel cross entropy, parameters, modules and checkpointed
// dropout streams; this file is only the layer, the final norm and the options (81 lines
// of code). Tensor-parallel ready: the projections are the SDK's column/row-parallel layers.
//
//   h = x + dropout(dense(attention(RMSNorm(x))))         causal multi-head attention, fused q/k/v
//   y = h + dropout(fc2(relu(fc1(RMSNorm(h)))^2))          squared-ReLU MLP (Primer); no biases
//
// Not here (the base refuses them with a message): Domino's schedule (a layer that implements
// dtk::layers::DominoLayer gets it) and generation with a key/value cache (forward_cached).
#include <dtk/layers/decoder_lm.hpp>

#include <ATen/ATen.h>

#include <cmath>
#include <memory>

namespace {

using namespace dtk::layers;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  return (xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type()) * weight;
}

class Layer : public DecoderLayer {
 public:
  // Weights in a fixed order from f (seeded by the layer's global index: any pipeline split and
  // tensor-parallel size gives the same model); output projections scaled as Megatron's.
  Layer(const DecoderConfig& c, const TPGroup& tp, ParamFactory& f) : c_(c), heads_(c.heads / tp.size) {
    const double out_std = c.init_std / std::sqrt(2.0 * static_cast<double>(c.num_layers));
    norm1_ = f.ones({c.hidden});
    qkv_ = ColumnParallelLinear(c.hidden, 3 * c.hidden, false, c.init_std, tp, f);
    dense_ = RowParallelLinear(c.hidden, c.hidden, false, out_std, tp, f);
    norm2_ = f.ones({c.hidden});
    fc1_ = ColumnParallelLinear(c.hidden, c.ffn, false, c.init_std, tp, f);
    fc2_ = RowParallelLinear(c.ffn, c.hidden, false, out_std, tp, f);
  }

  at::Tensor forward(const at::Tensor& x, const at::Tensor& /*positions*/, const at::Tensor& mask, DropoutRng& rng,
                     bool training) const override {
    const int64_t b = x.size(0), s = x.size(1), hd = c_.hidden / c_.heads;
    // [b, s, heads / tp * 3 * hd], per head [q | k | v] -> q, k, v [b, heads / tp, s, hd]
    const at::Tensor qkv = qkv_.forward(rms_norm(x, norm1_, c_.eps)).view({b, s, heads_, 3, hd}).permute({3, 0, 2, 1, 4});
    const at::Tensor scores = at::matmul(qkv[0], qkv[1].transpose(-1, -2)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    const at::Tensor masked = mask.defined() ? mask : at::ones({s, s}, x.options().dtype(at::kBool)).triu(1);
    at::Tensor probs = at::softmax(scores.to(at::kFloat).masked_fill(masked, -10000.0), -1).to(x.scalar_type());
    probs = dropout(probs, c_.attention_dropout, training, rng.attention);
    const at::Tensor context = at::matmul(probs, qkv[2]).transpose(1, 2).reshape({b, s, heads_ * hd});
    const at::Tensor h = x + dropout(dense_.forward(context), c_.hidden_dropout, training, rng.hidden);
    const at::Tensor mlp = fc2_.forward(at::relu(fc1_.forward(rms_norm(h, norm2_, c_.eps))).pow(2));
    return h + dropout(mlp, c_.hidden_dropout, training, rng.hidden);
  }

  // Tensor-parallel shards name the dimension they are split along; norms skip weight decay.
  void add_params(std::vector<dtk::Param>& out, const std::string& prefix) const override {
    add_param(out, prefix + "input_norm.weight", norm1_, -1, true);
    add_param(out, prefix + "self_attention.query_key_value.weight", qkv_.weight, 0, false);
    add_param(out, prefix + "self_attention.dense.weight", dense_.weight, 1, false);
    add_param(out, prefix + "post_attention_norm.weight", norm2_, -1, true);
    add_param(out, prefix + "mlp.dense_h_to_4h.weight", fc1_.weight, 0, false);
    add_param(out, prefix + "mlp.dense_4h_to_h.weight", fc2_.weight, 1, false);
  }

 private:
  const DecoderConfig& c_;
  int64_t heads_;
  at::Tensor norm1_, norm2_;
  ColumnParallelLinear qkv_, fc1_;
  RowParallelLinear dense_, fc2_;
};

class TinyDecoder : public DecoderLM {
 public:
  explicit TinyDecoder(const dtk::BuildContext& ctx) : DecoderLM(ctx, "template_tiny_decoder") {
    read_options(ctx, c_);  // the shared options this plugin declares (kOptions)
    c_.ffn = option_or(ctx.options, "ffn_hidden_size", 4 * c_.hidden);
    c_.max_pos = option_or(ctx.options, "max_position_embeddings", c_.seq);  // > 0: a learned position table
    validate(ctx, c_);
    build(ctx, c_, {{{"final_norm.weight", 1.0}}, /*layer_positions=*/false});
  }

 private:
  std::unique_ptr<DecoderLayer> make_layer(int64_t /*index*/, ParamFactory& f) override {
    return std::make_unique<Layer>(c_, tp_, f);
  }
  at::Tensor final_norm(const at::Tensor& x) const override { return rms_norm(x, final_norm_[0], c_.eps); }

  DecoderConfig c_;
};

const dtk_option_spec kOptions[] = {
    dtk::opt_int("num_layers", "2", "Transformer layers of the whole model (a pipeline stage holds num_layers / pp)."),
    dtk::opt_int("hidden_size", "64", "Width of the embeddings and the layers."),
    dtk::opt_int("num_attention_heads", "4", "Attention heads (divisible by the tensor-parallel size)."),
    dtk::opt_int("ffn_hidden_size", "0", "MLP inner size; 0 = 4 x hidden_size."),
    dtk::opt_int("max_position_embeddings", "0", "Rows of the position embedding; 0 = the run's seq_length."),
    dtk::opt_int("vocab_size", "50257", "Vocabulary size before padding (to a multiple of 128 x TP)."),
    dtk::opt_float("hidden_dropout", "0.0", "Dropout on the embeddings and on each residual branch."),
    dtk::opt_float("attention_dropout", "0.0", "Dropout on the attention probabilities."),
    dtk::opt_bool("untie_embeddings_and_output_weights", "false", "A separate output weight (else the word embedding)."),
    dtk::opt_enum("recompute_activations", "none", "none|full", "full = recompute each layer in backward."),
};

}  // namespace

DTK_PLUGIN("template_tiny_decoder", DTK_KIND_MODEL, "0.1.0",
           "Out-of-tree example: a small decoder-only transformer on the SDK's decoder-LM base", DTK_TORCH_VERSION,
           dtk::model_api<TinyDecoder>(), kOptions)
