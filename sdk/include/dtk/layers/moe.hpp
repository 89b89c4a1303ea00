// dtk/layers/moe.hpp — a mixture-of-experts MLP (Megatron-LM's MoELayer: TopKRouter, the
// experts, the shared experts, the token dispatcher's permute and unpermute), for model plugins
// (gpt, llama, yours).
//
//   logits = x W_router^T                          [tokens, experts], the router on this rank's tokens
//   softmax scores: probs = softmax(top-k logits)  (moe_router_pre_softmax: top-k of softmax(logits))
//   sigmoid scores: s = sigmoid(logits), probs = top-k s / their sum   (DeepSeek-V3's router)
//   sqrtsoftplus scores: s = sqrt(softplus(logits)), then as sigmoid's  (Megatron's sqrtsoftplus)
//   out(x) = sum over the k chosen experts e of probs_e * expert_e(x)  [+ shared(x), gated or not]
//   expert_e(x) = W2_e act(W1_e x + b1_e) + b2_e   (act: the model's, e.g. GELU or SwiGLU)
//
// Group-limited routing (moe_router_num_groups, moe_router_group_topk; DeepSeek's device- and
// node-limited routing): the experts form equal groups, a group scores the sum of its best
// topk / group_topk experts, and a token's k experts come from its group_topk best groups.
//
// Dropless, as Megatron's default (no capacity factor): every token reaches its k experts. The
// tokens are sorted by expert once (one read of the per-expert counts on the host), each expert
// runs one product on its rows, and the weighted outputs are added back per token.
//
// Token dropping (Megatron's --moe-expert-capacity-factor f, its apply_router_token_dropping): of
// one router call's T tokens (this rank's rows) each expert keeps at most
// C = ceil(T k / experts * f), the C with the highest weights (drop policy "probs") or the first C
// in Megatron's [sequence, batch] token order (policy "position"); a dropped choice weighs zero, so
// a token dropped by all its experts passes on the residual only. With C >= T nothing is dropped.
// Padding to capacity (--moe-pad-expert-input-to-capacity) gives every expert exactly its
// capacity's rows, the unfilled ones weighted zero: the same outputs and gradients with static
// shapes and no host read of the counts (only the expert bias differs: as in Megatron, every
// expert's load is then its capacity). Generation (a key/value cache) routes dropless.
//
// Expert parallelism (Megatron's --expert-model-parallel-size): the routed experts are split over
// the expert-parallel group (data-parallel ranks, each with its own tokens). Every rank routes its
// own tokens; then one of Megatron's two token dispatchers (moe_token_dispatcher):
//   allgather (default): the rows, their weights and their experts are all-gathered over the group,
//     each rank runs its own experts on the rows routed to them, and the weighted outputs are
//     reduce-scattered back to the rows' ranks (each rank receives and sends every rank's rows);
//   alltoall: each rank sends every choice's row to the rank holding its expert only, sorted by
//     expert (the counts per expert all-gathered first, one host read; with padding to capacity
//     every expert gets its capacity's rows from every rank, no read), the receiver groups the
//     rows by expert, runs its experts, and sends each output back, weighted and summed on the
//     row's own rank. A rank moves its tokens' k choices instead of every rank's tokens.
// Both compute the same outputs and gradients up to rounding (the gradients take the mirror path). The experts'
// second biases, a small table, are all-gathered instead.
//
// Tensor parallelism (Megatron's expert tensor parallelism with the size of the TP group): every
// expert is split as the dense MLP is (W1 column-parallel, W2 row-parallel), the routing is the
// same on every TP rank, and the outputs are weighted before the one reduction of the layer, as
// Megatron's alltoall dispatcher does. Under sequence parallelism the router runs on this rank's
// rows only (its weight's gradient is a partial sum, dtk_param_info.sequence_parallel), the rows
// and their routing are all-gathered into the region and the output reduce-scattered out of it;
// with the alltoall dispatcher under expert parallelism each TP rank instead sends its own rows
// over its expert-parallel group, the rows the TP group received are all-gathered over it before
// the experts and their outputs reduce-scattered back to their receivers (uneven parts, by
// all-to-all), as Megatron's alltoall dispatcher does: the expert-parallel group carries a TP-th
// of the rows. A shared expert is split the same way; ungated it joins the experts' reduction
// (with the alltoall dispatcher under SP and EP it has its own, its sum added after), gated (its
// output times sigmoid(x g), g [1, hidden], Megatron's moe_shared_expert_gate) it has its own.
//
// Input jitter (Megatron's --moe-input-jitter-eps eps, Switch Transformer's): the router's input,
// not the experts', is multiplied by Uniform(1 - eps, 1 + eps) noise per element, in training and
// evaluation as Megatron's TopKRouter (not in generation). The noise is hashed as dropout's masks
// are (dtk/layers/dropout.hpp), drawn from the layer's hidden-dropout generator (Megatron's
// default stream): recomputation repeats it, every TP rank draws the same, sequence parallelism
// applies the whole sequence's draw to each rank's rows (so SP == TP), and a captured step draws
// it anew for each replay. Under context parallelism each rank draws for its own share from the
// stream the group shares (as its dropout masks, and Megatron's, whose seeds have no CP term):
// the same bits on different positions, not one process's noise.
//
// Auxiliary losses, in training only, reach the router through its backward on every pipeline
// stage (Megatron's MoEAuxLossAutoScaler; the host's dtk.ext.aux_loss.v1 gives the factor of the
// step's loss): the load-balancing loss of Switch Transformer over the micro-batch (Megatron's
// "aux_loss"), over each sequence, averaged (Megatron's "seq_aux_loss", DeepSeek-V3's
// complementary sequence-wise loss) or with the tokens per expert of the global batch so far
// (Megatron's "global_aux_loss", Qwen's global-batch balance), weighted by moe_aux_loss_coeff, and ST-MoE's z-loss
// (moe_z_loss_coeff). Their values without the coefficient, averaged over the MoE layers, reach
// the log line as load_balancing_loss, seq_load_balancing_loss, global_load_balancing_loss and
// z_loss (Megatron's names).
//
// Balancing by the choice itself, without a loss (moe_router_load_balancing_type alone):
//   sinkhorn (S-BASE, Megatron's sinkhorn_load_balancing): in training each token's k experts are
//     the top-k of sinkhorn(logits), the token-by-expert matrix scaled to equal row and column
//     sums, and weighted by sigmoid(logits) (k = 1) or softmax(logits) over all experts (k > 1) at
//     them; in evaluation the top-k of those weights.
//   quantile_balancing (Megatron's dual coordinate-descent QB): the top-k of logits - beta, beta a
//     per-expert bias (a checkpointed buffer) that training forwards estimate as the column
//     quantile putting tokens * k / experts tokens on every expert; after each iteration beta
//     becomes ema * beta + (1 - ema) * the estimates' mean over the iteration and the
//     data-parallel ranks, centred. The weights are the score function's at the chosen experts.
// Both choose on the whole sequence's logits under sequence parallelism (gathered over the TP
// group, so SP == TP; Megatron gathers them for QB and not for sinkhorn) and under context
// parallelism (gathered over the context-parallel group too, so CP == one process).
//
// DeepSpeed's gate (moe_gate=deepspeed; Megatron-DeepSpeed's --num-experts with --topk, DeepSpeed's
// TopKGate: top1gating, Switch Transformer's, top2gating, GShard's, and topkgating for k > 2):
//   the router [experts, hidden] without a bias, its product and softmax in fp32: gates g [T, E];
//   top-1: the argmax of g, weighted g at it (not renormalised);
//   top-2: the argmax e1, then the argmax of logits + Gumbel noise with e1 masked out
//     (moe_top2_2nd_expert_sampling; the plain second best without it), weighted g / (g1 + g2)
//     over the choices kept (the sum clamped to fp32's epsilon);
//   top-k, k > 2: the k highest logits, weighted as top-2's (no noise);
//   capacity C = max(ceil(T / E * f * k) in fp32, moe_min_capacity), f the training factor
//     (moe_expert_capacity_factor) or in evaluation moe_eval_capacity_factor; 0 = dropless
//     (Megatron-DeepSpeed's --disable-moe-token-dropping, in both);
//   top-1 keeps of each expert's tokens the C with the highest Uniform(0, 1) draw (DeepSpeed's
//     random token selection); top-2 keeps each expert's first choices, then its second ones, in
//     Megatron's [sequence, batch] token order, up to C; top-k keeps each expert's C tokens of the
//     highest logit at it, counting the tokens that did not choose it as 0 (DeepSpeed's "probs"
//     policy ranks its chosen logits scattered into zeros);
//   the loss (weighted by moe_aux_loss_coeff per layer, DeepSpeed's l_aux: Megatron-DeepSpeed adds
//     --moe-loss-coeff times their sum over the layers): E * sum_e mean_t g[t, e] * (the share of
//     the T tokens whose first choice is e, before dropping; for k > 2, the share of all T k
//     choices that are e);
//   the experts' second projections have no bias (DeepSpeed's experts drop the bias their
//     ParallelMLP returns, so Megatron-DeepSpeed's never acts);
//   moe_residual (DeepSpeed's residual MoE, PR-MoE's; Megatron-DeepSpeed's --mlp-type residual):
//     a dense MLP of the experts' shape beside them (no second bias either), mixed per token as
//     out = experts(x) c0 + mlp(x) c1, (c0, c1) = softmax(x W_c^T + b_c), W_c [2, hidden].
// T is the micro-batch's tokens: the gate chooses on the whole sequence's logits under sequence
// and context parallelism (SP == TP, CP == one process; DP, PP and EP equal one process where it
// draws no noise). Its noise (the
// Gumbel draws, the selection's uniforms) comes from the
// layer's hidden-dropout generator as the input jitter's, in training and evaluation as
// DeepSpeed's; generation routes without noise and dropless.
#pragma once

