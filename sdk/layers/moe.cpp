// moe.cpp — see dtk/layers/moe.hpp. Megatron-LM: megatron/core/transformer/moe/{router.py,
// moe_utils.py (topk_routing_with_score_function, group_limited_topk,
// compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func, z_loss_func,
// MoEAuxLossAutoScaler, permute/unpermute), experts.py, shared_experts.py, token_dispatcher.py},
// and arguments.py's --moe-layer-freq.
#include <dtk/layers/moe.hpp>

#include <torch/csrc/autograd/custom_function.h>

#include <dtk/comma_list.hpp>
#include <dtk/layers/decoder_lm.hpp>  // add_param
#include <dtk/layers/layer_pattern.hpp>
#include <dtk/module_hooks.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
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
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& loss, int64_t tokens,
                            int64_t context_parallel) {
    ctx->saved_data["tokens"] = tokens;
    ctx->saved_data["cp"] = context_parallel;
    ctx->save_for_backward({loss});
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const at::Tensor loss = ctx->get_saved_variables()[0];
    const double scale = aux_loss_backward_scale(ctx->saved_data["tokens"].toInt(), ctx->saved_data["cp"].toInt());
    return {grad[0], at::full_like(loss, scale), at::Tensor(), at::Tensor()};
  }
};

// One expert on its rows inside the TP region: this rank's partial sum of its second product
// (the second bias, a row-parallel one, is added after the reduction).
at::Tensor expert_partial(const MoeMlp::Expert& e, const at::Tensor& rows, const ExpertActivation& activation) {
  std::vector<at::Tensor> projected;
  for (const ColumnParallelLinear& in : e.in) projected.push_back(dtk::linear(rows, in.weight, in.bias));
  return dtk::linear(activation(projected), e.out.weight);
}

// A group's size; a process without the host's communicator (a unit test) is alone.
int64_t group_size(int32_t group) {
  const dtk_host_services* h = host_services();
  return h && h->comm ? Comm::size(group) : 1;
}

// The sum over a group.
void sum_over_group(const at::Tensor& t, int32_t group) {
  if (group_size(group) > 1) Comm::all_reduce(t, group, DTK_REDUCE_SUM);
}

// The group's rows (the expert-parallel group's by default), concatenated along dim 0 in rank order.
at::Tensor gather_expert_rows(const at::Tensor& x, int64_t size, int32_t group = DTK_GROUP_EXPERT_PARALLEL) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] *= size;
  at::Tensor out = at::empty(shape, x.options());
  Comm::all_gather(out, x.contiguous(), group);
  return out;
}

// Rank r's 1 / size of x's rows, summed over the expert-parallel group.
at::Tensor reduce_scatter_expert_rows(const at::Tensor& x, int64_t size) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] /= size;
  at::Tensor out = at::empty(shape, x.options());
  Comm::reduce_scatter(out, x.contiguous(), DTK_GROUP_EXPERT_PARALLEL);
  return out;
}

// Into the experts: forward all-gather over the expert-parallel group; backward reduce-scatter,
// each rank's rows receiving the gradients every rank's experts gave them.
struct GatherToExperts : public torch::autograd::Function<GatherToExperts> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t size) {
    ctx->saved_data["size"] = size;
    return gather_expert_rows(x, size);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {reduce_scatter_expert_rows(grad[0], ctx->saved_data["size"].toInt()), at::Tensor()};
  }
};

// Out of the experts: forward reduce-scatter (each row's outputs from every rank's experts
// summed on the row's rank); backward all-gather.
struct ScatterFromExperts : public torch::autograd::Function<ScatterFromExperts> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t size) {
    ctx->saved_data["size"] = size;
    return reduce_scatter_expert_rows(x, size);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {gather_expert_rows(grad[0], ctx->saved_data["size"].toInt()), at::Tensor()};
  }
};

at::Tensor gather_to_experts(const at::Tensor& x, int64_t size) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return gather_expert_rows(x, size);
  return GatherToExperts::apply(x, size);
}

at::Tensor scatter_from_experts(const at::Tensor& x, int64_t size) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return reduce_scatter_expert_rows(x, size);
  return ScatterFromExperts::apply(x, size);
}

// The tensor an all-to-all of x's rows receives into: parts[j] rows from rank j, x's other sizes.
at::Tensor receiving_rows(const at::Tensor& x, const std::vector<int64_t>& parts) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = 0;
  for (const int64_t n : parts) shape[0] += n;
  return at::empty(shape, x.options());
}

// Rows exchanged over the expert-parallel group (moe_token_dispatcher=alltoall): x's rows in
// consecutive parts, send[j] of them to rank j, and recv[j] rows from rank j, in rank order.
at::Tensor all_to_all_expert_rows(const at::Tensor& x, const std::vector<int64_t>& recv,
                                  const std::vector<int64_t>& send) {
  at::Tensor out = receiving_rows(x, recv);
  Comm::all_to_all(out, x.contiguous(), DTK_GROUP_EXPERT_PARALLEL, recv, send);
  return out;
}

// Forward the exchange; backward the gradients take the way back (the splits swapped).
struct ExchangeExpertRows : public torch::autograd::Function<ExchangeExpertRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::vector<int64_t>& recv,
                            const std::vector<int64_t>& send) {
    ctx->saved_data["recv"] = recv;
    ctx->saved_data["send"] = send;
    return all_to_all_expert_rows(x, recv, send);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {
        all_to_all_expert_rows(grad[0], ctx->saved_data["send"].toIntVector(), ctx->saved_data["recv"].toIntVector()),
        at::Tensor(), at::Tensor()};
  }
};

at::Tensor exchange_expert_rows(const at::Tensor& x, const std::vector<int64_t>& recv,
                                const std::vector<int64_t>& send) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return all_to_all_expert_rows(x, recv, send);
  return ExchangeExpertRows::apply(x, recv, send);
}

// An exchange of expert rows in flight (moe_shared_expert_overlap): issued by start_exchange, put
// into the autograd graph when finish_exchange waits for it.
struct RowsInFlight {
  at::Tensor sent, received;
  std::vector<int64_t> recv, send;
  std::optional<Comm::Work> work;
};

std::shared_ptr<RowsInFlight> start_exchange(const at::Tensor& x, const std::vector<int64_t>& recv,
                                             const std::vector<int64_t>& send) {
  auto flight = std::make_shared<RowsInFlight>();
  flight->sent = x.contiguous();
  flight->recv = recv;
  flight->send = send;
  flight->received = receiving_rows(x, recv);
  flight->work.emplace(Comm::all_to_all_async(flight->received, flight->sent, DTK_GROUP_EXPERT_PARALLEL, recv, send));
  return flight;
}

// Forward waits for the rows; backward the gradients take the way back (at once).
struct FinishExchange : public torch::autograd::Function<FinishExchange> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*sent*/,
                            const std::shared_ptr<RowsInFlight>& flight) {
    flight->work->wait();
    ctx->saved_data["recv"] = flight->recv;
    ctx->saved_data["send"] = flight->send;
    return flight->received;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {
        all_to_all_expert_rows(grad[0], ctx->saved_data["send"].toIntVector(), ctx->saved_data["recv"].toIntVector()),
        at::Tensor()};
  }
};

// `x`: the rows start_exchange sent (the graph's edge to them).
at::Tensor finish_exchange(const at::Tensor& x, const std::shared_ptr<RowsInFlight>& flight) {
  if (at::GradMode::is_enabled() && x.requires_grad()) return FinishExchange::apply(x, flight);
  flight->work->wait();
  return flight->received;
}

// The TP group's rows in rank order, rank t holding rows[t] of them: an all-to-all that sends every
// rank the same rows (all_gather needs equal parts; this moves exactly the rows there are).
at::Tensor gather_tp_rows(const at::Tensor& x, const std::vector<int64_t>& rows) {
  const int64_t tp = static_cast<int64_t>(rows.size());
  at::Tensor out = receiving_rows(x, rows);
  const at::Tensor copies = x.contiguous().unsqueeze(0).expand({tp, x.size(0), x.size(1)}).reshape({-1, x.size(1)});
  Comm::all_to_all(out, copies, DTK_GROUP_TENSOR_PARALLEL, rows, std::vector<int64_t>(rows.size(), x.size(0)));
  return out;
}

// The mirror of gather_tp_rows: x [sum(rows), h] partial sums on every TP rank; rank t gets its
// rows[t] rows summed over the group (a reduce-scatter of uneven parts: each part sent to its rank,
// the group's copies summed there in rank order).
at::Tensor reduce_scatter_tp_rows(const at::Tensor& x, const std::vector<int64_t>& rows, int64_t rank) {
  const int64_t tp = static_cast<int64_t>(rows.size()), own = rows[static_cast<size_t>(rank)];
  at::Tensor parts = at::empty({tp * own, x.size(1)}, x.options());
  Comm::all_to_all(parts, x.contiguous(), DTK_GROUP_TENSOR_PARALLEL, std::vector<int64_t>(rows.size(), own), rows);
  return parts.view({tp, own, x.size(1)}).sum(0);
}

// Into the TP-split experts (gather_tp_rows); backward each rank's rows get their gradients summed
// over the group.
struct GatherTpRows : public torch::autograd::Function<GatherTpRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::vector<int64_t>& rows, int64_t rank) {
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["rank"] = rank;
    return gather_tp_rows(x, rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {reduce_scatter_tp_rows(grad[0], ctx->saved_data["rows"].toIntVector(), ctx->saved_data["rank"].toInt()),
            at::Tensor(), at::Tensor()};
  }
};

