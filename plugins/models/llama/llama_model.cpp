// llama_model.cpp — the "llama" model plugin: Megatron-LM's GPTModel configured as Llama 2
// (DeepSpeed-Domino's pretrain_llama_7b.sh: --position-embedding-type rope --swiglu
// --normalization RMSNorm --disable-bias-linear, optionally --group-query-attention), built only
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
#include <dtk/layers/domino.hpp>
#include <dtk/layers/lm_head.hpp>
#include <dtk/layers/recompute.hpp>
#include <dtk/module_hooks.hpp>

#include <limits>
#include <memory>

#include "llama_layer.hpp"

namespace dtk::llama {
namespace {

class LlamaModel : public Model {
 public:
  explicit LlamaModel(const BuildContext& ctx)
      : tp_{ctx.tp_rank, std::max(1, ctx.tp_size)}, pre_(ctx.pre_process), post_(ctx.post_process) {
    const Options& o = ctx.options;
    c_.num_layers = o.get_int("num_layers");
    c_.hidden = o.get_int("hidden_size");
    c_.heads = o.get_int("num_attention_heads");
    c_.groups = o.get_int("num_query_groups");
    if (c_.groups == 0) c_.groups = c_.heads;
    c_.ffn = o.get_int("ffn_hidden_size");
    // Megatron's default with --swiglu: 2/3 of 4h, rounded down to a multiple of 64.
    if (c_.ffn == 0) c_.ffn = (4 * c_.hidden * 2 / 3) / 64 * 64;
    c_.seq = o.get_int("seq_length");
    if (c_.seq == 0) c_.seq = ctx.seq_length;
    c_.vocab = o.get_int("vocab_size");
    c_.divisible_by = o.get_int("make_vocab_size_divisible_by");
    c_.rotary_base = o.get_float("rotary_base");
    c_.rotary_percent = o.get_float("rotary_percent");
    c_.hidden_dropout = o.get_float("hidden_dropout");
    c_.attention_dropout = o.get_float("attention_dropout");
    c_.init_std = o.get_float("init_method_std");
    c_.eps = o.get_float("layernorm_epsilon");
    c_.untie = o.get_bool("untie_embeddings_and_output_weights");
    c_.fused_lm_head = o.get_bool("fused_lm_head");
    c_.recompute = o.get_string("recompute_activations") == "full";
    c_.bias = o.get_bool("add_bias_linear");
    c_.lm_head_chunk_tokens = o.get_int("lm_head_chunk_tokens");
    c_.domino_chunks = o.get_int("domino_chunks");
    validate(ctx);
    c_.padded_vocab = padded_vocab_size(c_.vocab, c_.divisible_by, tp_.size);
    rotary_ = std::make_unique<Rotary>(c_.rotary_dim(), c_.rotary_base);

    // This pipeline stage's layers; every master weight drawn on the CPU from a generator seeded
    // by the run seed and the weight's place in the whole model (all TP ranks and stages agree).
    const int64_t local_layers = c_.num_layers / std::max(1, ctx.pp_size);
    const int64_t offset = static_cast<int64_t>(ctx.pp_rank) * local_layers;
    ParamFactory f;
    f.dtype = ctx.params_dtype;
    f.device = ctx.device;
    auto seeded = [&](uint64_t salt) -> ParamFactory& {
      f.gen = seeded_generator(ctx.seed * 1000003ULL + salt);
      return f;
    };
    if (pre_ || (post_ && !c_.untie)) word_ = VocabParallelEmbedding(c_.padded_vocab, c_.hidden, c_.init_std, tp_, seeded(1));
    for (int64_t i = 0; i < local_layers; ++i)
      layers_.push_back(std::make_unique<Layer>(c_, tp_, seeded(100 + offset + i), *rotary_));
    if (post_) {
      final_norm_ = f.ones({c_.hidden});
      if (c_.untie) output_ = ColumnParallelLinear(c_.hidden, c_.padded_vocab, false, c_.init_std, tp_, seeded(3)).weight;
    }
    rng_ = DropoutRng::from_host();
    init_domino();
  }

  TensorList state_save() override {
    TensorList out = Model::state_save();
    rng_.save(out);
    return out;
  }

  void state_load(const TensorList& state, bool strict) override {
    Model::state_load(state, strict);  // names and shapes of everything, the generator states too
    rng_.load(state);
  }

