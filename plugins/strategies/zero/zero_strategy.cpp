// zero_strategy.cpp — setup, gradients, the optimizer step, checkpoint state and memory of the
// ZeRO strategy (zero_strategy.hpp). Stage 3's gathering is in gather.cpp.
#include "zero_strategy.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

namespace dtk::zero {

namespace {

int64_t positive(const dtk::Options& o, const char* name) {
  const int64_t v = o.get_int(name);
  if (v <= 0) throw Error(std::string("zero: option '") + name + "' must be positive, got " + std::to_string(v));
  return v;
}

int64_t bytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

}  // namespace

// Options that act only with another setting (a stage-3 size at stage 2, nvme_path without nvme)
// are refused by the host before this runs: their declarations say which (zero.cpp, only_with).
Options Options::from(const dtk::Options& o) {
  Options r;
  r.stage = static_cast<int>(o.get_int("stage"));
  if (r.stage == 0)
    throw Error("zero: stage 0 partitions nothing; use the ddp strategy (--strategy ddp)");
  if (r.stage < 1 || r.stage > 3) throw Error("zero: option 'stage' must be 1, 2 or 3, got " + std::to_string(r.stage));
  r.reduce_bucket_size = positive(o, "reduce_bucket_size");
  r.allgather_bucket_size = positive(o, "allgather_bucket_size");
  r.overlap_comm = o.get_bool("overlap_comm");
  r.reduce_in_flight_size = positive(o, "reduce_in_flight_size");
  r.overlap_param_gather = o.get_bool("overlap_param_gather");
  if (!o.get_bool("contiguous_gradients"))
    throw Error(
        "zero: contiguous_gradients=false is not supported: gradients are always copied into contiguous "
        "buckets (DeepSpeed's default)");
  r.average_gradients = o.get_bool("average_gradients");
  r.prefetch_bucket_size = positive(o, "stage3_prefetch_bucket_size");
  r.max_live_parameters = positive(o, "stage3_max_live_parameters");
  r.persistence_threshold = o.get_int("stage3_param_persistence_threshold");
  if (r.persistence_threshold < 0) throw Error("zero: option 'stage3_param_persistence_threshold' must be >= 0");
  const std::string& optimizer_at = o.get_string("offload_optimizer");
  const std::string& param_at = o.get_string("offload_param");
  r.offload_optimizer = optimizer_at != "none";
  r.optimizer_on_disk = optimizer_at == "nvme";
  r.offload_param = param_at != "none";
  r.param_on_disk = param_at == "nvme";
  r.nvme_path = o.get_string("nvme_path");
  r.nvme_buffer_bytes = positive(o, "nvme_buffer_mb") << 20;
  r.param_buffer_count = o.get_int("param_buffer_count");
  if (r.param_buffer_count < 2)
    throw Error("zero: option 'param_buffer_count' must be at least 2, got " + std::to_string(r.param_buffer_count));
  if (r.optimizer_on_disk && r.nvme_path.empty())
    throw Error("zero: offload_optimizer=nvme needs strategy.nvme_path, the directory of the swap files");
  if (r.param_on_disk && r.nvme_path.empty())
    throw Error("zero: offload_param=nvme needs strategy.nvme_path, the directory of the swap files");
  if (r.param_on_disk && !r.offload_optimizer)
    throw Error(
        "zero: offload_param=nvme needs offload_optimizer=cpu or nvme (the fp32 masters would otherwise hold the "
        "parameters on the device)");
  r.zero_init = o.get_bool("zero_init");
  r.delayed_param_update = o.get_bool("delayed_param_update");
  if (r.delayed_param_update && r.param_on_disk)
    throw Error(
        "zero: delayed_param_update is not available with offload_param=nvme (the delayed step would write the "
        "partition on disk while the next forward reads it)");
  return r;
}

ZeroStrategy::ZeroStrategy(const BuildContext& ctx)
    : opt_(Options::from(ctx.options)),
      device_(ctx.device),
      dp_rank_(std::max(0, Comm::rank(DTK_GROUP_DATA_PARALLEL))),
      dp_size_(std::max(1, Comm::size(DTK_GROUP_DATA_PARALLEL))),
      tp_rank_(ctx.tp_rank),
      tp_size_(std::max(1, ctx.tp_size)),
      pp_rank_(ctx.pp_rank),
      pp_size_(std::max(1, ctx.pp_size)),
      ep_size_(std::max(1, ctx.ep_size)),
      edp_rank_(ep_size_ > 1 ? std::max(0, Comm::rank(DTK_GROUP_EXPERT_DATA_PARALLEL)) : dp_rank_),
      edp_size_(ep_size_ > 1 ? std::max(1, Comm::size(DTK_GROUP_EXPERT_DATA_PARALLEL)) : dp_size_) {
  // Stages 2 and 3 reduce and gather inside the model's backward, module by module; a pipeline
  // stage runs several micro-batches' backwards interleaved with forwards (DeepSpeed refuses
  // ZeRO 2/3 with pipeline parallelism as well).
  if (ctx.pp_size > 1 && opt_.stage >= 2)
    throw Error("zero: stage " + std::to_string(opt_.stage) +
                " cannot run with pipeline parallelism (distributed.pipeline_model_parallel_size " +
                std::to_string(ctx.pp_size) + "); use stage 1 or --strategy ddp");
  hooks_ = {dtk_module_hooks_STRUCT_SIZE, this, &pre_forward, &post_forward, &pre_backward, &post_backward};
}

ZeroStrategy::~ZeroStrategy() {
  // Finish what is in flight before the buffers go (each wait is bounded; a delayed step is a
  // finite host computation, and the optimizer it uses outlives the strategy: TrainingParts).
  try {
    if (delayed_.valid()) delayed_.get();
    finish_reductions(0);
    for (auto& g : gathering_)
      if (g) g->wait();
    if (param_swap_) {
      param_swap_->wait_writes();
      DTK_LOG(INFO) << param_swap_->stats();
    }
  } catch (const std::exception& e) {
    DTK_LOG(ERROR) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------
// Setup
// ---------------------------------------------------------------------------------------------

void ZeroStrategy::setup(const ModelHandle& model) {
  at::NoGradGuard no_grad;
  read_parameters(model);
  build_layout();
  const bool deferred = model.defers_parameters();
  if (deferred && opt_.stage < 3)
    throw Error("zero: the model was built without parameter values, which only stage 3 (zero_init) asks for");
  if (opt_.optimizer_on_disk || opt_.param_on_disk)
    for (const std::string& f : remove_stale_swap_files(opt_.nvme_path))
      DTK_LOG(INFO) << "removed " << f << ", the swap file of a run that is gone";
  allocate_parameters(deferred);
  if (deferred) init_deferred_parameters(model);
  allocate_masters_and_gradients();
  const Layout& l = *layout_;
  int64_t total = 0;
  for (const auto& p : l.params()) total += p.numel;
  DTK_LOG(INFO) << "stage " << opt_.stage << " over " << dp_size_ << " data-parallel ranks: " << total
                << " parameters in " << l.buckets().size() << " buckets, this rank's partition " << l.partition_numel()
                << " elements (" << shards_.size() << " shards)"
                << (opt_.optimizer_on_disk   ? ", optimizer offloaded to disk"
                    : opt_.offload_optimizer ? ", optimizer offloaded to the host"
                                             : "")
                << (reduce_overlapped_ ? ", gradients reduce-scattered during the last micro-batch's backward" : "")
                << (gather_overlapped_ ? ", updated parameters gathered during the next forward" : "")
                << (opt_.param_on_disk   ? ", parameters offloaded to disk"
                    : opt_.offload_param ? ", parameters offloaded to the host"
                                         : "")
                << (deferred ? ", built partitioned (zero_init)" : "")
                << (ep_size_ > 1 ? ", routed experts over the expert-data-parallel group (" +
                                       std::to_string(edp_size_) + (edp_size_ == 1 ? " rank)" : " ranks)")
                                 : std::string())
                << (opt_.delayed_param_update ? ", delayed parameter update (one step stale)" : "");
  if (swap_) DTK_LOG(INFO) << swap_->describe();
  if (param_swap_) DTK_LOG(INFO) << param_swap_->describe();
}

void ZeroStrategy::read_parameters(const ModelHandle& model) {
  params_ = model.parameters();
  if (params_.empty()) throw Error("zero: the model has no parameters");
  index_of_name_.clear();
  std::set<const void*> impls;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& t = params_[i].tensor;
    if (!t.is_floating_point()) throw Error("zero: parameter '" + params_[i].name + "' is not floating point");
    if (i == 0) dtype_ = t.scalar_type();
    if (t.scalar_type() != dtype_)
      throw Error("zero: parameters of different dtypes ('" + params_[0].name + "' " +
                  std::string(c10::toString(dtype_)) + ", '" + params_[i].name + "' " +
                  std::string(c10::toString(t.scalar_type())) + ") are not supported");
    if (t.device() != device_)
      throw Error("zero: parameter '" + params_[i].name + "' is on " + t.device().str() + ", the run's device is " +
                  device_.str());
    if (!impls.insert(t.unsafeGetTensorImpl()).second)
      throw Error("zero: parameter '" + params_[i].name + "' is listed twice (the same tensor under two names)");
    index_of_name_[params_[i].name] = i;
  }
  const std::vector<Module> modules = model.modules();
  gather_overlapped_ = opt_.overlap_param_gather && dp_size_ > 1 && !modules.empty();
  reduce_overlapped_ = opt_.stage == 1 && opt_.overlap_comm && dp_size_ > 1 && !modules.empty();
  if (opt_.overlap_param_gather && modules.empty())
    DTK_LOG(WARNING) << "overlap_param_gather: the model reports no modules; parameters are gathered after the step";
  if (opt_.stage >= 2 && modules.empty())
    throw Error("zero: stage " + std::to_string(opt_.stage) +
                " needs a model that reports its modules and fires module hooks (use stage 1)");
  int32_t max_index = -1;
  first_module_ = std::numeric_limits<int32_t>::max();
  for (const Module& m : modules) max_index = std::max(max_index, m.index), first_module_ = std::min(first_module_, m.index);
  module_reads_.assign(static_cast<size_t>(max_index + 1), {});
  for (const Module& m : modules) {
    if (m.index < 0) throw Error("zero: module '" + m.name + "' has a negative index");
    for (const std::string& n : m.params) {
      auto it = index_of_name_.find(n);
      if (it == index_of_name_.end())
        throw Error("zero: module '" + m.name + "' reads '" + n + "', which is not among the model's parameters");
      module_reads_[static_cast<size_t>(m.index)].push_back(it->second);
    }
  }
}

void ZeroStrategy::build_layout() {
  std::vector<LayoutParam> lps(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    lps[i].name = params_[i].name;
    lps[i].numel = params_[i].tensor.numel();
    lps[i].expert = ep_size_ > 1 && is_routed_expert(params_[i].info);
    // (The first and the last stage then shard their tied copies alike: TiedGradients sums them.)
    lps[i].own_bucket = pp_size_ > 1 && params_[i].info.shared;
  }
  // A gradient is complete after the backward of the lowest-index module that reads it.
  for (size_t m = 0; m < module_reads_.size(); ++m)
    for (size_t p : module_reads_[m])
      if (lps[p].ready_module < 0 || static_cast<int32_t>(m) < lps[p].ready_module)
        lps[p].ready_module = static_cast<int32_t>(m);
  // ZeRO-3 gathers a parameter for the modules that read it: one that no module lists stays whole.
  for (auto& lp : lps) lp.on_demand = opt_.stage == 3 && lp.numel > opt_.persistence_threshold && lp.ready_module >= 0;
  ready_at_.assign(module_reads_.size(), {});
  for (size_t p = 0; p < lps.size(); ++p)
    if (lps[p].ready_module >= 0) ready_at_[static_cast<size_t>(lps[p].ready_module)].push_back(p);
  // ZeRO-3's on-demand buckets never mix modules: a module is gathered by gathering its buckets.
  layout_.emplace(std::move(lps), dp_size_, opt_.reduce_bucket_size, edp_size_);
  shards_ = layout_->shards(dp_rank_, edp_rank_);
  shard_of_.assign(params_.size(), -1);
  for (size_t s = 0; s < shards_.size(); ++s) shard_of_[shards_[s].param] = static_cast<int64_t>(s);
  const size_t nb = layout_->buckets().size();
  module_buckets_.assign(module_reads_.size(), {});
  for (size_t m = 0; m < module_reads_.size(); ++m)
    for (size_t p : module_reads_[m]) {
      if (params_[p].tensor.numel() == 0) continue;  // in no bucket
      const size_t b = layout_->bucket_of(p);
      auto& list = module_buckets_[m];
      if (std::find(list.begin(), list.end(), b) == list.end()) list.push_back(b);
    }
  full_.assign(nb, at::Tensor());
  staging_.assign(nb, at::Tensor());
  if (opt_.overlap_comm && dp_size_ > 1) {
    // Staging buffers to keep: the most buckets reduce_in_flight_size lets be in flight (the
    // smallest ones), one more issued before the oldest completes, and one filling.
    std::vector<int64_t> sizes;
    for (const Bucket& bucket : layout_->buckets()) sizes.push_back(bucket.numel);
    std::sort(sizes.begin(), sizes.end());
    size_t fit = 0;
    for (int64_t sum = 0; fit < sizes.size() && sum + sizes[fit] <= opt_.reduce_in_flight_size; ++fit)
      sum += sizes[fit];
    max_spares_ = std::min(nb + 1, std::max<size_t>(3, fit + 2));
    // (Expert parallelism: a dense and an expert bucket fill at once.)
    if (std::any_of(layout_->buckets().begin(), layout_->buckets().end(), [](const Bucket& b) { return b.expert; }))
      max_spares_ = std::min(nb + 1, max_spares_ + 1);
  }
  pending_.assign(nb, 0);
  refs_.assign(nb, 0);
  gathering_.resize(nb);
  module_live_.assign(module_reads_.size(), 0);
  collected_.assign(params_.size(), 0);
}

at::Tensor ZeroStrategy::host_or_device(int64_t numel, at::ScalarType dtype, bool host) const {
  if (!host) return at::zeros({numel}, at::TensorOptions().dtype(dtype).device(device_));
  at::Tensor t = Device::pinned_empty({numel}, dtype);  // pinned host memory (CPU runs: host pool)
  t.zero_();
  return t;
}

// Stages 1/2: every parameter becomes a view of one flat buffer in the layout's order, so a
// bucket's all-gather writes the parameters in place. Stage 3: each rank keeps its chunks; whole
// values exist only for the always-whole buckets and while a bucket is gathered.
void ZeroStrategy::allocate_parameters(bool deferred) {
  const Layout& l = *layout_;
  auto view_params = [&](size_t b, const at::Tensor& whole) {
    for (const Slot& s : l.buckets()[b].slots) {
      at::Tensor& p = params_[s.param].tensor;
      at::Tensor v = whole.narrow(0, s.offset, s.numel).view(p.sizes());
      v.copy_(p);
      p.set_data(v);
    }
  };
  if (opt_.stage < 3) {
    // One buffer per bucket, filled as the parameters move in: the transient peak is the model
    // plus one bucket, not twice the model.
    for (size_t b = 0; b < l.buckets().size(); ++b) {
      full_[b] = at::zeros({l.buckets()[b].numel}, at::TensorOptions().dtype(dtype_).device(device_));
      view_params(b, full_[b]);
    }
    return;
  }
  if (opt_.param_on_disk) {
    create_param_swap();
    if (!deferred)  // the whole values the model created: each shard straight to the swap file
      for (const Shard& s : shards_)
        if (on_disk(s.bucket))
          param_swap_->write_at(s.bucket, s.partition_offset - l.buckets()[s.bucket].partition_offset,
                                params_[s.param].tensor.reshape({-1}).narrow(0, s.param_offset, s.numel));
  } else {
    part_params_ = host_or_device(l.partition_numel(), dtype_, opt_.offload_param);
    if (!deferred)
      for (const Shard& s : shards_)
        part_params_.narrow(0, s.partition_offset, s.numel)
            .copy_(params_[s.param].tensor.reshape({-1}).narrow(0, s.param_offset, s.numel));
  }
  nan_ = at::full({}, std::numeric_limits<double>::quiet_NaN(), at::TensorOptions().dtype(dtype_).device(device_));
  for (size_t b = 0; b < l.buckets().size(); ++b) {
    const Bucket& bucket = l.buckets()[b];
    if (!bucket.on_demand) {
      full_[b] = at::zeros({bucket.numel}, at::TensorOptions().dtype(dtype_).device(device_));
      view_params(b, full_[b]);
    } else {
      // Released: the parameter keeps its shape and shows NaN (any use outside a gather shows),
      // its storage is one shared element.
      for (const Slot& s : bucket.slots) params_[s.param].tensor.set_data(nan_.expand(params_[s.param].tensor.sizes()));
    }
  }
}

// zero_init: the model hands out each parameter's initial value (a CPU tensor, one at a time);
// this rank keeps its shard in the partition, and the whole value only where the parameter stays
// whole (a persistent bucket). The model never exists whole on the device.
void ZeroStrategy::init_deferred_parameters(const ModelHandle& model) {
  std::vector<char> given(params_.size(), 0);
  model.init_parameters([&](const std::string& name, const at::Tensor& value) {
    auto it = index_of_name_.find(name);
    if (it == index_of_name_.end()) throw Error("zero: the model's init_parameters gave '" + name + "', not one of its parameters");
    const size_t i = it->second;
    at::Tensor& p = params_[i].tensor;
    if (given[i]++) throw Error("zero: the model's init_parameters gave '" + name + "' twice");
    if (value.sizes() != p.sizes())
      throw Error("zero: the model's init_parameters gave '" + name + "' as " + shape_str(value) +
                  ", the parameter is " + shape_str(p));
    if (p.numel() == 0) return;
    if (shard_of_[i] >= 0) {
      const Shard& s = shards_[static_cast<size_t>(shard_of_[i])];
      const at::Tensor mine = value.reshape({-1}).narrow(0, s.param_offset, s.numel);
      if (on_disk(s.bucket))  // straight to the swap file
        param_swap_->write_at(s.bucket, s.partition_offset - layout_->buckets()[s.bucket].partition_offset, mine);
      else if (part_params_.defined())
        part_params_.narrow(0, s.partition_offset, s.numel).copy_(mine);
    }
    if (!layout_->buckets()[layout_->bucket_of(i)].on_demand) p.copy_(value);
  });
  for (size_t i = 0; i < params_.size(); ++i)
    if (!given[i]) throw Error("zero: the model's init_parameters gave no value for '" + params_[i].name + "'");
}

// A shard's values in the parameter dtype: in its whole bucket (stages 1/2; stage 3 with the
// partition on disk: the always-whole buckets) or the partition (3).
at::Tensor ZeroStrategy::param_values_of(const Shard& s) const {
  if (on_disk(s.bucket)) throw Error("zero: internal: shard of '" + params_[s.param].name + "' is on disk");
  if (opt_.stage == 3 && !param_swap_) return part_params_.narrow(0, s.partition_offset, s.numel);
  const Bucket& b = layout_->buckets()[s.bucket];
  return full_[s.bucket].narrow(0, layout_->flat_offset(s.param) - b.flat_offset + s.param_offset, s.numel);
}

at::Tensor ZeroStrategy::shard_values(const Shard& s) {
  if (!on_disk(s.bucket)) return param_values_of(s);
  return param_swap_->read_at(s.bucket, s.partition_offset - layout_->buckets()[s.bucket].partition_offset, s.numel);
}

// The step's new values of a shard (fp32 masters) reach the parameters: an always-whole bucket's
// own chunk, or (offload_param=nvme) the write-back slot of its bucket, written to the swap file
// once the shards move on to the next bucket (they come in partition order).
void ZeroStrategy::store_updated(const Shard& s, int64_t offset, const at::Tensor& values) {
  if (!on_disk(s.bucket)) {
    param_values_of(s).narrow(0, offset, values.numel()).copy_(values);
    return;
  }
  if (write_slot_ >= 0 && write_bucket_ != s.bucket) finish_write_back();
  if (write_slot_ < 0) write_slot_ = param_swap_->begin_write(s.bucket), write_bucket_ = s.bucket;
  param_swap_->chunk(write_slot_)
      .narrow(0, s.partition_offset - layout_->buckets()[s.bucket].partition_offset + offset, values.numel())
      .copy_(values);
}

void ZeroStrategy::finish_write_back() {
  if (write_slot_ < 0) return;
  const int slot = write_slot_;
  write_slot_ = -1;
  param_swap_->end_write(slot);
}

// offload_param=nvme: the partition's swap file, one chunk of every on-demand bucket.
void ZeroStrategy::create_param_swap() {
  std::vector<int64_t> chunks;
  for (const Bucket& b : layout_->buckets()) chunks.push_back(b.on_demand ? b.chunk : 0);
  const std::string rank = "dp" + std::to_string(dp_rank_) + "-tp" + std::to_string(tp_rank_) + "-pp" +
                           std::to_string(pp_rank_);
  param_swap_ = std::make_unique<ParamSwap>(opt_.nvme_path, rank, chunks, dtype_, opt_.param_buffer_count);
  gather_slot_.assign(layout_->buckets().size(), -1);
}

// The optimizer's view of a shard: fp32 values (on disk: the swap file's, read and written through
// the page cache).
at::Tensor ZeroStrategy::master_of(const Shard& s) const {
  if (masters_alias_) return param_values_of(s);
  return swap_ ? swap_->master(index_of(s)) : masters_.narrow(0, s.partition_offset, s.numel);
}

// offload_optimizer=nvme: one swap file per rank, after removing those of killed runs.
void ZeroStrategy::create_swap() {
  std::vector<int64_t> numels;
  std::vector<std::string> names;
  for (const Shard& s : shards_) numels.push_back(s.numel), names.push_back(params_[s.param].name);
  const std::string rank = "dp" + std::to_string(dp_rank_) + "-tp" + std::to_string(tp_rank_) + "-pp" +
                           std::to_string(pp_rank_);
  swap_ = std::make_unique<OptimizerSwap>(opt_.nvme_path, rank, numels, names, opt_.nvme_buffer_bytes);
}

void ZeroStrategy::allocate_masters_and_gradients() {
  const Layout& l = *layout_;
  // fp32 parameters where the optimizer runs are their own masters (no copy).
  // A delayed step writes its masters while the next forward reads the parameters: never aliased.
  masters_alias_ = !low_precision() && opt_.offload_optimizer == (opt_.stage == 3 && opt_.offload_param) &&
                   !opt_.delayed_param_update && !opt_.optimizer_on_disk && !opt_.param_on_disk;
  if (opt_.optimizer_on_disk) {
    create_swap();
    for (const Shard& s : shards_) master_of(s).copy_(shard_values(s));
  } else if (!masters_alias_) {
    masters_ = host_or_device(l.partition_numel(), at::kFloat, opt_.offload_optimizer);
    for (const Shard& s : shards_) masters_.narrow(0, s.partition_offset, s.numel).copy_(shard_values(s));
  }
  if (param_swap_) param_swap_->finish_setup();
  part_grads_ = host_or_device(l.partition_numel(), at::kFloat, opt_.offload_optimizer);
  if (opt_.delayed_param_update) step_grads_ = host_or_device(l.partition_numel(), at::kFloat, true);
  if (opt_.offload_optimizer && device_.is_cuda()) offload_ = std::make_unique<OffloadCopier>(device_);
  if (opt_.stage == 1) grad_flat_ = at::zeros({l.flat_numel()}, at::TensorOptions().dtype(at::kFloat).device(device_));
  optimizer_params_.clear();
  for (const Shard& s : shards_) {
    Param p;
    p.name = params_[s.param].name;
    p.tensor = swap_ ? swap_->param(index_of(s)) : master_of(s);  // swap_: re-pointed during its step
    p.tensor.mutable_grad() = part_grads_.narrow(0, s.partition_offset, s.numel);
    p.info = params_[s.param].info;
    p.info.struct_size = dtk_param_info_STRUCT_SIZE;
    p.info.shard_offset = s.param_offset;
    p.info.full_numel = params_[s.param].tensor.numel();
    optimizer_params_.push_back(std::move(p));
  }
  zero_grad();
}

// ---------------------------------------------------------------------------------------------
// Gradients
// ---------------------------------------------------------------------------------------------

void ZeroStrategy::before_backward(const dtk_backward_args& args) {
  at::NoGradGuard no_grad;
  backward_phase_ = true;
  if (opt_.stage == 1) {
    if (args.micro_batch > 0) collect_into_flat();  // fp32 accumulation of low-precision gradients
    reducing_in_backward_ = reduce_overlapped_ && args.is_last != 0;
    if (!reducing_in_backward_) return;
  } else if (args.micro_batch > 0) {
    flush_buckets();  // anything the previous backward left incomplete
  }
  const Layout& l = *layout_;
  for (size_t b = 0; b < l.buckets().size(); ++b) pending_[b] = static_cast<int64_t>(l.buckets()[b].slots.size());
  std::fill(collected_.begin(), collected_.end(), 0);
}

// Stage 1: fp32 parameters accumulate straight into the flat fp32 buffer (their .grad is a view of
// it, which autograd adds into in place); low-precision ones, and any gradient that is not that
// view (something replaced it), are added into it before every further backward and the reduction.
void ZeroStrategy::collect_into_flat() {
  for (size_t p = 0; p < params_.size(); ++p) add_into_flat(p);
}

void ZeroStrategy::add_into_flat(size_t p) {
  at::Tensor& g = params_[p].tensor.mutable_grad();
  if (!g.defined()) return;
  const at::Tensor slot = grad_flat_.narrow(0, layout_->flat_offset(p), params_[p].tensor.numel());
  if (!low_precision() && g.data_ptr() == slot.data_ptr()) return;  // already in place
  slot.add_(g.reshape({-1}));
  g = low_precision() ? at::Tensor() : slot.view(params_[p].tensor.sizes());
}

// Stages 2/3: one parameter's gradient of this micro-batch into its bucket's fp32 staging buffer;
// the bucket is reduce-scattered when its last gradient arrived. Stage 1 (in the last backward,
// reduce_overlapped_): the gradient is complete in the flat fp32 buffer, whose bucket is
// reduce-scattered in place when its last gradient arrived.
void ZeroStrategy::collect(size_t p) {
  if (collected_[p]) return;
  collected_[p] = 1;
  if (params_[p].tensor.numel() == 0) return;  // in no bucket
  const size_t b = layout_->bucket_of(p);
  const Bucket& bucket = layout_->buckets()[b];
  if (opt_.stage == 1) {
    add_into_flat(p);
    if (--pending_[b] == 0) reduce_bucket(b, grad_flat_.narrow(0, bucket.flat_offset, bucket.numel), at::Tensor());
    return;
  }
  if (!staging_[b].defined()) {
    staging_[b] = take_staging(bucket.numel);
    const int64_t used = bucket.slots.back().offset + bucket.slots.back().numel;
    staging_[b].narrow(0, used, bucket.numel - used).zero_();  // the padding
  }  // staging_[b] may be longer than the bucket: only its first bucket.numel elements are used
  at::Tensor& g = params_[p].tensor.mutable_grad();
  at::Tensor slot = staging_[b].narrow(0, layout_->flat_offset(p) - bucket.flat_offset, params_[p].tensor.numel());
  if (g.defined()) {
    slot.copy_(g.reshape({-1}));
    g = at::Tensor();  // the whole gradient is gone: only the bucket and the partition remain
  } else {
    slot.zero_();  // no gradient this micro-batch (the buffer is reused)
  }
  if (--pending_[b] == 0) {
    at::Tensor buffer = std::move(staging_[b]);
    staging_[b] = at::Tensor();
    reduce_bucket(b, buffer.narrow(0, 0, bucket.numel), buffer);
  }
}

// A staging buffer of at least `numel` fp32 elements, reused across buckets, micro-batches and
// steps: as many are kept as reductions can be in flight plus one filling (max_spares_), each of
// one bucket, so backward allocates nothing large in the steady state.
at::Tensor ZeroStrategy::take_staging(int64_t numel) {
  auto best = spare_.end();
  for (auto it = spare_.begin(); it != spare_.end(); ++it)
    if (it->numel() >= numel && (best == spare_.end() || it->numel() < best->numel())) best = it;
  at::Tensor base;
  if (best != spare_.end()) {
    base = *best;
    spare_.erase(best);
  } else {
    // None is large enough: a larger one replaces the largest spare (the pool grows to the
    // largest bucket instead of keeping one buffer per bucket size).
    auto largest = std::max_element(spare_.begin(), spare_.end(),
                                    [](const at::Tensor& a, const at::Tensor& b) { return a.numel() < b.numel(); });
    if (largest != spare_.end()) spare_.erase(largest);
    base = at::empty({numel}, at::TensorOptions().dtype(at::kFloat).device(device_));
  }
  return base;
}

void ZeroStrategy::return_staging(at::Tensor buffer) {
  if (spare_.size() < max_spares_) spare_.push_back(std::move(buffer));
}

// Reduce-scatters one bucket (fp32, whole) over its group (the DP group; the experts': the
// expert-data-parallel group) and adds this rank's chunk into the
// gradient partition. With overlap_comm the collective is left in flight while backward goes on:
// the oldest complete only when more than reduce_in_flight_size elements (and two buckets) are in
// flight, so on a slow link every bucket of a layer is on its way while the next layers' backward
// runs (the link, not the training thread, waits), and the memory held is that budget's staging.
void ZeroStrategy::reduce_bucket(size_t b, const at::Tensor& input, at::Tensor staging) {
  const Bucket& bucket = layout_->buckets()[b];
  InFlight f{b, input, at::empty({bucket.chunk}, input.options()), std::nullopt, std::move(staging)};
  // (Experts are summed over their group and divided by the data-parallel size in
  // finish_reductions: each expert's gradient already holds its expert-parallel group's tokens.)
  const int32_t op = opt_.average_gradients && !bucket.expert ? DTK_REDUCE_AVG : DTK_REDUCE_SUM;
  if (bucket.split == 1)
    f.output.copy_(input);
  else if (opt_.overlap_comm)
    f.work.emplace(Comm::reduce_scatter_async(f.output, input, group_of(bucket), op));
  else
    Comm::reduce_scatter(f.output, input, group_of(bucket), op);
  in_flight_.push_back(std::move(f));
  in_flight_numel_ += bucket.numel;
  if (!opt_.overlap_comm) {
    finish_reductions(0);
    return;
  }
  // (One rank sends nothing: two are kept only for an offloaded partition's copies to the host.)
  while (in_flight_.size() > 2 && (dp_size_ == 1 || in_flight_numel_ > opt_.reduce_in_flight_size))
    finish_reductions(in_flight_.size() - 1);
}

void ZeroStrategy::finish_reductions(size_t keep) {
  at::NoGradGuard no_grad;
  while (in_flight_.size() > keep) {
    InFlight& f = in_flight_.front();
    if (f.work) f.work->wait();
    const Bucket& bucket = layout_->buckets()[f.bucket];
    if (bucket.expert && opt_.average_gradients)
      f.output.div_(dp_size_);  // (Megatron's expert_gradient_scaling_factor)
    at::Tensor target = part_grads_.narrow(0, bucket.partition_offset, bucket.chunk);
    if (offload_) {
      // A GPU with the partition on the host: the copy engine moves the chunk while backward goes
      // on, and the host adds it once it landed.
      offload_->to_host(f.output, [target](const at::Tensor& host) { target.add_(host); });
    } else {
      target.add_(f.output.to(part_grads_.device()));  // a no-op move unless offloaded
    }
    if (f.staging.defined()) return_staging(std::move(f.staging));
    in_flight_numel_ -= bucket.numel;
    in_flight_.pop_front();
  }
  // Complete: every chunk in the partition. Otherwise a few copies stay in flight.
  if (offload_) offload_->drain(keep == 0 ? 0 : kOffloadCopiesInFlight);
}

void ZeroStrategy::flush_buckets() {
  for (size_t p = 0; p < params_.size(); ++p)
    if (!collected_[p] && params_[p].tensor.numel() > 0) collect(p);
  finish_reductions(0);
}

void ZeroStrategy::reduce_gradients() {
  at::NoGradGuard no_grad;
  backward_phase_ = false;
  if (opt_.stage >= 2 || reducing_in_backward_) {
    flush_buckets();  // what the hooks did not issue (stage 1: parameters no module reads)
    reducing_in_backward_ = false;
  } else {
    collect_into_flat();
    const Layout& l = *layout_;
    for (size_t b = 0; b < l.buckets().size(); ++b)
      reduce_bucket(b, grad_flat_.narrow(0, l.buckets()[b].flat_offset, l.buckets()[b].numel), at::Tensor());
    finish_reductions(0);
  }
  if (opt_.stage == 3)  // prefetched buckets nobody used
    for (size_t b = 0; b < full_.size(); ++b)
      if (layout_->buckets()[b].on_demand && refs_[b] == 0 && (full_[b].defined() || gathering_[b])) {
        wait_bucket(b);
        free_bucket(b);
      }
  // The previous iteration's delayed step ran during this forward and backward; its values reach
  // the parameters now, and the optimizer's gradients are this iteration's again (the host's
  // gradient syncs after this call, the norm and clipping read them).
  finish_delayed_step();
}

// Megatron's clip_grad_norm_fp32 over the partitions: this rank's shards (TP-replicated
// parameters on TP rank 0 only), summed over the data-parallel group (disjoint partitions) and
// the model-parallel group.
double ZeroStrategy::clip_and_norm(double max_norm) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> squared;  // summed in one multi-tensor pass on a GPU (dtk/grad_norm.hpp)
  // Counted once in the model: a TP-replicated parameter on TP rank 0, a tied one (pipeline
  // parallelism) on the first stage.
  auto counted = [&](const Param& p) {
    return (p.info.tensor_parallel || tp_rank_ == 0) && !(p.info.shared && pp_rank_ != 0);
  };
  bool all = true;
  for (const Shard& s : shards_) all = all && counted(params_[s.param]);
  if (all) {
    squared.push_back(part_grads_);  // padding is zero
  } else {
    for (const Shard& s : shards_)
      if (counted(params_[s.param])) squared.push_back(part_grads_.narrow(0, s.partition_offset, s.numel));
  }
  at::Tensor total = dtk::sum_of_squares(squared, part_grads_.device()).to(at::kCPU).reshape({1});
  Comm::all_reduce(total, DTK_GROUP_DATA_PARALLEL, DTK_REDUCE_SUM);
  Comm::all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM);
  const double norm = std::sqrt(total.item<double>());
  if (max_norm > 0 && std::isfinite(norm)) {
    const double coeff = max_norm / (norm + 1e-6);
    if (coeff < 1.0) part_grads_.mul_(coeff);
  }
  return norm;
}