// Out of them (reduce_scatter_tp_rows); backward the gradients are gathered.
struct ReduceScatterTpRows : public torch::autograd::Function<ReduceScatterTpRows> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const std::vector<int64_t>& rows, int64_t rank) {
    ctx->saved_data["rows"] = rows;
    return reduce_scatter_tp_rows(x, rows, rank);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {gather_tp_rows(grad[0], ctx->saved_data["rows"].toIntVector()), at::Tensor(), at::Tensor()};
  }
};

at::Tensor gather_to_tp_experts(const at::Tensor& x, const std::vector<int64_t>& rows, int64_t rank) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return gather_tp_rows(x, rows);
  return GatherTpRows::apply(x, rows, rank);
}

at::Tensor scatter_from_tp_experts(const at::Tensor& x, const std::vector<int64_t>& rows, int64_t rank) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return reduce_scatter_tp_rows(x, rows, rank);
  return ReduceScatterTpRows::apply(x, rows, rank);
}

// A host list of row indices as a tensor on `device`.
at::Tensor index_on(const std::vector<int64_t>& index, const at::Device& device) {
  at::Tensor t = at::empty({static_cast<int64_t>(index.size())}, at::kLong);
  std::copy(index.begin(), index.end(), t.data_ptr<int64_t>());
  return t.to(device);
}

// How many of the [tokens, k] choices fell in each of `bins` (the experts), [bins] int64 on their
// device (a scatter, where bincount would read the range back to the host).
at::Tensor count_choices(const at::Tensor& chosen, int64_t bins) {
  const at::Tensor flat = chosen.reshape(-1);
  return at::zeros({bins}, flat.options()).scatter_add_(0, flat, at::ones_like(flat));
}

// Each row once per choice, [tokens * k, h]: choice t * k + j reads row t (every gathered row then
// has its own source, so the gathers' backward adds to distinct places).
at::Tensor rows_per_choice(const at::Tensor& x, int64_t k) {
  const int64_t tokens = x.size(0), h = x.size(1);
  return x.unsqueeze(1).expand({tokens, k, h}).reshape({tokens * k, h});
}

// The choices' weighted outputs in their places [tokens * k, h], summed over each row's k.
at::Tensor sum_over_choices(const at::Tensor& placed, int64_t k, at::ScalarType dtype) {
  return placed.view({placed.size(0) / k, k, placed.size(1)}).sum(1).to(dtype);
}

// Padding to capacity: `slots` places for each of the experts [first, first + count), filled in the
// order of the choices sorted by expert: choice [count * slots] (the choice t * k + j a place holds;
// an unfilled place repeats one, to be masked) and filled [count * slots].
struct PaddedSlots {
  at::Tensor choice, filled;
};
PaddedSlots padded_slots(const at::Tensor& chosen, int64_t num_experts, int64_t first, int64_t count, int64_t slots) {
  const int64_t choices = chosen.numel();
  const at::Tensor order = std::get<1>(at::sort(chosen.reshape(-1), /*stable=*/true, 0, false));
  const at::Tensor all_counts = count_choices(chosen, num_experts + 1);
  const at::Tensor counts = all_counts.narrow(0, first, count);
  const at::Tensor starts = (at::cumsum(all_counts, 0) - all_counts).narrow(0, first, count);
  const at::Tensor slot = at::arange(slots, chosen.options()).unsqueeze(0);                     // [1, slots]
  const at::Tensor position = (starts.unsqueeze(1) + slot).clamp_max(choices - 1).reshape(-1);  // in `order`
  return {order.index_select(0, position), slot.lt(counts.unsqueeze(1)).reshape(-1)};
}

// The places' outputs [places, h] times their weights (zero where unfilled), summed over each
// token's k choices: the unfilled places put theirs past the choices, where they are dropped (they
// change no output and get no gradient).
at::Tensor sum_padded_slots(const at::Tensor& outputs, const at::Tensor& probs, const PaddedSlots& s, int64_t k,
                            at::ScalarType dtype) {
  const int64_t choices = probs.numel(), places = s.choice.size(0);
  const at::Tensor unfilled = s.filled.logical_not();
  const at::Tensor weights = probs.reshape(-1).index_select(0, s.choice).masked_fill(unfilled, 0).unsqueeze(-1);
  const at::Tensor weighted = outputs.to(probs.scalar_type()) * weights;
  const at::Tensor place = at::where(s.filled, s.choice, at::arange(places, s.choice.options()) + choices);
  const at::Tensor placed = at::zeros({choices + places, outputs.size(1)}, weighted.options())
                                .index_copy(0, place, weighted)
                                .narrow(0, 0, choices);
  return sum_over_choices(placed, k, dtype);
}

// The chosen choices' outputs [n, h] (choice[i] the choice t * k + j of row i) times their
// weights, put in their places and summed over each token's k.
at::Tensor sum_chosen(const at::Tensor& outputs, const at::Tensor& probs, const at::Tensor& choice, int64_t k,
                      at::ScalarType dtype) {
  const at::Tensor weighted = outputs.to(probs.scalar_type()) * probs.reshape(-1).index_select(0, choice).unsqueeze(-1);
  const at::Tensor placed =
      at::zeros({probs.numel(), outputs.size(1)}, weighted.options()).index_copy(0, choice, weighted);
  return sum_over_choices(placed, k, dtype);
}

// The masters an expert's projections draw (ColumnParallelLinear's [ffn, hidden] per input,
// RowParallelLinear's [hidden, ffn]), drawn and dropped for an expert another expert-parallel rank
// holds: every rank draws the same sequence, so each expert has the values it has in one process.
void draw_unheld_expert(size_t inputs, int64_t hidden, int64_t ffn, double init_std, double out_std, ParamFactory& f) {
  for (size_t i = 0; i < inputs; ++i) f.normal({ffn, hidden}, init_std);
  f.normal({hidden, ffn}, out_std);
}

}  // namespace

void record_aux_metric(const char* name, const at::Tensor& value) {
  const dtk_aux_loss_ext* e = aux_loss_extension();
  if (!e || e->struct_size < dtk_aux_loss_ext_STRUCT_SIZE_2_10) return;
  e->record(name, wrap(value.detach().reshape({1})));
}

double aux_loss_backward_scale(int64_t tokens, int64_t context_parallel) {
  const dtk_aux_loss_ext* e = aux_loss_extension();
  if (!e) return 1.0;
  const double scale = e->backward_scale();
  // A per-token loss's gradients are summed over the ranks (the host divides by the tokens), a
  // mean loss's averaged: there the context-parallel ranks' shares need C times.
  return e->per_token_loss() ? scale * static_cast<double>(tokens) : scale * static_cast<double>(context_parallel);
}

at::Tensor attach_aux_loss(const at::Tensor& x, const at::Tensor& loss, int64_t tokens, int64_t context_parallel) {
  return AttachAuxLoss::apply(x, loss, tokens, context_parallel);
}

at::Tensor switch_load_balancing_loss(const at::Tensor& scores, const at::Tensor& tokens_per_expert,
                                      int64_t total_tokens, int64_t topk, double coeff) {
  const double e = static_cast<double>(scores.size(-1)), t = static_cast<double>(total_tokens);
  return (scores.sum(0) * tokens_per_expert.to(scores.scalar_type())).sum() *
         (e * coeff / (static_cast<double>(topk) * t * t));
}

at::Tensor sequence_load_balancing_loss(const at::Tensor& scores, const at::Tensor& tokens_per_expert,
                                        int64_t seq_tokens, int64_t topk, double coeff) {
  const double e = static_cast<double>(scores.size(-1)), s = static_cast<double>(seq_tokens);
  const double sequences = static_cast<double>(scores.size(0));
  return (scores.sum(1) * tokens_per_expert.to(scores.scalar_type())).sum() *
         (e * coeff / (static_cast<double>(topk) * s * s * sequences));
}

namespace {

// sinkhorn and quantile_balancing: types that balance by the choice, not by a loss.
bool balances_by_choice(const std::string& type) { return type == "sinkhorn" || type == "quantile_balancing"; }

}  // namespace

void parse_moe_balance(const std::string& types, const std::string& coeffs, MoeConfig& c) {
  // (A trailing comma leaves an empty item: refused as an unknown type or not a number.)
  const std::vector<std::string> type = comma_items(types), weight = comma_items(coeffs);
  // The types first: which coefficient each item is.
  std::vector<double*> coeff;
  const bool alone = type.size() == 1 && (type[0] == "none" || balances_by_choice(type[0]));
  for (const std::string& t : type) {
    double* slot = t == "aux_loss"          ? &c.aux_loss_coeff
                   : t == "seq_aux_loss"    ? &c.seq_aux_loss_coeff
                   : t == "global_aux_loss" ? &c.global_aux_loss_coeff
                                            : nullptr;
    if (!slot && !alone && balances_by_choice(t))
      throw std::invalid_argument("option 'moe_router_load_balancing_type': " + t +
                                  " chooses the experts itself and adds no loss: list it alone");
    if (!slot && !alone)
      throw std::invalid_argument(
          "option 'moe_router_load_balancing_type': '" + t +
          "' is not one of aux_loss, seq_aux_loss, global_aux_loss (or sinkhorn, quantile_balancing, none alone)");
    if (slot && std::find(coeff.begin(), coeff.end(), slot) != coeff.end())
      throw std::invalid_argument("option 'moe_router_load_balancing_type' lists " + t + " twice");
    coeff.push_back(slot);
  }
  std::vector<double> value;
  for (const std::string& w : weight) {
    char* end = nullptr;
    const double v = std::strtod(w.c_str(), &end);
    if (w.empty() || *end) throw std::invalid_argument("option 'moe_aux_loss_coeff': '" + w + "' is not a number");
    if (!(v >= 0.0) || !std::isfinite(v))
      throw std::invalid_argument("option 'moe_aux_loss_coeff' must be finite and >= 0, got " + w);
    value.push_back(v);
  }
  if (value.size() != type.size())
    throw std::invalid_argument("option 'moe_aux_loss_coeff' gives " + std::to_string(value.size()) +
                                " coefficient(s) for the " + std::to_string(type.size()) +
                                " load-balancing type(s) of moe_router_load_balancing_type: give one per type");
  if (alone && type[0] == "none" && value[0] > 0.0)
    throw std::invalid_argument(
        "moe_aux_loss_coeff weighs no loss with moe_router_load_balancing_type=none: set one of them, not both");
  if (alone && type[0] != "none" && value[0] > 0.0)
    throw std::invalid_argument("moe_aux_loss_coeff must be 0 with moe_router_load_balancing_type=" + type[0] +
                                ", which balances by the choice itself and weighs no loss (Megatron asserts it for "
                                "sinkhorn and ignores it for quantile_balancing)");
  c.routing = !alone || type[0] == "none" ? MoeRouting::kTopK
              : type[0] == "sinkhorn"     ? MoeRouting::kSinkhorn
                                          : MoeRouting::kQuantileBalancing;
  c.aux_loss_coeff = c.seq_aux_loss_coeff = c.global_aux_loss_coeff = 0.0;
  for (size_t i = 0; i < coeff.size(); ++i)
    if (coeff[i]) *coeff[i] = value[i];
}

