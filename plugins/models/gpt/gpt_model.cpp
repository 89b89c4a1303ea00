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
// wraps each layer in a custom autograd function that keeps only the layer input, then reruns
// the layer in backward with clones of the generators taken before the forward, so the dropout
// masks are the same ones.
//
// Modules (for a strategy's per-module hooks, ZeRO-3): the embedding (first stage), each
// transformer layer, and the output layer (final LN + logits + loss, last stage), indexed in
// forward order. Hooks fire through dtk::ModuleHooks, inside the recomputed code as well.
//
// domino_chunks >= 2 runs the layers with DeepSpeed-Domino's schedule instead (dtk/layers/domino.hpp): the
// micro-batch split into chunks whose tensor-parallel all-reduces overlap each other's compute.
#include <dtk/layers/lm_head.hpp>
#include <dtk/module_hooks.hpp>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <memory>
#include <mutex>

#include "layer.hpp"

namespace dtk::gpt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Full activation recomputation of one layer (Megatron's CheckpointFunction with one layer per
// chunk): forward keeps only the input and the generator states; backward reruns the layer with
// grad enabled and backpropagates through it (parameter gradients accumulate as usual).
struct LayerCall {
  const Layer* layer;
  at::Tensor mask;
  DropoutRng* rng;
  bool training;
  const ModuleHooks* hooks;
  int32_t module;
};

// One layer as module `module`: the hooks fire around it (no-op without hooks).
at::Tensor run_layer(const ModuleHooks& hooks, int32_t module, const Layer& layer, const at::Tensor& x,
                     const at::Tensor& mask, DropoutRng& rng, bool training) {
  return hooks.run(module, x, [&](const at::Tensor& in) { return layer.forward(in, mask, rng, training); });
}

struct CheckpointedLayer : public torch::autograd::Function<CheckpointedLayer> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const LayerCall* call) {
    DropoutRng saved = call->rng->clone();
    ctx->saved_data["hidden_gen"] = saved.hidden;
    ctx->saved_data["attention_gen"] = saved.attention;
    ctx->saved_data["layer"] = reinterpret_cast<int64_t>(call->layer);
    ctx->saved_data["mask"] = call->mask;
    ctx->saved_data["training"] = call->training;
    ctx->saved_data["hooks"] = reinterpret_cast<int64_t>(call->hooks);
    ctx->saved_data["module"] = static_cast<int64_t>(call->module);
    ctx->save_for_backward({x});
    return run_layer(*call->hooks, call->module, *call->layer, x, call->mask, *call->rng, call->training);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const auto* layer = reinterpret_cast<const Layer*>(ctx->saved_data["layer"].toInt());
    DropoutRng rng{ctx->saved_data["hidden_gen"].toGenerator(), ctx->saved_data["attention_gen"].toGenerator()};
    rng = rng.clone();  // leave the saved states untouched (a second backward reruns identically)
    at::Tensor mask = ctx->saved_data["mask"].isTensor() ? ctx->saved_data["mask"].toTensor() : at::Tensor();
    at::Tensor input = x.detach().requires_grad_(true);
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      const auto* hooks = reinterpret_cast<const ModuleHooks*>(ctx->saved_data["hooks"].toInt());
      out = run_layer(*hooks, static_cast<int32_t>(ctx->saved_data["module"].toInt()), *layer, input, mask, rng,
                      ctx->saved_data["training"].toBool());
    }
    torch::autograd::backward({out}, {grad[0]});
    return {input.grad(), at::Tensor()};
  }
};

// 0 selects the documented default; a negative size is a mistake, not a request for it.
int64_t opt_or(const Options& o, const char* name, int64_t fallback) {
  const int64_t v = o.get_int(name);
  if (v < 0)
    throw Error(std::string("gpt: option '") + name + "' must be >= 0 (0 = default), got " + std::to_string(v));
  return v > 0 ? v : fallback;
}