// ---------------------------------------------------------------------------------------------
// The step
// ---------------------------------------------------------------------------------------------

void ZeroStrategy::optimizer_step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args) {
  at::NoGradGuard no_grad;
  if (gather_overlapped_)  // a bucket no module reads may still be in flight; the step writes them all
    for (size_t b = 0; b < gathering_.size(); ++b) finish_gather(b);
  finish_delayed_step();  // (done in reduce_gradients already; a no-op here)
  // Iteration 1's step runs at once: the optimizer allocates its state in it, on this thread
  // (DeepSpeed's DPU also starts after warm-up steps). A resumed run has its state loaded.
  if (opt_.delayed_param_update && args.iteration > 1) {
    launch_delayed_step(optimizer, args);
    return;
  }
  if (swap_) {
    step_from_disk(optimizer, args);
    return;
  }
  dtk::optimizer_step(optimizer, args);
  apply_step();
}

// The state streams from disk slice by slice (swap.hpp); each slice's updated masters reach the
// parameters while the next slice is read, then the gathers run as after any step.
void ZeroStrategy::step_from_disk(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args) {
  std::vector<at::Tensor> grads;
  for (const Shard& s : shards_) grads.push_back(part_grads_.narrow(0, s.partition_offset, s.numel));
  struct Repoint {  // the host reads the optimizer's gradients after the step too
    ZeroStrategy* s;
    ~Repoint() { s->point_optimizer_grads(s->part_grads_); }
  } repoint{this};
  // Blocking copies: the buffer half is read into again while a non-blocking copy could still run.
  swap_->step(optimizer, args, grads, [this](size_t i, int64_t offset, const at::Tensor& values) {
    store_updated(shards_[i], offset, values);
  });
  finish_write_back();
  apply_step();
}

