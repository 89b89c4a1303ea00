// dtk/layers/decoder_lm.hpp — the skeleton of a Megatron-style decoder-only language model, written
// once for every model plugin (gpt, llama, a third party's): a model supplies its layer and its
// final norm, the base does the rest.
//
//   tokens [, position_ids] -> word embedding [+ learned position embedding] -> dropout   (first stage)
//     -> this pipeline stage's layers (DecoderLayer; full recompute; or Domino's schedule)
//     -> final norm -> logits = h W^T, W the word embedding (tied) or its own output weight
//     -> with labels: per-token vocab-parallel cross entropy, fused with the output layer       (last stage)
//
// What the base owns:
//   * the shared options (DecoderConfig, read_options: Megatron's names) and their checks;
//   * the stage split: pre_process (embedding) and post_process (final norm, output layer) from
//     the build context; this stage's layers as the context's split gives them (num_layers /
//     pp_size each for the even split; dtk/pipeline_split.hpp), built with weights seeded by their
//     global index (pp_size and pp_rank count interleaved virtual stages: the host passes the
//     virtual stage's index), named language_model.encoder.layers.<local index>;
//   * tied vs untied output weight: the word embedding is `shared` on the first stage and copied
//     as word_embeddings_for_head.weight on the last stage of a pipeline (Megatron's names);
//   * initialisation: each weight from seeded_generator(seed * 1000003 + salt), salt 1 the word
//     embedding, 2 the position embedding, 3 the untied output weight, 100 + global index a layer;
//   * modules for per-module hooks (ZeRO-3): [embedding,] layers..., [output layer];
//   * the dropout generators (checkpointed as rng.hidden / rng.attention), recompute, Domino;
//   * generation with a key/value cache (docs/models.md "Generation").
//
// A model derives from DecoderLM, parses its options into a config derived from DecoderConfig
// (a member, so its layers may keep a reference), then calls build(). See the gpt and llama
// plugins, and sdk/templates/model/tiny_decoder.cpp for a small one.
#pragma once

#include <dtk/layers/context_parallel.hpp>
#include <dtk/layers/domino.hpp>
#include <dtk/layers/dropout.hpp>
#include <dtk/layers/fused_kernels.hpp>
#include <dtk/layers/layer_pattern.hpp>
#include <dtk/layers/lm_head.hpp>
#include <dtk/layers/moe.hpp>
#include <dtk/layers/tensor_parallel.hpp>
#include <dtk/module_hooks.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtk::layers {

// Appends a parameter: partition_dim >= 0 marks a tensor-parallel shard split along that dim.
void add_param(std::vector<Param>& out, const std::string& name, const at::Tensor& t, int partition_dim,
               bool no_weight_decay, bool shared = false, int32_t module = -1);

