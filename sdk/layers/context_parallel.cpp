// context_parallel.cpp — see dtk/layers/context_parallel.hpp.
#include <dtk/layers/context_parallel.hpp>

#include <torch/csrc/autograd/custom_function.h>

#include <dtk/capture.hpp>
#include <dtk/context_parallel.hpp>
#include <dtk/layers/attention.hpp>
#include <dtk/tensor.hpp>

#include <atomic>
#include <string>
#include <vector>

namespace dtk::layers {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_units(int64_t units, int64_t cp, const at::Tensor& x) {
  if (units <= 0 || x.size(-1) % units != 0 || units % cp != 0)
    throw Error("context parallelism " + std::to_string(cp) + ": " + std::to_string(units) +
                " attention heads (or key/value groups) on a tensor-parallel rank must divide by it, in a projection " +
                shape_str(x));
}

// [b, s / cp, units * w] -> [b, s, units / cp * w]: rank j receives every rank's share of the
// sequence for its units; the shares, side by side in rank order, are put back in order.
at::Tensor heads_from_sequence_once(const at::Tensor& x, int64_t units, int64_t cp) {
  const int64_t b = x.size(0), share = x.size(1), w = x.size(2) / units, mine = units / cp;
  at::Tensor send = x.reshape({b, share, cp, mine * w}).permute({2, 0, 1, 3}).contiguous();  // [cp, b, s/cp, ..]
  at::Tensor got = at::empty_like(send);
  Comm::all_to_all(got, send, DTK_GROUP_CONTEXT_PARALLEL);
  // got[j] is rank j's share for this rank's units: [b, cp x s/cp (rank order), mine * w].
  return context_parallel_whole(got.permute({1, 0, 2, 3}).reshape({b, cp * share, mine * w}), 1,
                                static_cast<int32_t>(cp));
}

// [b, s, units * w] -> [b, s / cp, cp * units * w]: every rank gets its share of the sequence
// back, for the units of each rank in rank order.
at::Tensor sequence_from_heads_once(const at::Tensor& x, int64_t cp) {
  const int64_t b = x.size(0), share = x.size(1) / cp, width = x.size(2);
  std::vector<at::Tensor> shares;  // [b, s / cp, width]: each rank j's share of the sequence
  shares.reserve(static_cast<size_t>(cp));
  for (int64_t j = 0; j < cp; ++j)
    shares.push_back(context_parallel_share(x, 1, static_cast<int32_t>(j), static_cast<int32_t>(cp)));
  at::Tensor send = at::stack(shares, 0);  // [cp, b, s / cp, width]
  at::Tensor got = at::empty_like(send);
  Comm::all_to_all(got, send, DTK_GROUP_CONTEXT_PARALLEL);
  // got[j] is this rank's share for rank j's units.
  return got.permute({1, 2, 0, 3}).reshape({b, share, cp * width});
}

struct HeadsFromSequence : public torch::autograd::Function<HeadsFromSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t units, int64_t cp) {
    ctx->saved_data["cp"] = cp;
    return heads_from_sequence_once(x, units, cp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {sequence_from_heads_once(grad[0].contiguous(), ctx->saved_data["cp"].toInt()), at::Tensor(), at::Tensor()};
  }
};

struct SequenceFromHeads : public torch::autograd::Function<SequenceFromHeads> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t units, int64_t cp) {
    ctx->saved_data["cp"] = cp;
    ctx->saved_data["units"] = units * cp;
    return sequence_from_heads_once(x, cp);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {
        heads_from_sequence_once(grad[0].contiguous(), ctx->saved_data["units"].toInt(), ctx->saved_data["cp"].toInt()),
        at::Tensor(), at::Tensor()};
  }
};