  TensorList forward(const TensorList& inputs) override {
    if (find(inputs, "kv_cache_length")) return forward_cached(inputs);
    const at::Tensor* mask_p = find(inputs, "attention_mask");
    if (mask_p && mask_p->scalar_type() != at::kBool)
      throw Error("llama: 'attention_mask' must be a bool tensor (true = masked, Megatron's convention), got " +
                  std::string(c10::toString(mask_p->scalar_type())));
    const at::Tensor mask = mask_p ? *mask_p : at::Tensor();
    const bool domino = c_.domino_chunks > 1;
    at::Tensor h, tokens;  // Domino runs the embedding itself (DominoEmbedding)
    if (pre_) {
      tokens = get(inputs, "tokens");
      if (tokens.dim() != 2) throw Error("llama: 'tokens' must be [batch, seq], got " + shape_str(tokens));
      if (tokens.scalar_type() != at::kLong && tokens.scalar_type() != at::kInt)
        throw Error("llama: 'tokens' must hold integer ids (int64 or int32)");
      check_id_range("llama", "tokens", tokens, c_.padded_vocab, "the padded vocabulary");
      if (!domino)
        h = hooks_.run(embedding_module(), tokens, [&](const at::Tensor& ids) {
          return dropout(word_.forward(ids), c_.hidden_dropout, training_, rng_.hidden);
        });
    } else {
      h = get(inputs, "hidden_states");
      if (h.dim() != 3) throw Error("llama: 'hidden_states' must be [batch, seq, hidden], got " + shape_str(h));
    }
    const int64_t b = pre_ ? tokens.size(0) : h.size(0), s = pre_ ? tokens.size(1) : h.size(1);
    const at::Tensor positions =
        position_ids(inputs, b, s).to(pre_ ? tokens.device() : h.device());  // once, not per layer
    if (mask.defined() && (mask.dim() != 4 || mask.size(1) != 1 || mask.size(2) != s || mask.size(3) != s ||
                           (mask.size(0) != 1 && mask.size(0) != b)))
      throw Error("llama: 'attention_mask' must be [batch or 1, 1, seq, seq], got " + shape_str(mask));
    const at::Tensor* labels = post_ ? find(inputs, "labels") : nullptr;
    if (labels) check_id_range("llama", "labels", *labels, c_.padded_vocab, "the padded vocabulary");

    if (domino) {
      // With labels the output layer joins the chunked schedule (DominoHead) and the result is
      // the per-token loss.
      DominoInputs in;
      in.hidden = h;
      in.tokens = pre_ ? tokens : at::Tensor();
      in.positions = positions;
      in.mask = mask;
      if (labels) in.labels = labels->to(at::kLong);
      h = domino_forward(domino_, in, rng_, training_);
      if (labels) return {{"loss", h}};
      if (!post_) return {{"hidden_states", h}};
      return {{"logits", hooks_.run(output_module(), h, [&](const at::Tensor& x) {
                 return parallel_lm_logits(rms_norm(x, final_norm_, c_.eps), c_.untie ? output_ : word_.weight, tp_,
                                           /*async_grad=*/true);
               })}};
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      // The hooks run inside the recomputed block, so a ZeRO-3 strategy gathers the layer's
      // parameters again for the rerun in backward.
      const Layer* layer = layers_[i].get();
      const ModuleHooks* hooks = &hooks_;
      const int32_t module = layer_module(i);
      const bool training = training_;
      RecomputedBlock block = [layer, hooks, module, positions, mask, training](const at::Tensor& x, DropoutRng& rng) {
        return hooks->run(module, x, [&](const at::Tensor& in) { return layer->forward(in, positions, mask, rng, training); });
      };
      h = c_.recompute ? recompute(h, rng_, std::move(block)) : block(h, rng_);
    }
    if (!post_) return {{"hidden_states", h}};

    at::Tensor out = hooks_.run(output_module(), h, [&](const at::Tensor& x) {
      const at::Tensor normed = rms_norm(x, final_norm_, c_.eps);
      const at::Tensor& weight = c_.untie ? output_ : word_.weight;
      if (labels && c_.fused_lm_head)
        return fused_lm_head_loss(copy_to_tp_region(normed, tp_), weight, *labels, tp_, c_.lm_head_chunk_tokens);
      at::Tensor logits = parallel_lm_logits(normed, weight, tp_);
      return labels ? vocab_parallel_cross_entropy(logits, *labels, tp_) : logits;
    });
    return {{labels ? "loss" : "logits", out}};
  }

