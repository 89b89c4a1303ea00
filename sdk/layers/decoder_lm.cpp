// decoder_lm.cpp — see dtk/layers/decoder_lm.hpp. Megatron-LM: megatron/model/gpt_model.py,
// language_model.py (Embedding, the tied word_embeddings_for_head), transformer.py (the stack).
#include <dtk/layers/decoder_lm.hpp>

#include <dtk/layers/lm_head.hpp>
#include <dtk/layers/recompute.hpp>
#include <dtk/pipeline_split.hpp>
#include <dtk/recompute_modules.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <stdexcept>
#include <unordered_map>
#include <utility>

namespace dtk::layers {

namespace {

// A number in a message as the user typed it ("1.5", not std::to_string's "1.500000").
std::string shown(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Domino's chunked schedule, or the plain one: a stage without layers (an uneven pipeline split)
// has nothing to overlap its output layer's or embedding's communication with.
bool runs_domino(const DecoderConfig& c, size_t stage_layers) { return c.domino_chunks > 1 && stage_layers > 0; }

// Megatron's --window-size "W,R" (its tuple_type: spaces, parentheses and quotes allowed) as W, the
// keys before a token its window holds; -1 (Megatron's infinite window) or "" = none. A causal
// LM's window ends at its token: R must be 0 (or -1, which causal attention makes 0).
int64_t parse_window_size(const std::string& text) {
  std::string t;
  for (const char ch : text)
    if (!std::isspace(static_cast<unsigned char>(ch)) && ch != '"' && ch != '\'' && ch != '(' && ch != ')') t += ch;
  if (t.empty()) return -1;
  const size_t comma = t.find(',');
  const auto not_two = [&] { return std::invalid_argument("'" + text + "' is not two integers W,R such as 4095,0"); };
  auto integer = [&](const std::string& part) -> int64_t {
    if (part.empty() || part.size() > 10 || part.find_first_not_of("-0123456789") != std::string::npos ||
        part.find('-', 1) != std::string::npos || part == "-")
      throw not_two();
    return std::stoll(part);
  };
  if (comma == std::string::npos) throw not_two();
  const int64_t left = integer(t.substr(0, comma)), right = integer(t.substr(comma + 1));
  if (left < -1 || right < -1)
    throw std::invalid_argument("'" + text + "': a side of the window is -1 (unlimited) or at least 0");
  if (right > 0)
    throw std::invalid_argument("'" + text + "' would let each token see the " + std::to_string(right) +
                                " tokens after it; a causal LM's window ends at its token (W,0)");
  return left;
}

// recompute_modules: names separated by commas or spaces (Megatron's list), each once or more.
// Megatron's other modules are named as such: their sub-layers are not DTK's layers' to rerun.
void read_recompute_modules(const std::string& text, DecoderConfig& c) {
  c.selective_recompute = c.recompute_mlp = c.recompute_moe = false;
  std::string name;
  const auto take = [&] {
    if (name.empty()) return;
    const int32_t bit = recompute_module_bit(name);
    if (bit < 0) throw std::invalid_argument("unknown module '" + name + "' (core_attn, mlp or moe)");
    if (bit == 0)
      throw std::invalid_argument("'" + name + "' is a Megatron module DTK's layers do not recompute (they recompute " +
                                  recompute_module_list(true) + ")");
    c.selective_recompute |= bit == DTK_RECOMPUTE_CORE_ATTENTION;
    c.recompute_mlp |= bit == DTK_RECOMPUTE_MLP;
    c.recompute_moe |= bit == DTK_RECOMPUTE_MOE;
    name.clear();
  };
  for (const char ch : text) {
    if (ch == ',' || std::isspace(static_cast<unsigned char>(ch)))
      take();
    else
      name += ch;
  }
  take();
}

}  // namespace

bool DecoderConfig::windowed(int64_t index) const {
  if (window < 0) return false;
  if (!window_layers.flags.empty())
    return index >= 0 && index < static_cast<int64_t>(window_layers.flags.size()) && window_layers.flags[index];
  return window_layers.every <= 0 || (index + 1) % window_layers.every != 0;
}

void add_param(std::vector<Param>& out, const std::string& name, const at::Tensor& t, int partition_dim,
               bool no_weight_decay, bool shared, int32_t module) {
  Param p;
  p.name = name;
  p.tensor = t;
  p.info.tensor_parallel = partition_dim >= 0 ? 1 : 0;
  p.info.partition_dim = partition_dim;
  p.info.no_weight_decay = no_weight_decay ? 1 : 0;
  p.info.shared = shared ? 1 : 0;
  p.info.module_index = module;
  out.push_back(std::move(p));
}

at::Tensor DecoderLayer::forward_cached(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                        const at::Tensor&) const {
  throw Error("this model's layers do not implement generation with a key/value cache", DTK_ERR_UNSUPPORTED);
}

at::Tensor DecoderLayer::empty_kv_cache(int64_t, int64_t, const at::TensorOptions&) const {
  throw Error("this model's layers do not implement generation with a key/value cache", DTK_ERR_UNSUPPORTED);
}

DecoderLM::DecoderLM(const BuildContext& ctx, std::string name)
    : name_(std::move(name)),
      tp_{ctx.tp_rank, std::max(1, ctx.tp_size), ctx.sequence_parallel},
      pre_(ctx.pre_process),
      post_(ctx.post_process) {}

void DecoderLM::fail(const std::string& what) const { throw Error(name_ + ": " + what); }

void DecoderLM::divisible(const char* what, int64_t n, const char* by, int64_t d) const {
  if (n % d != 0)
    fail(std::string(what) + " " + std::to_string(n) + " is not divisible by " + by + " " + std::to_string(d));
}

int64_t DecoderLM::option_or(const Options& o, const char* name, int64_t fallback) const {
  const int64_t v = o.get_int(name);
  if (v < 0) fail(std::string("option '") + name + "' must be >= 0 (0 = default), got " + std::to_string(v));
  return v > 0 ? v : fallback;
}

at::Tensor DecoderConfig::norm_gain(const at::Tensor& w) const { return norm_1p ? w + 1 : w; }

void DecoderLM::read_options(const BuildContext& ctx, DecoderConfig& c) const {
  const Options& o = ctx.options;
  c.num_layers = o.get_int("num_layers");
  c.hidden = o.get_int("hidden_size");
  c.heads = o.get_int("num_attention_heads");
  c.vocab = o.get_int("vocab_size");
  c.seq = o.has("seq_length") ? option_or(o, "seq_length", ctx.seq_length) : ctx.seq_length;
  c.cp = ContextParallel{ctx.cp_rank, std::max(1, ctx.cp_size), ctx.cp_comm_type};
  // The rest only where the plugin declares the option; otherwise DecoderConfig's default.
  auto int_opt = [&](const char* name, int64_t& v) {
    if (o.has(name)) v = o.get_int(name);
  };
  auto float_opt = [&](const char* name, double& v) {
    if (o.has(name)) v = o.get_float(name);
  };
  auto bool_opt = [&](const char* name, bool& v) {
    if (o.has(name)) v = o.get_bool(name);
  };
  int_opt("make_vocab_size_divisible_by", c.divisible_by);
  int_opt("kv_channels", c.kv_channels);
  float_opt("hidden_dropout", c.hidden_dropout);
  float_opt("attention_dropout", c.attention_dropout);
  float_opt("init_method_std", c.init_std);
  float_opt("layernorm_epsilon", c.eps);
  bool_opt("apply_layernorm_1p", c.norm_1p);
  bool_opt("untie_embeddings_and_output_weights", c.untie);
  bool_opt("fused_lm_head", c.fused_lm_head);
  int_opt("lm_head_chunk_tokens", c.lm_head_chunk_tokens);
  if (o.has("cross_entropy_impl")) {
    const std::string impl = o.get_string("cross_entropy_impl");
    c.cross_entropy_impl = impl == "host"  ? CrossEntropyRows::kHost
                           : impl == "ops" ? CrossEntropyRows::kOps
                                           : CrossEntropyRows::kAuto;
  }
  if (o.has("unfused_kernels")) {
    try {
      c.kernels = unfused_kernels(o.get_string("unfused_kernels"));
    } catch (const std::invalid_argument& e) {
      fail(std::string("option 'unfused_kernels': ") + e.what());
    }
  }
  if (o.has("recompute_activations")) {
    c.recompute = o.get_string("recompute_activations") == "full";
    c.selective = o.get_string("recompute_activations") == "selective";
    // Without the option (a plugin that does not declare it) selective is core attention alone.
    c.selective_recompute = c.selective;
    if (c.selective && o.has("recompute_modules")) {
      try {
        read_recompute_modules(o.get_string("recompute_modules"), c);
      } catch (const std::invalid_argument& e) {
        fail(std::string("option 'recompute_modules': ") + e.what());
      }
    }
  }
  if (o.has("recompute_method")) c.recompute_block = o.get_string("recompute_method") == "block";
  int_opt("recompute_num_layers", c.recompute_num_layers);
  int_opt("domino_chunks", c.domino_chunks);
  int_opt("num_experts", c.moe.num_experts);
  c.moe.ep_rank = ctx.ep_rank, c.moe.ep_size = ctx.ep_size;
  c.moe.cp = c.cp;
  int_opt("moe_router_topk", c.moe.topk);
  int_opt("moe_ffn_hidden_size", c.moe.ffn);
  if (o.has("moe_layer_freq")) {
    try {
      parse_moe_layer_freq(o.get_string("moe_layer_freq"), c.moe);
    } catch (const std::invalid_argument& e) {
      fail(std::string("option 'moe_layer_freq': ") + e.what());
    }
  }
  if (o.has("moe_layer_num_experts")) {
    try {
      parse_moe_layer_num_experts(o.get_string("moe_layer_num_experts"), c.moe);
    } catch (const std::invalid_argument& e) {
      fail(std::string("option 'moe_layer_num_experts': ") + e.what());
    }
  }
  if (o.has("window_size")) {
    try {
      c.window = parse_window_size(o.get_string("window_size"));
    } catch (const std::invalid_argument& e) {
      fail(std::string("option 'window_size': ") + e.what());
    }
  }
  if (o.has("window_attn_skip_freq") && !o.get_string("window_attn_skip_freq").empty()) {
    if (c.window < 0) fail("option 'window_attn_skip_freq' acts only with window_size (a sliding window)");
    try {
      c.window_layers = parse_layer_pattern(o.get_string("window_attn_skip_freq"));
    } catch (const std::invalid_argument& e) {
      fail(std::string("option 'window_attn_skip_freq': ") + e.what());
    }
    if (c.window_layers.flags.empty() && c.window_layers.every < 1)
      fail("option 'window_attn_skip_freq' must be >= 1, got " + std::to_string(c.window_layers.every));
  }
  if (o.has("moe_router_score_function")) {
    const std::string score = o.get_string("moe_router_score_function");
    c.moe.score = score == "sigmoid"        ? MoeScore::kSigmoid
                  : score == "sqrtsoftplus" ? MoeScore::kSqrtSoftplus
                                            : MoeScore::kSoftmax;
  }
  bool_opt("moe_router_pre_softmax", c.moe.pre_softmax);
  int_opt("moe_router_num_groups", c.moe.num_groups);
  int_opt("moe_router_group_topk", c.moe.group_topk);
  bool_opt("moe_router_fp32", c.moe.router_fp32);
  float_opt("moe_router_topk_scaling_factor", c.moe.topk_scaling_factor);
  if (o.has("moe_router_load_balancing_type") || o.has("moe_aux_loss_coeff")) {
    const auto text = [&](const char* name, const char* fallback) {
      return o.has(name) ? o.get_string(name) : std::string(fallback);
    };
    try {
      parse_moe_balance(text("moe_router_load_balancing_type", "aux_loss"), text("moe_aux_loss_coeff", "0"), c.moe);
    } catch (const std::invalid_argument& e) {
      fail(e.what());
    }
  }
  float_opt("moe_z_loss_coeff", c.moe.z_loss_coeff);
  bool_opt("moe_router_enable_expert_bias", c.moe.expert_bias);
  float_opt("moe_router_bias_update_rate", c.moe.bias_update_rate);
  float_opt("moe_expert_capacity_factor", c.moe.capacity_factor);
  if (o.has("moe_token_drop_policy"))
    c.moe.drop_policy =
        o.get_string("moe_token_drop_policy") == "position" ? MoeDropPolicy::kPosition : MoeDropPolicy::kProbs;
  bool_opt("moe_pad_expert_input_to_capacity", c.moe.pad_to_capacity);
  int_opt("moe_shared_expert_intermediate_size", c.moe.shared_ffn);
  bool_opt("moe_shared_expert_gate", c.moe.shared_gate);
  float_opt("moe_input_jitter_eps", c.moe.input_jitter_eps);
  float_opt("moe_router_quantile_balancing_ema", c.moe.quantile_ema);
  if (o.has("moe_gate"))
    c.moe.gate = o.get_string("moe_gate") == "deepspeed" ? MoeGate::kDeepSpeed : MoeGate::kMegatron;
  float_opt("moe_eval_capacity_factor", c.moe.eval_capacity_factor);
  int_opt("moe_min_capacity", c.moe.min_capacity);
  bool_opt("moe_top2_2nd_expert_sampling", c.moe.second_expert_sampling);
  bool_opt("moe_residual", c.moe.residual);
  if (o.has("moe_token_dispatcher"))
    c.moe.dispatcher =
        o.get_string("moe_token_dispatcher") == "alltoall" ? MoeDispatcher::kAllToAll : MoeDispatcher::kAllGather;
  bool_opt("moe_shared_expert_overlap", c.moe.shared_expert_overlap);
}

namespace {

// sinkhorn and quantile_balancing choose the experts themselves: what is wrong with their options
// (the options that steer a top-k choice would do nothing), or "".
std::string balanced_choice_error(const BuildContext& ctx, const MoeConfig& m) {
  const MoeConfig unset;
  if (m.routing == MoeRouting::kTopK)
    return m.quantile_ema != unset.quantile_ema ? "option 'moe_router_quantile_balancing_ema' does nothing without "
                                                  "moe_router_load_balancing_type=quantile_balancing"
                                                : "";
  const bool sinkhorn = m.routing == MoeRouting::kSinkhorn;
  const std::string with = std::string(" with moe_router_load_balancing_type=") +
                           (sinkhorn ? "sinkhorn" : "quantile_balancing") + ", which chooses the experts itself";
  if (m.expert_bias) return "moe_router_enable_expert_bias does nothing" + with;
  if (m.num_groups != 0 || m.group_topk != 0)
    return "group-limited routing (moe_router_num_groups, moe_router_group_topk) does nothing" + with;
  if (sinkhorn) {
    if (m.quantile_ema != unset.quantile_ema) return "option 'moe_router_quantile_balancing_ema' does nothing" + with;
    const std::pair<const char*, bool> ignored[] = {
        {"moe_router_score_function", m.score != unset.score},
        {"moe_router_pre_softmax", m.pre_softmax},
        {"moe_router_topk_scaling_factor", m.topk_scaling_factor != unset.topk_scaling_factor}};
    for (const auto& [option, set] : ignored)
      if (set)
        return std::string("option '") + option + "' does nothing" + with +
               " (its weights: sigmoid for moe_router_topk=1, else the softmax over all experts)";
    return "";
  }
  if (!(m.quantile_ema >= 0.0 && m.quantile_ema <= 1.0))
    return "option 'moe_router_quantile_balancing_ema' must be in [0, 1], got " + shown(m.quantile_ema);
  if (m.topk >= m.num_experts)
    return "quantile_balancing needs moe_router_topk < num_experts: it reads each token's (k + 1)-th best expert";
  const int64_t tokens = static_cast<int64_t>(ctx.micro_batch_size) * ctx.seq_length;
  if (tokens > 0 && (tokens * m.topk) % m.num_experts != 0)
    return "quantile_balancing puts micro_batch_size x seq_length x moe_router_topk = " +
           std::to_string(tokens * m.topk) + " choices equally on num_experts = " + std::to_string(m.num_experts) +
           " experts: make it a multiple";
  return "";
}

}  // namespace

// Group-limited routing (Megatron-LM's checks, and the two that make its top-k meaningful).
void DecoderLM::validate_moe_groups(const MoeConfig& m) const {
  if (m.num_groups == 0 && m.group_topk == 0) return;
  if (m.num_groups < 1 || m.group_topk < 1)
    fail("group-limited routing needs both moe_router_num_groups and moe_router_group_topk >= 1, got " +
         std::to_string(m.num_groups) + " and " + std::to_string(m.group_topk));
  divisible("num_experts", m.num_experts, "moe_router_num_groups", m.num_groups);
  if (m.group_topk > m.num_groups)
    fail("option 'moe_router_group_topk' (" + std::to_string(m.group_topk) + ") must be <= moe_router_num_groups (" +
         std::to_string(m.num_groups) + ")");
  if (m.group_topk > m.topk)
    fail("option 'moe_router_group_topk' (" + std::to_string(m.group_topk) + ") must be <= moe_router_topk (" +
         std::to_string(m.topk) + "): a group is scored by its best moe_router_topk / moe_router_group_topk experts");
  if (m.topk / m.group_topk > m.num_experts / m.num_groups || m.topk > m.group_topk * (m.num_experts / m.num_groups))
    fail("moe_router_topk " + std::to_string(m.topk) + " is more experts than moe_router_group_topk " +
         std::to_string(m.group_topk) + " groups of " + std::to_string(m.num_experts / m.num_groups) + " hold");
}

// DeepSpeed's gate's options (moe_gate=deepspeed): in range, none of Megatron-LM's router's beside
// them, and none of them without it.
void DecoderLM::validate_deepspeed_gate(const MoeConfig& m) const {
  const MoeConfig unset;
  if (m.gate != MoeGate::kDeepSpeed) {
    const std::pair<const char*, bool> own[] = {
        {"moe_eval_capacity_factor", m.eval_capacity_factor != unset.eval_capacity_factor},
        {"moe_min_capacity", m.min_capacity != unset.min_capacity},
        {"moe_top2_2nd_expert_sampling", m.second_expert_sampling != unset.second_expert_sampling},
        {"moe_residual", m.residual != unset.residual},
        {"moe_layer_num_experts", !m.layer_experts.empty()}};
    for (const auto& [option, set] : own)
      if (set) fail(std::string("option '") + option + "' is DeepSpeed's gate's: it acts only with moe_gate=deepspeed");
    return;
  }
  const std::pair<const char*, bool> megatrons[] = {
      {"moe_router_score_function", m.score != unset.score},
      {"moe_router_pre_softmax", m.pre_softmax != unset.pre_softmax},
      {"moe_router_num_groups", m.num_groups != unset.num_groups},
      {"moe_router_group_topk", m.group_topk != unset.group_topk},
      {"moe_router_topk_scaling_factor", m.topk_scaling_factor != unset.topk_scaling_factor},
      {"moe_router_load_balancing_type",
       m.routing != MoeRouting::kTopK || m.seq_aux_loss_coeff > 0.0 || m.global_aux_loss_coeff > 0.0},
      {"moe_z_loss_coeff", m.z_loss_coeff != unset.z_loss_coeff},
      {"moe_router_enable_expert_bias", m.expert_bias != unset.expert_bias},
      {"moe_token_drop_policy", m.drop_policy != unset.drop_policy},
      {"moe_pad_expert_input_to_capacity", m.pad_to_capacity != unset.pad_to_capacity},
      {"moe_shared_expert_intermediate_size", m.shared_ffn != unset.shared_ffn},
      {"moe_input_jitter_eps", m.input_jitter_eps != unset.input_jitter_eps}};
  for (const auto& [option, set] : megatrons)
    if (set)
      fail(std::string("option '") + option +
           "' is Megatron-LM's router's: moe_gate=deepspeed has DeepSpeed's gate (its choice, capacity and "
           "loss; moe_router_load_balancing_type aux_loss or none)");
  if (!std::isfinite(m.eval_capacity_factor) || m.eval_capacity_factor < 0.0 || m.eval_capacity_factor > 1e6)
    fail("option 'moe_eval_capacity_factor' must be in [0, 1e6] (0 = moe_expert_capacity_factor), got " +
         shown(m.eval_capacity_factor));
  if (m.min_capacity < 0 || m.min_capacity > (int64_t{1} << 31))
    fail("option 'moe_min_capacity' must be in [0, 2^31], got " + std::to_string(m.min_capacity));
  if (!m.drops_tokens() && (m.eval_capacity_factor != unset.eval_capacity_factor || m.min_capacity != 0))
    fail(std::string("option '") + (m.min_capacity != 0 ? "moe_min_capacity" : "moe_eval_capacity_factor") +
         "' does nothing without moe_expert_capacity_factor > 0: DeepSpeed's gate is then dropless in training and "
         "evaluation (Megatron-DeepSpeed's --disable-moe-token-dropping)");
  if (m.topk != 2 && !m.second_expert_sampling)
    fail("option 'moe_top2_2nd_expert_sampling' acts only with moe_router_topk=2");
}

// DeepSpeed's pyramid MoE: one count per MoE layer, num_experts the largest, each layer one that
// the run's top-k and expert-parallel size can build.
void DecoderLM::validate_layer_experts(const DecoderConfig& c) const {
  const MoeConfig& m = c.moe;
  if (m.layer_experts.empty()) return;
  const int64_t moe_layers = m.num_moe_layers(c.num_layers);
  if (static_cast<int64_t>(m.layer_experts.size()) != moe_layers)
    fail("option 'moe_layer_num_experts' lists " + std::to_string(m.layer_experts.size()) + " counts, the model has " +
         std::to_string(moe_layers) + " MoE layers (moe_layer_freq): give one per MoE layer");
  const int64_t largest = *std::max_element(m.layer_experts.begin(), m.layer_experts.end());
  if (largest != m.num_experts)
    fail("option 'num_experts' must be the largest count of moe_layer_num_experts, " + std::to_string(largest) +
         ", got " + std::to_string(m.num_experts));
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    if (!m.is_moe_layer(layer)) continue;
    const int64_t n = m.at_layer(layer, c.num_layers).num_experts;  // (the count the layer is built with)
    const std::string which = "option 'moe_layer_num_experts' gives layer " + std::to_string(layer + 1) +
                              " (1-based) " + std::to_string(n) + " experts";
    if (n == 1)  // (Megatron-DeepSpeed's count of 1 is a dense layer: the mapper makes it one)
      fail(which + ": a layer of one expert is a dense layer; leave it out of moe_layer_freq");
    if (n < m.topk) fail(which + ", fewer than moe_router_topk = " + std::to_string(m.topk));
    if (n % m.ep_size != 0)
      fail(which + ": the expert-parallel size (distributed.expert_model_parallel_size) " + std::to_string(m.ep_size) +
           " must divide every layer's count");
  }
}

// The MoE options: in range, and none set without experts (it would do nothing).
void DecoderLM::validate_moe(const BuildContext& ctx, const DecoderConfig& c) const {
  const MoeConfig& m = c.moe;
  const MoeConfig unset;
  if (m.num_experts < 0)
    fail("option 'num_experts' must be >= 0 (0 = dense MLPs), got " + std::to_string(m.num_experts));
  if (!m.enabled()) {
    const std::pair<const char*, bool> changed[] = {
        {"moe_router_topk", m.topk != unset.topk},
        {"moe_ffn_hidden_size", m.ffn != unset.ffn},
        {"moe_layer_freq", m.layer_freq != unset.layer_freq || !m.layer_pattern.empty()},
        {"moe_router_score_function", m.score != unset.score},
        {"moe_router_pre_softmax", m.pre_softmax != unset.pre_softmax},
        {"moe_router_num_groups", m.num_groups != unset.num_groups},
        {"moe_router_group_topk", m.group_topk != unset.group_topk},
        {"moe_router_fp32", m.router_fp32 != unset.router_fp32},
        {"moe_router_topk_scaling_factor", m.topk_scaling_factor != unset.topk_scaling_factor},
        {"moe_router_load_balancing_type", ctx.options.has("moe_router_load_balancing_type") &&
                                               ctx.options.get_string("moe_router_load_balancing_type") != "aux_loss"},
        {"moe_aux_loss_coeff", m.balances()},
        {"moe_z_loss_coeff", m.z_loss_coeff != unset.z_loss_coeff},
        {"moe_router_enable_expert_bias", m.expert_bias != unset.expert_bias},
        {"moe_router_bias_update_rate", m.bias_update_rate != unset.bias_update_rate},
        {"moe_expert_capacity_factor", m.capacity_factor != unset.capacity_factor},
        {"moe_token_drop_policy", m.drop_policy != unset.drop_policy},
        {"moe_pad_expert_input_to_capacity", m.pad_to_capacity != unset.pad_to_capacity},
        {"moe_shared_expert_intermediate_size", m.shared_ffn != unset.shared_ffn},
        {"moe_shared_expert_gate", m.shared_gate != unset.shared_gate},
        {"moe_input_jitter_eps", m.input_jitter_eps != unset.input_jitter_eps},
        {"moe_router_quantile_balancing_ema", m.quantile_ema != unset.quantile_ema},
        {"moe_gate", m.gate != unset.gate},
        {"moe_eval_capacity_factor", m.eval_capacity_factor != unset.eval_capacity_factor},
        {"moe_min_capacity", m.min_capacity != unset.min_capacity},
        {"moe_top2_2nd_expert_sampling", m.second_expert_sampling != unset.second_expert_sampling},
        {"moe_residual", m.residual != unset.residual},
        {"moe_layer_num_experts", !m.layer_experts.empty()},
        {"moe_token_dispatcher", m.dispatcher != unset.dispatcher},
        {"moe_shared_expert_overlap", m.shared_expert_overlap != unset.shared_expert_overlap}};
    for (const auto& [option, set] : changed)
      if (set) fail(std::string("option '") + option + "' does nothing without num_experts > 0");
    return;
  }
  if (m.num_experts > 4096) fail("option 'num_experts' is " + std::to_string(m.num_experts) + ", more than 4096");
  divisible("num_experts", m.num_experts, "the expert-parallel size (distributed.expert_model_parallel_size)",
            m.ep_size);
  if (m.topk < 1 || m.topk > m.num_experts)
    fail("option 'moe_router_topk' must be in [1, num_experts = " + std::to_string(m.num_experts) + "], got " +
         std::to_string(m.topk));
  validate_deepspeed_gate(m);
  if (m.topk == 1 && m.score == MoeScore::kSoftmax && !m.pre_softmax && m.routing != MoeRouting::kSinkhorn &&
      m.gate == MoeGate::kMegatron)
    fail(
        "moe_router_topk=1 needs moe_router_pre_softmax=true: the softmax of one chosen logit is always 1, so the "
        "router would learn nothing from the language-model loss (Megatron-LM refuses it too)");
  if (m.ffn < 0 || m.ffn > (int64_t{1} << 31))
    fail("option 'moe_ffn_hidden_size' must be in [0, 2^31] (0 = ffn_hidden_size), got " + std::to_string(m.ffn));
  divisible("moe_ffn_hidden_size (or ffn_hidden_size)", c.expert_ffn(), "the tensor-parallel size", tp_.size);
  if (m.layer_freq < 1) fail("option 'moe_layer_freq' must be >= 1, got " + std::to_string(m.layer_freq));
  if (!m.layer_pattern.empty() && static_cast<int64_t>(m.layer_pattern.size()) != c.num_layers)
    fail("option 'moe_layer_freq' lists " + std::to_string(m.layer_pattern.size()) + " layers, the model has " +
         std::to_string(c.num_layers) + " (num_layers): give one 0 or 1 per layer");
  if (!m.layer_pattern.empty() && m.num_moe_layers(c.num_layers) == 0)
    fail("option 'moe_layer_freq' makes no layer an MoE layer: every entry is 0 (use num_experts=0 for dense MLPs)");
  validate_layer_experts(c);
  if (m.score != MoeScore::kSoftmax && m.pre_softmax)
    fail(std::string("moe_router_pre_softmax acts on softmax scores only, not with moe_router_score_function=") +
         (m.score == MoeScore::kSigmoid ? "sigmoid" : "sqrtsoftplus"));
  validate_moe_groups(m);
  if (const std::string wrong = balanced_choice_error(ctx, m); !wrong.empty()) fail(wrong);
  if (m.expert_bias && m.score == MoeScore::kSoftmax)
    fail(
        "moe_router_enable_expert_bias needs moe_router_score_function=sigmoid or sqrtsoftplus (Megatron-LM's "
        "auxiliary-loss-free balancing is for those scores)");
  if (!m.expert_bias && m.bias_update_rate != MoeConfig().bias_update_rate)
    fail("option 'moe_router_bias_update_rate' does nothing without moe_router_enable_expert_bias=true");
  if (!std::isfinite(m.capacity_factor) || m.capacity_factor < 0.0 || m.capacity_factor > 1e6)
    fail("option 'moe_expert_capacity_factor' must be in [0, 1e6] (0 = dropless), got " + shown(m.capacity_factor));
  // eps >= 1 would make some of the router's inputs negative multiples of themselves.
  if (!std::isfinite(m.input_jitter_eps) || m.input_jitter_eps < 0.0 || m.input_jitter_eps >= 1.0)
    fail("option 'moe_input_jitter_eps' must be in [0, 1) (0 = no jitter), got " + shown(m.input_jitter_eps));
  if (!m.drops_tokens() && m.drop_policy != MoeConfig().drop_policy)
    fail("option 'moe_token_drop_policy' does nothing without moe_expert_capacity_factor > 0 (dropless)");
  if (!m.drops_tokens() && m.pad_to_capacity)
    fail("option 'moe_pad_expert_input_to_capacity' pads to a capacity: it needs moe_expert_capacity_factor > 0");
  if (m.shared_ffn < 0 || m.shared_ffn > (int64_t{1} << 31))
    fail("option 'moe_shared_expert_intermediate_size' must be in [0, 2^31] (0 = no shared expert), got " +
         std::to_string(m.shared_ffn));
  if (m.shared_gate && m.shared_ffn == 0)
    fail("option 'moe_shared_expert_gate' gates the shared expert: it needs moe_shared_expert_intermediate_size > 0");
  if (m.shared_ffn > 0)
    divisible("moe_shared_expert_intermediate_size", m.shared_ffn, "the tensor-parallel size", tp_.size);
  if (m.shared_expert_overlap && m.shared_ffn == 0 && !m.residual)
    fail(
        "option 'moe_shared_expert_overlap' overlaps the shared expert: it needs moe_shared_expert_intermediate_size > "
        "0");
  if (m.shared_expert_overlap && m.dispatcher != MoeDispatcher::kAllToAll)
    fail(
        "option 'moe_shared_expert_overlap' overlaps the shared expert with the alltoall dispatcher's exchange: it "
        "needs moe_token_dispatcher=alltoall (Megatron-LM refuses it with the allgather dispatcher too)");
  for (const auto& [option, v] :
       {std::pair<const char*, double>{"moe_router_topk_scaling_factor", m.topk_scaling_factor},
        {"moe_z_loss_coeff", m.z_loss_coeff},
        {"moe_router_bias_update_rate", m.bias_update_rate}})
    if (!(v >= 0.0) || !std::isfinite(v))
      fail(std::string("option '") + option + "' must be finite and >= 0, got " + std::to_string(v));
  if (c.domino_chunks > 1)
    fail(
        "domino_chunks > 1 runs dense MLPs only: Domino's chunked schedule has no mixture-of-experts layer "
        "(num_experts " +
        std::to_string(m.num_experts) + "); use domino_chunks=1");
  (void)ctx;
}

void DecoderLM::validate(const BuildContext& ctx, const DecoderConfig& c) const {
  validate_moe(ctx, c);  // first: the size check below counts the experts
  auto positive = [&](const char* option, int64_t v) {
    if (v <= 0) fail(std::string("option '") + option + "' must be positive, got " + std::to_string(v));
  };
  // Sizes past 2^31 are no model's (hidden_size first: ffn_hidden_size's default derives from it).
  for (const auto& [option, v] : {std::pair<const char*, int64_t>{"hidden_size", c.hidden},
                                  {"num_layers", c.num_layers},
                                  {"num_attention_heads", c.heads},
                                  {"ffn_hidden_size (given, or derived from hidden_size)", c.ffn},
                                  {"vocab_size", c.vocab},
                                  {"seq_length (option or train.seq_length)", c.seq},
                                  {"max_position_embeddings", c.max_pos}})
    if (v > (int64_t{1} << 31))
      fail(std::string("option '") + option + "' is " + std::to_string(v) + ", more than 2^31");
  positive("num_layers", c.num_layers);
  positive("hidden_size", c.hidden);
  positive("num_attention_heads", c.heads);
  positive("ffn_hidden_size", c.ffn);
  positive("seq_length (option or train.seq_length)", c.seq);
  positive("vocab_size", c.vocab);
  positive("make_vocab_size_divisible_by", c.divisible_by);
  if (c.window >= 0 && !c.window_layers.flags.empty() &&
      static_cast<int64_t>(c.window_layers.flags.size()) != c.num_layers)
    fail("option 'window_attn_skip_freq' lists " + std::to_string(c.window_layers.flags.size()) +
         " layers, the model has " + std::to_string(c.num_layers));
  if (c.kv_channels < 0 || c.kv_channels > (int64_t{1} << 20))
    fail("option 'kv_channels' must be in [0, 2^20] (0: hidden_size / num_attention_heads), got " +
         std::to_string(c.kv_channels));
  // A model of more than 10^15 parameters (petabytes) is a mistaken size, refused before its
  // layers are created one by one (minutes of it, for a layer count in the millions).
  const double mlps = c.moe.enabled() ? static_cast<double>(c.moe.num_experts) : 1.0;
  const double attention_width = static_cast<double>(c.heads) * static_cast<double>(c.head_dim());
  const double per_layer = 4.0 * c.hidden * attention_width + 3.0 * c.hidden * c.expert_ffn() * mlps;
  const double parameters = c.num_layers * per_layer + (static_cast<double>(c.vocab) + c.max_pos) * c.hidden;
  if (parameters > 1e15) {
    char text[32];
    std::snprintf(text, sizeof text, "%.2g", parameters);
    fail(std::string("num_layers ") + std::to_string(c.num_layers) + " of hidden_size " + std::to_string(c.hidden) +
         " and ffn_hidden_size " + std::to_string(c.ffn) + " make about " + text +
         " parameters: no machine holds that many");
  }
  // As Megatron: the heads must split hidden_size only when their width derives from it.
  if (c.kv_channels == 0) divisible("hidden_size", c.hidden, "num_attention_heads", c.heads);
  divisible("num_attention_heads", c.heads, "the tensor-parallel size", tp_.size);
  divisible("ffn_hidden_size", c.ffn, "the tensor-parallel size", tp_.size);
  // Pipeline stages: pipeline_model_parallel_size, times virtual_pipeline_model_parallel_size
  // with the interleaved schedule; even, or as the build context's split says.
  if (const std::string refusal = pipeline_split_refusal(pipeline_split(ctx), c.num_layers); !refusal.empty())
    fail(refusal);
  // A learned position table must have a row for every position of the run's samples: refused
  // when the model is built, not at the first forward after the data.
  if (c.max_pos > 0 && ctx.seq_length > c.max_pos)
    fail("max_position_embeddings " + std::to_string(c.max_pos) +
         " (0: the option seq_length) is below train.seq_length " + std::to_string(ctx.seq_length) +
         ": the position table has no row for the later positions");
  if (c.max_pos > 0 && c.max_pos < c.seq)
    fail("max_position_embeddings " + std::to_string(c.max_pos) + " < seq_length " + std::to_string(c.seq));
  for (double p : {c.hidden_dropout, c.attention_dropout})
    if (p < 0.0 || p >= 1.0) fail("dropout probabilities must be in [0, 1)");
  if (!(c.init_std > 0.0)) fail("option 'init_method_std' must be positive");
  if (!(c.eps > 0.0)) fail("option 'layernorm_epsilon' must be positive, got " + std::to_string(c.eps));
  if (c.lm_head_chunk_tokens < 0)
    fail("option 'lm_head_chunk_tokens' must be >= 0 (0 = automatic), got " + std::to_string(c.lm_head_chunk_tokens));
  if (c.cross_entropy_impl == CrossEntropyRows::kHost && !ctx.device.is_cpu())
    fail("option cross_entropy_impl=host runs on the CPU only; use auto or ops on a GPU");
  if (c.recompute_num_layers < 1)
    fail("option 'recompute_num_layers' must be >= 1, got " + std::to_string(c.recompute_num_layers));
  // Against the largest stage: a stage of fewer layers (an uneven split) recomputes all of its own.
  int64_t stage_layers = 0;
  for (const StageLayers& stage : pipeline_stage_layers(pipeline_split(ctx), c.num_layers))
    stage_layers = std::max(stage_layers, stage.count);
  if (c.recompute && c.recompute_num_layers > stage_layers)
    fail("recompute_num_layers (" + std::to_string(c.recompute_num_layers) + ") exceeds the " +
         std::to_string(stage_layers) + " layers of a pipeline stage");
  // (Domino's layers are dense, so moe recomputes nothing there and is let be.)
  if (c.domino_chunks > 1 && c.recompute_mlp)
    fail(
        "recompute_modules mlp: Domino's chunked schedule (domino_chunks > 1) runs the MLP in pieces of "
        "its own; recompute whole layers (recompute_activations=full) or use domino_chunks=1");
  if (c.domino_chunks > 1 && c.recompute && (c.recompute_block || c.recompute_num_layers != 1))
    fail(
        "domino_chunks > 1 recomputes one layer at a time: recompute_method=block or recompute_num_layers > 1 "
        "needs domino_chunks=1");
  if (tp_.splits_sequence() && c.seq % tp_.size != 0)
    fail("sequence parallelism splits the sequence over the tensor-parallel ranks: seq_length " +
         std::to_string(c.seq) + " is not divisible by the tensor-parallel size " + std::to_string(tp_.size));
  if (c.domino_chunks < 1)
    fail("option 'domino_chunks' must be >= 1 (1 = plain tensor parallelism), got " + std::to_string(c.domino_chunks));
  validate_context_parallel(c);
  if (ctx.micro_batch_size > 0 && c.domino_chunks > ctx.micro_batch_size)
    fail("domino_chunks (" + std::to_string(c.domino_chunks) + ") exceeds the micro-batch size (" +
         std::to_string(ctx.micro_batch_size) + "): each chunk needs at least one sequence");
  if (ctx.params_dtype != at::kFloat && ctx.params_dtype != at::kBFloat16 && ctx.params_dtype != at::kHalf)
    fail("parameters must be fp32, bf16 or fp16");
}

// Context parallelism: each tensor-parallel rank's heads split over the group, the sequence in
// 2 x cp equal chunks. A mixture of experts needs nothing more: it routes each rank's share, its
// balancing losses count over the group, and what decides on whole sequences gathers them
// (moe.cpp); token dropping keeps each expert's capacity of the rank's tokens, as Megatron's.
void DecoderLM::validate_context_parallel(const DecoderConfig& c) const {
  if (!c.cp.active()) return;
  const std::string cp = "context parallelism " + std::to_string(c.cp.size);
  if (!c.cp.gathers_keys() && (c.heads / tp_.size) % c.cp.size != 0)
    fail(cp + " by all-to-all gives each rank the whole sequence of 1 / " + std::to_string(c.cp.size) +
         " of the attention heads: num_attention_heads / the tensor-parallel size (" + std::to_string(c.heads) + " / " +
         std::to_string(tp_.size) + ") must divide by " + std::to_string(c.cp.size) +
         " (distributed.cp_comm_type=all_gather has no such condition)");
  if (c.seq % (2 * c.cp.size) != 0)
    fail(cp + " splits each sequence into " + std::to_string(2 * c.cp.size) + " equal chunks: seq_length " +
         std::to_string(c.seq) + " is not divisible by " + std::to_string(2 * c.cp.size));
  if (tp_.splits_sequence() && (c.seq / c.cp.size) % tp_.size != 0)
    fail(cp + " with sequence parallelism: each rank's " + std::to_string(c.seq / c.cp.size) +
         " positions must split over the tensor-parallel size " + std::to_string(tp_.size));
}

void DecoderLM::build(const BuildContext& ctx, DecoderConfig& c, DecoderParts parts) {
  config_ = &c;
  parts_ = std::move(parts);
  c.padded_vocab = padded_vocab_size(c.vocab, c.divisible_by, tp_.size);
  // Layers of this pipeline stage: consecutive, as many as the split gives it (dtk/pipeline_split.hpp).
  const StageLayers stage = pipeline_layers(pipeline_split(ctx), c.num_layers, ctx.pp_rank);
  const int64_t local_layers = stage.count, offset = stage.offset;
  // Every master weight comes from a CPU generator seeded by the run seed and the weight's place
  // in the whole model, so all TP ranks (and any pipeline split) agree.
  ParamFactory f;
  f.dtype = ctx.params_dtype;
  f.device = ctx.device;
  if (ctx.deferred_parameters) {
    deferred_ = std::make_unique<DeferredInit>();
    f.deferred = deferred_.get();
  }
  auto seeded = [&](uint64_t salt) -> ParamFactory& {
    f.gen = seeded_generator(ctx.seed * 1000003ULL + salt);
    return f;
  };
  if (pre_ || (post_ && !c.untie)) word_ = VocabParallelEmbedding(c.padded_vocab, c.hidden, c.init_std, tp_, seeded(1));
  if (pre_ && c.max_pos > 0) position_ = f.param(seeded(2).normal({c.max_pos, c.hidden}, c.init_std));
  for (int64_t i = 0; i < local_layers; ++i) layers_.push_back(make_layer(offset + i, seeded(100 + offset + i)));
  if (post_) {
    for (const auto& norm : parts_.final_norm) {
      if (norm.second != 0.0 && norm.second != 1.0) fail("a final norm's tensor starts at 1 or 0");
      final_norm_.push_back(norm.second == 0.0 ? f.zeros({c.hidden}) : f.ones({c.hidden}));
    }
    if (c.untie) output_ = ColumnParallelLinear(c.hidden, c.padded_vocab, false, c.init_std, tp_, seeded(3)).weight;
  }
  init_domino();
  rng_ = DropoutRng::from_host();  // CPU generators on every device: they only seed the masks (dropout.hpp)
}

// The Domino schedule's view of this model (domino.hpp).
void DecoderLM::init_domino() {
  const DecoderConfig& c = *config_;
  domino_.model = name_;
  domino_.chunks = c.domino_chunks;
  domino_.hidden = c.hidden;
  domino_.recompute = c.recompute;
  domino_.tp = tp_;
  for (const auto& l : layers_) {
    if (c.domino_chunks > 1 && !l->domino()) fail("domino_chunks > 1 needs layers that implement DominoLayer");
    domino_.layers.push_back(l->domino());
  }
  domino_.hooks = &hooks_;
  domino_.module_of = [this](size_t i) { return layer_module(i); };
  if (pre_) {
    embedding_.word_partial = [this](const at::Tensor& ids) { return word_.partial(ids); };
    if (position_.defined())
      embedding_.position = [this](const at::Tensor& pos) { return at::embedding(position_, pos); };
    embedding_.anchor = [this]() -> const at::Tensor& { return position_.defined() ? position_ : word_.weight; };
    embedding_.dropout = c.hidden_dropout;
    embedding_.module = embedding_module();
    domino_.embedding = &embedding_;
  }
  if (post_) {
    head_.norm = [this](const at::Tensor& x) { return final_norm(x); };
    head_.weight = [this]() -> const at::Tensor& { return output_weight(); };
    head_.tp = tp_;
    head_.module = output_module();
    domino_.head = &head_;
  }
}

// The replayed values under the parameters' names, once: afterwards the model no longer reports
// deferred parameters (the host checks that the strategy took them). A recorded tensor the model
// does not list (none today) gets its value in place, so nothing is left a placeholder.
void DecoderLM::init_parameters(const ParamValueFn& take) {
  if (!deferred_) return Model::init_parameters(take);
  std::unordered_map<const void*, std::string> names;
  for (const Param& p : parameters()) names.emplace(p.tensor.unsafeGetTensorImpl(), p.name);
  at::NoGradGuard no_grad;
  deferred_->replay([&](const at::Tensor& param, const at::Tensor& value) {
    auto it = names.find(param.unsafeGetTensorImpl());
    if (it != names.end()) return take(it->second, value);
    param.set_data(value.to(param.device(), param.scalar_type()).contiguous());
  });
  deferred_.reset();  // handed out: the receiver holds the values now (and the records go)
}

TensorList DecoderLM::state_save() {
  TensorList out = Model::state_save();
  rng_.save(out);
  return out;
}

void DecoderLM::state_load(const TensorList& state, bool strict) {
  Model::state_load(state, strict);  // names and shapes of everything, the generator states too
  rng_.load(state);                  // a non-strict load without them keeps the current streams
}

// Megatron's convention: bool, true = masked. A float "1 = may attend" mask would silently flip
// meaning if converted, so anything but bool is refused.
at::Tensor DecoderLM::attention_mask(const TensorList& inputs) const {
  const at::Tensor* mask = find(inputs, "attention_mask");
  if (mask && mask->scalar_type() != at::kBool)
    fail("'attention_mask' must be a bool tensor (true = masked, Megatron's convention), got " +
         std::string(c10::toString(mask->scalar_type())));
  return mask ? *mask : at::Tensor();
}

at::Tensor DecoderLM::check_tokens(const TensorList& inputs, IdRangeChecks& checks) const {
  const at::Tensor& tokens = get(inputs, "tokens");
  if (tokens.dim() != 2) fail("'tokens' must be [batch, seq], got " + shape_str(tokens));
  if (tokens.scalar_type() != at::kLong && tokens.scalar_type() != at::kInt)
    fail("'tokens' must hold integer ids (int64 or int32)");
  if (position_.defined() && tokens.size(1) > config_->max_pos)
    fail("sequence of " + std::to_string(tokens.size(1)) + " tokens exceeds max_position_embeddings " +
         std::to_string(config_->max_pos));
  checks.add("tokens", tokens, config_->padded_vocab, "the padded vocabulary");
  return tokens;
}

// The step's position_ids (or 0..s-1 for every sequence) where the layers or a learned table read
// them; undefined where nothing does.
at::Tensor DecoderLM::positions(const TensorList& inputs, const at::Tensor& tokens, const at::Tensor& h,
                                IdRangeChecks& checks) const {
  const at::Tensor* given = find(inputs, "position_ids");
  if (parts_.layer_positions) {
    const at::Tensor& shape = pre_ ? tokens : h;
    const int64_t b = shape.size(0), s = pre_ ? tokens.size(1) : whole_sequence(h);
    at::Tensor pos;
    if (given) {
      if (given->dim() != 2 || given->size(0) != b || given->size(1) != s)
        fail("'position_ids' must be [batch, seq] = [" + std::to_string(b) + ", " + std::to_string(s) + "], got " +
             shape_str(*given));
      checks.add("position_ids", *given, std::numeric_limits<int64_t>::max(), "non-negative positions");
      pos = given->to(at::kLong);
    } else if (config_->cp.active()) {
      pos = config_->cp.share_of_positions(b, s * config_->cp.size, at::kCPU);
    } else {
      pos = at::arange(s, at::TensorOptions().dtype(at::kLong)).unsqueeze(0).expand({b, s});
    }
    pos = pos.to(shape.device());  // once, not per layer
    // Positions made here are 0..s-1; on the first stage check_tokens compared s with max_pos.
    if (position_.defined() && (given || !pre_))
      checks.add("position_ids", pos, config_->max_pos, "max_position_embeddings");
    return pos;
  }
  if (!position_.defined()) return {};
  // Positions made here are 0..s-1, below max_pos (check_tokens compared s with it): no check.
  if (!given && config_->cp.active())
    return config_->cp.share_of_positions(tokens.size(0), tokens.size(1) * config_->cp.size, tokens.device());
  if (!given) return at::arange(tokens.size(1), tokens.options()).unsqueeze(0).expand_as(tokens);
  checks.add("position_ids", *given, config_->max_pos, "max_position_embeddings");
  return *given;
}

// Under sequence parallelism the word embedding's partial sums are reduce-scattered and this
// rank adds the position embedding of its own rows (the table's gradient is then a partial sum:
// dtk_param_info.sequence_parallel).
at::Tensor DecoderLM::embed(const at::Tensor& tokens, const at::Tensor& positions) const {
  at::Tensor x = word_.forward(tokens);
  if (position_.defined()) x = x + at::embedding(position_, sequence_shard(positions, tp_));
  return x;
}

int64_t DecoderLM::whole_sequence(const at::Tensor& h) const {
  return h.size(1) * (tp_.splits_sequence() ? tp_.size : 1);
}

std::vector<std::pair<size_t, size_t>> DecoderLM::recompute_groups() const {
  const DecoderConfig& c = *config_;
  std::vector<std::pair<size_t, size_t>> groups;
  if (!c.recompute) return groups;
  const size_t n = layers_.size(), k = static_cast<size_t>(c.recompute_num_layers);
  if (c.recompute_block) {
    for (size_t i = 0; i < std::min(k, n); ++i) groups.emplace_back(i, i + 1);
  } else {
    for (size_t i = 0; i < n; i += k) groups.emplace_back(i, std::min(n, i + k));
  }
  return groups;
}

TensorList DecoderLM::forward(const TensorList& inputs) {
  if (find(inputs, "kv_cache_length")) return forward_cached(inputs);
  const DecoderConfig& c = *config_;
  const at::Tensor mask = attention_mask(inputs);
  const bool domino = runs_domino(c, layers_.size());
  at::Tensor h, tokens;  // Domino runs the embedding itself (DominoEmbedding)
  IdRangeChecks checks(name_);
  if (pre_) {
    tokens = check_tokens(inputs, checks);
  } else {
    h = get(inputs, "hidden_states");
    if (h.dim() != 3) fail("'hidden_states' must be [batch, seq, hidden], got " + shape_str(h));
  }
  const at::Tensor pos = positions(inputs, tokens, h, checks);
  // An id outside the vocabulary would be dropped by every rank's slice and scored silently.
  const at::Tensor* labels = post_ ? find(inputs, "labels") : nullptr;
  if (labels) checks.add("labels", *labels, c.padded_vocab, "the padded vocabulary");
  checks.verify();
  if (pre_ && !domino)
    h = hooks_.run(embedding_module(), tokens, [&](const at::Tensor& ids) {
      return dropout(embed(ids, pos), c.hidden_dropout, training_, rng_.hidden, tp_);
    });
  // Under context parallelism the mask stays the whole sequence's (the attention runs on it).
  const int64_t b = pre_ ? tokens.size(0) : h.size(0), s = (pre_ ? tokens.size(1) : whole_sequence(h)) * c.cp.size;
  if (c.cp.active() && s > c.seq)
    fail("context parallelism " + std::to_string(c.cp.size) + ": each rank takes its share of the sequence, at most " +
         std::to_string(c.seq / c.cp.size) + " of seq_length " + std::to_string(c.seq) + " positions, got " +
         std::to_string(s / c.cp.size) + " (a step must split the sequence: dtk/context_parallel.hpp)");
  if (mask.defined() && (mask.dim() != 4 || mask.size(1) != 1 || mask.size(2) != s || mask.size(3) != s ||
                         (mask.size(0) != 1 && mask.size(0) != b)))
    fail("'attention_mask' must be [batch or 1, 1, seq, seq], got " + shape_str(mask));
  // The layers' positions (rotary) are the whole sequence's under context parallelism's a2a: their
  // attention runs on whole sequences (under all_gather each rank rotates its own share's keys).
  const at::Tensor layer_pos =
      parts_.layer_positions && pos.defined() && !c.cp.gathers_keys() ? c.cp.whole_positions(pos) : pos;
  if (domino) {
    // With labels the output layer joins the chunked schedule (DominoHead): the result is the loss.
    DominoInputs in;
    in.hidden = h;
    in.tokens = tokens;
    in.positions = pos;
    in.layer_positions = layer_pos;
    in.mask = mask;
    if (labels) in.labels = labels->to(at::kLong);
    h = domino_forward(domino_, in, rng_, training_);
    if (labels) return {{"loss", h}};
  }
  const ResidualStream out = domino ? ResidualStream{h, {}} : plain_layers(h, layer_pos, mask);
  if (!post_) return {{"hidden_states", out.sum()}};
  return {{labels ? "loss" : "logits", output_layer(out, labels)}};
}

// Plain tensor parallelism: layer after layer on the whole micro-batch. The hooks run inside the
// recomputed block, so a ZeRO-3 strategy gathers the layer's parameters again for the rerun.
// Full recomputation checkpoints the groups recompute_groups() names: one group, one
// checkpoint holding only its input; the layers between groups run plainly.
// Without hooks, each layer hands its last residual branch to the next layer's first norm (and
// the last layer's to the final norm) within a run of layers; a checkpoint's input and output,
// a module's (hooks) and a stage's output are whole tensors.
ResidualStream DecoderLM::plain_layers(const at::Tensor& h, const at::Tensor& positions, const at::Tensor& mask) {
  using LayerRun = std::function<ResidualStream(ResidualStream, DropoutRng&)>;
  auto layers = [this, positions, mask](size_t first, size_t last) -> LayerRun {
    std::vector<std::pair<const DecoderLayer*, int32_t>> run;  // held by value: the backward reruns it
    for (size_t i = first; i < last; ++i) run.emplace_back(layers_[i].get(), layer_module(i));
    const ModuleHooks* hooks = &hooks_;
    const bool training = training_;
    return [run, hooks, positions, mask, training](ResidualStream y, DropoutRng& rng) {
      for (const auto& entry : run) {
        const DecoderLayer* layer = entry.first;  // not a structured binding: the lambda below captures it
        const int32_t module = entry.second;
        if (!hooks->active()) {
          y = layer->forward_residual(y, positions, mask, rng, training);
          continue;
        }
        y = {hooks->run(module, y.sum(),
                        [&](const at::Tensor& in) { return layer->forward(in, positions, mask, rng, training); }),
             {}};
      }
      return y;
    };
  };
  ResidualStream y{h, {}};
  size_t next = 0;
  for (const auto& [first, last] : recompute_groups()) {
    if (next < first) y = layers(next, first)(y, rng_);
    const LayerRun group = layers(first, last);
    y = {recompute(y.sum(), rng_,
                   [group](const at::Tensor& x, DropoutRng& rng) {
                     return group({x, {}}, rng).sum();
                   }),
         {}};
    next = last;
  }
  if (next < layers_.size()) y = layers(next, layers_.size())(y, rng_);
  return y;
}

// Final norm, logits; with labels the per-token loss (the fused output layer never makes the
// logits whole, lm_head.hpp). A branch still to add (plain_layers) comes only without hooks.
at::Tensor DecoderLM::output_layer(const ResidualStream& h, const at::Tensor* labels) {
  const DecoderConfig& c = *config_;
  auto head = [&](const at::Tensor& normed) {
    if (labels && c.fused_lm_head)
      return fused_lm_head_loss(enter_tp_region(normed, tp_), output_weight(), *labels, tp_, c.lm_head_chunk_tokens,
                                c.cross_entropy_impl);
    at::Tensor logits = parallel_lm_logits(normed, output_weight(), tp_, /*async_grad=*/runs_domino(c, layers_.size()));
    return labels ? vocab_parallel_cross_entropy(logits, *labels, tp_) : logits;
  };
  if (h.branch.defined()) return head(final_add_norm(h));
  return hooks_.run(output_module(), h.stream, [&](const at::Tensor& x) { return head(final_norm(x)); });
}

// Generation with a key/value cache (docs/models.md "Generation"): "tokens"/"position_ids" [b, n]
// at cache positions [L, L + n), "attention_mask" [b, 1, n, L + n] (bool, true = masked),
// "kv_cache_length" L, and the caches "kv_cache.<layer>" a previous call returned or, on the
// first call (L = 0), "kv_cache_capacity". Outputs "logits" [b, 1, vocab / tp] of the last
// position and the caches, filled up to L + n.
TensorList DecoderLM::forward_cached(const TensorList& inputs) {
  if (!pre_ || !post_) fail("generation needs the whole model on this rank (no pipeline stages)");
  if (tp_.splits_sequence()) fail("generation runs without sequence parallelism");
  at::NoGradGuard no_grad;
  const at::Tensor& tokens = get(inputs, "tokens");
  const at::Tensor& pos = get(inputs, "position_ids");
  const at::Tensor& mask = get(inputs, "attention_mask");
  const int64_t length = get(inputs, "kv_cache_length").item<int64_t>();
  if (tokens.dim() != 2 || pos.sizes() != tokens.sizes())
    fail("generation needs 'tokens' and 'position_ids' of one shape [batch, n], got " + shape_str(tokens) + " and " +
         shape_str(pos));
  const int64_t b = tokens.size(0), n = tokens.size(1);
  if (mask.scalar_type() != at::kBool || mask.dim() != 4 || mask.size(0) != b || mask.size(2) != n ||
      mask.size(3) != length + n)
    fail("generation's 'attention_mask' must be bool [batch, 1, n, kv_cache_length + n], got " + shape_str(mask));
  IdRangeChecks checks(name_);  // one host read per generated step for both
  checks.add("tokens", tokens, config_->padded_vocab, "the padded vocabulary");
  if (position_.defined())
    checks.add("position_ids", pos, config_->max_pos, "max_position_embeddings");
  else
    checks.add("position_ids", pos, std::numeric_limits<int64_t>::max(), "non-negative positions");
  checks.verify();
  std::vector<at::Tensor> caches;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (const at::Tensor* given = find(inputs, "kv_cache." + std::to_string(i))) {
      caches.push_back(*given);
      continue;
    }
    const at::Tensor* capacity = find(inputs, "kv_cache_capacity");
    if (!capacity || length != 0)
      fail("generation needs 'kv_cache." + std::to_string(i) +
           "' (from the previous call) or, on the first call, 'kv_cache_capacity'");
    caches.push_back(layers_[i]->empty_kv_cache(b, capacity->item<int64_t>(), word_.weight.options()));
  }
  if (length + n > caches[0].size(3))
    fail("generation ran past the key/value cache's capacity of " + std::to_string(caches[0].size(3)) + " positions");
  at::Tensor h = embed(tokens, pos);
  for (size_t i = 0; i < layers_.size(); ++i) h = layers_[i]->forward_cached(h, pos, caches[i], length, mask);
  TensorList out{{"logits", at::linear(final_norm(h.narrow(1, n - 1, 1)), output_weight())}};
  for (size_t i = 0; i < caches.size(); ++i) out.emplace_back("kv_cache." + std::to_string(i), caches[i]);
  return out;
}