void parse_moe_layer_freq(const std::string& text, MoeConfig& c) {
  const LayerPattern p = parse_layer_pattern(text);
  c.layer_freq = p.flags.empty() ? p.every : 1;
  c.layer_pattern = p.flags;
}

void parse_moe_layer_num_experts(const std::string& text, MoeConfig& c) {
  c.layer_experts.clear();
  if (text.find_first_not_of(" \t") == std::string::npos) return;
  for (const std::string& item : comma_items(text)) {
    const bool digits = !item.empty() && item.size() <= 9 &&
                        std::all_of(item.begin(), item.end(), [](unsigned char ch) { return std::isdigit(ch) != 0; });
    if (!digits || std::stoll(item) < 1)
      throw std::invalid_argument("'" + item +
                                  "' is not a positive expert count (give one per MoE layer, e.g. 32,32,64)");
    c.layer_experts.push_back(std::stoll(item));
  }
}

MoeConfig MoeConfig::at_layer(int64_t index, int64_t num_layers) const {
  MoeConfig layer = *this;
  layer.logged_layers = num_moe_layers(num_layers);
  if (!layer_experts.empty()) {
    const int64_t ordinal = num_moe_layers(index);  // the MoE layers before this one
    layer.num_experts = layer_experts.at(static_cast<size_t>(ordinal));
  }
  return layer;
}

int64_t MoeConfig::capacity(int64_t tokens) const {
  return static_cast<int64_t>(
      std::ceil(static_cast<double>(tokens * topk) / static_cast<double>(num_experts) * capacity_factor));
}

int64_t MoeConfig::deepspeed_capacity(int64_t tokens, bool training) const {
  const double factor = training || eval_capacity_factor <= 0.0 ? capacity_factor : eval_capacity_factor;
  // DeepSpeed multiplies the Python float T / E by an fp32 tensor of f * k: one fp32 product.
  const float c = std::ceil(static_cast<float>(static_cast<double>(tokens) / static_cast<double>(num_experts)) *
                            static_cast<float>(factor * static_cast<double>(topk)));
  return std::max(static_cast<int64_t>(c), min_capacity);
}

at::Tensor sinkhorn(const at::Tensor& cost, double tol) {
  at::NoGradGuard no_grad;
  const at::Tensor e = at::exp(cost);
  const double rows = static_cast<double>(e.size(0)), columns = static_cast<double>(e.size(1));
  at::Tensor d0 = at::ones({e.size(0)}, e.options()), d1 = at::ones({e.size(1)}, e.options());
  at::Tensor d1_old = d1;
  // (One host read per round, as Megatron's loop; a NaN ends it as there.)
  for (int round = 0; round < 10000; ++round) {
    d0 = at::reciprocal((d1 * e).sum(1) + 1e-8) * (1.0 / rows);
    d1 = at::reciprocal((d0.unsqueeze(1) * e).sum(0) + 1e-8) * (1.0 / columns);
    const double error = (d1_old - d1).abs().mean().item<double>();
    d1_old = d1;
    if (!(error > tol)) break;
  }
  return d1 * e * d0.unsqueeze(1);
}

at::Tensor router_z_loss(const at::Tensor& logits, double coeff) {
  return at::logsumexp(logits.to(at::kFloat), -1).square().mean() * coeff;
}

MoeMlp::MoeMlp(const MoeConfig& c, int64_t hidden, std::vector<std::string> inputs, std::string output, bool bias,
               double init_std, double out_std, const TPGroup& tp, ParamFactory& f)
    : c_(c), inputs_(std::move(inputs)), output_(std::move(output)), tp_(tp) {
  router = f.param(f.normal({c.num_experts, hidden}, init_std));
  // Megatron-LM's router has a bias with add_bias_linear, drawn like its weight; DeepSpeed's has none.
  const bool deepspeed = c.gate == MoeGate::kDeepSpeed;
  if (bias && !deepspeed) router_bias = f.param(f.normal({c.num_experts}, init_std));
  const int64_t first = c.first_local_expert(), held = c.local_experts();
  experts.reserve(static_cast<size_t>(held));
  for (int64_t index = 0; index < c.num_experts; ++index) {
    if (index < first || index >= first + held) {
      draw_unheld_expert(inputs_.size(), hidden, c.ffn, init_std, out_std, f);
      continue;
    }
    Expert& e = experts.emplace_back();
    for (size_t i = 0; i < inputs_.size(); ++i) e.in.emplace_back(hidden, c.ffn, bias, init_std, tp, f);
    e.out = RowParallelLinear(c.ffn, hidden, bias && !deepspeed, out_std, tp, f);
  }
  if (c.expert_bias) {
    const at::TensorOptions fp32 = at::TensorOptions().dtype(at::kFloat).device(f.device);
    expert_bias = at::zeros({c.num_experts}, fp32);
    expert_load = at::zeros({c.num_experts}, fp32);
  }
  if (c.routing == MoeRouting::kQuantileBalancing)
    qb_beta = at::zeros({c.num_experts}, at::TensorOptions().dtype(at::kFloat).device(f.device));
  if (c.shared_ffn > 0 || c.residual) {
    // (DeepSpeed's residual MLP is a copy of its expert, whose second bias never acts.)
    const int64_t ffn = c.residual ? c.ffn : c.shared_ffn;
    for (size_t i = 0; i < inputs_.size(); ++i) shared.in.emplace_back(hidden, ffn, bias, init_std, tp, f);
    shared.out = RowParallelLinear(ffn, hidden, bias && !deepspeed, out_std, tp, f);
    if (c.shared_gate) shared_gate = f.param(f.normal({1, hidden}, init_std));
  }
  if (c.residual) {  // DeepSpeed's Linear(hidden, 2), with its bias whatever the model's (drawn as the router)
    residual_coefficient = f.param(f.normal({2, hidden}, init_std));
    residual_coefficient_bias = f.zeros({2});
  }
}

namespace {

// Records one MoE layer's loss for the log without its coefficient: what this rank holds of the
// mean over the MoE layers and of the TP group's sum (a partial sum under sequence parallelism,
// the whole loss on every TP rank otherwise). Under context parallelism the loss is this rank's
// share of the sequence's, and the log averages over the context-parallel ranks: C times it.
void record_layer_loss(const char* name, const at::Tensor& loss, double coeff, const MoeConfig& c, const TPGroup& tp) {
  const double share =
      static_cast<double>(c.cp.size) / (static_cast<double>(c.logged_layers) * (tp.splits_sequence() ? 1 : tp.size));
  record_aux_metric(name, loss * (share / coeff));
}

}  // namespace

// The router on this rank's tokens x [tokens, h] (`batch` sequences of tokens / batch
// positions): the chosen experts and their weights, the auxiliary losses attached (training, with
// gradients) as Megatron's TopKRouter.routing does.
MoeMlp::Routing MoeMlp::route(const at::Tensor& x, int64_t batch, bool generating, bool training,
                              at::Generator* rng) const {
  if (c_.gate == MoeGate::kDeepSpeed) return deepspeed_route(x, batch, generating, training, rng);
  const bool aux = at::GradMode::is_enabled() && x.requires_grad();
  // Under sequence parallelism each TP rank routes its own rows: the losses' sums over the group
  // are the whole micro-batch's, as the router's gradient (a partial sum here) is summed. Under
  // context parallelism each rank's loss is its share of its sequences' the same way.
  const int64_t parts = sequence_parts();
  const int64_t total = x.size(0) * parts;
  // [tokens, experts], in x's dtype (Megatron's default router dtype) or fp32
  at::Tensor logits = c_.router_fp32 ? at::linear(x.to(at::kFloat), router.to(at::kFloat),
                                                  router_bias.defined() ? router_bias.to(at::kFloat) : router_bias)
                                     : dtk::linear(x, router, router_bias);
  if (aux && c_.z_loss_coeff > 0.0) {
    const at::Tensor z = router_z_loss(logits, c_.z_loss_coeff / static_cast<double>(parts));
    record_layer_loss("z_loss", z, c_.z_loss_coeff, c_, tp_);
    logits = attach_aux_loss(logits, z, total, c_.cp.size);
  }
  Routing r = choose(logits, batch, training && !generating);
  if (c_.drops_tokens() && !generating) drop_over_capacity(r, batch);
  if (aux && c_.balances()) r.probs = attach_aux_loss(r.probs, balance_loss(logits, batch, total), total, c_.cp.size);
  // The expert bias follows the loads of the training forwards (not evaluation's, nor the first
  // pass of a recomputed layer, which runs without gradients), as Megatron's _apply_expert_bias.
  if (aux && expert_load.defined()) {
    at::NoGradGuard no_grad;
    expert_load.add_(choice_loads(r));
  }
  return r;
}