class GPTModel : public Model {
 public:
  explicit GPTModel(const BuildContext& ctx)
      : tp_{ctx.tp_rank, std::max(1, ctx.tp_size)}, pre_(ctx.pre_process), post_(ctx.post_process) {
    const Options& o = ctx.options;
    c_.num_layers = o.get_int("num_layers");
    c_.hidden = o.get_int("hidden_size");
    c_.heads = o.get_int("num_attention_heads");
    c_.ffn = opt_or(o, "ffn_hidden_size", 4 * c_.hidden);
    c_.seq = opt_or(o, "seq_length", ctx.seq_length);
    c_.max_pos = opt_or(o, "max_position_embeddings", c_.seq);
    c_.vocab = o.get_int("vocab_size");
    c_.divisible_by = o.get_int("make_vocab_size_divisible_by");
    c_.hidden_dropout = o.get_float("hidden_dropout");
    c_.attention_dropout = o.get_float("attention_dropout");
    c_.init_std = o.get_float("init_method_std");
    c_.eps = o.get_float("layernorm_epsilon");
    c_.untie = o.get_bool("untie_embeddings_and_output_weights");
    c_.openai_gelu = o.get_bool("openai_gelu");
    c_.recompute = o.get_string("recompute_activations") == "full";
    c_.selective_recompute = o.get_string("recompute_activations") == "selective";
    c_.domino_chunks = o.get_int("domino_chunks");
    c_.fused_lm_head = o.get_bool("fused_lm_head");
    c_.lm_head_chunk_tokens = o.get_int("lm_head_chunk_tokens");
    validate(ctx);
    c_.padded_vocab = padded_vocab_size(c_.vocab, c_.divisible_by, tp_.size);

    // Layers of this pipeline stage: num_layers / pp_size consecutive layers.
    const int64_t pp_size = std::max(1, ctx.pp_size);
    const int64_t local_layers = c_.num_layers / pp_size;
    const int64_t offset = static_cast<int64_t>(ctx.pp_rank) * local_layers;

    // Initialization: every master weight comes from a CPU generator seeded by the run seed and
    // the weight's place in the full model, so all TP ranks (and any pipeline split) agree.
    ParamFactory f;
    f.dtype = ctx.params_dtype;
    f.device = ctx.device;
    auto seeded = [&](uint64_t salt) {
      f.gen = seeded_generator(ctx.seed * 1000003ULL + salt);
      return &f;
    };
    const bool need_word = pre_ || (post_ && !c_.untie);
    if (need_word) word_ = VocabParallelEmbedding(c_.padded_vocab, c_.hidden, c_.init_std, tp_, *seeded(1));
    if (pre_) position_ = f.param(seeded(2)->normal({c_.max_pos, c_.hidden}, c_.init_std));
    for (int64_t i = 0; i < local_layers; ++i)
      layers_.push_back(std::make_unique<Layer>(c_, tp_, *seeded(100 + offset + i)));
    if (post_) {
      final_ln_w_ = f.ones({c_.hidden});
      final_ln_b_ = f.zeros({c_.hidden});
      if (c_.untie) {
        ColumnParallelLinear out(c_.hidden, c_.padded_vocab, false, c_.init_std, tp_, *seeded(3));
        output_ = out.weight;
      }
    }
    domino_.model = "gpt";
    domino_.chunks = c_.domino_chunks;
    domino_.hidden = c_.hidden;
    domino_.recompute = c_.recompute;
    for (const auto& l : layers_) domino_.layers.push_back(l.get());
    domino_.hooks = &hooks_;
    domino_.module_of = [this](size_t i) { return layer_module(i); };
    if (pre_) {
      embedding_.word_partial = [this](const at::Tensor& ids) { return word_.partial(ids); };
      embedding_.position = [this](const at::Tensor& pos) { return at::embedding(position_, pos); };
      embedding_.anchor = [this]() -> const at::Tensor& { return position_; };
      embedding_.dropout = c_.hidden_dropout;
      embedding_.module = embedding_module();
      domino_.embedding = &embedding_;
    }
    if (post_) {
      head_.norm = [this](const at::Tensor& x) { return layer_norm(x, final_ln_w_, final_ln_b_, c_.eps); };
      head_.weight = [this]() -> const at::Tensor& { return c_.untie ? output_ : word_.weight; };
      head_.tp = tp_;
      head_.module = output_module();
      domino_.head = &head_;
    }
    // CPU generators on every device: they only seed the masks (dropout.hpp).
    rng_ = DropoutRng::from_host();
  }

  // Checkpoint state: the parameters (Model's default: each once, tied embedding once) plus the
  // two dropout generators' states ("rng.hidden", "rng.attention": uint8 tensors from
  // at::Generator::get_state), so that a resumed run draws the same dropout masks as an
  // uninterrupted one. They are part of the state: a strict load of a checkpoint without them
  // fails naming the missing entry.
  TensorList state_save() override {
    TensorList out = Model::state_save();
    rng_.save(out);
    return out;
  }