  // Generation with a key/value cache, the protocol of docs/models.md "Generation" (the gpt
  // plugin's): "tokens"/"position_ids" [b, n] at cache positions [L, L + n), "attention_mask"
  // [b, 1, n, L + n], "kv_cache_length" L, and the caches "kv_cache.<layer>" [2, b, groups / tp,
  // capacity, head_dim] (keys stored rotated) or, on the first call, "kv_cache_capacity".
  TensorList forward_cached(const TensorList& inputs) {
    if (!pre_ || !post_) throw Error("llama: generation needs the whole model on this rank (no pipeline stages)");
    at::NoGradGuard no_grad;
    const at::Tensor& tokens = get(inputs, "tokens");
    const at::Tensor& pos = get(inputs, "position_ids");
    const at::Tensor& mask = get(inputs, "attention_mask");
    const int64_t length = get(inputs, "kv_cache_length").item<int64_t>();
    if (tokens.dim() != 2 || pos.sizes() != tokens.sizes())
      throw Error("llama: generation needs 'tokens' and 'position_ids' of one shape [batch, n], got " +
                  shape_str(tokens) + " and " + shape_str(pos));
    const int64_t b = tokens.size(0), n = tokens.size(1);
    if (mask.scalar_type() != at::kBool || mask.dim() != 4 || mask.size(0) != b || mask.size(2) != n ||
        mask.size(3) != length + n)
      throw Error("llama: generation's 'attention_mask' must be bool [batch, 1, n, kv_cache_length + n], got " +
                  shape_str(mask));
    check_id_range("llama", "tokens", tokens, c_.padded_vocab, "the padded vocabulary");
    check_id_range("llama", "position_ids", pos, std::numeric_limits<int64_t>::max(), "non-negative positions");
    std::vector<at::Tensor> caches;
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (const at::Tensor* given = find(inputs, "kv_cache." + std::to_string(i))) {
        caches.push_back(*given);
        continue;
      }
      const at::Tensor* capacity = find(inputs, "kv_cache_capacity");
      if (!capacity || length != 0)
        throw Error("llama: generation needs 'kv_cache." + std::to_string(i) +
                    "' (from the previous call) or, on the first call, 'kv_cache_capacity'");
      caches.push_back(at::zeros({2, b, layers_[i]->groups_local(), capacity->item<int64_t>(), c_.head_dim()},
                                 word_.weight.options()));
    }
    if (length + n > caches[0].size(3))
      throw Error("llama: generation ran past the key/value cache's capacity of " + std::to_string(caches[0].size(3)) +
                  " positions");
    at::Tensor h = word_.forward(tokens);
    for (size_t i = 0; i < layers_.size(); ++i) h = layers_[i]->forward_cached(h, pos, caches[i], length, mask);
    const at::Tensor last = rms_norm(h.narrow(1, n - 1, 1), final_norm_, c_.eps);
    TensorList out{{"logits", at::linear(last, c_.untie ? output_ : word_.weight)}};
    for (size_t i = 0; i < caches.size(); ++i) out.emplace_back("kv_cache." + std::to_string(i), caches[i]);
    return out;
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
    for (size_t i = 0; i < layers_.size(); ++i) add(layer_module(i), "language_model.encoder.layers." + std::to_string(i));
    if (post_) add(output_module(), "language_model.output_layer");
    for (const Param& p : parameters()) out[static_cast<size_t>(p.info.module_index)].params.push_back(p.name);
    // A tied output layer reads the word embedding owned by the embedding module.
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
    } else if (post_ && tied) {
      module = output_module();  // Megatron's copy of the embedding on the last stage
      add("word_embeddings_for_head.weight", word_.weight, 0, false, true);
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
      const size_t first = out.size();
      layers_[i]->add_params(out, "language_model.encoder.layers." + std::to_string(i) + ".");
      for (size_t k = first; k < out.size(); ++k) out[k].info.module_index = layer_module(i);
    }
    if (post_) {
      module = output_module();
      add("language_model.encoder.final_norm.weight", final_norm_, -1, true, false);
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
    i.tied_embeddings = c_.untie ? 0 : 1;
    i.recompute = c_.recompute ? 1 : 0;
    return i;
  }