void ZeroStrategy::launch_delayed_step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args) {
  step_grads_.copy_(part_grads_);
  point_optimizer_grads(step_grads_);
  dtk::StepArgs a(args);  // runs after the call: owns the group rates
  delayed_ = std::async(std::launch::async, [optimizer, a] {
    at::NoGradGuard no_grad;
    dtk::optimizer_step(optimizer, a.get());
  });
}

void ZeroStrategy::finish_delayed_step() {
  if (!delayed_.valid()) return;
  std::future<void> step = std::move(delayed_);
  // A failed step rethrows here; the optimizer's gradients point back at part_grads_ either way.
  struct Repoint {
    ZeroStrategy* s;
    ~Repoint() { s->point_optimizer_grads(s->part_grads_); }
  } repoint{this};
  step.get();
  at::NoGradGuard no_grad;
  apply_step();
}

void ZeroStrategy::point_optimizer_grads(const at::Tensor& grads) {
  for (size_t i = 0; i < shards_.size(); ++i)
    optimizer_params_[i].tensor.mutable_grad() = grads.narrow(0, shards_[i].partition_offset, shards_[i].numel);
}

// The updated masters reach the parameters: stage 3's partition, stages 1/2's own chunk of each
// bucket, then the gathers of the other ranks' chunks.
void ZeroStrategy::apply_step() {
  const Layout& l = *layout_;
  // Offloaded masters go back to the GPU without blocking the host (pinned memory: the copy engine
  // runs them in order before the gathers queued next); masters_ is not written again before the
  // next step, whose backward the host has waited for. Except under delayed_param_update: the
  // next step starts on the host right after this, so the copies complete first.
  const bool non_blocking = !opt_.delayed_param_update;
  if (param_swap_) {
    // The partition on disk: each bucket's chunk written back through a slot (the buckets the
    // next forward reads first, the last ones, last: they stay in the slots as cache), the
    // always-whole buckets' chunks into place for the gathers below.
    if (!swap_)  // (shards are in partition order, grouped by bucket)
      for (size_t k = shards_.size(); k-- > 0;)
        store_updated(shards_[k], 0, masters_.narrow(0, shards_[k].partition_offset, shards_[k].numel));
    finish_write_back();
  } else if (opt_.stage == 3) {
    // The partition takes the updated values (in the parameter dtype) for the next gathers.
    if (!masters_alias_ && !swap_) part_params_.copy_(masters_, non_blocking);
  } else if (!masters_alias_ && !swap_) {  // (swap_: copied slice by slice in step_from_disk)
    for (size_t b = 0; b < l.buckets().size(); ++b) {
      const Bucket& bucket = l.buckets()[b];
      full_[b]
          .narrow(0, own_offset(bucket), bucket.chunk)
          .copy_(masters_.narrow(0, bucket.partition_offset, bucket.chunk), non_blocking);
    }
  }
  if (gather_overlapped_)
    issue_gathers_after_step();
  else
    gather_after_step();
}