#include <dtk/layers/context_parallel.hpp>
#include <dtk/layers/tensor_parallel.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace dtk::layers {

enum class MoeScore { kSoftmax, kSigmoid, kSqrtSoftplus };  // moe_router_score_function
enum class MoeDropPolicy { kProbs, kPosition };          // moe_token_drop_policy
// How the router chooses: the top-k of its scores, or balanced by the choice itself
// (moe_router_load_balancing_type sinkhorn or quantile_balancing).
enum class MoeRouting { kTopK, kSinkhorn, kQuantileBalancing };
enum class MoeGate { kMegatron, kDeepSpeed };  // moe_gate: Megatron-LM's TopKRouter or DeepSpeed's TopKGate
enum class MoeDispatcher { kAllGather, kAllToAll };  // moe_token_dispatcher

struct MoeConfig {
  int64_t num_experts = 0;  // 0: dense MLPs
  int64_t topk = 2;
  int64_t ffn = 0;         // an expert's inner size (0 until read: the model's ffn)
  int64_t layer_freq = 1;  // layer i (0-based, whole model) is an MoE layer when i % layer_freq == 0
  // Non-empty: layer i is an MoE layer when layer_pattern[i] (Megatron's --moe-layer-freq list,
  // one entry per layer of the whole model); layer_freq is then unused.
  std::vector<bool> layer_pattern;
  MoeScore score = MoeScore::kSoftmax;
  bool pre_softmax = false;          // softmax scores: top-k of the softmax instead of the softmax of the top-k
  int64_t num_groups = 0;            // group-limited routing: the experts in this many equal groups
  int64_t group_topk = 0;            // ... and each token's experts from its this many best groups (0: no limit)
  bool router_fp32 = false;          // the router's product and softmax in fp32 (else the input's dtype)
  double topk_scaling_factor = 0.0;  // > 0: the chosen probabilities times this
  // The load-balancing losses' weights, 0 where not computed (moe_router_load_balancing_type with
  // moe_aux_loss_coeff, one per type, Megatron's lists: the listed types' losses are added).
  double aux_loss_coeff = 0.0;         // aux_loss: Switch Transformer's over the micro-batch
  double seq_aux_loss_coeff = 0.0;     // seq_aux_loss: per sequence, averaged (DeepSeek-V3's)
  double global_aux_loss_coeff = 0.0;  // global_aux_loss: with the global batch's tokens per expert
  double z_loss_coeff = 0.0;
  MoeRouting routing = MoeRouting::kTopK;
  double quantile_ema = 0.0;  // quantile_balancing: how much of the old bias each update keeps
  // Auxiliary-loss-free balancing (DeepSeek-V3; sigmoid or sqrtsoftplus scores): a per-expert bias added to the
  // scores for the choice only, moved by bias_update_rate after every iteration toward the
  // experts below the mean load (end_moe_iteration).
  bool expert_bias = false;
  double bias_update_rate = 1e-3;
  // > 0: token dropping, each expert keeping at most capacity(T) of a router call's T tokens
  // (Megatron's --moe-expert-capacity-factor); 0: dropless.
  double capacity_factor = 0.0;
  MoeDropPolicy drop_policy = MoeDropPolicy::kProbs;  // which tokens an expert over capacity keeps
  bool pad_to_capacity = false;  // every expert multiplies exactly its capacity's rows (static shapes)
  int64_t shared_ffn = 0;    // > 0: a shared expert of this inner size runs on every token
  bool shared_gate = false;  // the shared expert's output times sigmoid(x g)
  double input_jitter_eps = 0.0;  // > 0: the router's input times Uniform(1 - eps, 1 + eps)
  // DeepSpeed's gate (see above): its capacity factor in evaluation (0: the training one), its
  // least capacity, and whether top-2 samples the second expert.
  MoeGate gate = MoeGate::kMegatron;
  double eval_capacity_factor = 0.0;
  int64_t min_capacity = 0;
  bool second_expert_sampling = true;
  bool residual = false;  // DeepSpeed's residual MoE: a dense MLP beside the experts, mixed per token
  // Non-empty: DeepSpeed's pyramid MoE, the experts of each MoE layer in the model's order
  // (Megatron-DeepSpeed's --num-experts list); num_experts is then their largest. at_layer() gives
  // each layer its own count.
  std::vector<int64_t> layer_experts;
  // The model's MoE layers: each records its losses' share of their mean over the layers for the
  // log (dtk.ext.aux_loss.v1's record, ABI 2.10), as Megatron-LM prints them.
  int64_t logged_layers = 1;
  // Expert parallelism (dtk_build_context.ep_size, ABI 2.12): this rank holds the routed experts
  // [first_local_expert(), + local_experts()) of the expert-parallel group's ep_size shares.
  int64_t ep_rank = 0, ep_size = 1;
  // Context parallelism (dtk_build_context.cp_size, ABI 2.20): each rank routes its share of every
  // sequence; the balancing losses count the tokens over the context-parallel group, and each
  // rank's loss is its share of the whole's (Megatron's tp_cp_group statistics); what decides on
  // whole sequences (DeepSpeed's gate, sinkhorn, quantile balancing) gathers them over the group.
  ContextParallel cp;
  MoeDispatcher dispatcher = MoeDispatcher::kAllGather;  // how tokens reach the other ranks' experts
  // moe_shared_expert_overlap: the shared expert's forward runs while the alltoall dispatcher's
  // rows are in flight to the experts (Megatron's --moe-shared-expert-overlap).
  bool shared_expert_overlap = false;
  int64_t local_experts() const { return num_experts / ep_size; }
  int64_t first_local_expert() const { return ep_rank * local_experts(); }
  bool enabled() const { return num_experts > 0; }
  bool drops_tokens() const { return capacity_factor > 0.0; }
  bool balances() const { return aux_loss_coeff > 0.0 || seq_aux_loss_coeff > 0.0 || global_aux_loss_coeff > 0.0; }
  // Megatron's get_capacity for T tokens routed k ways: ceil(T k / num_experts * capacity_factor).
  int64_t capacity(int64_t tokens) const;
  // DeepSpeed's _capacity for T tokens routed k ways: max(ceil(T / E * f * k), min_capacity),
  // f the training or the evaluation factor; computed in fp32 as DeepSpeed's.
  int64_t deepspeed_capacity(int64_t tokens, bool training) const;
  bool is_moe_layer(int64_t index) const {
    if (!enabled()) return false;
    if (!layer_pattern.empty())
      return index >= 0 && index < static_cast<int64_t>(layer_pattern.size()) && layer_pattern[index];
    return index % layer_freq == 0;
  }
  int64_t num_moe_layers(int64_t num_layers) const {
    int64_t n = 0;
    for (int64_t i = 0; i < num_layers; ++i) n += is_moe_layer(i) ? 1 : 0;
    return n;
  }
  // The configuration MoE layer `index` (0-based, whole model, of num_layers) is built with: its
  // own expert count (layer_experts) and the number of MoE layers its logged losses average over.
  MoeConfig at_layer(int64_t index, int64_t num_layers) const;
};