 private:
  // The Domino schedule's view of this model (dtk/layers/domino.hpp).
  void init_domino() {
    domino_.model = "llama";
    domino_.chunks = c_.domino_chunks;
    domino_.hidden = c_.hidden;
    domino_.recompute = c_.recompute;
    for (const auto& l : layers_) domino_.layers.push_back(l.get());
    domino_.hooks = &hooks_;
    domino_.module_of = [this](size_t i) { return layer_module(i); };
    if (pre_) {
      embedding_.word_partial = [this](const at::Tensor& ids) { return word_.partial(ids); };
      embedding_.anchor = [this]() -> const at::Tensor& { return word_.weight; };
      embedding_.dropout = c_.hidden_dropout;
      embedding_.module = embedding_module();
      domino_.embedding = &embedding_;
    }
    if (post_) {
      head_.norm = [this](const at::Tensor& x) { return rms_norm(x, final_norm_, c_.eps); };
      head_.weight = [this]() -> const at::Tensor& { return c_.untie ? output_ : word_.weight; };
      head_.tp = tp_;
      head_.module = output_module();
      domino_.head = &head_;
    }
  }

  // The step's position_ids, or 0..s-1 for every sequence.
  static at::Tensor position_ids(const TensorList& inputs, int64_t b, int64_t s) {
    if (const at::Tensor* p = find(inputs, "position_ids")) {
      if (p->dim() != 2 || p->size(0) != b || p->size(1) != s)
        throw Error("llama: 'position_ids' must be [batch, seq] = [" + std::to_string(b) + ", " + std::to_string(s) +
                    "], got " + shape_str(*p));
      check_id_range("llama", "position_ids", *p, std::numeric_limits<int64_t>::max(), "non-negative positions");
      return p->to(at::kLong);
    }
    return at::arange(s, at::TensorOptions().dtype(at::kLong)).unsqueeze(0).expand({b, s});
  }

  void validate(const BuildContext& ctx) const {
    auto positive = [](const char* name, int64_t v) {
      if (v <= 0) throw Error(std::string("llama: option '") + name + "' must be positive, got " + std::to_string(v));
    };
    positive("num_layers", c_.num_layers);
    positive("hidden_size", c_.hidden);
    positive("num_attention_heads", c_.heads);
    positive("num_query_groups", c_.groups);
    positive("ffn_hidden_size", c_.ffn);
    positive("seq_length (option or train.seq_length)", c_.seq);
    positive("vocab_size", c_.vocab);
    positive("make_vocab_size_divisible_by", c_.divisible_by);
    auto divisible = [](const char* what, int64_t n, const char* by, int64_t d) {
      if (n % d != 0)
        throw Error(std::string("llama: ") + what + " " + std::to_string(n) + " is not divisible by " + by + " " +
                    std::to_string(d));
    };
    divisible("hidden_size", c_.hidden, "num_attention_heads", c_.heads);
    divisible("num_attention_heads", c_.heads, "num_query_groups", c_.groups);
    divisible("num_query_groups", c_.groups, "the tensor-parallel size", tp_.size);
    divisible("ffn_hidden_size", c_.ffn, "the tensor-parallel size", tp_.size);
    // Pipeline stages: pipeline_model_parallel_size, times virtual_pipeline_model_parallel_size
    // with the interleaved schedule.
    divisible("num_layers", c_.num_layers, "the pipeline stages", std::max(1, ctx.pp_size));
    if (!(c_.rotary_percent > 0.0 && c_.rotary_percent <= 1.0))
      throw Error("llama: option 'rotary_percent' must be in (0, 1], got " + std::to_string(c_.rotary_percent));
    if (c_.rotary_dim() % 2 != 0)
      throw Error("llama: rotary_percent x head dim (" + std::to_string(c_.head_dim()) + ") = " +
                  std::to_string(c_.rotary_dim()) + " channels must be even (they rotate in pairs)");
    if (!(c_.rotary_base > 0.0)) throw Error("llama: option 'rotary_base' must be positive");
    for (double p : {c_.hidden_dropout, c_.attention_dropout})
      if (p < 0.0 || p >= 1.0) throw Error("llama: dropout probabilities must be in [0, 1)");
    if (!(c_.init_std > 0.0)) throw Error("llama: option 'init_method_std' must be positive");
    if (!(c_.eps > 0.0)) throw Error("llama: option 'layernorm_epsilon' must be positive");
    if (c_.lm_head_chunk_tokens < 0)
      throw Error("llama: option 'lm_head_chunk_tokens' must be >= 0 (0 = 512), got " +
                  std::to_string(c_.lm_head_chunk_tokens));
    if (c_.domino_chunks < 1)
      throw Error("llama: option 'domino_chunks' must be >= 1 (1 = plain tensor parallelism), got " +
                  std::to_string(c_.domino_chunks));
    if (ctx.micro_batch_size > 0 && c_.domino_chunks > ctx.micro_batch_size)
      throw Error("llama: domino_chunks (" + std::to_string(c_.domino_chunks) + ") exceeds the micro-batch size (" +
                  std::to_string(ctx.micro_batch_size) + "): each chunk needs at least one sequence");
    if (ctx.params_dtype != at::kFloat && ctx.params_dtype != at::kBFloat16 && ctx.params_dtype != at::kHalf)
      throw Error("llama: parameters must be fp32, bf16 or fp16");
  }

