#include "dtk/core/export/generate.hpp"

#include <ATen/ATen.h>
#include <dtk/model.hpp>

#include <algorithm>
#include <limits>
#include <string>

#include "dtk/core/comm/comm.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

at::Tensor sample_next(const at::Tensor& logits_in, const SamplingOptions& o, void* generator) {
  // Only the real vocabulary: the padding rows differ between tensor-parallel layouts, and the
  // sampler's random draws must not depend on them (same seed, same text at any TP size).
  at::Tensor logits = logits_in.to(at::kFloat);
  if (o.vocab_size > 0 && o.vocab_size < logits.size(1)) logits = logits.narrow(1, 0, o.vocab_size);
  logits = logits.contiguous().clone();
  if (o.temperature <= 0) return logits.argmax(1);
  // Each row's top logit to 0 first (softmax does not change), then times 1 / temperature, at most
  // float's largest: a temperature so small that logits / t overflow, or that rounds to 0 in float,
  // leaves the top token at 0 and the others at -inf (greedy), never NaN.
  logits.sub_(std::get<0>(logits.max(1, /*keepdim=*/true)));
  logits.mul_(std::min(1.0 / o.temperature, static_cast<double>(std::numeric_limits<float>::max())));
  if (o.top_k > 0 && o.top_k < logits.size(1)) {
    // Everything below the k-th largest logit is out.
    const at::Tensor kth = std::get<0>(logits.topk(o.top_k, 1)).narrow(1, o.top_k - 1, 1);
    logits.masked_fill_(logits < kth, -INFINITY);
  }
  if (o.top_p < 1.0) {
    // Nucleus: sort, keep the tokens whose preceding cumulative probability is below top_p (the
    // most likely token always stays).
    auto [sorted, order] = logits.sort(1, /*descending=*/true);
    const at::Tensor cumulative = sorted.softmax(1).cumsum(1);
    const at::Tensor drop_sorted = (cumulative - sorted.softmax(1)) >= o.top_p;
    drop_sorted.select(1, 0).fill_(false);  // even where top_p rounds to 0 in float
    logits.scatter_(1, order, sorted.masked_fill(drop_sorted, -INFINITY));
  }
  const at::Tensor probs = logits.softmax(1);
  return at::multinomial(probs, 1, false, *static_cast<at::Generator*>(generator)).squeeze(1);
}

void check_generation_fits(int64_t longest_prompt, int64_t max_new_tokens, int64_t max_positions) {
  if (longest_prompt + max_new_tokens - 1 > max_positions)
    throw host::HostError("generate: the longest prompt (" + std::to_string(longest_prompt) + " tokens) plus " +
                          std::to_string(max_new_tokens) + " new tokens exceeds the model's " +
                          std::to_string(max_positions) + " positions");
}

std::vector<std::vector<int64_t>> generate(const dtk_model_ref* model, const std::vector<std::vector<int64_t>>& prompts,
                                           const SamplingOptions& o, int64_t max_positions,
                                           const std::function<void(size_t, int64_t)>& on_token) {
  at::NoGradGuard no_grad;
  const dtk::ModelHandle m(model);
  const int64_t b = static_cast<int64_t>(prompts.size());
  int64_t longest = 0;
  for (const auto& p : prompts) {
    if (p.empty()) throw host::HostError("generate: an empty prompt (nothing to continue)");
    longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  }
  if (b == 0) return {};
  check_generation_fits(longest, o.max_new_tokens, max_positions);
  const int64_t capacity = longest + o.max_new_tokens - 1;  // the last new token is never fed back
  // Left padding: row i's first real token sits at column pad[i].
  at::Tensor tokens = at::zeros({b, longest}, at::kLong), pad = at::empty({b}, at::kLong);
  for (int64_t i = 0; i < b; ++i) {
    const auto& p = prompts[static_cast<size_t>(i)];
    const int64_t start = longest - static_cast<int64_t>(p.size());
    pad[i] = start;
    tokens[i].narrow(0, start, static_cast<int64_t>(p.size())).copy_(at::tensor(p, at::kLong));
  }
  // Keys a query may see: real tokens (column >= pad) not after it. mask true = masked.
  auto mask_for = [&](int64_t length, int64_t n) {
    const at::Tensor key = at::arange(length + n, at::kLong).view({1, 1, 1, length + n});
    const at::Tensor query = (at::arange(n, at::kLong) + length).view({1, 1, n, 1});
    return (key < pad.view({b, 1, 1, 1})).logical_or(key > query);
  };
  auto positions_for = [&](int64_t length, int64_t n) {
    return (at::arange(n, at::kLong) + length).view({1, n}).sub(pad.view({b, 1})).clamp_min(0);
  };
  const Topology& topo = topology();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(b));
  std::vector<bool> done(static_cast<size_t>(b), false);
  TensorList caches;
  at::Tensor step_tokens = tokens;
  int64_t length = 0;
  for (int64_t t = 0; t < o.max_new_tokens; ++t) {
    const int64_t n = step_tokens.size(1);
    TensorList in{{"tokens", step_tokens},
                  {"position_ids", positions_for(length, n)},
                  {"attention_mask", mask_for(length, n)},
                  {"kv_cache_length", at::scalar_tensor(length, at::kLong)}};
    if (caches.empty())
      in.emplace_back("kv_cache_capacity", at::scalar_tensor(capacity, at::kLong));
    else
      for (const auto& c : caches) in.push_back(c);
    TensorList result = m.forward(in);
    caches.clear();
    at::Tensor logits;
    for (auto& [name, value] : result) {
      if (name == "logits")
        logits = value;
      else if (name.rfind("kv_cache.", 0) == 0)
        caches.emplace_back(name, value);
    }
    if (!logits.defined()) throw host::HostError("generate: the model returned no 'logits'");
    logits = logits.reshape({b, -1}).to(at::kFloat);
    if (topo.tp_size > 1) {  // the vocabulary slices, whole, in rank order
      at::Tensor whole = at::empty({topo.tp_size * logits.size(1), b}, at::kFloat);
      all_gather(whole, logits.t().contiguous(), DTK_GROUP_TENSOR_PARALLEL).wait();
      logits = whole.t();
    }
    // (Every rank holds the whole logits here: all refuse together.)
    if (!logits.isfinite().all().item<bool>())
      throw host::HostError(
          "generate: the model's logits are not finite (NaN or infinite): the checkpoint's "
          "weights are broken (was its training skipping every step?)");
    at::Tensor next = sample_next(logits, o, &gen).to(at::kLong).contiguous();
    if (topo.tp_size > 1) broadcast(next, DTK_GROUP_TENSOR_PARALLEL, 0).wait();
    length += n;
    bool all_done = true;
    for (int64_t i = 0; i < b; ++i) {
      if (done[static_cast<size_t>(i)]) {
        next[i] = o.eos >= 0 ? o.eos : 0;  // keeps feeding a finished row; its tokens are not kept
        continue;
      }
      const int64_t id = next[i].item<int64_t>();
      out[static_cast<size_t>(i)].push_back(id);
      if (on_token) on_token(static_cast<size_t>(i), id);
      if (id == o.eos) done[static_cast<size_t>(i)] = true;
      all_done = all_done && done[static_cast<size_t>(i)];
    }
    if (all_done) break;
    step_tokens = next.view({b, 1});
  }
  return out;
}

}  // namespace dtk::core