// moe_layer_num_experts (comma-separated positive counts, one per MoE layer) into c.layer_experts;
// std::invalid_argument names what is wrong. "" leaves it empty (num_experts on every MoE layer).
void parse_moe_layer_num_experts(const std::string& text, MoeConfig& c);

// moe_router_load_balancing_type and moe_aux_loss_coeff (each a comma-separated list, Megatron's
// lists: one coefficient per type) into c's coefficients, or sinkhorn or quantile_balancing alone
// (coefficient 0) into c.routing; std::invalid_argument names what is wrong.
void parse_moe_balance(const std::string& types, const std::string& coeffs, MoeConfig& c);

// Megatron-LM's --moe-layer-freq into `c`: an integer N (every N-th layer from the first: sets
// layer_freq) or a Python list of 0 and 1, one per layer, written out or as a sum of repeated
// lists ("[1,0,1,0]", "[0]*3+[1]*11", parenthesised or quoted as Megatron's scripts write it: sets
// layer_pattern). Throws std::invalid_argument saying what it cannot read.
void parse_moe_layer_freq(const std::string& text, MoeConfig& c);

// The MoE options a decoder LM declares (read_options reads them by these names; Megatron-LM's
// --num-experts and --moe-* flags of the same names). A model lists them all with
// DTK_LAYERS_MOE_OPTIONS in its option table.
inline constexpr dtk_option_spec kNumExpertsOption =
    opt_int("num_experts", "0",
            "Mixture of experts: experts per MoE layer (0 = dense MLPs; Megatron's --num-experts; the largest layer's "
            "with moe_layer_num_experts). Each token runs moe_router_topk of them. The moe_ options act only with "
            "num_experts > 0.");
