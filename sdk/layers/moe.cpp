// moe.cpp — see dtk/layers/moe.hpp. Megatron-LM: megatron/core/transformer/moe/{router.py,
// moe_utils.py (topk_routing_with_score_function, switch_load_balancing_loss_func, z_loss_func,
// MoEAuxLossAutoScaler, permute/unpermute), experts.py, token_dispatcher.py}.
#include <dtk/layers/moe.hpp>

#include <torch/csrc/autograd/custom_function.h>

#include <dtk/layers/decoder_lm.hpp>  // add_param
#include <dtk/module_hooks.hpp>

#include <utility>

namespace dtk::layers {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

const dtk_aux_loss_ext* aux_loss_extension() {
  static const dtk_aux_loss_ext* ext = [] {
    const dtk_host_services* h = host_services();
    if (!h || !h->get_extension) return static_cast<const dtk_aux_loss_ext*>(nullptr);
    const auto* e = static_cast<const dtk_aux_loss_ext*>(h->get_extension(DTK_EXT_AUX_LOSS_V1));
    return e && e->struct_size >= dtk_aux_loss_ext_STRUCT_SIZE_2_9 ? e : nullptr;
  }();
  return ext;
}

// Identity on x; in backward `loss` gets the gradient the host gives the step's loss.
struct AttachAuxLoss : public torch::autograd::Function<AttachAuxLoss> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& loss, int64_t tokens) {
    ctx->saved_data["tokens"] = tokens;
    ctx->save_for_backward({loss});
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const at::Tensor loss = ctx->get_saved_variables()[0];
    const double scale = aux_loss_backward_scale(ctx->saved_data["tokens"].toInt());
    return {grad[0], at::full_like(loss, scale), at::Tensor()};
  }
};

}  // namespace

void record_aux_metric(const char* name, const at::Tensor& value) {
  const dtk_aux_loss_ext* e = aux_loss_extension();
  if (!e || e->struct_size < dtk_aux_loss_ext_STRUCT_SIZE_2_10) return;
  e->record(name, wrap(value.detach().reshape({1})));
}

double aux_loss_backward_scale(int64_t tokens) {
  const dtk_aux_loss_ext* e = aux_loss_extension();
  if (!e) return 1.0;
  const double scale = e->backward_scale();
  return e->per_token_loss() ? scale * static_cast<double>(tokens) : scale;
}

at::Tensor attach_aux_loss(const at::Tensor& x, const at::Tensor& loss, int64_t tokens) {
  return AttachAuxLoss::apply(x, loss, tokens);
}

at::Tensor switch_load_balancing_loss(const at::Tensor& scores, const at::Tensor& tokens_per_expert,
                                      int64_t total_tokens, int64_t topk, double coeff) {
  const double e = static_cast<double>(scores.size(-1)), t = static_cast<double>(total_tokens);
  return (scores.sum(0) * tokens_per_expert.to(scores.scalar_type())).sum() *
         (e * coeff / (static_cast<double>(topk) * t * t));
}

at::Tensor router_z_loss(const at::Tensor& logits, double coeff) {
  return at::logsumexp(logits.to(at::kFloat), -1).square().mean() * coeff;
}

MoeMlp::MoeMlp(const MoeConfig& c, int64_t hidden, std::vector<std::string> inputs, std::string output, bool bias,
               double init_std, double out_std, const TPGroup& tp, ParamFactory& f)
    : c_(c), inputs_(std::move(inputs)), output_(std::move(output)), tp_(tp) {
  router = f.param(f.normal({c.num_experts, hidden}, init_std));
  // Megatron-LM's router has a bias with add_bias_linear, drawn like its weight.
  if (bias) router_bias = f.param(f.normal({c.num_experts}, init_std));
  experts.resize(static_cast<size_t>(c.num_experts));
  for (Expert& e : experts) {
    for (size_t i = 0; i < inputs_.size(); ++i) e.in.emplace_back(hidden, c.ffn, bias, init_std, tp, f);
    e.out = RowParallelLinear(c.ffn, hidden, bias, out_std, tp, f);
  }
}