std::vector<Param> DecoderLM::buffers() {
  std::vector<Param> out;
  for (size_t i = 0; i < layers_.size(); ++i)
    if (const MoeMlp* moe = layers_[i]->moe_mlp())
      moe->add_buffers(out, "language_model.encoder.layers." + std::to_string(i) + ".mlp.");
  return out;
}

void DecoderLM::end_iteration() {
  std::vector<MoeMlp*> moe;
  for (const auto& layer : layers_)
    if (MoeMlp* m = layer->moe_mlp()) moe.push_back(m);
  end_moe_iteration(moe);
}

void DecoderLM::to(at::Device device, std::optional<at::ScalarType> dtype) {
  auto move = [&](const at::Tensor& t, bool cast) {
    t.set_data(cast && dtype && t.is_floating_point() ? t.to(device, *dtype) : t.to(device));
  };
  for (const Param& p : parameters()) move(p.tensor, true);
  // Megatron's _maintain_float32_expert_bias: the biases' 1e-3 steps vanish in bf16. Their loads
  // (not buffers: never saved) move beside them.
  for (const Param& b : buffers()) move(b.tensor, false);
  for (const auto& layer : layers_)
    if (MoeMlp* moe = layer->moe_mlp(); moe && moe->expert_load.defined()) move(moe->expert_load, false);
}