namespace {

// Megatron's token order of `tokens` rows of `batch` sequences ([sequence, batch]): its p-th
// token, p = s * batch + b, is row b * positions + s.
at::Tensor sequence_major_rows(int64_t tokens, int64_t batch, const at::TensorOptions& index) {
  return at::arange(tokens, index).view({batch, tokens / batch}).t().reshape(-1);
}

// Each element's rank in its column of key [rows, n], highest first (ties: the earlier row), int64.
at::Tensor column_ranks(const at::Tensor& key, const at::TensorOptions& index) {
  const int64_t rows = key.size(0), n = key.size(1);
  const at::Tensor by_rank = std::get<1>(at::sort(key, /*stable=*/true, 0, /*descending=*/true));
  return at::empty({rows, n}, index).scatter_(0, by_rank, at::arange(rows, index).unsqueeze(1).expand({rows, n}));
}

// Uniform(0, 1) draws [shape] in fp32 on `device` from `gen` (hashed as dropout's masks are).
at::Tensor uniforms(at::IntArrayRef shape, at::Generator& gen, const at::Device& device) {
  int64_t numel = 1;
  for (const int64_t size : shape) numel *= size;
  return uniform_noise_on(draw_uniforms(shape, gen), numel, 0.0, 1.0, device).view(shape);
}

}  // namespace

// DeepSpeed's TopKGate on this rank's rows x [tokens, h] (see moe.hpp): the choice on the whole
// sequence's logits (no gradient), the weights and the loss on this rank's rows.
MoeMlp::Routing MoeMlp::deepspeed_route(const at::Tensor& x, int64_t batch, bool generating, bool training,
                                        at::Generator* rng) const {
  if (!generating && rng == nullptr)
    throw Error("moe_gate=deepspeed needs the generator its noise is drawn from: pass it to MoeMlp::forward");
  const int64_t n = c_.num_experts;
  const at::Tensor logits = at::linear(x.to(at::kFloat), router.to(at::kFloat));
  const at::Tensor gates = at::softmax(logits, -1);
  at::Tensor chosen, kept, share;
  {
    at::NoGradGuard no_grad;
    const at::Tensor whole = whole_sequence(logits.detach(), batch);
    const int64_t tokens = whole.size(0);
    const at::Tensor first = at::softmax(whole, -1).argmax(1, true);
    chosen = first;
    if (c_.topk == 2) {
      at::Tensor scored = whole;
      if (c_.second_expert_sampling && !generating)  // the Gumbel-max trick: a draw from softmax(logits)
        scored = whole - at::log(-at::log(uniforms({tokens, n}, *rng, whole.device())));
      const at::Tensor second = scored.scatter(1, first, -std::numeric_limits<double>::infinity()).argmax(1, true);
      chosen = at::cat({first, second}, 1);
    } else if (c_.topk > 2) {  // topkgating: the k highest logits, no noise
      chosen = std::get<1>(at::topk(whole, c_.topk, 1));
    }
    kept = c_.drops_tokens() && !generating ? deepspeed_kept(chosen, whole, batch, training, *rng)
                                            : at::ones_like(chosen, at::kFloat);
    // l_aux's share of the tokens per expert: of the first choices (top1gating, top2gating), or of
    // all k choices over k (topkgating's mean of its k-hot mask, times E^2 / k).
    const bool all_choices = c_.topk > 2;
    share = expert_counts(all_choices ? chosen : first, n).to(at::kFloat) /
            static_cast<double>(tokens * (all_choices ? c_.topk : 1));
    chosen = own_rows(chosen, batch);
    kept = own_rows(kept, batch);
  }
  Routing r;
  r.probs = gates.gather(1, chosen) * kept;
  if (c_.topk >= 2) r.probs = r.probs / r.probs.sum(1, true).clamp_min(std::numeric_limits<float>::epsilon());
  r.experts = chosen.masked_fill(kept.eq(0), n);
  if (at::GradMode::is_enabled() && x.requires_grad() && c_.aux_loss_coeff > 0.0) {
    // l_aux = E * sum_e mean_t(gates) * share over the micro-batch's T tokens: this rank's
    // rows' part of the mean (the parts summed over the TP group under sequence parallelism, and
    // the context-parallel group's under CP).
    const int64_t total = x.size(0) * sequence_parts();
    const at::Tensor loss =
        (gates.sum(0) * share).sum() * (static_cast<double>(n) * c_.aux_loss_coeff / static_cast<double>(total));
    record_layer_loss("load_balancing_loss", loss, c_.aux_loss_coeff, c_, tp_);
    r.probs = attach_aux_loss(r.probs, loss, total, c_.cp.size);
  }
  return r;
}

// Which of the whole sequence's choices [T, k] (of its logits [T, E]) DeepSpeed's capacity keeps,
// [T, k] fp32 0 or 1: top-1 each expert's C tokens with the highest Uniform(0, 1) draws (random
// token selection; ties: the earlier row), top-2 each expert's first choices then its second ones
// in Megatron's [sequence, batch] token order, up to C; top-k (k > 2, topkgating's "probs" policy)
// each expert's C tokens of the highest logit at it, the tokens that did not choose it counting
// as 0 (DeepSpeed ranks its top-k logits scattered into zeros, so a choice of a negative logit
// can be dropped with room left).
at::Tensor MoeMlp::deepspeed_kept(const at::Tensor& chosen, const at::Tensor& logits, int64_t batch, bool training,
                                  at::Generator& rng) const {
  const int64_t tokens = chosen.size(0), n = c_.num_experts, capacity = c_.deepspeed_capacity(tokens, training);
  const at::TensorOptions index = chosen.options();
  if (c_.topk > 2) {
    const at::Tensor key = at::zeros_like(logits).scatter(1, chosen, logits.gather(1, chosen));
    return column_ranks(key, index).gather(1, chosen).lt(capacity).to(at::kFloat);
  }
  if (c_.topk == 1) {
    const at::Tensor draw = uniforms({tokens, 1}, rng, chosen.device());
    const at::Tensor key = at::full({tokens, n}, -1.0, draw.options()).scatter(1, chosen, draw);
    return column_ranks(key, index).gather(1, chosen).lt(capacity).to(at::kFloat);
  }
  const at::Tensor row_of = sequence_major_rows(tokens, batch, index);
  const at::Tensor in_order = chosen.index_select(0, row_of);
  const at::Tensor first = at::zeros({tokens, n}, index).scatter(1, in_order.narrow(1, 0, 1), 1);
  const at::Tensor second = at::zeros({tokens, n}, index).scatter(1, in_order.narrow(1, 1, 1), 1);
  // Each choice's place in its expert's buffer: the first choices' before every second one.
  const at::Tensor place = at::cat({(first.cumsum(0) - 1).gather(1, in_order.narrow(1, 0, 1)),
                                    (second.cumsum(0) - 1 + first.sum(0, true)).gather(1, in_order.narrow(1, 1, 1))},
                                   1);
  return at::empty_like(place).index_copy_(0, row_of, place).lt(capacity).to(at::kFloat);
}

// Megatron's apply_router_token_dropping on one router call's choices (`batch` sequences of
// tokens / batch positions): each expert ranks the tokens routed to it, by weight (ties: the
// earlier token) or by Megatron's token order, and keeps the first capacity; the dropped choices
// weigh zero and point past the experts (num_experts). Padding records the rows each expert takes.
void MoeMlp::drop_over_capacity(Routing& r, int64_t batch) const {
  const int64_t tokens = r.experts.size(0), n = c_.num_experts, capacity = c_.capacity(tokens);
  if (c_.pad_to_capacity) r.padded_rows = std::min(capacity, tokens);
  if (capacity >= tokens) return;  // every token fits
  at::Tensor kept;
  {
    at::NoGradGuard no_grad;
    const at::TensorOptions index = r.experts.options();
    // [tokens, experts], what each expert ranks its tokens by, highest first (an unrouted token lowest).
    const at::Tensor key = c_.drop_policy == MoeDropPolicy::kProbs
                               ? at::full({tokens, n}, -1.0, index.dtype(at::kFloat))
                                     .scatter(1, r.experts, r.probs.detach().to(at::kFloat))
                               : at::zeros({tokens, n}, index.dtype(at::kFloat)).scatter(1, r.experts, 1.0);
    // Ranked in Megatron's token order ([sequence, batch]), so ties go to its earlier token.
    const at::Tensor row_of = sequence_major_rows(tokens, batch, index);
    const at::Tensor rank_in_order = column_ranks(key.index_select(0, row_of), index);
    const at::Tensor rank = at::empty_like(rank_in_order).index_copy_(0, row_of, rank_in_order);
    kept = rank.lt(capacity).gather(1, r.experts);
  }
  r.probs = r.probs * kept.to(r.probs.scalar_type());
  r.experts = r.experts.masked_fill(kept.logical_not(), n);
}

// What each expert took of one router call, [experts] fp32 (the expert bias's load, from
// Megatron's final routing map): its kept choices, or with padding its capacity's rows.
at::Tensor MoeMlp::choice_loads(const Routing& r) const {
  if (r.padded_rows > 0) return at::full({c_.num_experts}, static_cast<double>(r.padded_rows), expert_load.options());
  return expert_counts(r.experts, c_.num_experts + 1).narrow(0, 0, c_.num_experts).to(at::kFloat);
}

namespace {

// Sigmoid or sqrtsoftplus scores, in fp32 (softplus with torch's defaults: beta 1, linear above 20).
at::Tensor gate_scores(const at::Tensor& logits, MoeScore score) {
  const at::Tensor l = logits.to(at::kFloat);
  return score == MoeScore::kSigmoid ? at::sigmoid(l) : at::sqrt(at::softplus(l));
}

}  // namespace