// The options every decoder LM shares (option names in read_options).
struct DecoderConfig {
  int64_t num_layers = 0, hidden = 0, heads = 0, ffn = 0, seq = 0;
  // Channels of each attention head (Megatron's --kv-channels; option kv_channels where the
  // plugin declares it): 0 = hidden / heads. Qwen3's heads are wider than hidden / heads.
  int64_t kv_channels = 0;
  int64_t head_dim() const { return kv_channels > 0 ? kv_channels : hidden / heads; }
  int64_t max_pos = 0;  // rows of a learned position embedding; 0: none (positions reach the layers only)
  int64_t vocab = 0, padded_vocab = 0, divisible_by = 128;
  double hidden_dropout = 0.0, attention_dropout = 0.0, init_std = 0.02, eps = 1e-5;
  bool untie = false, fused_lm_head = true;
  // Megatron's --apply-layernorm-1p (option apply_layernorm_1p): every norm multiplies by 1 + w,
  // its weight w starting at 0 (zero-centred, as Transformer Engine's zero_centered_gamma).
  bool norm_1p = false;
  // What a norm multiplies by for its weight w: 1 + w with norm_1p, else w itself.
  at::Tensor norm_gain(const at::Tensor& w) const;
  // A norm weight's initial value: 0 with norm_1p, else 1.
  double norm_init() const { return norm_1p ? 0.0 : 1.0; }
  // Megatron's activation recomputation (recompute.hpp): recompute_activations none|selective|full
  // (--recompute-granularity); with full, recompute_method uniform (every group of
  // recompute_num_layers consecutive layers of a stage is one checkpoint) or block (the first
  // recompute_num_layers layers of a stage are checkpointed one by one, the rest are not).
  // Selective recomputes the sub-layers recompute_modules names (Megatron's --recompute-modules,
  // core_attn by default), each the layer's own business: core attention (selective_recompute),
  // the MLP of a dense layer (recompute_mlp) or of a mixture-of-experts layer (recompute_moe),
  // each one checkpoint holding the MLP's input (its norm's output).
  bool recompute = false;  // full
  bool selective = false;  // recompute_activations=selective, whichever modules it names
  bool selective_recompute = false;                   // core attention (core_attn)
  bool recompute_mlp = false, recompute_moe = false;  // mlp, moe
  bool recompute_block = false;
  int64_t recompute_num_layers = 1;
  // Whether a layer recomputes its MLP: recompute_moe for a mixture-of-experts layer's, else
  // recompute_mlp (Megatron's "mlp" is the dense MLP, "moe" the MoE layer).
  bool recomputes_mlp(bool moe_layer) const { return moe_layer ? recompute_moe : recompute_mlp; }
  int64_t lm_head_chunk_tokens = 0;  // 0 = 512 on the CPU, about 1 GiB of fp32 logits on a GPU
  CrossEntropyRows cross_entropy_impl = CrossEntropyRows::kAuto;  // lm_head.hpp
  int64_t domino_chunks = 1;                                      // >= 2: Domino's chunked schedule (domino.hpp)
  FusedKernels kernels;  // the GPU kernels the layers use (fused_kernels.hpp; option unfused_kernels)
  MoeConfig moe;         // mixture of experts (moe.hpp; its options where the plugin declares them)
  // Megatron's sliding-window attention (options window_size "W,0" and window_attn_skip_freq
  // where the plugin declares them): in a windowed layer a token sees itself and the `window`
  // tokens before it (attention.hpp's window_mask); -1: no window. window_layers says which
  // layers: an integer N all but every N-th (1-based, Megatron's), a list the 1s, neither all.
  int64_t window = -1;
  LayerPattern window_layers;
  bool windowed(int64_t index) const;
  // Context parallelism (dtk_build_context.cp_size, from the build context): the layers' inputs
  // are this rank's share of each sequence, their attention trades it for whole sequences of
  // 1 / cp of the heads (context_parallel.hpp); the layers get the whole sequence's positions.
  ContextParallel cp;
  int64_t expert_ffn() const { return moe.ffn > 0 ? moe.ffn : ffn; }
};

// The fused output layer's options, declared alike by every decoder LM (put them in the plugin's
// option table; read_options reads them by these names). Those that act only with another setting
// say so (only_with): the plugin declares that setting too, and the host refuses them idle.
inline constexpr dtk_option_spec kLmHeadChunkTokensOption =
    only_with("fused_lm_head=true",
              opt_int("lm_head_chunk_tokens", "0",
                      "Tokens per chunk of the fused output layer; 0 = 512 on the CPU, about 1 GiB of fp32 logits on a "
                      "GPU."));
// Megatron's --recompute-granularity, --recompute-modules, --recompute-method and
// --recompute-num-layers.
inline constexpr dtk_option_spec kRecomputeActivationsOption =
    opt_enum("recompute_activations", "none", "none|selective|full",
             "full = recompute the layers' activations in backward (checkpoints as recompute_method and "
             "recompute_num_layers group them); selective = recompute the sub-layers recompute_modules names "
             "(core attention by default) in backward (Megatron's --recompute-granularity).");
inline constexpr dtk_option_spec kRecomputeModulesOption = only_with(
    "recompute_activations=selective",
    opt_string("recompute_modules", "core_attn",
               "The sub-layers selective recomputation reruns in backward, comma-separated (Megatron's "
               "--recompute-modules): core_attn = core attention, keeping no attention probabilities; mlp = a dense "
               "layer's MLP, keeping only its input; moe = a mixture-of-experts layer's router and experts, keeping "
               "only their input. Empty = none."));
inline constexpr dtk_option_spec kRecomputeMethodOption = only_with(
    "recompute_activations=full",
    opt_enum("recompute_method", "uniform", "uniform|block",
             "uniform = every group of recompute_num_layers consecutive layers is one checkpoint; block = only the "
             "first recompute_num_layers layers of each pipeline stage are recomputed (Megatron's "
             "--recompute-method)."));