inline constexpr dtk_option_spec kMoeRouterTopkOption =
    opt_int("moe_router_topk", "2", "Experts each token is routed to.");
inline constexpr dtk_option_spec kMoeFfnHiddenSizeOption =
    opt_int("moe_ffn_hidden_size", "0", "An expert's inner size; 0 = ffn_hidden_size.");
inline constexpr dtk_option_spec kMoeLayerFreqOption =
    opt_string("moe_layer_freq", "1",
               "Which layers are MoE layers: N = every N-th from the first (1 = all), or one 0/1 per layer as "
               "Megatron's Python list, e.g. [0]*3+[1]*11 or [1,0,1,0].");
inline constexpr dtk_option_spec kMoeRouterScoreFunctionOption =
    opt_enum("moe_router_score_function", "softmax", "softmax|sigmoid|sqrtsoftplus",
             "The router's scores: softmax, or sigmoid (DeepSeek-V3) or sqrt(softplus) with the chosen scores divided "
             "by their sum.");
inline constexpr dtk_option_spec kMoeRouterPreSoftmaxOption =
    opt_bool("moe_router_pre_softmax", "false",
             "Softmax scores: top-k of the softmax over all experts instead of the softmax over the top-k logits.");
inline constexpr dtk_option_spec kMoeRouterNumGroupsOption =
    opt_int("moe_router_num_groups", "0",
            "Group-limited routing: the experts in this many equal groups (0 = none; needs "
            "moe_router_group_topk).");
inline constexpr dtk_option_spec kMoeRouterGroupTopkOption =
    opt_int("moe_router_group_topk", "0",
            "Group-limited routing: each token's experts come from its this many best groups, a group scored by "
            "the sum of its best moe_router_topk / moe_router_group_topk experts.");
inline constexpr dtk_option_spec kMoeRouterFp32Option =
    opt_bool("moe_router_fp32", "false",
             "The router's product and softmax in fp32 (Megatron's --moe-router-dtype fp32); else in the model's "
             "dtype.");
inline constexpr dtk_option_spec kMoeRouterTopkScalingFactorOption =
    opt_float("moe_router_topk_scaling_factor", "0", "> 0: the chosen probabilities times this.");