// The chosen experts and their weights: the top-k of the scores (topk_routing_with_score_function),
// sinkhorn's or quantile balancing's choice.
MoeMlp::Routing MoeMlp::choose(const at::Tensor& logits, int64_t batch, bool training) const {
  Routing r;
  if (c_.routing == MoeRouting::kSinkhorn) {
    r = sinkhorn_choice(logits, batch, training);
  } else {
    if (c_.routing == MoeRouting::kQuantileBalancing) {
      r.experts = quantile_choice(logits, batch, training);
    } else {
      at::NoGradGuard no_grad;
      at::Tensor scores = c_.score != MoeScore::kSoftmax ? gate_scores(logits, c_.score)
                          : c_.pre_softmax               ? at::softmax(logits, -1, at::kFloat)
                                                         : logits;
      // The expert bias steers the choice only; the weights are the unbiased scores of the chosen.
      if (expert_bias.defined()) scores = scores + expert_bias.to(at::kFloat);
      r.experts = std::get<1>(top_k(scores));
    }
    r.probs = weights_at(logits, r.experts);
  }
  if (c_.topk_scaling_factor > 0.0) r.probs = r.probs * c_.topk_scaling_factor;
  // The experts' outputs are weighted in the router's dtype (fp32 with moe_router_fp32), as
  // Megatron's probs.type_as(logits).
  r.probs = r.probs.to(logits.scalar_type());
  return r;
}

// The weights of the chosen experts [tokens, k] under the score function, in fp32: the softmax of
// their logits (or, pre-softmax, the softmax over all experts at them), or their sigmoid or
// sqrtsoftplus scores divided by their sum (k > 1).
at::Tensor MoeMlp::weights_at(const at::Tensor& logits, const at::Tensor& chosen) const {
  if (c_.score != MoeScore::kSoftmax) {
    const at::Tensor top = gate_scores(logits, c_.score).gather(1, chosen);
    return c_.topk > 1 ? top / (top.sum(-1, true) + 1e-20) : top;
  }
  if (c_.pre_softmax) return at::softmax(logits, -1, at::kFloat).gather(1, chosen);
  return at::softmax(logits.gather(1, chosen), -1, at::kFloat);
}

// Megatron's sinkhorn_load_balancing: in training the top-k of sinkhorn(logits) in fp32 (on the
// whole sequence's logits), else the top-k of the weights; the weights are sigmoid(logits) for one
// expert, else the softmax over all experts (in fp32, then the logits' dtype), at the chosen.
MoeMlp::Routing MoeMlp::sinkhorn_choice(const at::Tensor& logits, int64_t batch, bool training) const {
  const at::Tensor weights =
      c_.topk == 1 ? at::sigmoid(logits) : at::softmax(logits, -1, at::kFloat).to(logits.scalar_type());
  Routing r;
  {
    at::NoGradGuard no_grad;
    r.experts =
        training ? own_rows(std::get<1>(sinkhorn(whole_sequence(logits.to(at::kFloat), batch)).topk(c_.topk, 1)), batch)
                 : std::get<1>(weights.topk(c_.topk, 1));
  }
  r.probs = weights.gather(1, r.experts);
  return r;
}

// Megatron's quantile_balancing (qb_dual_update) on the whole sequence's logits in fp32: the top-k
// of logits - qb_beta. A training forward with gradients (not evaluation, nor a recomputed layer's
// first pass) also estimates the bias that would give every expert tokens * k / experts tokens:
// with alpha a token's (k + 1)-th best of logits - qb_beta, each expert's (target + 1)-th best of
// logits - alpha over the tokens. Returns this rank's rows' experts.
at::Tensor MoeMlp::quantile_choice(const at::Tensor& logits, int64_t batch, bool training) const {
  const bool estimate = training && at::GradMode::is_enabled();
  at::NoGradGuard no_grad;
  const at::Tensor scores = whole_sequence(logits.to(at::kFloat), batch);
  const int64_t tokens = scores.size(0), k = c_.topk, experts = c_.num_experts;
  const auto [best, chosen] = (scores - qb_beta).topk(k + 1, 1);
  if (estimate) {
    if ((tokens * k) % experts != 0)
      throw Error("quantile_balancing needs a micro-batch's tokens times moe_router_topk to be a multiple of " +
                  std::to_string(experts) + " (num_experts): " + std::to_string(tokens) + " tokens times " +
                  std::to_string(k) + " is not (a train.curriculum_schedule's shorter sequences must keep it too)");
    const int64_t target = tokens * k / experts;
    const at::Tensor quantile = std::get<0>((scores - best.narrow(1, k, 1)).topk(target + 1, 0)).select(0, target);
    qb_estimates = qb_estimates.defined() ? qb_estimates + quantile : quantile;
    ++qb_forwards;
  }
  return own_rows(chosen.narrow(1, 0, k).contiguous(), batch);
}

// A router tensor of this rank's rows [tokens, n] (`batch` sequences) as the whole sequence's rows
// (gathered over the TP group under sequence parallelism, then over the context-parallel group, in
// the order of the unsplit sequence).
at::Tensor MoeMlp::whole_sequence(const at::Tensor& rows, int64_t batch) const {
  if (!tp_.splits_sequence() && !c_.cp.active()) return rows;
  at::Tensor share = rows.view({batch, -1, rows.size(1)});
  if (tp_.splits_sequence()) share = sequence_all_gather(share, tp_);
  return c_.cp.whole_sequence(share).reshape({-1, rows.size(1)});
}

// This rank's rows of a whole-sequence tensor [batch * s, n] (the inverse of whole_sequence).
at::Tensor MoeMlp::own_rows(const at::Tensor& whole, int64_t batch) const {
  if (!tp_.splits_sequence() && !c_.cp.active()) return whole;
  at::Tensor rows = c_.cp.share_of_sequence(whole.view({batch, -1, whole.size(1)}));
  if (tp_.splits_sequence()) rows = sequence_shard(rows, tp_);
  return rows.reshape({-1, whole.size(1)});
}

// The k best of scores [tokens, experts], from each token's group_topk best groups when routing is
// group-limited (a group scored by the sum of its topk / group_topk best).
std::tuple<at::Tensor, at::Tensor> MoeMlp::top_k(const at::Tensor& scores) const {
  if (c_.group_topk <= 0) return scores.topk(c_.topk, -1);
  const int64_t tokens = scores.size(0);
  const at::Tensor grouped = scores.view({tokens, c_.num_groups, -1});
  const at::Tensor group_scores = std::get<0>(grouped.topk(c_.topk / c_.group_topk, -1)).sum(-1);
  const at::Tensor best = std::get<1>(group_scores.topk(c_.group_topk, -1));
  const at::Tensor kept = at::zeros({tokens, c_.num_groups}, scores.options().dtype(at::kBool))
                              .scatter(1, best, true)
                              .unsqueeze(-1)
                              .expand(grouped.sizes())
                              .reshape({tokens, -1});
  return scores.masked_fill(kept.logical_not(), -std::numeric_limits<double>::infinity()).topk(c_.topk, -1);
}

// The load-balancing losses of this rank's rows, added (compute_routing_scores_for_aux_loss, then
// the micro-batch's, each sequence's and the global batch's Switch loss, each at its coefficient):
// the normalised scores over all experts, and the tokens per expert of a plain top-k over them (no
// group limit), summed over the TP group under sequence parallelism and the context-parallel group
// under CP (sum_over_sequence). Records each for the log.
at::Tensor MoeMlp::balance_loss(const at::Tensor& logits, int64_t batch, int64_t total) const {
  at::Tensor scores =
      c_.score == MoeScore::kSoftmax ? at::softmax(logits, -1, at::kFloat) : gate_scores(logits, c_.score);
  if (c_.score != MoeScore::kSoftmax) scores = scores / (scores.sum(-1, true) + 1e-20);
  const at::Tensor chosen = std::get<1>(scores.topk(c_.topk, -1));
  at::Tensor loss = at::zeros({}, scores.options());
  // The micro-batch's tokens per expert (aux_loss's and global_aux_loss's), counted once.
  at::Tensor per_expert;
  if (c_.aux_loss_coeff > 0.0 || c_.global_aux_loss_coeff > 0.0) {
    per_expert = sum_over_sequence(expert_counts(chosen, c_.num_experts).to(at::kFloat));
  }
  if (c_.aux_loss_coeff > 0.0) {
    const at::Tensor l = switch_load_balancing_loss(scores, per_expert, total, c_.topk, c_.aux_loss_coeff);
    record_layer_loss("load_balancing_loss", l, c_.aux_loss_coeff, c_, tp_);
    loss = loss + l;
  }
  if (c_.seq_aux_loss_coeff > 0.0) {
    // Each (sequence, expert) its own bin: row t belongs to sequence t / positions.
    const int64_t positions = logits.size(0) / batch;
    const at::Tensor sequence = at::arange(batch, chosen.options()).repeat_interleave(positions).unsqueeze(1);
    const at::Tensor per_sequence =
        sum_over_sequence(expert_counts(chosen + sequence * c_.num_experts, batch * c_.num_experts).to(at::kFloat));
    const at::Tensor l = sequence_load_balancing_loss(scores.view({batch, positions, c_.num_experts}),
                                                      per_sequence.view({batch, c_.num_experts}), total / batch,
                                                      c_.topk, c_.seq_aux_loss_coeff);
    record_layer_loss("seq_load_balancing_loss", l, c_.seq_aux_loss_coeff, c_, tp_);
    loss = loss + l;
  }
  if (c_.global_aux_loss_coeff > 0.0) loss = loss + global_balance_loss(scores, per_expert, total);
  return loss;
}