// Stages 1/2 with overlap_param_gather: every bucket's all-gather issued now, in the order the
// forward needs them (the layout is in backward order: the last bucket holds the first modules'
// parameters), and left in flight; the next forward's pre_forward waits for a module's buckets
// just before the module runs, and the host's reads of the parameters outside a step
// (checkpoints, the parameter norm) wait for all of them (gather_parameters, partitions_parameters).
void ZeroStrategy::issue_gathers_after_step() {
  const Layout& l = *layout_;
  for (size_t k = l.buckets().size(); k-- > 0;) {
    const Bucket& bucket = l.buckets()[k];
    if (bucket.split == 1) continue;  // this rank's chunk is the bucket, updated in place
    at::Tensor mine = full_[k].narrow(0, own_offset(bucket), bucket.chunk);
    gathering_[k].emplace(Comm::all_gather_async(full_[k], mine, group_of(bucket)));
  }
}

void ZeroStrategy::finish_gather(size_t b) {
  if (!gathering_[b]) return;
  gathering_[b]->wait();
  gathering_[b].reset();
}

// Every always-whole bucket (all of them in stages 1/2) gets the other ranks' updated chunks, in
// place; at most allgather_bucket_size elements are in flight at once (one bucket at least).
void ZeroStrategy::gather_after_step() {
  if (dp_size_ == 1 && opt_.stage < 3) return;
  const Layout& l = *layout_;
  std::deque<std::pair<int64_t, Comm::Work>> flying;
  int64_t in_flight = 0;
  for (size_t b = 0; b < l.buckets().size(); ++b) {
    const Bucket& bucket = l.buckets()[b];
    if (bucket.on_demand) continue;
    at::Tensor mine = full_[b].narrow(0, own_offset(bucket), bucket.chunk);
    // (offload_param=nvme: the step wrote the chunk in place, store_updated.)
    if (opt_.stage == 3 && !param_swap_) mine.copy_(part_params_.narrow(0, bucket.partition_offset, bucket.chunk));
    if (bucket.split == 1) continue;
    while (!flying.empty() && in_flight + bucket.numel > opt_.allgather_bucket_size) {
      flying.front().second.wait();
      in_flight -= flying.front().first;
      flying.pop_front();
    }
    flying.emplace_back(bucket.numel, Comm::all_gather_async(full_[b], mine, group_of(bucket)));
    in_flight += bucket.numel;
  }
  for (auto& f : flying) f.second.wait();
}