inline constexpr dtk_option_spec kMoeRouterLoadBalancingTypeOption =
    opt_string("moe_router_load_balancing_type", "aux_loss",
               "The load-balancing loss moe_aux_loss_coeff weighs: Switch Transformer's over the micro-batch "
               "(aux_loss), its mean over the sequences (seq_aux_loss, DeepSeek-V3's), with the tokens per expert "
               "of the global batch so far (global_aux_loss, over every data-parallel rank), or none; or a "
               "comma-separated list of the first three, their losses added (Megatron's lists). sinkhorn (S-BASE) "
               "or quantile_balancing (a per-expert bias by dual coordinate descent) balance by the choice itself, "
               "listed alone with coefficient 0.");
inline constexpr dtk_option_spec kMoeAuxLossCoeffOption =
    opt_string("moe_aux_loss_coeff", "0",
               "Weight of the load-balancing loss per MoE layer; 0 = none. With a list of types, a comma-separated "
               "list of as many weights, in their order.");
inline constexpr dtk_option_spec kMoeZLossCoeffOption =
    opt_float("moe_z_loss_coeff", "0", "Weight of the router's z-loss (ST-MoE) per MoE layer; 0 = none.");
inline constexpr dtk_option_spec kMoeRouterEnableExpertBiasOption =
    opt_bool("moe_router_enable_expert_bias", "false",
             "Auxiliary-loss-free balancing (DeepSeek-V3, sigmoid or sqrtsoftplus scores): a per-expert bias on the "
             "scores for the "
             "choice, after every iteration moved by moe_router_bias_update_rate toward the less loaded experts.");
inline constexpr dtk_option_spec kMoeRouterBiasUpdateRateOption = opt_float(
    "moe_router_bias_update_rate", "1e-3", "How far the expert bias moves per iteration (sign of the load's offset).");
inline constexpr dtk_option_spec kMoeExpertCapacityFactorOption =
    opt_float("moe_expert_capacity_factor", "0",
              "> 0: token dropping, each expert taking at most ceil(tokens * moe_router_topk / num_experts * this) "
              "of a router call's tokens (Megatron's --moe-expert-capacity-factor); 0 = dropless.");
inline constexpr dtk_option_spec kMoeTokenDropPolicyOption =
    opt_enum("moe_token_drop_policy", "probs", "probs|position",
             "Which tokens an expert over its capacity keeps: those with the highest weights (probs), or the first "
             "in Megatron's [sequence, batch] order (position).");
inline constexpr dtk_option_spec kMoePadExpertInputToCapacityOption =
    opt_bool("moe_pad_expert_input_to_capacity", "false",
             "Every expert multiplies exactly its capacity's rows, the unfilled ones weighted zero: the same "
             "outputs with static shapes and no host read (needs moe_expert_capacity_factor > 0; the expert bias, "
             "as in Megatron, then sees every expert at its capacity).");
inline constexpr dtk_option_spec kMoeSharedExpertIntermediateSizeOption =
    opt_int("moe_shared_expert_intermediate_size", "0",
            "> 0: a shared expert of this inner size (the model's MLP) runs on every token beside the routed ones.");
inline constexpr dtk_option_spec kMoeSharedExpertGateOption = opt_bool(
    "moe_shared_expert_gate", "false", "The shared expert's output times sigmoid(x g), g a learned [1, hidden].");
inline constexpr dtk_option_spec kMoeInputJitterEpsOption =
    opt_float("moe_input_jitter_eps", "0",
              "> 0: the router's input (not the experts') times Uniform(1 - eps, 1 + eps) noise per element, in "
              "training and evaluation (Megatron's --moe-input-jitter-eps); 0 = none.");

inline constexpr dtk_option_spec kMoeGateOption = opt_enum(
    "moe_gate", "megatron", "megatron|deepspeed",
    "The router: Megatron-LM's TopKRouter (megatron), or DeepSpeed's TopKGate as Megatron-DeepSpeed's "
    "--num-experts runs it (deepspeed: top-1, top-2 or top-k, fp32, capacity with moe_min_capacity, random token "
    "selection for top-1, its own load-balancing loss, no router bias and no second expert bias).");
inline constexpr dtk_option_spec kMoeEvalCapacityFactorOption =
    opt_float("moe_eval_capacity_factor", "0",
              "moe_gate=deepspeed: the capacity factor in evaluation (Megatron-DeepSpeed's "
              "--moe-eval-capacity-factor); 0 = moe_expert_capacity_factor.");
inline constexpr dtk_option_spec kMoeMinCapacityOption =
    opt_int("moe_min_capacity", "0",
            "moe_gate=deepspeed: the least capacity of an expert whatever the factor (Megatron-DeepSpeed's "
            "--moe-min-capacity, default 4 there).");
inline constexpr dtk_option_spec kMoeTop2SecondExpertSamplingOption =
    opt_bool("moe_top2_2nd_expert_sampling", "true",
             "moe_gate=deepspeed with moe_router_topk=2: the second expert is the best of the logits plus Gumbel "
             "noise (false: the second best; Megatron-DeepSpeed's --disable-moe-top2-2nd-expert-sampling).");

inline constexpr dtk_option_spec kMoeLayerNumExpertsOption =
    opt_string("moe_layer_num_experts", "",
               "moe_gate=deepspeed: DeepSpeed's pyramid MoE (PR-MoE; Megatron-DeepSpeed's --num-experts list), the "
               "experts of each MoE layer in order, comma-separated, one per layer moe_layer_freq picks, e.g. "
               "32,32,64,64; num_experts must be their largest. Empty = num_experts on every MoE layer.");