inline constexpr dtk_option_spec kRecomputeNumLayersOption =
    only_with("recompute_activations=full",
              opt_int("recompute_num_layers", "1",
                      "Layers per checkpoint (uniform) or recomputed layers per pipeline stage (block) (Megatron's "
                      "--recompute-num-layers)."));
inline constexpr dtk_option_spec kCrossEntropyImplOption =
    only_with("fused_lm_head=true",
              opt_enum("cross_entropy_impl", "auto", "auto|host|ops",
                       "The fused output layer's cross entropy per chunk: host = row passes in cache (CPU only), ops = "
                       "LibTorch ops (any device; a GPU's path), auto = host on the CPU, ops elsewhere (Megatron's "
                       "--cross-entropy-fusion-impl)."));

// The residual stream between two layers with the last branch not yet added: its value is
// stream + branch (branch undefined: stream alone). A pre-norm layer ends `h + branch` and the
// next one starts `norm(h + branch)`; handing the branch on lets that norm add it in its own kernel
// (add_layer_norm, add_rms_norm: on a GPU one pass forward and one backward, instead of the add's
// pass, the norm's and the gradient sum's). branch_bias and branch_keep: the branch's bias still
// to add and its dropout still to apply (a row-parallel product made without its bias, where the
// next norm's kernel takes both: add_bias_dropout_layer_norm), so the value is
// stream + apply_dropout(branch + branch_bias, branch_keep).
struct ResidualStream {
  at::Tensor stream, branch;
  at::Tensor branch_bias = {};   // initialised: {stream, branch} leaves it out
  DropoutMask branch_keep = {};  // undefined: no dropout left to apply
  // What the branch adds to the stream: branch through its bias and dropout.
  at::Tensor branch_value() const {
    return apply_dropout(branch_bias.defined() ? branch + branch_bias : branch, branch_keep);
  }
  at::Tensor sum() const { return branch.defined() ? stream + branch_value() : stream; }
};

// Megatron's --window-size and --window-attn-skip-freq, declared alike by the models that take
// them.
inline constexpr dtk_option_spec kWindowSizeOption =
    opt_string("window_size", "",
               "Sliding-window attention (Megatron's --window-size W,0): in the windowed layers each token sees "
               "itself and the W tokens before it; empty or -1,0 = none.");
inline constexpr dtk_option_spec kWindowAttnSkipFreqOption =
    opt_string("window_attn_skip_freq", "",
               "With window_size, the layers that keep full attention (Megatron's --window-attn-skip-freq): N = "
               "every N-th layer, counting from 1; or one 0/1 per layer, 1 = windowed, e.g. [1,1,1,0]*3; empty = "
               "every layer windowed.");

// DTK's fused GPU kernels a model's layers leave out (fused_kernels.hpp); Megatron's
// --no-bias-gelu-fusion, --no-bias-swiglu-fusion, --no-bias-dropout-fusion and --no-rope-fusion
// map here.
inline constexpr dtk_option_spec kUnfusedKernelsOption = opt_string(
    "unfused_kernels", "",
    "DTK's GPU kernels to leave out, comma-separated (add_norm, bias_add, rms_norm, bias_gelu, swiglu, rotary, or "
    "all): the layers run LibTorch ops there instead. No effect on the CPU, which runs the ops always.");