// The router on this rank's tokens x [tokens, h]: the chosen experts and their weights, the
// auxiliary losses attached (training, with gradients) as Megatron's TopKRouter.routing does.
MoeMlp::Routing MoeMlp::route(const at::Tensor& x) const {
  const bool aux = at::GradMode::is_enabled() && x.requires_grad();
  // Under sequence parallelism each TP rank routes its own rows: the losses' sums over the group
  // are the whole micro-batch's, as the router's gradient (a partial sum here) is summed.
  const bool split = tp_.splits_sequence();
  const int64_t tokens = x.size(0), total = tokens * (split ? tp_.size : 1);
  // What this rank logs of a loss: its share of the mean over the MoE layers, and of the TP group's
  // sum (a partial sum under sequence parallelism, the whole loss on every rank otherwise).
  const double share = 1.0 / (static_cast<double>(c_.logged_layers) * (split ? 1 : tp_.size));
  // [tokens, experts], in x's dtype (Megatron's default router dtype) or fp32
  at::Tensor logits = c_.router_fp32 ? at::linear(x.to(at::kFloat), router.to(at::kFloat),
                                                  router_bias.defined() ? router_bias.to(at::kFloat) : router_bias)
                                     : dtk::linear(x, router, router_bias);
  if (aux && c_.z_loss_coeff > 0.0) {
    const at::Tensor z = router_z_loss(logits, c_.z_loss_coeff / (split ? tp_.size : 1));
    record_aux_metric("z_loss", z * (share / c_.z_loss_coeff));
    logits = attach_aux_loss(logits, z, total);
  }
  Routing r;
  if (c_.pre_softmax) {
    std::tie(r.probs, r.experts) = at::softmax(logits, -1, at::kFloat).topk(c_.topk, -1);
  } else {
    at::Tensor top;
    std::tie(top, r.experts) = logits.topk(c_.topk, -1);
    r.probs = at::softmax(top, -1, at::kFloat);
  }
  if (c_.topk_scaling_factor > 0.0) r.probs = r.probs * c_.topk_scaling_factor;
  // The experts' outputs are weighted in the router's dtype (fp32 with moe_router_fp32), as
  // Megatron's probs.type_as(logits).
  r.probs = r.probs.to(logits.scalar_type());
  if (aux && c_.aux_loss_coeff > 0.0) {
    const at::Tensor scores = at::softmax(logits, -1, at::kFloat);
    at::Tensor per_expert = expert_counts(r.experts).to(at::kFloat);
    if (split) Comm::all_reduce(per_expert, DTK_GROUP_TENSOR_PARALLEL, DTK_REDUCE_SUM);
    const at::Tensor balance = switch_load_balancing_loss(scores, per_expert, total, c_.topk, c_.aux_loss_coeff);
    record_aux_metric("load_balancing_loss", balance * (share / c_.aux_loss_coeff));
    r.probs = attach_aux_loss(r.probs, balance, total);
  }
  return r;
}

// How many of the [tokens, k] choices went to each expert, [experts] int64 on their device (a
// scatter, where bincount would read the range back to the host).
at::Tensor MoeMlp::expert_counts(const at::Tensor& chosen) const {
  const at::Tensor flat = chosen.reshape(-1);
  return at::zeros({c_.num_experts}, flat.options()).scatter_add_(0, flat, at::ones_like(flat));
}