inline constexpr dtk_option_spec kMoeResidualOption =
    opt_bool("moe_residual", "false",
             "moe_gate=deepspeed: DeepSpeed's residual MoE (Megatron-DeepSpeed's --mlp-type residual): a dense MLP "
             "of the experts' shape beside them, out = experts(x) c0 + mlp(x) c1 with (c0, c1) = softmax(x W^T + b), "
             "W [2, hidden].");

inline constexpr dtk_option_spec kMoeTokenDispatcherOption =
    opt_enum("moe_token_dispatcher", "allgather", "allgather|alltoall",
             "Expert parallelism: how tokens reach the experts on other ranks (Megatron's "
             "--moe-token-dispatcher-type): every rank's tokens all-gathered and the outputs reduce-scattered "
             "(allgather), or each token's row sent only to the ranks of its experts and back (alltoall). The "
             "same results up to rounding.");

inline constexpr dtk_option_spec kMoeSharedExpertOverlapOption =
    opt_bool("moe_shared_expert_overlap", "false",
             "With a shared expert and moe_token_dispatcher=alltoall (Megatron's --moe-shared-expert-overlap): "
             "the shared expert's forward runs while the rows are in flight to the other ranks' experts. The "
             "same results; the backward's exchanges are waited at once.");

inline constexpr dtk_option_spec kMoeRouterQuantileBalancingEmaOption =
    opt_float("moe_router_quantile_balancing_ema", "0",
              "quantile_balancing: after each iteration the bias is this times the old one plus 1 - this times "
              "the iteration's estimate (averaged over its micro-batches and the data-parallel ranks), then "
              "centred (0 = the latest estimate alone).");

// Every option above, for a plugin's option table (one list for every model that has experts).
#define DTK_LAYERS_MOE_OPTIONS                                                                              \
  dtk::layers::kNumExpertsOption, dtk::layers::kMoeRouterTopkOption, dtk::layers::kMoeFfnHiddenSizeOption,  \
      dtk::layers::kMoeLayerFreqOption, dtk::layers::kMoeRouterScoreFunctionOption,                         \
      dtk::layers::kMoeRouterPreSoftmaxOption, dtk::layers::kMoeRouterNumGroupsOption,                      \
      dtk::layers::kMoeRouterGroupTopkOption, dtk::layers::kMoeRouterFp32Option,                            \
      dtk::layers::kMoeRouterTopkScalingFactorOption, dtk::layers::kMoeRouterLoadBalancingTypeOption,       \
      dtk::layers::kMoeAuxLossCoeffOption, dtk::layers::kMoeZLossCoeffOption,                               \
      dtk::layers::kMoeRouterEnableExpertBiasOption, dtk::layers::kMoeRouterBiasUpdateRateOption,           \
      dtk::layers::kMoeExpertCapacityFactorOption, dtk::layers::kMoeTokenDropPolicyOption,                  \
      dtk::layers::kMoePadExpertInputToCapacityOption, dtk::layers::kMoeSharedExpertIntermediateSizeOption, \
      dtk::layers::kMoeSharedExpertGateOption, dtk::layers::kMoeInputJitterEpsOption,                       \
      dtk::layers::kMoeRouterQuantileBalancingEmaOption, dtk::layers::kMoeGateOption,                       \
      dtk::layers::kMoeEvalCapacityFactorOption, dtk::layers::kMoeMinCapacityOption,                        \
      dtk::layers::kMoeTop2SecondExpertSamplingOption, dtk::layers::kMoeResidualOption,                     \
      dtk::layers::kMoeLayerNumExpertsOption, dtk::layers::kMoeTokenDispatcherOption,                       \
      dtk::layers::kMoeSharedExpertOverlapOption

// An expert's activation on its input projections' outputs (one: GELU; two: SwiGLU's gate and up).
using ExpertActivation = std::function<at::Tensor(const std::vector<at::Tensor>& projected)>;

class MoeMlp {
 public:
  MoeMlp() = default;
  // `inputs` names the input projections (gpt: {"dense_h_to_4h"}, llama: {"gate", "up"}) and
  // `output` the output one; the router weight [experts, hidden] (and with `bias` its bias, as
  // Megatron's with add_bias_linear) is drawn with init_std, each expert's input projections with
  // init_std and its output projection with out_std; then the shared expert's, and its gate with
  // init_std.
  MoeMlp(const MoeConfig& c, int64_t hidden, std::vector<std::string> inputs, std::string output, bool bias,
         double init_std, double out_std, const TPGroup& tp, ParamFactory& f);

  // x [b, s, h] (under sequence parallelism this rank's [b, s / tp, h]), the normed input -> the
  // MLP branch of the same shape, after the layer's reduction, biases included. `generating`: a
  // forward with a key/value cache, which routes every token to its experts whatever the capacity
  // (as Megatron's inference router): a cached step's few tokens and the left padding of a batch
  // would otherwise change which tokens fit. `jitter_rng`: the generator the input jitter's and
  // DeepSpeed's gate's noise is drawn from (the layer's DropoutRng::hidden, inside a recomputed
  // block the block's); needed with moe_input_jitter_eps > 0 or moe_gate=deepspeed except when
  // generating, which draws none. `training`: the
  // model's training flag (Megatron's module.training; sinkhorn chooses differently in evaluation),
  // the same in both passes of a recomputed layer.
  at::Tensor forward(const at::Tensor& x, const ExpertActivation& activation, bool generating = false,
                     at::Generator* jitter_rng = nullptr, bool training = true) const;

