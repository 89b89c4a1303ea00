#include "layout.hpp"

#include <algorithm>
#include <numeric>
#include <stdexcept>

namespace dtk::zero {

Layout::Layout(std::vector<LayoutParam> params, int dp_size, int64_t bucket_numel)
    : params_(std::move(params)), flat_offset_(params_.size()), bucket_of_(params_.size()), dp_(dp_size) {
  if (dp_ < 1 || bucket_numel < 1) throw std::invalid_argument("zero layout: dp size and bucket size must be >= 1");
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
  const int64_t align = static_cast<int64_t>(dp_) * kChunkAlign;
  auto close = [&](Bucket& b) {
    if (b.slots.empty()) return;
    const int64_t used = b.slots.back().offset + b.slots.back().numel;
    b.numel = (used + align - 1) / align * align;
    b.chunk = b.numel / dp_;
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
  Bucket current;
  int64_t used = 0;
  for (size_t p : order) {
    const LayoutParam& lp = params_[p];
    if (lp.numel <= 0) continue;  // an empty parameter has nothing to partition
    const bool fits = used + lp.numel <= bucket_numel;
    // ZeRO-3 gathers whole buckets: one module's on-demand parameters per bucket.
    const bool same_kind = current.slots.empty() || (current.on_demand == lp.on_demand &&
                                                     (!lp.on_demand || current.ready_module == lp.ready_module));
    if (!current.slots.empty() && (!fits || !same_kind)) {
      close(current);
      used = 0;
    }
    if (current.slots.empty()) {
      current.on_demand = lp.on_demand;
      current.ready_module = lp.ready_module;
    }
    current.slots.push_back(Slot{p, used, lp.numel});
    current.ready_module = std::min(current.ready_module, lp.ready_module);
    used += lp.numel;
  }
  close(current);
}

std::vector<Shard> Layout::shards(int rank) const {
  if (rank < 0 || rank >= dp_) throw std::invalid_argument("zero layout: rank outside the data-parallel group");
  std::vector<Shard> out;
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    const Bucket& b = buckets_[bi];
    const int64_t lo = static_cast<int64_t>(rank) * b.chunk, hi = lo + b.chunk;
    for (const Slot& s : b.slots) {
      const int64_t a = std::max(lo, s.offset), e = std::min(hi, s.offset + s.numel);
      if (a >= e) continue;
      out.push_back(Shard{s.param, bi, a - s.offset, e - a, b.partition_offset + (a - lo)});
    }
  }
  return out;
}

}  // namespace dtk::zero