// One transformer layer of a decoder LM: [b, s, h] -> [b, s, h].
class DecoderLayer {
 public:
  virtual ~DecoderLayer() = default;
  // positions [b, s] int64 when the model gives its layers positions (DecoderParts), else
  // undefined; mask [b or 1, 1, s, s] bool (true = masked) or undefined (causal). Dropout from
  // rng.hidden (residual branches) and rng.attention (probabilities).
  virtual at::Tensor forward(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& mask, DropoutRng& rng,
                             bool training) const = 0;
  // forward() on x.sum(), with the output's last branch left unadded: forward_residual(x).sum()
  // equals forward(x.sum()). The default adds the input's branch first and returns no branch; a
  // layer whose first norm can add it (gpt's, llama's) overrides this, and forward() calls it.
  // The base calls it between layers that no per-module hook separates (plain_layers).
  virtual ResidualStream forward_residual(const ResidualStream& x, const at::Tensor& positions, const at::Tensor& mask,
                                          DropoutRng& rng, bool training) const {
    return {forward(x.sum(), positions, mask, rng, training), {}};
  }
  // The parameters under `prefix` ("language_model.encoder.layers.<i>."), in a fixed order.
  virtual void add_params(std::vector<Param>& out, const std::string& prefix) const = 0;
  // Domino's view of the layer (nullptr: domino_chunks > 1 is refused).
  virtual const DominoLayer* domino() const { return nullptr; }
  // The layer's mixture-of-experts MLP (nullptr: a dense one): its buffers and its end of
  // iteration (the expert bias) are the model's.
  virtual MoeMlp* moe_mlp() const { return nullptr; }
  // Generation: x [b, n, h] at cache positions [length, length + n); positions [b, n] as given;
  // `cache` as empty_kv_cache made it; mask [b, 1, n, length + n]. The default refuses.
  virtual at::Tensor forward_cached(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cache,
                                    int64_t length, const at::Tensor& mask) const;
  virtual at::Tensor empty_kv_cache(int64_t batch, int64_t capacity, const at::TensorOptions& options) const;
};

// What a model tells build() besides its config.
struct DecoderParts {
  // The final norm's tensors: names under "language_model.encoder." and their initial value
  // (1: a weight, 0: a bias), e.g. {{"final_layernorm.weight", 1}, {"final_layernorm.bias", 0}}.
  std::vector<std::pair<std::string, double>> final_norm;
  // The layers read position ids (rotary embeddings): "position_ids" [b, s] are checked, taken
  // as int64 and passed to every stage's layers; else only a learned table (max_pos) reads them.
  bool layer_positions = false;
  // The layers run context parallelism: each calls DecoderConfig::cp's heads_from_sequence before
  // core attention and sequence_from_heads after it (context_parallel.hpp). Reported in
  // dtk_model_info.context_parallel; without it the host refuses distributed.context_parallel_size.
  bool context_parallel = false;
  // ... and its all_gather exchange too (ABI 2.21): where cp.gathers_keys() core attention calls
  // cp.attend_whole_keys (the two calls above then return their input). Reported as that
  // exchange's bit; without it the host refuses distributed.cp_comm_type=all_gather.
  bool context_parallel_all_gather = false;
};

class DecoderLM : public Model {
 public:
  TensorList forward(const TensorList& inputs) override;
  std::vector<Param> parameters() override;
  // The MoE layers' expert biases (moe_router_enable_expert_bias), under the layers' prefixes.
  std::vector<Param> buffers() override;
  // The MoE layers' expert biases follow the iteration's expert loads (ABI 2.11).
  void end_iteration() override;
  // Model::to, but the expert biases stay fp32 (their steps would vanish in bf16).
  void to(at::Device device, std::optional<at::ScalarType> dtype) override;
  std::vector<Module> modules() override;
  void set_module_hooks(const dtk_module_hooks* hooks) override { hooks_.set(hooks); }
  void set_training(bool training) override { training_ = training; }
  dtk_model_info info() override;
  // The parameters (Model's default) plus the two dropout generators' states.
  TensorList state_save() override;
  void state_load(const TensorList& state, bool strict) override;
  // Partitioned construction (ABI 2.4): built under ctx.deferred_parameters, every parameter is a
  // placeholder and init_parameters replays the draws (param_factory.hpp).
  bool defers_parameters() override { return deferred_ != nullptr; }
  void init_parameters(const ParamValueFn& take) override;

 protected:
  // `name` prefixes every error ("gpt: ...").
  DecoderLM(const BuildContext& ctx, std::string name);