// Megatron's _apply_global_aux_loss: the tokens per expert summed over every data-parallel rank
// (and the sequence- and context-parallel ones) in this forward, added to this iteration's
// earlier training forwards' and averaged over them; T is one forward's tokens over those ranks.
// So each rank's loss is its rows' share of the global batch's: the log sums the shares over the
// data-parallel ranks (Megatron's needs_dp_avg=False), and the gradient, averaged over them with
// the others, weighs it 1 / (data-parallel size) of a micro-batch loss at the same balance, as in
// Megatron.
// per_expert: the micro-batch's tokens per expert (over the TP group under sequence parallelism
// and the context-parallel group under CP), which aux_loss's gradient may hold: summed over the
// data-parallel ranks in a copy.
at::Tensor MoeMlp::global_balance_loss(const at::Tensor& scores, const at::Tensor& per_expert, int64_t total) const {
  // Under context parallelism the data-parallel group holds the DP x CP ranks, and every rank of
  // a context-parallel group holds its group's counts: each adds 1 / C of them.
  const at::Tensor global = per_expert / static_cast<double>(c_.cp.size);
  sum_over_group(global, DTK_GROUP_DATA_PARALLEL);
  global_tokens = global_tokens.defined() ? global_tokens + global : global;
  ++global_forwards;
  const int64_t dp = group_size(DTK_GROUP_DATA_PARALLEL) / c_.cp.size;  // the ranks reading their own samples
  const at::Tensor loss = switch_load_balancing_loss(scores, global_tokens / static_cast<double>(global_forwards),
                                                     total * dp, c_.topk, c_.global_aux_loss_coeff);
  record_layer_loss("global_load_balancing_loss", loss * static_cast<double>(dp), c_.global_aux_loss_coeff, c_, tp_);
  return loss;
}

// How many parts of each sequence the router's rows are: the TP ranks' under sequence
// parallelism, times the context-parallel ranks'.
int64_t MoeMlp::sequence_parts() const { return (tp_.splits_sequence() ? tp_.size : 1) * c_.cp.size; }

// `counts` of this rank's rows summed over the ranks holding the other parts of its sequences
// (in place; returned).
at::Tensor MoeMlp::sum_over_sequence(const at::Tensor& counts) const {
  if (tp_.splits_sequence()) Comm::all_reduce(counts, DTK_GROUP_TENSOR_PARALLEL, DTK_REDUCE_SUM);
  sum_over_group(counts, DTK_GROUP_CONTEXT_PARALLEL);
  return counts;
}

// How many of the [tokens, k] choices fell in each of `bins` (the experts), [bins] int64 on their
// device (a scatter, where bincount would read the range back to the host).
at::Tensor MoeMlp::expert_counts(const at::Tensor& chosen, int64_t bins) const { return count_choices(chosen, bins); }

// This rank's experts on the rows routed to them, inside the TP region: x [T, h] (all the TP
// group's rows, and under expert parallelism all the expert-parallel group's), probs and experts
// [T, k]. The T x k choices are sorted by expert (one host read of the counts); this rank's
// experts' choices are one run of that order, whose rows are gathered, each expert multiplies its
// part, and the outputs, times their weights, are put back in their choices' places (the other
// ranks' experts' places stay zero) and summed over each row's k: this rank's partial sum [T, h]
// of the experts' second products (before the layer's reductions). Only gathers and copies to
// distinct places and a sum over k move the rows, so the backward adds nothing with atomics (the
// same bits on every run, on a GPU too), and only this rank's choices are multiplied.
at::Tensor MoeMlp::run_experts(const at::Tensor& x, const Routing& r, const ExpertActivation& activation) const {
  const int64_t k = c_.topk, first = c_.first_local_expert();
  const at::Tensor order = std::get<1>(at::sort(r.experts.reshape(-1), /*stable=*/true, 0, false));
  // (one bin past the experts: the dropped choices, sorted last)
  const at::Tensor counts = expert_counts(r.experts, c_.num_experts + 1).cpu();
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t begin = 0, held_choices = 0;
  for (int64_t e = 0; e < first; ++e) begin += count[e];
  for (size_t e = 0; e < experts.size(); ++e) held_choices += count[first + static_cast<int64_t>(e)];
  const at::Tensor mine = order.narrow(0, begin, held_choices);  // choice t * k + j, by expert
  const at::Tensor rows = rows_per_choice(x, k).index_select(0, mine);
  std::vector<at::Tensor> outputs;
  outputs.reserve(experts.size());
  int64_t offset = 0;
  // Every expert of this rank runs, an empty run included, so each of its weights gets a gradient
  // (zero when no row chose it), as a dense layer's would.
  for (size_t e = 0; e < experts.size(); ++e) {
    const int64_t n = count[first + static_cast<int64_t>(e)];
    outputs.push_back(expert_partial(experts[e], rows.narrow(0, offset, n), activation));
    offset += n;
  }
  return sum_chosen(at::cat(outputs), r.probs, mine, k, x.scalar_type());
}

// run_experts with padding to capacity: each of this rank's experts multiplies exactly
// r.padded_rows rows, its run of the sorted choices and then rows weighted zero, all indexed on the
// device (no host read, static shapes). The unfilled slots (zero rows of weight zero) put their
// outputs in places of their own past the choices, which are dropped: they change no output and get
// no gradient.
at::Tensor MoeMlp::run_padded_experts(const at::Tensor& x, const Routing& r, const ExpertActivation& activation) const {
  const int64_t k = c_.topk, held = static_cast<int64_t>(experts.size()), slots = r.padded_rows;
  const PaddedSlots s = padded_slots(r.experts, c_.num_experts, c_.first_local_expert(), held, slots);
  // (Zero rows and weights in the unfilled slots, so an overflow there cannot reach a gradient as 0 * inf.)
  const at::Tensor rows =
      rows_per_choice(x, k).index_select(0, s.choice).masked_fill(s.filled.logical_not().unsqueeze(1), 0);
  std::vector<at::Tensor> outputs;
  outputs.reserve(experts.size());
  for (int64_t e = 0; e < held; ++e)
    outputs.push_back(expert_partial(experts[static_cast<size_t>(e)], rows.narrow(0, e * slots, slots), activation));
  return sum_padded_slots(at::cat(outputs), r.probs, s, k, x.scalar_type());
}

// The alltoall dispatcher (moe_token_dispatcher=alltoall, expert parallelism): x [T, h] and r are
// this rank's rows and choices only (under sequence parallelism its own share of the sequence).
// Every rank's choices per expert are all-gathered (one host read, as run_experts'), each kept
// choice's row goes to its expert's rank, sorted by expert, and comes back as that expert's output,
// weighted and summed here: run_experts' partial sum over the whole group, for this rank's rows
// (under sequence parallelism already summed over the TP group).
at::Tensor MoeMlp::run_experts_all_to_all(const at::Tensor& x, const Routing& r, const ExpertActivation& activation,
                                          const std::function<void()>& meanwhile) const {
  const int64_t k = c_.topk, num = c_.num_experts, ep = c_.ep_size;
  const at::Tensor order = std::get<1>(at::sort(r.experts.reshape(-1), /*stable=*/true, 0, false));
  // sources x (experts + 1) counts, a source per rank sending rows (the TP group's too where each TP rank
  // sends its own): the last bin the dropped choices, which stay here.
  at::Tensor every = gather_expert_rows(count_choices(r.experts, num + 1), ep);
  if (shares_tp_rows()) every = gather_expert_rows(every, tp_.size, DTK_GROUP_TENSOR_PARALLEL);
  every = every.cpu();
  const int64_t* count = every.data_ptr<int64_t>();
  const int64_t sources = every.numel() / (num + 1);
  std::vector<int64_t> counts(static_cast<size_t>(sources * num));
  for (int64_t j = 0; j < sources; ++j)
    for (int64_t e = 0; e < num; ++e) counts[static_cast<size_t>(j * num + e)] = count[j * (num + 1) + e];
  int64_t kept = 0;
  for (int64_t e = 0; e < num; ++e) kept += counts[static_cast<size_t>(own_source() * num + e)];
  const at::Tensor sent = order.narrow(0, 0, kept);  // choice t * k + j, by expert
  const at::Tensor outputs =
      experts_all_to_all(rows_per_choice(x, k).index_select(0, sent), counts, /*padded=*/false, activation, meanwhile);
  return sum_chosen(outputs, r.probs, sent, k, x.scalar_type());
}

// The alltoall dispatcher with padding to capacity: every expert of the group gets exactly
// r.padded_rows rows from every rank (the unfilled ones zero and weighted zero), so the exchange's
// sizes are known without a host read.
at::Tensor MoeMlp::run_padded_experts_all_to_all(const at::Tensor& x, const Routing& r,
                                                 const ExpertActivation& activation,
                                                 const std::function<void()>& meanwhile) const {
  const int64_t k = c_.topk, num = c_.num_experts, slots = r.padded_rows;
  const PaddedSlots s = padded_slots(r.experts, num, 0, num, slots);
  const at::Tensor rows =
      rows_per_choice(x, k).index_select(0, s.choice).masked_fill(s.filled.logical_not().unsqueeze(1), 0);
  const int64_t sources = c_.ep_size * (shares_tp_rows() ? tp_.size : 1);
  const std::vector<int64_t> counts(static_cast<size_t>(sources * num), slots);
  return sum_padded_slots(experts_all_to_all(rows, counts, /*padded=*/true, activation, meanwhile), r.probs, s, k,
                          x.scalar_type());
}

// Under sequence parallelism the alltoall dispatcher sends each TP rank's own rows over its
// expert-parallel group and gathers what the TP group received before the TP-split experts (as
// Megatron's): a TP-th of the expert-parallel traffic of sending the region's whole rows.
bool MoeMlp::shares_tp_rows() const {
  return c_.ep_size > 1 && c_.dispatcher == MoeDispatcher::kAllToAll && tp_.splits_sequence();
}