  void state_load(const TensorList& state, bool strict) override {
    // Checks names and shapes of everything, the generator states included, and copies the
    // parameters (the copies into the freshly taken generator states are discarded).
    Model::state_load(state, strict);
    rng_.load(state);  // a non-strict load without them keeps the current streams
  }

  TensorList forward(const TensorList& inputs) override {
    if (find(inputs, "kv_cache_length")) return forward_cached(inputs);
    at::Tensor h;
    DominoInputs domino_in;  // Domino runs the embedding itself (dtk/layers/domino.hpp DominoEmbedding)
    const bool domino = c_.domino_chunks > 1;
    const at::Tensor* mask_p = find(inputs, "attention_mask");
    // Megatron's convention: bool, true = masked. A float "1 = may attend" mask would silently
    // flip meaning if converted, so anything but bool is refused.
    if (mask_p && mask_p->scalar_type() != at::kBool)
      throw Error("gpt: 'attention_mask' must be a bool tensor (true = masked, Megatron's convention), got " +
                  std::string(c10::toString(mask_p->scalar_type())));
    const at::Tensor mask = mask_p ? *mask_p : at::Tensor();
    if (pre_) {
      const at::Tensor& tokens = get(inputs, "tokens");
      if (tokens.dim() != 2) throw Error("gpt: 'tokens' must be [batch, seq], got " + shape_str(tokens));
      if (tokens.scalar_type() != at::kLong && tokens.scalar_type() != at::kInt)
        throw Error("gpt: 'tokens' must hold integer ids (int64 or int32)");
      if (tokens.size(1) > c_.max_pos)
        throw Error("gpt: sequence of " + std::to_string(tokens.size(1)) + " tokens exceeds max_position_embeddings " +
                    std::to_string(c_.max_pos));
      const at::Tensor* pos_p = find(inputs, "position_ids");
      at::Tensor pos = pos_p ? *pos_p : at::arange(tokens.size(1), tokens.options()).unsqueeze(0).expand_as(tokens);
      check_id_range("gpt", "tokens", tokens, c_.padded_vocab, "the padded vocabulary");
      check_id_range("gpt", "position_ids", pos, c_.max_pos, "max_position_embeddings");
      if (domino) {
        domino_in.tokens = tokens;
        domino_in.positions = pos;
      } else {
        h = hooks_.run(embedding_module(), tokens, [&](const at::Tensor& ids) {
          return dropout(word_.forward(ids) + at::embedding(position_, pos), c_.hidden_dropout, training_, rng_.hidden);
        });
      }
    } else {
      h = get(inputs, "hidden_states");
    }
    const at::Tensor& shape = h.defined() ? h : domino_in.tokens;  // [b, s, ...]
    if (mask.defined() && (mask.dim() != 4 || mask.size(1) != 1 || mask.size(2) != shape.size(1) ||
                           mask.size(3) != shape.size(1) || (mask.size(0) != 1 && mask.size(0) != shape.size(0))))
      throw Error("gpt: 'attention_mask' must be [batch or 1, 1, seq, seq], got " + shape_str(mask));

    const at::Tensor* labels = post_ ? find(inputs, "labels") : nullptr;
    // An id outside the vocabulary would be dropped by every rank's slice and scored silently.
    if (labels) check_id_range("gpt", "labels", *labels, c_.padded_vocab, "the padded vocabulary");
    if (domino) {
      // With labels the output layer joins the chunked schedule (dtk/layers/domino.hpp DominoHead).
      domino_in.hidden = h;
      domino_in.mask = mask;
      if (labels) domino_in.labels = labels->to(at::kLong);
      h = domino_forward(domino_, domino_in, rng_, training_);
      if (labels) return {{"loss", h}};
    } else {
      h = plain_layers(h, mask);
    }
    if (!post_) return {{"hidden_states", h}};

    at::Tensor out = hooks_.run(output_module(), h, [&](const at::Tensor& x) {
      const at::Tensor normed = layer_norm(x, final_ln_w_, final_ln_b_, c_.eps);
      const at::Tensor& weight = c_.untie ? output_ : word_.weight;
      // With labels the logits are never made whole (lm_head.hpp); without, they are the output.
      if (labels && c_.fused_lm_head)
        return fused_lm_head_loss(copy_to_tp_region(normed, tp_), weight, *labels, tp_, c_.lm_head_chunk_tokens);
      at::Tensor logits = parallel_lm_logits(normed, weight, tp_, /*async_grad=*/c_.domino_chunks > 1);
      return labels ? vocab_parallel_cross_entropy(logits, *labels, tp_) : logits;
    });
    return {{labels ? "loss" : "logits", out}};
  }