std::vector<Param> DecoderLM::parameters() {
  std::vector<Param> out;
  const bool tied = !config_->untie;
  if (pre_) {
    // Tied: read by the output layer too, here or (pipeline) on the last stage, whose copy follows.
    add_param(out, "language_model.embedding.word_embeddings.weight", word_.weight, 0, false, tied, embedding_module());
    if (position_.defined())
      add_param(out, "language_model.embedding.position_embeddings.weight", position_, -1, false, false,
                embedding_module());
  } else if (post_ && tied) {
    // Megatron's copy of the embedding on the last stage (kept in sync by the embedding group).
    add_param(out, "word_embeddings_for_head.weight", word_.weight, 0, false, true, output_module());
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    const size_t first = out.size();
    layers_[i]->add_params(out, "language_model.encoder.layers." + std::to_string(i) + ".");
    for (size_t k = first; k < out.size(); ++k) out[k].info.module_index = layer_module(i);
  }
  if (post_) {
    for (size_t i = 0; i < final_norm_.size(); ++i)
      add_param(out, "language_model.encoder." + parts_.final_norm[i].first, final_norm_[i], -1, true, false,
                output_module());
    if (config_->untie) add_param(out, "language_model.output_layer.weight", output_, 0, false, false, output_module());
  }
  // Under sequence parallelism every replicated parameter (norms, row-parallel biases, the
  // position embedding) is read on this rank's rows of the sequence only.
  if (tp_.splits_sequence())
    for (Param& p : out) p.info.sequence_parallel = p.info.partition_dim < 0 ? 1 : 0;
  return out;
}

