// dtk/layers/moe.hpp — a mixture-of-experts MLP (Megatron-LM's MoELayer: TopKRouter, the
// experts, the token dispatcher's permute and unpermute), for model plugins (gpt, llama, yours).
//
//   logits = x W_router^T                          [tokens, experts], the router on this rank's tokens
//   top-k:   probs = softmax(top-k logits)         (moe_router_pre_softmax: top-k of softmax(logits))
//   out(x) = sum over the k chosen experts e of probs_e * expert_e(x)
//   expert_e(x) = W2_e act(W1_e x + b1_e) + b2_e   (act: the model's, e.g. GELU or SwiGLU)
//
// Dropless, as Megatron's default (no capacity factor): every token reaches its k experts. The
// tokens are sorted by expert once (one read of the per-expert counts on the host), each expert
// runs one product on its rows, and the weighted outputs are added back per token.
//
// Tensor parallelism (Megatron's expert tensor parallelism with the size of the TP group): every
// expert is split as the dense MLP is (W1 column-parallel, W2 row-parallel), the routing is the
// same on every TP rank, and the outputs are weighted before the one reduction of the layer, as
// Megatron's alltoall dispatcher does. Under sequence parallelism the router runs on this rank's
// rows only (its weight's gradient is a partial sum, dtk_param_info.sequence_parallel), the rows
// and their routing are all-gathered into the region and the output reduce-scattered out of it.
//
// Auxiliary losses, in training only, reach the router through its backward on every pipeline
// stage (Megatron's MoEAuxLossAutoScaler; the host's dtk.ext.aux_loss.v1 gives the factor of the
// step's loss): the load-balancing loss of Switch Transformer (Megatron's "aux_loss",
// moe_aux_loss_coeff) and ST-MoE's z-loss (moe_z_loss_coeff). Their values without the
// coefficient, averaged over the MoE layers, reach the log line as load_balancing_loss and
// z_loss (Megatron's names).
#pragma once

#include <dtk/layers/tensor_parallel.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtk::layers {

struct MoeConfig {
  int64_t num_experts = 0;  // 0: dense MLPs
  int64_t topk = 2;
  int64_t ffn = 0;                   // an expert's inner size (0 until read: the model's ffn)
  int64_t layer_freq = 1;            // layer i (0-based, whole model) is an MoE layer when i % layer_freq == 0
  bool pre_softmax = false;          // top-k of the softmax instead of the softmax of the top-k
  bool router_fp32 = false;          // the router's product and softmax in fp32 (else the input's dtype)
  double topk_scaling_factor = 0.0;  // > 0: the chosen probabilities times this
  double aux_loss_coeff = 0.0;       // load balancing (Megatron's moe_router_load_balancing_type aux_loss)
  double z_loss_coeff = 0.0;
  // The model's MoE layers: each records its losses' share of their mean over the layers for the
  // log (dtk.ext.aux_loss.v1's record, ABI 2.10), as Megatron-LM prints them.
  int64_t logged_layers = 1;
  bool enabled() const { return num_experts > 0; }
  bool is_moe_layer(int64_t index) const { return enabled() && index % layer_freq == 0; }
  int64_t num_moe_layers(int64_t num_layers) const {
    return enabled() ? (num_layers + layer_freq - 1) / layer_freq : 0;
  }
};

// The MoE options a decoder LM declares (read_options reads them by these names; Megatron's
// --num-experts, --moe-router-topk, --moe-ffn-hidden-size, --moe-layer-freq,
// --moe-router-pre-softmax, --moe-router-topk-scaling-factor, --moe-aux-loss-coeff,
// --moe-z-loss-coeff).
// (Each one a constant, listed one by one in the plugin's option table.)
inline constexpr dtk_option_spec kNumExpertsOption =
    opt_int("num_experts", "0",
            "Mixture of experts: experts per MoE layer (0 = dense MLPs; Megatron's --num-experts). Each token runs "
            "moe_router_topk of them. The moe_ options act only with num_experts > 0.");
inline constexpr dtk_option_spec kMoeRouterTopkOption =
    opt_int("moe_router_topk", "2", "Experts each token is routed to.");
inline constexpr dtk_option_spec kMoeFfnHiddenSizeOption =
    opt_int("moe_ffn_hidden_size", "0", "An expert's inner size; 0 = ffn_hidden_size.");
inline constexpr dtk_option_spec kMoeLayerFreqOption =
    opt_int("moe_layer_freq", "1", "Every this many layers is an MoE layer, from the first (1 = all).");
inline constexpr dtk_option_spec kMoeRouterPreSoftmaxOption =
    opt_bool("moe_router_pre_softmax", "false",
             "Top-k of the softmax over all experts instead of the softmax over the top-k logits.");