// This rank's row of the dispatcher's counts: TP rank t of expert-parallel rank j is source t x ep + j.
int64_t MoeMlp::own_source() const { return (shares_tp_rows() ? tp_.rank * c_.ep_size : 0) + c_.ep_rank; }

// The exchange of the alltoall dispatcher. `sent` [n, h]: this rank's rows for the group's experts,
// sorted by expert; counts [sources x experts]: how many rows source s sends expert e (every
// source's, so each knows what it and its TP group receive; own_source()). The rows go to their
// experts' ranks (arriving by source rank, then expert), under shares_tp_rows() the TP group's
// arrivals are gathered (by TP rank, then source, then expert), they are grouped by expert, run
// through this rank's experts (each of them, an empty run included, so every weight gets a
// gradient), put back in arrival order (under shares_tp_rows() summed over the TP group into each
// rank's own arrivals) and returned: [n, h], the experts' partial outputs for `sent`, in its order.
// `padded`: every count the same, so the grouping is a transpose (no index). `meanwhile` (if set)
// runs while the rows are in flight to the experts.
at::Tensor MoeMlp::experts_all_to_all(const at::Tensor& sent, const std::vector<int64_t>& counts, bool padded,
                                      const ExpertActivation& activation,
                                      const std::function<void()>& meanwhile) const {
  const int64_t ep = c_.ep_size, num = c_.num_experts, held = c_.local_experts(), first = c_.first_local_expert();
  const int64_t h = sent.size(1), sources = static_cast<int64_t>(counts.size()) / num, self = own_source();
  const int64_t tp = sources / ep, tp_rank = self / ep;  // (tp 1 unless shares_tp_rows())
  const auto count = [&](int64_t source, int64_t expert) { return counts[static_cast<size_t>(source * num + expert)]; };
  // Rows each source's experts here get (arrival blocks), and this rank's exchange.
  std::vector<int64_t> arriving(static_cast<size_t>(sources), 0), send(static_cast<size_t>(ep), 0),
      recv(static_cast<size_t>(ep), 0), tp_rows(static_cast<size_t>(tp), 0);
  for (int64_t source = 0; source < sources; ++source)
    for (int64_t e = 0; e < held; ++e) arriving[static_cast<size_t>(source)] += count(source, first + e);
  for (int64_t j = 0; j < ep; ++j) {
    for (int64_t e = 0; e < held; ++e) send[static_cast<size_t>(j)] += count(self, j * held + e);
    recv[static_cast<size_t>(j)] = arriving[static_cast<size_t>(tp_rank * ep + j)];
  }
  for (int64_t source = 0; source < sources; ++source)
    tp_rows[static_cast<size_t>(source / ep)] += arriving[static_cast<size_t>(source)];
  at::Tensor received;
  if (meanwhile) {  // (moe_shared_expert_overlap: the shared expert while the rows travel)
    const std::shared_ptr<RowsInFlight> flight = start_exchange(sent, recv, send);
    meanwhile();
    received = finish_exchange(sent, flight);
  } else {
    received = exchange_expert_rows(sent, recv, send);
  }
  if (tp > 1) received = gather_to_tp_experts(received, tp_rows, tp_rank);
  // By expert: expert e's rows from source 0, then source 1, ... (with one expert here, as they arrived)
  at::Tensor grouped = received, arrival;
  const int64_t slots = padded ? count(0, 0) : 0;
  if (padded && held > 1) {
    grouped = received.view({sources, held, slots, h}).transpose(0, 1).reshape({-1, h});
  } else if (!padded && held > 1) {
    std::vector<int64_t> by_expert, back(static_cast<size_t>(received.size(0)));
    by_expert.reserve(back.size());
    for (int64_t e = 0; e < held; ++e) {
      int64_t start = 0;  // of the source's rows for expert e in arrival order
      for (int64_t source = 0; source < sources; ++source) {
        int64_t row = start;
        for (int64_t before = 0; before < e; ++before) row += count(source, first + before);
        for (int64_t i = 0; i < count(source, first + e); ++i) {
          back[static_cast<size_t>(row + i)] = static_cast<int64_t>(by_expert.size());
          by_expert.push_back(row + i);
        }
        start += arriving[static_cast<size_t>(source)];
      }
    }
    grouped = received.index_select(0, index_on(by_expert, received.device()));
    arrival = index_on(back, received.device());
  }
  std::vector<at::Tensor> outputs;
  outputs.reserve(experts.size());
  int64_t offset = 0;
  for (int64_t e = 0; e < held; ++e) {
    int64_t n = 0;
    for (int64_t source = 0; source < sources; ++source) n += count(source, first + e);
    outputs.push_back(expert_partial(experts[static_cast<size_t>(e)], grouped.narrow(0, offset, n), activation));
    offset += n;
  }
  at::Tensor out = at::cat(outputs);
  if (held > 1)
    out = padded ? out.view({held, sources, slots, h}).transpose(0, 1).reshape({-1, h}) : out.index_select(0, arrival);
  if (tp > 1) out = scatter_from_tp_experts(out, tp_rows, tp_rank);
  return exchange_expert_rows(out, send, recv);
}

// The experts' second biases, sum over a row's k experts of probs * b2 [tokens, h], on this
// rank's rows (after the reduction, as a row-parallel bias): the weights scattered into [tokens,
// experts] times the biases [experts, h], one product (no atomic adds in its backward).
at::Tensor MoeMlp::output_bias(const Routing& r, at::ScalarType dtype) const {
  if (experts.empty() || !experts[0].out.bias.defined()) return {};
  std::vector<at::Tensor> biases;
  for (const Expert& e : experts) biases.push_back(e.out.bias);
  at::Tensor table = at::stack(biases);  // [experts held here, h]
  // Every expert's bias from its rank (the gradient of each summed over the group's tokens).
  if (c_.ep_size > 1) table = gather_to_experts(table, c_.ep_size);
  const at::Tensor dense = at::zeros({r.experts.size(0), c_.num_experts + 1}, r.probs.options())
                               .scatter(1, r.experts, r.probs)
                               .narrow(1, 0, c_.num_experts);  // (the dropped choices' column left out)
  return at::matmul(dense, table.to(r.probs.scalar_type())).to(dtype);
}

// Megatron's apply_input_jitter: x [b, s, h] times Uniform(1 - eps, 1 + eps), the noise made in
// fp32 and rounded to x's dtype (Megatron draws it in the input's dtype: in bf16 its uniforms have
// 8 bits). Under sequence parallelism the draw is the whole sequence's and x this rank's rows of
// it, as dropout's (tensor_parallel.hpp); Megatron gives every rank's rows the same noise.
at::Tensor MoeMlp::jittered(const at::Tensor& x, at::Generator& gen) const {
  const DropoutMask draw = draw_uniforms(x, gen, tp_);
  const double eps = c_.input_jitter_eps;
  return x * uniform_noise_on(draw, x.numel(), 1.0 - eps, 1.0 + eps, x.device()).view(x.sizes()).to(x.scalar_type());
}

// The layer's experts on the TP region's rows (whole on every TP rank): the routed experts' output
// and the shared expert's where it leaves the region by itself (else undefined), both out of the
// region. x [b, s, h] and `local` this rank's rows and their routing.
std::pair<at::Tensor, at::Tensor> MoeMlp::dispatch_region(const at::Tensor& x, const Routing& local,
                                                          const ExpertActivation& activation) const {
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2);
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
  // Expert parallelism: the rows reach the other ranks' experts and their outputs come back, every
  // rank's rows all-gathered here (allgather) or this rank's sent where they are routed (alltoall).
  const bool all_gather = c_.ep_size > 1 && c_.dispatcher == MoeDispatcher::kAllGather;
  const bool all_to_all = c_.ep_size > 1 && c_.dispatcher == MoeDispatcher::kAllToAll;
  // Padding: every router call whose rows meet here (the TP group's under sequence parallelism, with
  // the allgather dispatcher the expert-parallel group's) keeps at most padded_rows per expert.
  region.padded_rows = local.padded_rows * (tp_.splits_sequence() ? tp_.size : 1) * (all_gather ? c_.ep_size : 1);
  region.probs = region.probs.reshape({b * whole, c_.topk});
  region.experts = region.experts.reshape({b * whole, c_.topk});
  at::Tensor routed_rows = rows.reshape({b * whole, h});
  at::Tensor routed, shared_partial;
  const auto run_shared = [&] { shared_partial = expert_partial(shared, rows, activation); };
  if (all_to_all) {
    const std::function<void()> meanwhile = overlaps_shared_expert() ? std::function<void()>(run_shared) : nullptr;
    routed = region.padded_rows > 0 ? run_padded_experts_all_to_all(routed_rows, region, activation, meanwhile)
                                    : run_experts_all_to_all(routed_rows, region, activation, meanwhile);
  } else {
    if (all_gather) {
      routed_rows = gather_to_experts(routed_rows, c_.ep_size);
      region.probs = gather_to_experts(region.probs, c_.ep_size);
      region.experts = gather_expert_rows(region.experts, c_.ep_size);
    }
    routed = region.padded_rows > 0 ? run_padded_experts(routed_rows, region, activation)
                                    : run_experts(routed_rows, region, activation);
    if (all_gather) routed = scatter_from_experts(routed, c_.ep_size);
  }
  at::Tensor partial = routed.view({b, whole, h});
  // The shared expert on every row: ungated its partial sum joins the routed experts' reduction;
  // gated it leaves the region by itself, to be weighted per row.
  at::Tensor shared_out;
  if (has_shared_expert()) {
    if (!shared_partial.defined()) run_shared();
    if (shared_gate.defined() || residual_coefficient.defined())
      shared_out = exit_tp_region(shared_partial, tp_);
    else
      partial = partial + shared_partial;
  }
  return {exit_tp_region(partial, tp_), shared_out};
}