// Every expert on the rows routed to it, inside the TP region: x [T, h] (all the group's rows),
// probs and experts [T, k]. The T x k choices are sorted by expert (one host read of the counts),
// each expert multiplies its run, and the outputs, times their weights, are put back in the
// choices' order and summed over each row's k: this rank's partial sum [T, h] of the experts'
// second products (before the layer's reduction). Only permutations and a sum over k move the
// rows, so the backward adds nothing with atomics (the same bits on every run, on a GPU too).
at::Tensor MoeMlp::run_experts(const at::Tensor& x, const Routing& r, const ExpertActivation& activation) const {
  const int64_t tokens = x.size(0), h = x.size(1), k = c_.topk;
  const at::Tensor order = std::get<1>(at::sort(r.experts.reshape(-1), /*stable=*/true, 0, false));
  const at::Tensor counts = expert_counts(r.experts).cpu();
  const at::Tensor sorted = x.unsqueeze(1).expand({tokens, k, h}).reshape({tokens * k, h}).index_select(0, order);
  const int64_t* count = counts.data_ptr<int64_t>();
  std::vector<at::Tensor> outputs;
  outputs.reserve(experts.size());
  int64_t offset = 0;
  // Every expert runs, an empty run included, so each of its weights gets a gradient (zero when no
  // row chose it), as a dense layer's would.
  for (size_t e = 0; e < experts.size(); ++e) {
    const at::Tensor run = sorted.narrow(0, offset, count[e]);
    offset += count[e];
    std::vector<at::Tensor> projected;
    for (const ColumnParallelLinear& in : experts[e].in) projected.push_back(dtk::linear(run, in.weight, in.bias));
    outputs.push_back(dtk::linear(activation(projected), experts[e].out.weight));
  }
  const at::Tensor unsorted = at::cat(outputs).index_select(0, at::argsort(order));
  const at::Tensor weighted = unsorted.to(r.probs.scalar_type()).view({tokens, k, h}) * r.probs.unsqueeze(-1);
  return weighted.sum(1).to(x.scalar_type());
}

// The experts' second biases, sum over a row's k experts of probs * b2 [tokens, h], on this
// rank's rows (after the reduction, as a row-parallel bias): the weights scattered into [tokens,
// experts] times the biases [experts, h], one product (no atomic adds in its backward).
at::Tensor MoeMlp::output_bias(const Routing& r, at::ScalarType dtype) const {
  if (experts.empty() || !experts[0].out.bias.defined()) return {};
  std::vector<at::Tensor> biases;
  for (const Expert& e : experts) biases.push_back(e.out.bias);
  const at::Tensor dense =
      at::zeros({r.experts.size(0), c_.num_experts}, r.probs.options()).scatter(1, r.experts, r.probs);
  return at::matmul(dense, at::stack(biases).to(r.probs.scalar_type())).to(dtype);
}

at::Tensor MoeMlp::forward(const at::Tensor& x, const ExpertActivation& activation) const {
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2);
  const Routing local = route(x.reshape({b * s, h}));
  // Into the TP region: the rows, their weights and their experts, whole on every TP rank.
  Routing region;
  at::Tensor rows;
  if (tp_.splits_sequence()) {
    rows = gather_from_sequence_parallel_region(x, tp_);
    region.probs = gather_from_sequence_parallel_region(local.probs.view({b, s, c_.topk}), tp_);
    region.experts = sequence_all_gather(local.experts.view({b, s, c_.topk}), tp_);
  } else {
    rows = copy_to_tp_region(x, tp_);
    region.probs = copy_to_tp_region(local.probs, tp_);
    region.experts = local.experts;
  }
  const int64_t whole = rows.size(1);
  region.probs = region.probs.reshape({b * whole, c_.topk});
  region.experts = region.experts.reshape({b * whole, c_.topk});
  const at::Tensor partial = run_experts(rows.reshape({b * whole, h}), region, activation);
  at::Tensor out = exit_tp_region(partial.view({b, whole, h}), tp_);
  const at::Tensor bias = output_bias(local, out.scalar_type());
  return bias.defined() ? out + bias.view({b, s, h}) : out;
}

void MoeMlp::add_params(std::vector<Param>& out, const std::string& prefix) const {
  add_param(out, prefix + "router.weight", router, -1, false);
  if (router_bias.defined()) add_param(out, prefix + "router.bias", router_bias, -1, true);
  for (size_t e = 0; e < experts.size(); ++e) {
    const std::string name = prefix + "experts." + std::to_string(e) + ".";
    const size_t first = out.size();
    for (size_t i = 0; i < inputs_.size(); ++i) {
      add_param(out, name + inputs_[i] + ".weight", experts[e].in[i].weight, 0, false);
      if (experts[e].in[i].bias.defined()) add_param(out, name + inputs_[i] + ".bias", experts[e].in[i].bias, 0, true);
    }
    add_param(out, name + output_ + ".weight", experts[e].out.weight, 1, false);
    if (experts[e].out.bias.defined()) add_param(out, name + output_ + ".bias", experts[e].out.bias, -1, true);
    for (size_t k = first; k < out.size(); ++k) out[k].info.expert = 1;
  }
}

}  // namespace dtk::layers