// all_gather's keys and values: this rank's share [b, s / cp, ...] -> the whole sequence [b, s,
// ...] in order; the backward sums every rank's gradient of each share into its owner's
// (reduce-scatter of the gradients laid out by share).
struct GatherSequence : public torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& share, int64_t rank, int64_t cp) {
    ctx->saved_data["rank"] = rank;
    ctx->saved_data["cp"] = cp;
    return ContextParallel{static_cast<int32_t>(rank), static_cast<int32_t>(cp)}.whole_sequence(share);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto cp = static_cast<int32_t>(ctx->saved_data["cp"].toInt());
    std::vector<at::Tensor> shares;  // [b, s / cp, ...]: each rank j's share of the gradient
    shares.reserve(static_cast<size_t>(cp));
    for (int32_t j = 0; j < cp; ++j) shares.push_back(context_parallel_share(grad[0], 1, j, cp));
    const at::Tensor send = at::cat(shares, 0);  // [cp x b, s / cp, ...], rank-major
    at::Tensor mine = at::empty_like(shares[0], at::MemoryFormat::Contiguous);
    Comm::reduce_scatter(mine, send, DTK_GROUP_CONTEXT_PARALLEL);
    return {mine, at::Tensor(), at::Tensor()};
  }
};

// The mask of `s` queries at positions first .. first + s - 1 over the keys 0 .. t - 1 (t = first
// + s): `given`'s rows and columns there, else the causal one; a window's keys masked too.
at::Tensor chunk_mask(const at::Tensor& given, int64_t first, int64_t s, int64_t t, int64_t window, at::Device device) {
  at::Tensor m = given.defined() ? given.narrow(2, first, s).narrow(3, 0, t) : at::Tensor();
  if (window >= 0) return window_mask(m, s, t, window, device);
  if (m.defined()) return m;
  return at::ones({s, t}, at::TensorOptions().dtype(at::kBool).device(device)).triu(t - s + 1).view({1, 1, s, t});
}

// Refuses a given mask ([b or 1, 1, s, s], true = masked) that lets a query see a key in a later
// chunk of the sequence's 2 cp: a chunk reads only the keys up to its own end. Every rank checks
// every chunk (the mask is the whole sequence's, the same on each), so each fails alike before the
// gather instead of one failing and the others waiting. One reduction per chunk (over views: no
// copy of the mask) and one read of their results. On the CPU every call; on a GPU, where the read
// is a device synchronisation, the first call, and while a CUDA graph is recorded every replay
// (the host reads the flag once per iteration: dtk/capture.hpp).
void refuse_masks_seeing_later_chunks(const at::Tensor& given, int64_t whole, int64_t chunks) {
  static std::atomic<bool> read_on_a_device{false};
  if (!given.defined()) return;
  if (given.dim() != 4 || given.size(2) != whole || given.size(3) != whole)
    throw Error("context parallelism's all_gather: the attention mask must be the whole sequence's [b or 1, 1, " +
                std::to_string(whole) + ", " + std::to_string(whole) + "], got " + shape_str(given));
  if (!given.device().is_cpu() && !capturing() && read_on_a_device.exchange(true)) return;
  const int64_t chunk = whole / chunks;
  std::vector<at::Tensor> masked;  // per chunk but the last: every later key masked for its rows
  for (int64_t c = 0; c + 1 < chunks; ++c)
    masked.push_back(given.narrow(2, c * chunk, chunk).narrow(3, (c + 1) * chunk, whole - (c + 1) * chunk).all());
  const at::Tensor all_masked = at::stack(masked);
  const std::string why =
      "and all_gather's chunks of queries attend over the keys up to their own end only (a causal "
      "mask); run distributed.cp_comm_type=a2a";
  if (capturing())
    return defer_check(all_masked.logical_not(),
                       "context parallelism's all_gather: the attention mask lets a query see a later key, " + why);
  const at::Tensor read = all_masked.cpu();
  for (int64_t c = 0; c + 1 < chunks; ++c)
    if (!read[c].item<bool>())
      throw Error("context parallelism's all_gather: the attention mask lets a query at positions " +
                  std::to_string(c * chunk) + ".." + std::to_string((c + 1) * chunk - 1) + " see a later key, " + why);
}

}  // namespace