std::vector<Module> DecoderLM::modules() {
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
  // A tied output layer reads the word embedding owned by the embedding module.
  if (pre_ && post_ && !config_->untie) out.back().params.push_back("language_model.embedding.word_embeddings.weight");
  return out;
}

dtk_model_info DecoderLM::info() {
  const DecoderConfig& c = *config_;
  dtk_model_info i{};
  i.struct_size = dtk_model_info_STRUCT_SIZE;
  i.num_layers = c.num_layers;
  i.hidden_size = c.hidden;
  i.num_attention_heads = c.heads;
  i.ffn_hidden_size = c.ffn;
  i.seq_length = c.seq;
  i.vocab_size = c.padded_vocab;
  i.recompute = c.recompute ? 1 : 0;
  i.tied_embeddings = c.untie ? 0 : 1;
  i.sequence_parallel = tp_.splits_sequence() ? 1 : 0;
  // Selective recomputation of nothing (recompute_modules empty) is none: a selective model's 0
  // modules mean core attention (ABI 2.16, as a 2.15 model's).
  const int32_t modules = (c.selective_recompute ? DTK_RECOMPUTE_CORE_ATTENTION : 0) |
                          (c.recompute_mlp ? DTK_RECOMPUTE_MLP : 0) | (c.recompute_moe ? DTK_RECOMPUTE_MOE : 0);
  i.recompute_granularity = c.recompute ? 1 : c.selective && modules != 0 ? 2 : 0;
  i.recompute_method = c.recompute_block ? 1 : 0;
  i.recompute_num_layers = static_cast<int32_t>(c.recompute_num_layers);
  i.num_experts = static_cast<int32_t>(c.moe.num_experts);
  i.moe_router_topk = c.moe.enabled() ? static_cast<int32_t>(c.moe.topk) : 0;
  i.expert_parallel = c.moe.enabled() ? 1 : 0;  // MoeMlp keeps this rank's share of the experts
  i.pipeline_split = 1;                         // build() takes dtk::pipeline_layers' layers
  i.kv_channels = c.head_dim();
  if (i.recompute_granularity == 2) i.recompute_modules = modules;
  // The exchanges the layers run their attention by (bits 1 << DTK_CP_COMM_*).
  i.context_parallel =
      (parts_.context_parallel ? 1 << DTK_CP_COMM_A2A : 0) |
      (parts_.context_parallel && parts_.context_parallel_all_gather ? 1 << DTK_CP_COMM_ALL_GATHER : 0);
  return i;
}

}  // namespace dtk::layers