  // "router.weight" (and "router.bias"), per expert e "experts.<e>.<projection>.weight" (and
  // .bias; e the expert's index in the whole layer, under expert parallelism this rank's only), then
  // "shared_experts.<projection>.weight" (.bias) and "shared_experts.gate_weight" (with moe_residual
  // "residual_mlp.<projection>.weight" (.bias), "coefficient.weight" and "coefficient.bias"), under
  // prefix; the routed experts' tensors marked dtk_param_info.expert.
  void add_params(std::vector<Param>& out, const std::string& prefix) const;
  // "router.expert_bias" (and "router.qb_beta") under prefix, where the layer has one.
  void add_buffers(std::vector<Param>& out, const std::string& prefix) const;

  struct Expert {
    std::vector<ColumnParallelLinear> in;
    RowParallelLinear out;
  };
  at::Tensor router;       // [experts, hidden], replicated
  at::Tensor router_bias;  // [experts] with biases, else undefined
  std::vector<Expert> experts;  // this rank's routed experts (all of them without expert parallelism)
  Expert shared;  // the shared expert (no projections without one)
  // With expert_bias: [experts] fp32 on the device, a buffer (checkpointed, not trained), and the
  // choices of this iteration's training forwards per expert, not yet applied (not saved: the
  // update follows every iteration before a checkpoint is written).
  at::Tensor expert_bias;
  mutable at::Tensor expert_load;
  // With global_aux_loss: the tokens per expert of this iteration's training forwards so far,
  // summed over the data-parallel (and sequence-parallel) ranks, [experts] fp32 (undefined before
  // the first), and how many forwards that is (Megatron's global_tokens_per_expert and ga_steps;
  // never saved: end_moe_iteration restarts them after every iteration).
  mutable at::Tensor global_tokens;
  mutable int64_t global_forwards = 0;
  // With quantile_balancing: the per-expert bias [experts] fp32 on the device (a buffer,
  // checkpointed), and the sum of this iteration's training forwards' estimates and their count
  // (Megatron's qb_beta, qb_beta_accum, qb_beta_count; end_moe_iteration folds them in).
  at::Tensor qb_beta;
  mutable at::Tensor qb_estimates;
  mutable int64_t qb_forwards = 0;
  at::Tensor shared_gate;  // [1, hidden] with moe_shared_expert_gate, else undefined
  // With moe_residual: `shared` is DeepSpeed's residual MLP, mixed with the experts by
  // softmax(x residual_coefficient^T + residual_coefficient_bias), [2, hidden] and [2].
  at::Tensor residual_coefficient, residual_coefficient_bias;
  bool has_shared_expert() const { return !shared.in.empty(); }
  const MoeConfig& config() const { return c_; }

 private:
  struct Routing {
    at::Tensor probs;    // [tokens, k], the chosen experts' weights (differentiable; zero where dropped)
    at::Tensor experts;  // [tokens, k] int64; num_experts where token dropping dropped the choice
    // Padding to capacity: the most choices any expert holds of these tokens (0: not padded).
    int64_t padded_rows = 0;
  };
  Routing route(const at::Tensor& x, int64_t batch, bool generating, bool training, at::Generator* rng) const;
  Routing deepspeed_route(const at::Tensor& x, int64_t batch, bool generating, bool training, at::Generator* rng) const;
  at::Tensor deepspeed_kept(const at::Tensor& chosen, const at::Tensor& logits, int64_t batch, bool training,
                            at::Generator& rng) const;
  at::Tensor jittered(const at::Tensor& x, at::Generator& gen) const;
  Routing choose(const at::Tensor& logits, int64_t batch, bool training) const;
  at::Tensor weights_at(const at::Tensor& logits, const at::Tensor& chosen) const;
  Routing sinkhorn_choice(const at::Tensor& logits, int64_t batch, bool training) const;
  at::Tensor quantile_choice(const at::Tensor& logits, int64_t batch, bool training) const;
  at::Tensor whole_sequence(const at::Tensor& rows, int64_t batch) const;
  at::Tensor own_rows(const at::Tensor& whole, int64_t batch) const;
  void drop_over_capacity(Routing& r, int64_t batch) const;
  at::Tensor choice_loads(const Routing& r) const;
  std::tuple<at::Tensor, at::Tensor> top_k(const at::Tensor& scores) const;
  at::Tensor balance_loss(const at::Tensor& logits, int64_t batch, int64_t total) const;
  at::Tensor global_balance_loss(const at::Tensor& scores, const at::Tensor& per_expert, int64_t total) const;
  int64_t sequence_parts() const;
  at::Tensor sum_over_sequence(const at::Tensor& counts) const;
  at::Tensor run_experts(const at::Tensor& x, const Routing& r, const ExpertActivation& activation) const;
  at::Tensor run_padded_experts(const at::Tensor& x, const Routing& r, const ExpertActivation& activation) const;
  at::Tensor run_experts_all_to_all(const at::Tensor& x, const Routing& r, const ExpertActivation& activation,
                                    const std::function<void()>& meanwhile) const;
  at::Tensor run_padded_experts_all_to_all(const at::Tensor& x, const Routing& r, const ExpertActivation& activation,
                                           const std::function<void()>& meanwhile) const;
  at::Tensor experts_all_to_all(const at::Tensor& sent, const std::vector<int64_t>& counts, bool padded,
                                const ExpertActivation& activation, const std::function<void()>& meanwhile) const;
  bool shares_tp_rows() const;
  bool overlaps_shared_expert() const;
  int64_t own_source() const;
  std::pair<at::Tensor, at::Tensor> dispatch_region(const at::Tensor& x, const Routing& local,
                                                    const ExpertActivation& activation) const;
  at::Tensor dispatch_own_rows(const at::Tensor& x, const Routing& local, const ExpertActivation& activation,
                               const std::function<void()>& meanwhile) const;
  at::Tensor output_bias(const Routing& r, at::ScalarType dtype) const;
  at::Tensor expert_counts(const at::Tensor& chosen, int64_t bins) const;