void ZeroStrategy::zero_grad() {
  at::NoGradGuard no_grad;
  finish_reductions(0);
  part_grads_.zero_();
  for (auto& p : params_) p.tensor.mutable_grad() = at::Tensor();
  if (opt_.stage == 1) {
    grad_flat_.zero_();
    if (!low_precision())  // accumulate in place, in the layout's order
      for (size_t p = 0; p < params_.size(); ++p)
        params_[p].tensor.mutable_grad() =
            grad_flat_.narrow(0, layout_->flat_offset(p), params_[p].tensor.numel()).view(params_[p].tensor.sizes());
  }
}

// ---------------------------------------------------------------------------------------------
// Checkpoints, info, memory
// ---------------------------------------------------------------------------------------------

// Low-precision runs save their fp32 masters per shard, under ddp's names ("master.<param>"), so
// the host can re-partition them (another DP size, or ddp). fp32 parameters are their own
// masters: the model's state has them.
TensorList ZeroStrategy::state_save() {
  TensorList out;
  if (!low_precision()) return out;
  for (const Shard& s : shards_) out.emplace_back("master." + params_[s.param].name, master_of(s));
  return out;
}

// A checkpoint saved with fp32 parameters (an imported Hugging Face model, an fp32 run) has no
// masters at all: a low-precision run's masters start from the parameters just loaded (whole now:
// stage 3's host gathered them around the load), as ddp's do and Megatron's reload_model_params.
// One missing among others is a damaged checkpoint.
void ZeroStrategy::state_load(const TensorList& state) {
  at::NoGradGuard no_grad;
  const bool has_masters = any_named(state, "master.");
  int64_t from_params = 0;
  for (const Shard& s : shards_) {
    const std::string& name = params_[s.param].name;
    at::Tensor dst = master_of(s);
    if (low_precision()) {
      const at::Tensor* t = find(state, "master." + name);
      if (!t && !has_masters) {
        dst.copy_(params_[s.param].tensor.reshape({-1}).narrow(0, s.param_offset, s.numel));
        ++from_params;
        continue;
      }
      if (!t) throw Error("zero: checkpoint has no fp32 master for '" + name + "'", DTK_ERR_NOT_FOUND);
      if (t->numel() != s.numel)
        throw Error("zero: master '" + name + "' has " + std::to_string(t->numel()) + " elements, this rank's shard " +
                    std::to_string(s.numel));
      dst.copy_(t->reshape({-1}));
    } else if (!masters_alias_) {
      // Separate fp32 masters (offload) take the loaded parameters, which are whole now (stage 3:
      // the host gathered them around the load).
      dst.copy_(params_[s.param].tensor.reshape({-1}).narrow(0, s.param_offset, s.numel));
    }
  }
  if (from_params > 0)
    DTK_LOG(WARNING) << "zero: the checkpoint has no fp32 masters for this rank's " << from_params
                     << " shard(s) of low-precision parameters (saved with fp32 parameters, or without the optimizer's "
                        "state?): their masters start "
                        "from the loaded values";
}