// shares_tp_rows(): the routed experts' output for this rank's own rows x [b, s, h], already summed
// over the TP group (nothing to reduce out of the region).
at::Tensor MoeMlp::dispatch_own_rows(const at::Tensor& x, const Routing& local, const ExpertActivation& activation,
                                     const std::function<void()>& meanwhile) const {
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2);
  const at::Tensor rows = x.reshape({b * s, h});
  const at::Tensor routed = local.padded_rows > 0 ? run_padded_experts_all_to_all(rows, local, activation, meanwhile)
                                                  : run_experts_all_to_all(rows, local, activation, meanwhile);
  return routed.view({b, s, h});
}

// moe_shared_expert_overlap where there is an exchange to overlap (the option is refused without
// the alltoall dispatcher or a shared expert).
bool MoeMlp::overlaps_shared_expert() const {
  return c_.shared_expert_overlap && c_.ep_size > 1 && c_.dispatcher == MoeDispatcher::kAllToAll && has_shared_expert();
}

at::Tensor MoeMlp::forward(const at::Tensor& x, const ExpertActivation& activation, bool generating,
                           at::Generator* jitter_rng, bool training) const {
  const int64_t b = x.size(0), s = x.size(1), h = x.size(2);
  at::Tensor router_in = x;
  if (c_.input_jitter_eps > 0.0 && !generating) {
    if (jitter_rng == nullptr)
      throw Error("moe_input_jitter_eps needs the generator its noise is drawn from: pass it to MoeMlp::forward");
    router_in = jittered(x, *jitter_rng);
  }
  const Routing local = route(router_in.reshape({b * s, h}), b, generating, training, jitter_rng);
  // The routed experts' output and, where it is weighted apart, the shared expert's, out of the TP
  // region (the ungated shared expert is in `out`).
  at::Tensor out, shared_out;
  if (shares_tp_rows()) {
    const auto run_shared = [&] {
      shared_out =
          exit_tp_region(expert_partial(shared, gather_from_sequence_parallel_region(x, tp_), activation), tp_);
    };
    out =
        dispatch_own_rows(x, local, activation, overlaps_shared_expert() ? std::function<void()>(run_shared) : nullptr);
    if (has_shared_expert()) {
      if (!shared_out.defined()) run_shared();
      if (!shared_gate.defined() && !residual_coefficient.defined()) out = out + shared_out;
    }
  } else {
    std::tie(out, shared_out) = dispatch_region(x, local, activation);
  }
  const at::Tensor bias = output_bias(local, out.scalar_type());
  if (bias.defined()) out = out + bias.view({b, s, h});
  if (!has_shared_expert()) return out;
  if (residual_coefficient.defined()) {  // DeepSpeed's residual MoE: the two mixed per token
    const at::Tensor mix = at::softmax(dtk::linear(x, residual_coefficient, residual_coefficient_bias), -1);
    return out * mix.narrow(-1, 0, 1) + shared_out * mix.narrow(-1, 1, 1);
  }
  if (!shared_gate.defined()) return shared.out.bias.defined() ? out + shared.out.bias : out;
  if (shared.out.bias.defined()) shared_out = shared_out + shared.out.bias;
  return out + shared_out * at::sigmoid(dtk::linear(x, shared_gate, at::Tensor()));
}

void MoeMlp::add_buffers(std::vector<Param>& out, const std::string& prefix) const {
  if (expert_bias.defined()) add_param(out, prefix + "router.expert_bias", expert_bias, -1, true);
  if (qb_beta.defined()) add_param(out, prefix + "router.qb_beta", qb_beta, -1, true);
}

namespace {

// Every layer's expert bias moves toward the experts below the mean load (see end_moe_iteration).
void move_expert_biases(const std::vector<MoeMlp*>& layers) {
  std::vector<MoeMlp*> biased;
  std::vector<at::Tensor> loads;
  for (MoeMlp* layer : layers)
    if (layer && layer->expert_bias.defined()) biased.push_back(layer), loads.push_back(layer->expert_load);
  if (biased.empty()) return;
  at::NoGradGuard no_grad;
  // [layers, experts]: every layer's loads in one all-reduce per group (data x tensor parallel:
  // without sequence parallelism every TP rank counted every token, a factor the sign ignores).
  const at::Tensor stacked = at::stack(loads);
  for (const int32_t group : {DTK_GROUP_DATA_PARALLEL, DTK_GROUP_TENSOR_PARALLEL}) sum_over_group(stacked, group);
  const int64_t experts = stacked.size(1);
  const at::Tensor offset = stacked.sum(-1, true) / static_cast<double>(experts) - stacked;
  for (size_t i = 0; i < biased.size(); ++i) {
    MoeMlp& layer = *biased[i];
    // Kept in fp32 whatever moved the model (Megatron's _maintain_float32_expert_bias).
    if (layer.expert_bias.scalar_type() != at::kFloat) layer.expert_bias.set_data(layer.expert_bias.to(at::kFloat));
    layer.expert_bias.add_(offset[static_cast<int64_t>(i)].sign().to(layer.expert_bias.device()) *
                           layer.config().bias_update_rate);
    layer.expert_load.zero_();
  }
}

// Every quantile_balancing bias takes in its iteration's estimates (see end_moe_iteration):
// Megatron's _update_router_qb_beta, each layer's mean estimate averaged over the data-parallel
// ranks in one all-reduce for all the layers.
void move_quantile_biases(const std::vector<MoeMlp*>& layers) {
  std::vector<MoeMlp*> balanced;
  std::vector<at::Tensor> means;
  for (MoeMlp* layer : layers) {
    if (!layer || !layer->qb_beta.defined()) continue;
    balanced.push_back(layer);
    // (No training forward: a zero estimate, as Megatron's count clamped to 1.)
    means.push_back(layer->qb_estimates.defined() ? layer->qb_estimates.to(layer->qb_beta.device()) /
                                                        static_cast<double>(std::max<int64_t>(layer->qb_forwards, 1))
                                                  : at::zeros_like(layer->qb_beta, at::kFloat));
  }
  if (balanced.empty()) return;
  at::NoGradGuard no_grad;
  const at::Tensor mean = at::stack(means);  // [layers, experts]
  sum_over_group(mean, DTK_GROUP_DATA_PARALLEL);
  mean.div_(static_cast<double>(group_size(DTK_GROUP_DATA_PARALLEL)));
  for (size_t i = 0; i < balanced.size(); ++i) {
    MoeMlp& layer = *balanced[i];
    if (layer.qb_beta.scalar_type() != at::kFloat) layer.qb_beta.set_data(layer.qb_beta.to(at::kFloat));
    const double ema = layer.config().quantile_ema;
    const at::Tensor moved = layer.qb_beta * ema + mean[static_cast<int64_t>(i)] * (1.0 - ema);
    layer.qb_beta.copy_(moved - moved.mean());
    layer.qb_estimates = at::Tensor();
    layer.qb_forwards = 0;
  }
}

}  // namespace

void end_moe_iteration(const std::vector<MoeMlp*>& layers) {
  move_expert_biases(layers);
  move_quantile_biases(layers);
  for (MoeMlp* layer : layers) {
    if (!layer) continue;
    layer->global_tokens = at::Tensor();
    layer->global_forwards = 0;
  }
}

void update_expert_biases(const std::vector<MoeMlp*>& layers) { end_moe_iteration(layers); }

void MoeMlp::add_params(std::vector<Param>& out, const std::string& prefix) const {
  add_param(out, prefix + "router.weight", router, -1, false);
  if (router_bias.defined()) add_param(out, prefix + "router.bias", router_bias, -1, true);
  for (size_t e = 0; e < experts.size(); ++e) {
    const int64_t index = c_.first_local_expert() + static_cast<int64_t>(e);  // in the whole layer
    const std::string name = prefix + "experts." + std::to_string(index) + ".";
    const size_t first = out.size();
    for (size_t i = 0; i < inputs_.size(); ++i) {
      add_param(out, name + inputs_[i] + ".weight", experts[e].in[i].weight, 0, false);
      if (experts[e].in[i].bias.defined()) add_param(out, name + inputs_[i] + ".bias", experts[e].in[i].bias, 0, true);
    }
    add_param(out, name + output_ + ".weight", experts[e].out.weight, 1, false);
    if (experts[e].out.bias.defined()) add_param(out, name + output_ + ".bias", experts[e].out.bias, -1, true);
    for (size_t k = first; k < out.size(); ++k) {
      out[k].info.expert = 1;
      out[k].info.layer_experts = static_cast<int32_t>(c_.num_experts);  // this layer's (pyramid MoE)
    }
  }
  if (!has_shared_expert()) return;
  const std::string name = prefix + (c_.residual ? "residual_mlp." : "shared_experts.");
  for (size_t i = 0; i < inputs_.size(); ++i) {
    add_param(out, name + inputs_[i] + ".weight", shared.in[i].weight, 0, false);
    if (shared.in[i].bias.defined()) add_param(out, name + inputs_[i] + ".bias", shared.in[i].bias, 0, true);
  }
  add_param(out, name + output_ + ".weight", shared.out.weight, 1, false);
  if (shared.out.bias.defined()) add_param(out, name + output_ + ".bias", shared.out.bias, -1, true);
  if (shared_gate.defined()) add_param(out, name + "gate_weight", shared_gate, -1, false);
  if (residual_coefficient.defined()) {
    add_param(out, prefix + "coefficient.weight", residual_coefficient, -1, false);
    add_param(out, prefix + "coefficient.bias", residual_coefficient_bias, -1, true);
  }
}

}  // namespace dtk::layers
