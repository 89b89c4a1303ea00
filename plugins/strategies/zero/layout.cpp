#include "layout.hpp"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace dtk::zero {

Layout::Layout(std::vector<LayoutParam> params, int dp_size, int64_t bucket_numel, int expert_dp)
    : params_(std::move(params)),
      flat_offset_(params_.size()),
      bucket_of_(params_.size()),
      dp_(dp_size),
      expert_dp_(expert_dp == 0 ? dp_size : expert_dp) {
  if (dp_ < 1 || bucket_numel < 1) throw std::invalid_argument("zero layout: dp size and bucket size must be >= 1");
  if (expert_dp_ < 1 || dp_ % expert_dp_ != 0)
    throw std::invalid_argument("zero layout: the expert-data-parallel size must divide the dp size");
  // Backward order: the module whose backward runs first (the highest ready module) comes first;
  // parameters no module reads go last. ZeRO-3's on-demand parameters come before the always-whole
  // ones, so that each module's on-demand parameters form one bucket and the small persistent
  // ones share buckets across modules. Ties keep the model's order.
  std::vector<size_t> order(params_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (params_[a].on_demand != params_[b].on_demand) return params_[a].on_demand;
    return std::max(params_[a].ready_module, -1) > std::max(params_[b].ready_module, -1);
  });
  auto close = [&](Bucket& b) {
    if (b.slots.empty()) return;
    const int64_t used = b.slots.back().offset + b.slots.back().numel;
    const int64_t align = static_cast<int64_t>(b.split) * kChunkAlign;
    b.numel = (used + align - 1) / align * align;
    b.chunk = b.numel / b.split;
    b.flat_offset = flat_numel_;
    b.partition_offset = partition_numel_;
    flat_numel_ += b.numel;
    partition_numel_ += b.chunk;
    for (const Slot& s : b.slots) {
      flat_offset_[s.param] = b.flat_offset + s.offset;
      bucket_of_[s.param] = buckets_.size();
    }
    buckets_.push_back(std::move(b));
    b = Bucket{};
  };
  // One bucket open per kind: the dense parameters' and the experts'.
  Bucket current[2];
  int64_t used[2] = {0, 0};
  for (size_t p : order) {
    const LayoutParam& lp = params_[p];
    if (lp.numel <= 0) continue;  // an empty parameter has nothing to partition
    Bucket& open = current[lp.expert ? 1 : 0];
    int64_t& filled = used[lp.expert ? 1 : 0];
    const bool fits = filled + lp.numel <= bucket_numel;
    // ZeRO-3 gathers whole buckets: one module's on-demand parameters per bucket.
    const bool same_kind = open.slots.empty() ||
                           (open.on_demand == lp.on_demand && (!lp.on_demand || open.ready_module == lp.ready_module));
    if (!open.slots.empty() && (!fits || !same_kind || lp.own_bucket)) {
      close(open);
      filled = 0;
    }
    if (open.slots.empty()) {
      open.on_demand = lp.on_demand;
      open.ready_module = lp.ready_module;
      open.expert = lp.expert;
      open.split = lp.expert ? expert_dp_ : dp_;
    }
    open.slots.push_back(Slot{p, filled, lp.numel});
    open.ready_module = std::min(open.ready_module, lp.ready_module);
    filled += lp.numel;
    if (lp.own_bucket) {
      close(open);
      filled = 0;
    }
  }
  close(current[0]);
  close(current[1]);
}

std::vector<Shard> Layout::shards(int rank, int expert_rank) const {
  if (rank < 0 || rank >= dp_) throw std::invalid_argument("zero layout: rank outside the data-parallel group");
  if (expert_rank < 0 || expert_rank >= expert_dp_)
    throw std::invalid_argument("zero layout: rank outside the expert-data-parallel group");
  std::vector<Shard> out;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const Bucket& b = buckets_[bi];
    const int64_t lo = static_cast<int64_t>(b.expert ? expert_rank : rank) * b.chunk, hi = lo + b.chunk;
    for (const Slot& s : b.slots) {
      const int64_t a = std::max(lo, s.offset), e = std::min(hi, s.offset + s.numel);
      if (a >= e) continue;
      out.push_back(Shard{s.param, bi, a - s.offset, e - a, b.partition_offset + (a - lo)});
    }
  }
  return out;
}

}  // namespace dtk::zero