  MoeConfig c_;
  std::vector<std::string> inputs_;
  std::string output_;
  TPGroup tp_;
};

// After a training iteration (a model's end_iteration, once per iteration, taken or skipped):
// every layer's expert bias moves by its update rate times sign(mean load - the expert's load), the
// loads being the choices its training forwards made, summed over the data- and tensor-parallel
// ranks (Megatron-LM's _update_router_expert_bias), and the loads restart from zero; every
// quantile_balancing bias takes in its iteration's estimates, averaged over the forwards and the
// data-parallel ranks (Megatron's _update_router_qb_beta); then every layer's global_aux_loss
// counts restart (Megatron's reset_model_temporary_tensors). Every rank of a stage calls it with
// its layers (two all-reduces for all the expert biases, one for all the QB biases, none without
// them). A model that never calls it averages its global_aux_loss counts over the whole run and
// never moves its QB biases.
void end_moe_iteration(const std::vector<MoeMlp*>& layers);

// The name end_moe_iteration had before global_aux_loss (the same work, for models written
// against it).
void update_expert_biases(const std::vector<MoeMlp*>& layers);

// The load-balancing loss of Switch Transformer as Megatron-LM computes it: scores [tokens,
// experts] (the softmax over all experts, fp32), tokens_per_expert [experts] (how many of the
// `total_tokens` chose each, over the whole micro-batch), E * coeff / (k * T^2) *
// sum_e(sum_t scores[t, e] * tokens_per_expert[e]).
at::Tensor switch_load_balancing_loss(const at::Tensor& scores, const at::Tensor& tokens_per_expert,
                                      int64_t total_tokens, int64_t topk, double coeff);

// Megatron-LM's sequence-level variant ("seq_aux_loss"): the same loss for each sequence alone,
// averaged over the micro-batch's sequences. scores [sequences, positions, experts] (the
// normalised scores, fp32), tokens_per_expert [sequences, experts] (over each whole sequence of
// `seq_tokens` positions), mean over sequences of E * coeff / (k * S^2) * sum_e(sum_s scores *
// tokens_per_expert).
at::Tensor sequence_load_balancing_loss(const at::Tensor& scores, const at::Tensor& tokens_per_expert,
                                        int64_t seq_tokens, int64_t topk, double coeff);

// Megatron-LM's sinkhorn on cost [tokens, experts] (fp32): exp(cost) scaled by d0 [tokens] and d1
// [experts], alternately d0 = 1 / (tokens * (exp(cost) d1)) and d1 = 1 / (experts * (d0 exp(cost))),
// until the mean change of d1 is at most tol (at most 10,000 rounds: a bound Megatron has not).
at::Tensor sinkhorn(const at::Tensor& cost, double tol = 1e-4);

// ST-MoE's z-loss: coeff * mean over tokens of logsumexp(logits)^2.
at::Tensor router_z_loss(const at::Tensor& logits, double coeff);

// `x` in forward; in backward its gradient passes on and `loss` receives the gradient the host
// gives a loss of the step's objective (aux_loss_backward_scale(tokens)), so the loss joins the
// objective without being added to the step's (Megatron's MoEAuxLossAutoScaler). `tokens`: the
// micro-batch's tokens the loss covers (all TP and context-parallel ranks'). Under context
// parallelism (`context_parallel` C > 1) `loss` is this rank's share of the whole sequence's: a
// mean loss's gradient, averaged over the data- and context-parallel ranks, takes it C times.
at::Tensor attach_aux_loss(const at::Tensor& x, const at::Tensor& loss, int64_t tokens, int64_t context_parallel = 1);

// Adds `value` (one element) to this training iteration's `name` in the log (dtk.ext.aux_loss.v1's
// record, ABI 2.10: the host sums the ranks' shares and averages over micro-batches and
// data-parallel ranks). Nothing without the extension.
void record_aux_metric(const char* name, const at::Tensor& value);

// The host's factor for an auxiliary loss's gradient (dtk.ext.aux_loss.v1): backward_scale(),
// times `tokens` under a per-token loss, else times `context_parallel` (see attach_aux_loss). 1
// without the extension (an older host, a unit test).
double aux_loss_backward_scale(int64_t tokens, int64_t context_parallel = 1);

}  // namespace dtk::layers
