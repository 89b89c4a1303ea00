// gather.cpp — the ZeRO strategy's module hooks and stage 3's parameter gathering
// (zero_strategy.hpp).
//
// A module holds the on-demand buckets of every parameter it reads (the tied output layer holds
// the embedding's) from its pre_forward or pre_backward to its post_forward or post_backward;
// buckets are reference-counted across modules and freed when the last holder lets go. In
// backward with full recomputation a module's recomputed forward comes first: its post_forward
// then keeps the buckets for the backward that follows; so does the last module's forward when
// backward follows it. Prefetch: entering a module issues the
// all-gathers of the next modules in the direction of travel (forward: higher indices, backward:
// lower), up to stage3_prefetch_bucket_size elements and while the gathered total stays within
// stage3_max_live_parameters.
#include "zero_strategy.hpp"

#include <algorithm>

namespace dtk::zero {

namespace {

ZeroStrategy* self(void* ctx) { return static_cast<ZeroStrategy*>(ctx); }

}  // namespace

dtk_status* ZeroStrategy::pre_forward(void* ctx, int32_t module) {
  return guard([&] {
    ZeroStrategy* z = self(ctx);
    if (z->opt_.stage != 3) {
      // Stages 1/2 with overlap_param_gather: this module's updated parameters arrive.
      if (z->gather_overlapped_ && module >= 0 && static_cast<size_t>(module) < z->module_buckets_.size())
        for (size_t b : z->module_buckets_[static_cast<size_t>(module)]) z->finish_gather(b);
      return;
    }
    z->acquire_module(module);
    z->prefetch(module, z->backward_phase_ ? -1 : +1);
  });
}

dtk_status* ZeroStrategy::post_forward(void* ctx, int32_t module) {
  return guard([&] {
    ZeroStrategy* z = self(ctx);
    if (z->opt_.stage != 3 || z->backward_phase_) return;
    // The last module's backward comes right after its forward: keep what it holds.
    if (at::GradMode::is_enabled() && static_cast<size_t>(module) + 1 == z->module_reads_.size()) return;
    z->release_module(module);
  });
}

dtk_status* ZeroStrategy::pre_backward(void* ctx, int32_t module) {
  return guard([&] {
    ZeroStrategy* z = self(ctx);
    if (z->opt_.stage != 3) return;
    z->acquire_module(module);
    z->prefetch(module, -1);
  });
}

// The gradients this module completes go to their buckets (reduce-scattered when full); stage 3
// lets the module's buckets go.
dtk_status* ZeroStrategy::post_backward(void* ctx, int32_t module) {
  return guard([&] {
    ZeroStrategy* z = self(ctx);
    // Stage 1 reduces from here only in the last micro-batch's backward (reduce_overlapped_).
    if (z->opt_.stage == 1 && !z->reducing_in_backward_) return;
    at::NoGradGuard no_grad;
    if (module < 0 || static_cast<size_t>(module) >= z->ready_at_.size())
      throw Error("zero: post_backward for module " + std::to_string(module) + ", which the model did not report");
    for (size_t p : z->ready_at_[static_cast<size_t>(module)]) z->collect(p);
    if (z->opt_.stage == 3) z->release_module(module);
    if (module == z->first_module_) z->backward_phase_ = false;  // the last module of backward
  });
}

// The on-demand buckets a module reads, each once.
static std::vector<size_t> buckets_of(const Layout& l, const std::vector<size_t>& params) {
  std::vector<size_t> out;
  for (size_t p : params) {
    if (!l.params()[p].on_demand) continue;
    const size_t b = l.bucket_of(p);
    if (std::find(out.begin(), out.end(), b) == out.end()) out.push_back(b);
  }
  return out;
}

void ZeroStrategy::acquire_module(int32_t module) {
  if (module < 0 || static_cast<size_t>(module) >= module_reads_.size())
    throw Error("zero: hook for module " + std::to_string(module) + ", which the model did not report");
  if (module_live_[static_cast<size_t>(module)]) return;
  at::NoGradGuard no_grad;
  for (size_t b : buckets_of(*layout_, module_reads_[static_cast<size_t>(module)])) {
    ++refs_[b];
    if (gathering_[b])
      wait_bucket(b);
    else if (!full_[b].defined())
      gather_bucket(b, /*async=*/false);
  }
  module_live_[static_cast<size_t>(module)] = 1;
}

void ZeroStrategy::release_module(int32_t module) {
  if (module < 0 || static_cast<size_t>(module) >= module_reads_.size() || !module_live_[static_cast<size_t>(module)])
    return;
  for (size_t b : buckets_of(*layout_, module_reads_[static_cast<size_t>(module)]))
    if (--refs_[b] == 0) free_bucket(b);
  module_live_[static_cast<size_t>(module)] = 0;
}

// All-gathers bucket b from every rank's chunk (host -> device first when the partition is
// offloaded; read from the swap file into a buffer first with offload_param=nvme). Synchronous
// gathers point the parameters into it at once; an async one when waited.
void ZeroStrategy::gather_bucket(size_t b, bool async) {
  const Bucket& bucket = layout_->buckets()[b];
  at::Tensor whole = at::empty({bucket.numel}, at::TensorOptions().dtype(dtype_).device(device_));
  int slot = -1;
  at::Tensor mine;
  if (on_disk(b)) {
    slot = param_swap_->acquire(b);
    mine = param_swap_->chunk(slot);
  } else {
    mine = part_params_.narrow(0, bucket.partition_offset, bucket.chunk);
  }
  if (mine.device() != device_) {
    mine = mine.to(device_);
    if (slot >= 0) param_swap_->release(slot), slot = -1;  // the gather reads the device copy
  }
  full_[b] = whole;
  if (bucket.split == 1) {
    whole.copy_(mine);
  } else if (async) {
    gathering_[b].emplace(Comm::all_gather_async(whole, mine, group_of(bucket)));
    if (slot >= 0) gather_slot_[b] = slot;  // held until the gather completes
    return;
  } else {
    Comm::all_gather(whole, mine, group_of(bucket));
  }
  if (slot >= 0) param_swap_->release(slot);
  gathering_[b].reset();
  wait_bucket(b);
}

// offload_param=nvme: the buffer an async gather read from is free again.
static void release_gather_slot(ParamSwap* swap, std::vector<int>& gather_slot, size_t b) {
  if (!swap || gather_slot[b] < 0) return;
  swap->release(gather_slot[b]);
  gather_slot[b] = -1;
}

void ZeroStrategy::wait_bucket(size_t b) {
  if (gathering_[b]) {
    gathering_[b]->wait();
    gathering_[b].reset();
    release_gather_slot(param_swap_.get(), gather_slot_, b);
  }
  if (!full_[b].defined()) return;
  for (const Slot& s : layout_->buckets()[b].slots) {
    at::Tensor& p = params_[s.param].tensor;
    p.set_data(full_[b].narrow(0, s.offset, s.numel).view(p.sizes()));
  }
}

void ZeroStrategy::free_bucket(size_t b) {
  if (gathering_[b]) {
    gathering_[b]->wait();
    gathering_[b].reset();
    release_gather_slot(param_swap_.get(), gather_slot_, b);
  }
  for (const Slot& s : layout_->buckets()[b].slots) {
    at::Tensor& p = params_[s.param].tensor;
    p.set_data(nan_.expand(p.sizes()));
  }
  full_[b] = at::Tensor();
}

// offload_param=nvme: a bucket whose chunk no host buffer holds yet has its read issued instead
// (into a buffer whose chunk was used already), and from there on only reads are issued; those
// buckets are gathered by their module's acquire. So the disk reads the next modules' chunks while
// this one computes, and a chunk read one module ahead is gathered ahead too. What is gathered
// when depends only on the order of calls (ParamSwap::prefetch), so every rank issues the same
// all-gathers in the same order. An async gather holds its buffer until it completes (on a CPU
// run its input is the buffer): one buffer always stays unpinned for the synchronous path.
void ZeroStrategy::prefetch(int32_t from_module, int direction) {
  int64_t live = 0;
  for (size_t b = 0; b < full_.size(); ++b)
    if (layout_->buckets()[b].on_demand && full_[b].defined()) live += layout_->buckets()[b].numel;
  int64_t budget = opt_.prefetch_bucket_size;
  bool reads_only = false;
  for (int32_t m = from_module + direction; m >= 0 && static_cast<size_t>(m) < module_reads_.size(); m += direction) {
    for (size_t b : buckets_of(*layout_, module_reads_[static_cast<size_t>(m)])) {
      if (full_[b].defined()) continue;
      const int64_t n = layout_->buckets()[b].numel;
      if (n > budget || live + n > opt_.max_live_parameters) return;
      if (on_disk(b)) {
        if (!param_swap_->holds(b)) {
          if (!param_swap_->prefetch(b)) return;  // no buffer to read into
          reads_only = true;
        } else if (device_.is_cpu() && param_swap_->pinned() + 2 > param_swap_->slots()) {
          reads_only = true;
        }
        if (reads_only) {
          budget -= n;
          continue;
        }
      }
      gather_bucket(b, /*async=*/true);
      budget -= n;
      live += n;
    }
  }
}

void ZeroStrategy::write_back_partition(size_t b) {
  const Bucket& bucket = layout_->buckets()[b];
  if (!full_[b].defined()) return;
  const at::Tensor values = full_[b].narrow(0, own_offset(bucket), bucket.chunk);
  if (param_swap_) {  // (an always-whole bucket's values are its full_ already)
    if (!bucket.on_demand) return;
    const int slot = param_swap_->begin_write(b);
    param_swap_->chunk(slot).copy_(values);
    param_swap_->end_write(slot);
    return;
  }
  part_params_.narrow(0, bucket.partition_offset, bucket.chunk).copy_(values);
}

// Around the host's reads and writes of whole parameters (checkpoints): gather every on-demand
// bucket; afterwards take this rank's chunks of the (possibly loaded) values and release.
void ZeroStrategy::gather_parameters(bool whole) {
  // A delayed step completes before the host reads parameters or optimizer state (a checkpoint
  // saves the state of every step taken; a resumed run continues from there exactly).
  if (whole) finish_delayed_step();
  if (opt_.stage != 3) {
    // Stages 1/2 (overlap_param_gather): the gathers in flight complete; the values stay whole.
    if (whole)
      for (size_t b = 0; b < gathering_.size(); ++b) finish_gather(b);
    return;
  }
  at::NoGradGuard no_grad;
  const Layout& l = *layout_;
  for (size_t b = 0; b < l.buckets().size(); ++b) {
    if (whole) {
      if (!l.buckets()[b].on_demand) continue;
      ++refs_[b];
      if (gathering_[b])
        wait_bucket(b);
      else if (!full_[b].defined())
        gather_bucket(b, /*async=*/false);
    } else {
      write_back_partition(b);
      if (l.buckets()[b].on_demand && --refs_[b] == 0) free_bucket(b);
    }
  }
}

}  // namespace dtk::zero