  // The shared options: num_layers, hidden_size, num_attention_heads, vocab_size (required), and
  // where the plugin declares them (else DecoderConfig's defaults): seq_length (0: the run's),
  // make_vocab_size_divisible_by, hidden_dropout, attention_dropout, init_method_std,
  // layernorm_epsilon, apply_layernorm_1p, untie_embeddings_and_output_weights, fused_lm_head, lm_head_chunk_tokens,
  // cross_entropy_impl, unfused_kernels,
  // recompute_activations, recompute_modules, recompute_method, recompute_num_layers, domino_chunks, and the MoE
  // options (moe.hpp's k*Option constants). The model reads ffn_hidden_size (and max_position_embeddings) itself, e.g.
  // with option_or.
  void read_options(const BuildContext& ctx, DecoderConfig& c) const;
  // The option's value; 0 selects `fallback`; negative is refused.
  int64_t option_or(const Options& o, const char* name, int64_t fallback) const;
  // Checks the shared options (and ffn, max_pos); throws "<name>: ..." naming the first wrong one.
  void validate(const BuildContext& ctx, const DecoderConfig& c) const;
  void validate_moe(const BuildContext& ctx, const DecoderConfig& c) const;  // the MoE options (validate calls it)
  void validate_moe_groups(const MoeConfig& m) const;                        // group-limited routing's options
  void validate_deepspeed_gate(const MoeConfig& m) const;                    // moe_gate=deepspeed's options
  void validate_layer_experts(const DecoderConfig& c) const;                 // moe_layer_num_experts (pyramid)
  void validate_context_parallel(const DecoderConfig& c) const;              // the heads and sequence split over cp
  // Builds the embedding, this stage's layers and the output layer. `config` must outlive the
  // model (a member of it); its padded_vocab is set here. Call from the model's constructor.
  void build(const BuildContext& ctx, DecoderConfig& config, DecoderParts parts);
  void fail(const std::string& what) const;  // throws Error(name + ": " + what)
  // Refuses n % d != 0: "<name>: <what> <n> is not divisible by <by> <d>".
  void divisible(const char* what, int64_t n, const char* by, int64_t d) const;

  // Recomputed layers of this stage, as the recompute options group them: each group is one
  // checkpoint; layers in no group keep their activations.
  std::vector<std::pair<size_t, size_t>> recompute_groups() const;

  // The model's parts: layer `index` (global, over all stages) drawing its weights from f; the
  // final norm of x reading final_norm_ (the tensors of DecoderParts::final_norm, in order).
  virtual std::unique_ptr<DecoderLayer> make_layer(int64_t index, ParamFactory& f) = 0;
  virtual at::Tensor final_norm(const at::Tensor& x) const = 0;
  // The final norm of x.sum() (x: the last layer's ResidualStream); a model whose norm has an
  // add-and-norm kernel overrides it (gpt: add_layer_norm, llama: add_rms_norm).
  virtual at::Tensor final_add_norm(const ResidualStream& x) const { return final_norm(x.sum()); }

  std::string name_;
  TPGroup tp_;
  bool pre_, post_;
  std::vector<at::Tensor> final_norm_;
  std::vector<std::unique_ptr<DecoderLayer>> layers_;

 private:
  TensorList forward_cached(const TensorList& inputs);
  at::Tensor attention_mask(const TensorList& inputs) const;
  at::Tensor check_tokens(const TensorList& inputs, IdRangeChecks& checks) const;
  at::Tensor positions(const TensorList& inputs, const at::Tensor& tokens, const at::Tensor& h,
                       IdRangeChecks& checks) const;
  at::Tensor embed(const at::Tensor& tokens, const at::Tensor& positions) const;
  int64_t whole_sequence(const at::Tensor& h) const;  // a stage input's sequence length, all TP ranks
  ResidualStream plain_layers(const at::Tensor& h, const at::Tensor& positions, const at::Tensor& mask);
  at::Tensor output_layer(const ResidualStream& h, const at::Tensor* labels);
  const at::Tensor& output_weight() const { return config_->untie ? output_ : word_.weight; }
  void init_domino();
  int32_t embedding_module() const { return 0; }
  int32_t layer_module(size_t i) const { return static_cast<int32_t>(i) + (pre_ ? 1 : 0); }
  int32_t output_module() const { return layer_module(layers_.size()); }

  const DecoderConfig* config_ = nullptr;
  DecoderParts parts_;
  bool training_ = true;
  VocabParallelEmbedding word_;
  at::Tensor position_, output_;
  DropoutRng rng_;
  ModuleHooks hooks_;
  DominoStack domino_;
  DominoHead head_;
  DominoEmbedding embedding_;
  std::unique_ptr<DeferredInit> deferred_;  // set while the parameters await their values
};

}  // namespace dtk::layers