  Config c_;
  TPGroup tp_;
  bool pre_, post_;
  bool training_ = true;
  std::unique_ptr<Rotary> rotary_;
  VocabParallelEmbedding word_;
  std::vector<std::unique_ptr<Layer>> layers_;
  at::Tensor final_norm_, output_;
  DropoutRng rng_;
  ModuleHooks hooks_;
  DominoStack domino_;
  DominoHead head_;
  DominoEmbedding embedding_;
};

const dtk_option_spec kOptions[] = {
    opt_int("num_layers", "32", "Number of transformer layers (whole model, all pipeline stages)."),
    opt_int("hidden_size", "4096", "Transformer hidden size."),
    opt_int("num_attention_heads", "32", "Number of query heads."),
    opt_int("num_query_groups", "0",
            "Key/value heads for grouped-query attention (Megatron's --num-query-groups); 0 = num_attention_heads "
            "(plain multi-head attention)."),
    opt_int("ffn_hidden_size", "0", "SwiGLU inner size; 0 = Megatron's default, 2/3 x 4 x hidden_size rounded down to 64."),
    opt_int("seq_length", "0", "Training sequence length; 0 = the run's train.seq_length."),
    opt_int("vocab_size", "32000", "Vocabulary size before padding (Llama's tokenizer: 32000; GPT-2 BPE: 50257)."),
    opt_int("make_vocab_size_divisible_by", "128",
            "Pad the vocabulary to a multiple of this x tensor-parallel size (Megatron)."),
    opt_float("rotary_base", "10000", "Base of the rotary embedding's frequencies (Megatron's --rotary-base)."),
    opt_float("rotary_percent", "1.0", "Fraction of each head's channels that rotate (Megatron's --rotary-percent)."),
    opt_float("hidden_dropout", "0.0", "Dropout on the embedding and on each residual branch."),
    opt_float("attention_dropout", "0.0", "Dropout on the attention probabilities."),
    opt_float("init_method_std", "0.02", "Std of the normal init; output projections use std / sqrt(2 x num_layers)."),
    opt_float("layernorm_epsilon", "1e-5", "RMSNorm epsilon (Megatron's --layernorm-epsilon / --norm-epsilon)."),
    opt_bool("untie_embeddings_and_output_weights", "true",
             "A separate output layer (Llama's); false reads the word-embedding weight."),
    opt_bool("add_bias_linear", "false",
             "Biases on the attention and MLP projections (Megatron's default GPT layers; Llama has none, Megatron's "
             "--disable-bias-linear)."),
    opt_bool("fused_lm_head", "true",
             "Compute the output layer and its cross entropy chunk by chunk without the whole [tokens, vocabulary] "
             "logits (false: the logits, then vocab-parallel cross entropy)."),
    opt_int("lm_head_chunk_tokens", "0", "Tokens per chunk of the fused output layer; 0 = 512."),
    opt_enum("recompute_activations", "none", "none|full",
             "full = recompute every layer's activations in backward (one layer per checkpoint; Megatron's "
             "--recompute-granularity full)."),
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