at::Tensor ContextParallel::attend_whole_keys(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              double scale, const at::Tensor& given, int64_t window,
                                              const DropoutMask& keep, const FusedKernels& kernels) const {
  if (!gathers_keys()) throw Error("attend_whole_keys: context parallelism's all_gather is not on");
  const int64_t share = q.size(1), chunk = share / 2, whole = share * size, hd = k.size(-1);
  if (share % 2 != 0 || k.size(1) != share || v.sizes() != k.sizes())
    throw Error("attend_whole_keys: queries " + shape_str(q) + ", keys " + shape_str(k) + " and values " +
                shape_str(v) + " must hold this rank's share (two equal chunks) of the same positions");
  refuse_masks_seeing_later_chunks(given, whole, 2 * size);
  // The keys and values in one collective: [b, s, groups, 2 hd].
  const at::Tensor kv = GatherSequence::apply(at::cat({k, v}, -1), rank, size);
  std::vector<at::Tensor> context;
  for (int64_t j = 0; j < 2; ++j) {
    // The share's chunk j is the sequence's chunk `rank` (j 0) or 2 cp - 1 - rank (j 1).
    const int64_t first = (j == 0 ? rank : 2 * size - 1 - rank) * chunk, keys = first + chunk;
    const at::Tensor seen = kv.narrow(1, 0, keys);
    const at::Tensor queries = q.narrow(1, j * chunk, chunk), k_seen = seen.narrow(-1, 0, hd),
                     v_seen = seen.narrow(-1, hd, hd);
    const DropoutMask chunk_keep = keep.columns(2 * whole, j * whole, keys);
    // On a GPU, DTK's kernel: its queries sit at the last `chunk` of the `keys` positions, the
    // chunk's rows of the causal mask (and of a window), the probabilities never in memory.
    if (!given.defined() && fused_attention_applies(queries, k_seen, v_seen, chunk_keep, kernels))
      context.push_back(fused_attention(queries, k_seen, v_seen, scale, chunk_keep, window));
    // On the CPU in fp32 (no window), the causal kernel that skips the masked keys.
    else if (!given.defined() && window < 0 && causal_attention_applies(queries, k_seen, v_seen, chunk_keep))
      context.push_back(causal_attention(queries, k_seen, v_seen, scale, chunk_keep));
    else
      context.push_back(attention_ops(queries, k_seen, v_seen, scale,
                                      chunk_mask(given, first, chunk, keys, window, q.device()), chunk_keep));
  }
  return at::cat(context, 1);
}

std::vector<int64_t> ContextParallel::gathered_probs_shape(int64_t b, int64_t heads, int64_t share) const {
  return {b, heads, share / 2, 2 * share * size};
}

at::Tensor ContextParallel::heads_from_sequence(const at::Tensor& x, int64_t units) const {
  if (!active() || gathers_keys()) return x;
  check_units(units, size, x);
  return HeadsFromSequence::apply(x, units, static_cast<int64_t>(size));
}

at::Tensor ContextParallel::sequence_from_heads(const at::Tensor& x, int64_t units) const {
  if (!active() || gathers_keys()) return x;
  check_units(units, 1, x);
  return SequenceFromHeads::apply(x, units, static_cast<int64_t>(size));
}

at::Tensor ContextParallel::whole_positions(const at::Tensor& positions) const {
  return whole_sequence(positions.to(at::kLong));
}

at::Tensor ContextParallel::whole_sequence(const at::Tensor& share) const {
  if (!active()) return share;
  const at::Tensor mine = share.detach().contiguous();
  std::vector<int64_t> gathered = mine.sizes().vec();
  gathered[0] *= size;
  at::Tensor all = at::empty(gathered, mine.options());
  Comm::all_gather(all, mine, DTK_GROUP_CONTEXT_PARALLEL);  // [cp x b, s / cp, ...], rank-major
  std::vector<int64_t> by_rank = mine.sizes().vec(), whole = mine.sizes().vec();
  by_rank.insert(by_rank.begin(), size);  // [cp, b, s / cp, ...]
  whole[1] *= size;                       // [b, s, ...]
  return context_parallel_whole(all.view(by_rank).transpose(0, 1).reshape(whole), 1, size);
}

at::Tensor ContextParallel::share_of_sequence(const at::Tensor& whole) const {
  if (!active()) return whole;
  return context_parallel_share(whole, 1, rank, size);
}

at::Tensor ContextParallel::share_of_positions(int64_t b, int64_t s, at::Device device) const {
  const at::Tensor whole = at::arange(s, at::TensorOptions().dtype(at::kLong).device(device)).unsqueeze(0);
  return context_parallel_share(whole, 1, rank, size).expand({b, s / size}).contiguous();
}

}  // namespace dtk::layers