  // Generation with a key/value cache (docs/models.md "Generation"): inputs "tokens" [b, n] at
  // cache positions [L, L + n), "position_ids" [b, n], "attention_mask" [b, 1, n, L + n] (bool,
  // true = masked), "kv_cache_length" L (int64 scalar), and either the caches "kv_cache.<layer>"
  // [2, b, heads / tp, capacity, head_dim] a previous call returned, or (L = 0) "kv_cache_capacity"
  // to allocate them. Outputs "logits" [b, 1, vocab / tp] of the last position (this rank's
  // vocabulary slice, as forward's) and the caches, filled up to L + n.
  TensorList forward_cached(const TensorList& inputs) {
    if (!pre_ || !post_) throw Error("gpt: generation needs the whole model on this rank (no pipeline stages)");
    at::NoGradGuard no_grad;
    const at::Tensor& tokens = get(inputs, "tokens");
    const at::Tensor& pos = get(inputs, "position_ids");
    const at::Tensor& mask = get(inputs, "attention_mask");
    const int64_t length = get(inputs, "kv_cache_length").item<int64_t>();
    if (tokens.dim() != 2 || pos.sizes() != tokens.sizes())
      throw Error("gpt: generation needs 'tokens' and 'position_ids' of one shape [batch, n], got " +
                  shape_str(tokens) + " and " + shape_str(pos));
    const int64_t b = tokens.size(0), n = tokens.size(1);
    if (mask.scalar_type() != at::kBool || mask.dim() != 4 || mask.size(0) != b || mask.size(2) != n ||
        mask.size(3) != length + n)
      throw Error("gpt: generation's 'attention_mask' must be bool [batch, 1, n, kv_cache_length + n], got " +
                  shape_str(mask));
    check_id_range("gpt", "tokens", tokens, c_.padded_vocab, "the padded vocabulary");
    check_id_range("gpt", "position_ids", pos, c_.max_pos, "max_position_embeddings");
    std::vector<at::Tensor> caches;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const at::Tensor* given = find(inputs, "kv_cache." + std::to_string(i));
      if (given) {
        caches.push_back(*given);
        continue;
      }
      const at::Tensor* capacity = find(inputs, "kv_cache_capacity");
      if (!capacity || length != 0)
        throw Error("gpt: generation needs 'kv_cache." + std::to_string(i) +
                    "' (from the previous call) or, on the first call, 'kv_cache_capacity'");
      const Layer& l = *layers_[i];
      caches.push_back(at::zeros({2, b, l.heads_local(), capacity->item<int64_t>(), l.head_dim()},
                                 word_.weight.options()));
    }
    if (length + n > caches[0].size(3))
      throw Error("gpt: generation ran past the key/value cache's capacity of " + std::to_string(caches[0].size(3)) +
                  " positions");
    at::Tensor h = word_.forward(tokens) + at::embedding(position_, pos);
    for (size_t i = 0; i < layers_.size(); ++i) h = layers_[i]->forward_cached(h, caches[i], length, mask);
    const at::Tensor last = layer_norm(h.narrow(1, n - 1, 1), final_ln_w_, final_ln_b_, c_.eps);
    TensorList out{{"logits", at::linear(last, c_.untie ? output_ : word_.weight)}};
    for (size_t i = 0; i < caches.size(); ++i) out.emplace_back("kv_cache." + std::to_string(i), caches[i]);
    return out;
  }

  // Plain tensor parallelism: layer after layer on the whole micro-batch.
  at::Tensor plain_layers(at::Tensor h, const at::Tensor& mask) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = *layers_[i];
      const int32_t module = layer_module(i);
      if (c_.recompute && at::GradMode::is_enabled()) {
        if (!h.requires_grad()) h = h.detach().requires_grad_(true);
        LayerCall call{&layer, mask, &rng_, training_, &hooks_, module};
        h = CheckpointedLayer::apply(h, &call);
      } else {
        h = run_layer(hooks_, module, layer, h, mask, rng_, training_);
      }
    }
    return h;
  }

  // Modules in forward order: [embedding,] layers..., [output layer].
  int32_t embedding_module() const { return 0; }
  int32_t layer_module(size_t i) const { return static_cast<int32_t>(i) + (pre_ ? 1 : 0); }
  int32_t output_module() const { return layer_module(layers_.size()); }

  std::vector<Module> modules() override {
    std::vector<Module> out;
    auto add = [&](int32_t index, const std::string& name) {
      Module m;
      m.index = index;
      m.name = name;
      out.push_back(std::move(m));
    };
    if (pre_) add(embedding_module(), "language_model.embedding");
    for (size_t i = 0; i < layers_.size(); ++i)
      add(layer_module(i), "language_model.encoder.layers." + std::to_string(i));
    if (post_) add(output_module(), "language_model.output_layer");
    for (const Param& p : parameters()) out[static_cast<size_t>(p.info.module_index)].params.push_back(p.name);
    // The tied output layer reads the word embedding owned by the embedding module.
    if (pre_ && post_ && !c_.untie) out.back().params.push_back("language_model.embedding.word_embeddings.weight");
    return out;
  }

  void set_module_hooks(const dtk_module_hooks* hooks) override { hooks_.set(hooks); }

  std::vector<Param> parameters() override {
    std::vector<Param> out;
    int32_t module = 0;
    auto add = [&](const std::string& name, const at::Tensor& t, int partition_dim, bool no_wd, bool shared) {
      Param p;
      p.name = name;
      p.tensor = t;
      p.info.tensor_parallel = partition_dim >= 0 ? 1 : 0;
      p.info.partition_dim = partition_dim;
      p.info.no_weight_decay = no_wd ? 1 : 0;
      p.info.shared = shared ? 1 : 0;
      p.info.module_index = module;
      out.push_back(std::move(p));
    };
    const bool tied = !c_.untie;
    if (pre_) {
      module = embedding_module();
      // Tied: read by the output layer too, here or (pipeline) on the last stage, whose copy follows.
      add("language_model.embedding.word_embeddings.weight", word_.weight, 0, false, tied);
      add("language_model.embedding.position_embeddings.weight", position_, -1, false, false);
    } else if (post_ && tied) {
      // Megatron's copy of the embedding on the last stage (kept in sync by the embedding group).
      module = output_module();
      add("word_embeddings_for_head.weight", word_.weight, 0, false, true);
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const size_t first = out.size();
      layers_[i]->add_params(out, "language_model.encoder.layers." + std::to_string(i) + ".");
      for (size_t k = first; k < out.size(); ++k) out[k].info.module_index = layer_module(i);
    }
    if (post_) {
      module = output_module();
      add("language_model.encoder.final_layernorm.weight", final_ln_w_, -1, true, false);
      add("language_model.encoder.final_layernorm.bias", final_ln_b_, -1, true, false);
      if (c_.untie) add("language_model.output_layer.weight", output_, 0, false, false);
    }
    return out;
  }

  void set_training(bool training) override { training_ = training; }

  dtk_model_info info() override {
    dtk_model_info i{};
    i.struct_size = dtk_model_info_STRUCT_SIZE;
    i.num_layers = c_.num_layers;
    i.hidden_size = c_.hidden;
    i.num_attention_heads = c_.heads;
    i.ffn_hidden_size = c_.ffn;
    i.seq_length = c_.seq;
    i.vocab_size = c_.padded_vocab;
    i.recompute = c_.recompute ? 1 : 0;
    i.tied_embeddings = c_.untie ? 0 : 1;
    return i;
  }

 private:
  void validate(const BuildContext& ctx) const {
    auto positive = [](const char* name, int64_t v) {
      if (v <= 0)
        throw Error(std::string("gpt: option '") + name + "' must be positive (got " + std::to_string(v) + ")");
    };
    positive("num_layers", c_.num_layers);
    positive("hidden_size", c_.hidden);
    positive("num_attention_heads", c_.heads);
    positive("seq_length (option or train.seq_length)", c_.seq);
    positive("vocab_size", c_.vocab);
    positive("make_vocab_size_divisible_by", c_.divisible_by);
    if (c_.hidden % c_.heads != 0)
      throw Error("gpt: hidden_size " + std::to_string(c_.hidden) + " is not divisible by num_attention_heads " +
                  std::to_string(c_.heads));
    if (c_.heads % tp_.size != 0 || c_.ffn % tp_.size != 0)
      throw Error("gpt: num_attention_heads and ffn_hidden_size must be divisible by the tensor-parallel size " +
                  std::to_string(tp_.size));
    if (c_.max_pos < c_.seq)
      throw Error("gpt: max_position_embeddings " + std::to_string(c_.max_pos) + " < seq_length " +
                  std::to_string(c_.seq));
    const int64_t pp = std::max(1, ctx.pp_size);
    if (c_.num_layers % pp != 0)
      throw Error("gpt: num_layers " + std::to_string(c_.num_layers) + " is not divisible by the pipeline stages " +
                  std::to_string(pp) +
                  " (pipeline_model_parallel_size, times virtual_pipeline_model_parallel_size "
                  "with the interleaved schedule)");
    for (double p : {c_.hidden_dropout, c_.attention_dropout})
      if (p < 0.0 || p >= 1.0) throw Error("gpt: dropout probabilities must be in [0, 1)");
    if (c_.init_std <= 0.0) throw Error("gpt: init_method_std must be positive");
    if (!(c_.eps > 0.0)) throw Error("gpt: option 'layernorm_epsilon' must be positive, got " + std::to_string(c_.eps));

    if (c_.lm_head_chunk_tokens < 0)
      throw Error("gpt: option 'lm_head_chunk_tokens' must be >= 0 (0 = automatic), got " +
                  std::to_string(c_.lm_head_chunk_tokens));
    if (c_.domino_chunks < 1)
      throw Error("gpt: option 'domino_chunks' must be >= 1 (1 = plain tensor parallelism), got " +
                  std::to_string(c_.domino_chunks));
    if (ctx.micro_batch_size > 0 && c_.domino_chunks > ctx.micro_batch_size)
      throw Error("gpt: domino_chunks (" + std::to_string(c_.domino_chunks) + ") exceeds the micro-batch size (" +
                  std::to_string(ctx.micro_batch_size) + "): each chunk needs at least one sequence");
    if (ctx.params_dtype != at::kFloat && ctx.params_dtype != at::kBFloat16 && ctx.params_dtype != at::kHalf)
      throw Error("gpt: parameters must be fp32, bf16 or fp16");
  }

  Config c_;
  TPGroup tp_;
  bool pre_, post_;
  bool training_ = true;
  VocabParallelEmbedding word_;
  at::Tensor position_;
  std::vector<std::unique_ptr<Layer>> layers_;
  at::Tensor final_ln_w_, final_ln_b_, output_;
  DropoutRng rng_;
  ModuleHooks hooks_;
  DominoStack domino_;
  DominoHead head_;
  DominoEmbedding embedding_;
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
    opt_bool("openai_gelu", "false",
             "GELU's tanh approximation (Megatron's --openai-gelu, GPT-2's and Hugging Face's gelu_new) instead of the "
             "exact erf GELU."),
    opt_bool("untie_embeddings_and_output_weights", "false",
             "Use a separate output layer instead of the word-embedding weight."),
    opt_enum("recompute_activations", "none", "none|selective|full",
             "full = recompute every layer's activations in backward (one layer per checkpoint); selective = keep no "
             "attention probabilities and form them again in backward (Megatron's recompute_granularity=selective; "
             "the CPU fp32 causal attention, dtk/layers/attention.hpp)."),
    opt_bool("fused_lm_head", "true",
             "Compute the output layer and its cross entropy chunk by chunk without the whole [tokens, vocabulary] "
             "logits (false: Megatron's logits, then vocab-parallel cross entropy)."),
    opt_int("lm_head_chunk_tokens", "0", "Tokens per chunk of the fused output layer; 0 = 512."),
    opt_int("domino_chunks", "1",
            "Domino: split each micro-batch into this many chunks whose tensor-parallel all-reduces "
            "overlap the other chunks' compute (DeepSpeed-Domino); 1 = plain tensor parallelism."),
};

}  // namespace
}  // namespace dtk::gpt

DTK_PLUGIN("gpt", DTK_KIND_MODEL, "1.0.0", "Megatron-LM GPT (pre-LN, learned positions, tensor-parallel ready)",
           DTK_TORCH_VERSION, dtk::model_api<dtk::gpt::GPTModel>(), dtk::gpt::kOptions)