inline constexpr dtk_option_spec kMoeRouterFp32Option =
    opt_bool("moe_router_fp32", "false",
             "The router's product and softmax in fp32 (Megatron's --moe-router-dtype fp32); else in the model's "
             "dtype.");
inline constexpr dtk_option_spec kMoeRouterTopkScalingFactorOption =
    opt_float("moe_router_topk_scaling_factor", "0", "> 0: the chosen probabilities times this.");
inline constexpr dtk_option_spec kMoeAuxLossCoeffOption =
    opt_float("moe_aux_loss_coeff", "0",
              "Weight of the load-balancing loss (Switch Transformer's; Megatron's aux_loss) per MoE layer; 0 = none.");
inline constexpr dtk_option_spec kMoeZLossCoeffOption =
    opt_float("moe_z_loss_coeff", "0", "Weight of the router's z-loss (ST-MoE) per MoE layer; 0 = none.");

// An expert's activation on its input projections' outputs (one: GELU; two: SwiGLU's gate and up).
using ExpertActivation = std::function<at::Tensor(const std::vector<at::Tensor>& projected)>;

class MoeMlp {
 public:
  MoeMlp() = default;
  // `inputs` names the input projections (gpt: {"dense_h_to_4h"}, llama: {"gate", "up"}) and
  // `output` the output one; the router weight [experts, hidden] (and with `bias` its bias, as
  // Megatron's with add_bias_linear) is drawn with init_std, each expert's input projections with
  // init_std and its output projection with out_std.
  MoeMlp(const MoeConfig& c, int64_t hidden, std::vector<std::string> inputs, std::string output, bool bias,
         double init_std, double out_std, const TPGroup& tp, ParamFactory& f);

  // x [b, s, h] (under sequence parallelism this rank's [b, s / tp, h]), the normed input -> the
  // MLP branch of the same shape, after the layer's reduction, biases included.
  at::Tensor forward(const at::Tensor& x, const ExpertActivation& activation) const;

  // "router.weight" (and "router.bias"), then per expert e "experts.<e>.<projection>.weight" (and .bias) under
  // prefix; the experts' tensors marked dtk_param_info.expert.
  void add_params(std::vector<Param>& out, const std::string& prefix) const;

  struct Expert {
    std::vector<ColumnParallelLinear> in;
    RowParallelLinear out;
  };
  at::Tensor router;       // [experts, hidden], replicated
  at::Tensor router_bias;  // [experts] with biases, else undefined
  std::vector<Expert> experts;

 private:
  struct Routing {
    at::Tensor probs;    // [tokens, k], the chosen experts' weights (differentiable)
    at::Tensor experts;  // [tokens, k] int64
  };
  Routing route(const at::Tensor& x) const;
  at::Tensor run_experts(const at::Tensor& x, const Routing& r, const ExpertActivation& activation) const;
  at::Tensor output_bias(const Routing& r, at::ScalarType dtype) const;
  at::Tensor expert_counts(const at::Tensor& chosen) const;

  MoeConfig c_;
  std::vector<std::string> inputs_;
  std::string output_;
  TPGroup tp_;
};

// The load-balancing loss of Switch Transformer as Megatron-LM computes it: scores [tokens,
// experts] (the softmax over all experts, fp32), tokens_per_expert [experts] (how many of the
// `total_tokens` chose each, over the whole micro-batch), E * coeff / (k * T^2) *
// sum_e(sum_t scores[t, e] * tokens_per_expert[e]).
at::Tensor switch_load_balancing_loss(const at::Tensor& scores, const at::Tensor& tokens_per_expert,
                                      int64_t total_tokens, int64_t topk, double coeff);

// ST-MoE's z-loss: coeff * mean over tokens of logsumexp(logits)^2.
at::Tensor router_z_loss(const at::Tensor& logits, double coeff);

// `x` in forward; in backward its gradient passes on and `loss` receives the gradient the host
// gives a loss of the step's objective (aux_loss_backward_scale(tokens)), so the loss joins the
// objective without being added to the step's (Megatron's MoEAuxLossAutoScaler). `tokens`: the
// micro-batch's tokens the loss covers (all TP ranks').
at::Tensor attach_aux_loss(const at::Tensor& x, const at::Tensor& loss, int64_t tokens);

// Adds `value` (one element) to this training iteration's `name` in the log (dtk.ext.aux_loss.v1's
// record, ABI 2.10: the host sums the ranks' shares and averages over micro-batches and
// data-parallel ranks). Nothing without the extension.
void record_aux_metric(const char* name, const at::Tensor& value);

// The host's factor for an auxiliary loss's gradient (dtk.ext.aux_loss.v1): backward_scale(),
// times `tokens` under a per-token loss. 1 without the extension (an older host, a unit test).
double aux_loss_backward_scale(int64_t tokens);

}  // namespace dtk::layers