dtk_strategy_info ZeroStrategy::info() {
  dtk_strategy_info i{};
  i.struct_size = dtk_strategy_info_STRUCT_SIZE;
  i.sharded_state = 1;
  // Stages 1/2 with overlap_param_gather: parameters are not whole between the step and the
  // module hooks of the next forward (their gathers are in flight), so the host gathers around
  // its reads as for stage 3.
  // delayed_param_update: the host's reads of the parameters (checkpoints, the parameter norm)
  // go through gather_parameters, which completes the delayed step first.
  i.partitions_parameters = opt_.stage == 3 || gather_overlapped_ || opt_.delayed_param_update ? 1 : 0;
  i.optimizer_on_host = opt_.offload_optimizer ? 1 : 0;
  i.expert_parallel = 1;  // experts partitioned over the expert-data-parallel group (layout.hpp)
  return i;
}

dtk_memory_usage ZeroStrategy::memory_usage() {
  dtk_memory_usage u{};
  u.struct_size = dtk_memory_usage_STRUCT_SIZE;
  // Parameters: every bucket whole (1/2), or the partition plus the whole buckets held (3).
  u.parameter_bytes = bytes(part_params_);
  for (const auto& f : full_) u.parameter_bytes += bytes(f);
  if (opt_.offload_param) u.host_bytes += bytes(part_params_);
  if (param_swap_) {  // the partition is on disk: host memory holds the buffers only
    u.parameter_bytes += param_swap_->buffer_bytes();
    u.host_bytes += param_swap_->buffer_bytes();
  }
  // Gradients: the partition, stage 1's whole buffer, staging buckets, and any .grad held (stage
  // 1's fp32 .grad tensors are views of its buffer: not counted twice).
  u.gradient_bytes = bytes(part_grads_) + bytes(grad_flat_);
  for (const auto& s : staging_) u.gradient_bytes += bytes(s);
  for (const auto& s : spare_) u.gradient_bytes += bytes(s);
  for (const auto& f : in_flight_) u.gradient_bytes += bytes(f.staging) + bytes(f.output);
  if (!(opt_.stage == 1 && !low_precision()))
    for (const auto& p : params_) u.gradient_bytes += bytes(p.tensor.grad());
  u.master_bytes = masters_alias_ ? 0 : bytes(masters_);
  if (opt_.offload_optimizer) u.host_bytes += bytes(part_grads_) + bytes(step_grads_) + u.master_bytes;
  if (swap_) u.host_bytes += swap_->buffer_bytes();  // the state itself is on disk
  return u;
}

}  // namespace dtk::zero
