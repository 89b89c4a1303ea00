// ddp — data parallelism as PyTorch's DistributedDataParallel and Megatron's
// --overlap-grad-reduce: gradients are averaged over the data-parallel group in buckets of about
// bucket_size_mb (fp32 bytes), the parameters grouped in the order their gradients become ready in
// backward (the model's modules in reverse, from its per-module hooks). On the last micro-batch of
// a global batch (no communication while gradients accumulate, as DDP's no_sync) each bucket's
// all-reduce is issued asynchronously as soon as its last gradient is complete (the post_backward
// hook of the lowest module that reads it), on the communication stream on a GPU (NCCL) or Gloo's
// threads on a CPU, while the backward goes on; reduce_gradients issues what the hooks did not and
// waits bucket by bucket. overlap_grad_reduce=false reduces the same buckets after the backward
// (the same collectives, so identical results, without the overlap). A model without modules (no
// hooks) reduces its buckets after the backward too. The gradients are views of the buckets'
// buffers (attach_gradient_views), so the backward accumulates into them in place.
//
// overlap_param_gather splits each bucket's all-reduce across the step, as Megatron's distributed
// optimizer splits its traffic, while the optimizer stays replicated: the bucket is reduce-scattered
// during the backward (half the traffic), the global norm is taken from the reduced shards (each
// rank's sum of squares, summed over the group), the clip coefficient scales the shards, and the
// all-gather of the reduced gradients (the other half) runs during the next forward; just before
// the first module that reads a bucket's parameters (its pre_forward hook) the bucket's update is
// applied: the optimizer is called with only that bucket's gradients defined (the shipped
// optimizers skip a tensor without a gradient and count one step per iteration of the step
// arguments, so the calls of one step are one update; checked once, check_one_step_counted). The exposed floor drops
// from the forward plus the step (nothing can be sent between the norm and the next backward) to half the traffic less
// the forward. Parameters the host reduces further (tied weights across pipeline stages, sequence-parallel ones) and
// those no module reads stay whole-reduced and are updated in the step. Until a bucket's update lands its parameters
// are stale, so the strategy reports partitions_parameters: the host's reads outside a step (checkpoints, the parameter
// norm) call gather_parameters, which applies every pending update first. The global gradient norm follows Megatron's
// clip_grad_norm_fp32 (TP-sharded parameters on every TP rank, replicated ones once, summed over the model-parallel
// group). With one process every collective is the identity, so this is also the single-device path.
//
// Mixed precision as Megatron's Float16OptimizerWithFloat16Params: for bf16/fp16 parameters the
// optimizer works on fp32 master copies (gradients converted to fp32 before the reduction, the
// norm and the update), and the updated masters are copied back into the model's parameters.
// Without masters a bf16 weight near 1.0 cannot move by less than 2^-8: small updates vanish.
// Gradients of such parameters accumulate across micro-batches in fp32 (Megatron's
// accumulate_allreduce_grads_in_fp32): before each further micro-batch's backward, and before the
// reduction, the parameter's gradient is added into the master's fp32 gradient and cleared.
//
// Expert parallelism (ABI 2.12, Megatron's --expert-model-parallel-size): the routed experts'
// weights (dtk_param_info.expert) differ between the expert-parallel ranks, so they go in buckets
// of their own, summed over the expert-data-parallel group and divided by the data-parallel size,
// reduced whole in the step (never split by overlap_param_gather); the norm adds their squares
// over the expert-parallel group.
#include <dtk/strategy.hpp>

#include <dtk/trace.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_bool("average_gradients", "true", "Average (not sum) gradients over data-parallel ranks."),
    dtk::opt_bool("fp32_master_weights", "true",
                  "For bf16/fp16 parameters, let the optimizer update fp32 master copies (Megatron)."),
    dtk::opt_bool("overlap_grad_reduce", "true",
                  "All-reduce each gradient bucket during the last micro-batch's backward, as soon as its "
                  "gradients are complete (Megatron's --overlap-grad-reduce, PyTorch DDP); false: after the backward."),
    dtk::opt_float("bucket_size_mb", "25",
                   "Gradient bucket size in MB (fp32 bytes, 2^20), in backward order (PyTorch DDP's bucket_cap_mb)."),
    dtk::only_with("overlap_grad_reduce=true",
                   dtk::opt_bool("overlap_param_gather", "false",
                                 "Split each bucket's all-reduce across the step: reduce-scatter during the last "
                                 "backward, all-gather of the reduced gradients during the next forward, each bucket's "
                                 "update applied just before the first module that reads it (the same results; the "
                                 "optimizer is called once per bucket and must skip tensors without a gradient, as "
                                 "the shipped ones do). Not with logging.log_num_zeros_in_grad.")),
};

double positive_mb(const dtk::Options& o) {
  const double mb = o.get_float("bucket_size_mb");
  if (!(mb > 0) || !std::isfinite(mb)) {
    char shown[32];
    std::snprintf(shown, sizeof shown, "%g", mb);
    throw dtk::Error(std::string("ddp: option 'bucket_size_mb' must be a positive number of MB, got ") + shown);
  }
  return mb;
}

class Ddp : public dtk::Strategy {
 public:
  explicit Ddp(const dtk::BuildContext& ctx)
      : average_(ctx.options.get_bool("average_gradients")),
        masters_enabled_(ctx.options.get_bool("fp32_master_weights")),
        overlap_(ctx.options.get_bool("overlap_grad_reduce")),
        split_asked_(ctx.options.get_bool("overlap_param_gather")),
        bucket_bytes_(static_cast<int64_t>(std::max(1.0, positive_mb(ctx.options) * 1048576.0))),
        tp_rank_(ctx.tp_rank),
        pp_rank_(ctx.pp_rank),
        dp_size_(std::max(1, dtk::Comm::size(DTK_GROUP_DATA_PARALLEL))),
        dp_rank_(std::max(0, dtk::Comm::rank(DTK_GROUP_DATA_PARALLEL))),
        ep_size_(std::max(1, dtk::Comm::size(DTK_GROUP_EXPERT_PARALLEL))),
        tied_across_stages_(ctx.pp_size > 1),
        sums_over_tensor_parallel_(ctx.tp_size > 1) {
    hooks_ = {dtk_module_hooks_STRUCT_SIZE, this, &pre_forward, nullptr, nullptr, &post_backward};
  }

  ~Ddp() override {
    // Finish what is in flight before the buckets go (each wait is bounded).
    try {
      for (auto& b : buckets_) {
        if (b.work) b.work->wait();
        if (b.gather) b.gather->wait();
      }
      // The model may outlive this plugin's code: its parameters keep no hook of ours, and no
      // gradient that holds a bucket's memory.
      for (const auto& [i, hook] : gradient_hooks_) params_[i].tensor.remove_hook(hook);
      for (at::Tensor& m : masters_)
        if (m.grad().defined() && in_bucket(m.grad())) m.mutable_grad() = at::Tensor();
    } catch (const std::exception& e) {
      DTK_LOG(ERROR) << e.what();
    }
  }

  void setup(const dtk::ModelHandle& model) override {
    params_ = model.parameters();
    at::NoGradGuard no_grad;
    for (const auto& p : params_) {
      const bool low =
          p.tensor.is_floating_point() && p.tensor.scalar_type() != at::kFloat && p.tensor.scalar_type() != at::kDouble;
      // The master is the parameter itself for fp32 (no copy), a fp32 clone otherwise.
      masters_.push_back(masters_enabled_ && low ? p.tensor.detach().to(at::kFloat).clone() : p.tensor);
    }
    if (dp_size_ > 1) build_buckets(model);
  }

  // Installed only where they can overlap: several data-parallel ranks, a model with modules.
  const dtk_module_hooks* module_hooks() override { return hooked_ ? &hooks_ : nullptr; }

  // The optimizer sees the masters: fp32 copies for low-precision parameters, else the params.
  std::vector<dtk::Param> optimizer_params() override {
    std::vector<dtk::Param> out = params_;
    for (size_t i = 0; i < out.size(); ++i) out[i].tensor = masters_[i];
    return out;
  }

  void before_backward(const dtk_backward_args& args) override {
    if (args.micro_batch > 0) accumulate_into_masters();
    if (buckets_.empty()) return;
    if (args.micro_batch == 0) refuse_pending_updates();
    // Only the last micro-batch's backward completes gradients (DDP's no_sync before it).
    syncing_ = hooked_ && args.is_last != 0;
    if (!syncing_) return;
    std::fill(ready_.begin(), ready_.end(), 0);
    for (auto& b : buckets_) b.pending = static_cast<int64_t>(b.slots.size());
    next_launch_ = 0;
  }

  void reduce_gradients() override {
    at::NoGradGuard no_grad;
    accumulate_into_masters();
    if (buckets_.empty()) return;
    if (!syncing_) {  // nothing was issued in backward: every bucket now
      std::fill(ready_.begin(), ready_.end(), 0);
      for (auto& b : buckets_) b.pending = static_cast<int64_t>(b.slots.size());
      next_launch_ = 0;
    }
    syncing_ = false;
    // Whatever the hooks did not complete (parameters no module reads, a last backward that did
    // not reach a module), in bucket order; then each bucket as it completes.
    for (size_t b = 0; b < buckets_.size(); ++b)
      for (const Slot& s : buckets_[b].slots) mark_ready(s.param);
    for (size_t b = 0; b < buckets_.size(); ++b) finish(b);
  }

  dtk_memory_usage memory_usage() override {
    dtk_memory_usage u{};
    u.struct_size = dtk_memory_usage_STRUCT_SIZE;
    for (size_t i = 0; i < params_.size(); ++i) {
      u.parameter_bytes += bytes(params_[i].tensor);
      u.gradient_bytes += bytes(params_[i].tensor.grad());
      if (is_self(i)) continue;
      u.master_bytes += bytes(masters_[i]);
      u.gradient_bytes += bytes(masters_[i].grad());
    }
    // The buckets (the reduced gradients are views of them until zero_grad).
    for (const auto& b : buckets_) u.gradient_bytes += bytes(b.flat) + bytes(b.shard);
    // (An fp32 parameter is its own master: its gradient is counted, and subtracted, once.)
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& g = params_[i].tensor.grad();
      if (g.defined() && in_bucket(g)) u.gradient_bytes -= bytes(g);
      const at::Tensor& mg = masters_[i].grad();
      if (!is_self(i) && mg.defined() && in_bucket(mg)) u.gradient_bytes -= bytes(mg);
    }
    return u;
  }

  double clip_and_norm(double max_norm) override {
    at::NoGradGuard no_grad;
    // Accumulate on the gradients' device (one host sync at the end, not one per parameter): one
    // multi-tensor pass on a GPU (dtk/grad_norm.hpp).
    std::vector<at::Tensor> counted, experts;
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& g = masters_[i].grad();
      if (g.defined() && counted_in_norm(i)) (held_by_expert_rank(i) ? experts : counted).push_back(g);
    }
    // On the parameters' device even without gradients: every rank of the group must pick the same
    // backend (NCCL for CUDA tensors, Gloo for host ones).
    const at::Device device = masters_.empty() ? at::Device(at::kCPU) : masters_.front().device();
    at::Tensor total = dtk::sum_of_squares(counted, device);
    // Expert parallelism: the other experts' gradients are on the expert-parallel group's ranks.
    if (ep_size_ > 1) {
      at::Tensor held = dtk::sum_of_squares(experts, device);
      dtk::Comm::all_reduce(held, DTK_GROUP_EXPERT_PARALLEL, DTK_REDUCE_SUM);
      total = total + held;
    }
    // overlap_param_gather: the rest of the gradients are this rank's reduced shards; the group's
    // shards together are every reduced gradient once.
    if (split_) {
      at::Tensor shards = dtk::sum_of_squares(counted_shard_pieces(), device);
      dtk::Comm::all_reduce(shards, DTK_GROUP_DATA_PARALLEL, DTK_REDUCE_SUM);
      total = total + shards;
    }
    dtk::Comm::all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM);
    const double norm = std::sqrt(total.item<double>());
    if (max_norm > 0 && std::isfinite(norm)) {
      const double coeff = max_norm / (norm + 1e-6);
      if (coeff < 1.0) {
        std::vector<at::Tensor> grads;
        for (auto& m : masters_)
          if (m.grad().defined()) grads.push_back(m.grad());
        for (auto& b : buckets_)
          if (b.split && b.shard.defined()) grads.push_back(b.shard);
        dtk::scale_all(grads, coeff);
      }
    }
    return norm;
  }

  void optimizer_step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args) override {
    if (split_) apply_pending_updates(std::numeric_limits<int32_t>::max());  // (none: the forward applied them)
    if (split_ && !step_checked_) step_before_ = optimizer_step_count(*optimizer);
    // overlap_param_gather: the gradients defined here are the whole-reduced ones; the buckets'
    // updates wait for their all-gathers (issued below) and their modules' next forward.
    if (!split_ || any_gradient()) dtk::optimizer_step(optimizer, args);
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!is_self(i) && (!split_ || masters_[i].grad().defined()))
        params_[i].tensor.copy_(masters_[i]);  // round the fp32 master into the param
    if (split_) issue_gradient_gathers(*optimizer, args);
  }

  // The host is about to read or write whole parameters (checkpoints, the parameter norm): every
  // pending update lands first (overlap_param_gather; partitions_parameters in info()).
  void gather_parameters(bool whole) override {
    if (whole && split_) apply_pending_updates(std::numeric_limits<int32_t>::max());
  }

  dtk_strategy_info info() override {
    dtk_strategy_info i{};
    i.struct_size = dtk_strategy_info_STRUCT_SIZE;
    // Parameters are stale between the step and their module's next pre_forward.
    i.partitions_parameters = split_ ? 1 : 0;
    i.expert_parallel = 1;  // experts' gradients over the expert-data-parallel group (bucket.group)
    return i;
  }

  void zero_grad() override {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].tensor.grad().defined()) params_[i].tensor.mutable_grad() = at::Tensor();
      if (!is_self(i) && masters_[i].grad().defined()) masters_[i].mutable_grad() = at::Tensor();
    }
    attach_gradient_views();
  }

  // Checkpoints carry the fp32 masters: the low-precision params alone would lose their bits.
  dtk::TensorList state_save() override {
    dtk::TensorList out;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!is_self(i)) out.emplace_back("master." + params_[i].name, masters_[i]);
    return out;
  }

  // A checkpoint saved with fp32 parameters (an imported Hugging Face model, an fp32 run) has no
  // masters at all: they start from the parameters just loaded, as Megatron's reload_model_params
  // does when the optimizer state is not loaded. One missing among others is a damaged checkpoint.
  void state_load(const dtk::TensorList& state) override {
    at::NoGradGuard no_grad;
    const bool has_masters = dtk::any_named(state, "master.");
    int64_t from_params = 0;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (is_self(i)) continue;
      const at::Tensor* t = dtk::find(state, "master." + params_[i].name);
      if (!t && has_masters)
        throw dtk::Error("ddp: checkpoint has no fp32 master for '" + params_[i].name + "'", DTK_ERR_NOT_FOUND);
      if (!t) {
        masters_[i].copy_(params_[i].tensor);
        ++from_params;
        continue;
      }
      if (t->sizes() != masters_[i].sizes())
        throw dtk::Error("ddp: master '" + params_[i].name + "' has shape " + dtk::shape_str(*t) + ", expected " +
                         dtk::shape_str(masters_[i]));
      masters_[i].copy_(*t);
    }
    if (from_params > 0)
      DTK_LOG(WARNING) << "ddp: the checkpoint has no fp32 masters for " << from_params
                       << " low-precision parameter(s) (saved with fp32 parameters, or without the optimizer's "
                          "state?): their masters start from the "
                          "loaded values";
  }

 private:
  bool is_self(size_t i) const { return masters_[i].unsafeGetTensorImpl() == params_[i].tensor.unsafeGetTensorImpl(); }

  // Moves the low-precision parameters' gradients (one micro-batch's) into the fp32 masters'.
  void accumulate_into_masters() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) accumulate_one(i);
  }
  void accumulate_one(size_t i) {
    at::Tensor& g = params_[i].tensor.mutable_grad();
    if (is_self(i) || !g.defined()) return;
    at::Tensor& main = masters_[i].mutable_grad();
    if (main.defined())
      main.add_(g);  // (into its bucket's view where it has one)
    else
      main = g.to(at::kFloat);
    g = at::Tensor();
  }

  // ------------------------------------------------------------------------------------------
  // Buckets
  // ------------------------------------------------------------------------------------------

  struct Slot {
    size_t param;
    int64_t offset, numel;
  };
  struct Bucket {
    std::vector<Slot> slots;
    int64_t numel = 0;
    at::ScalarType dtype = at::kFloat;
    at::Device device = at::kCPU;
    at::Tensor flat;                  // the bucket's gradients, contiguous (allocated on first use)
    std::optional<dtk::Comm::Work> work;  // its all-reduce (split: reduce-scatter) while in flight
    std::vector<char> had_grad;       // per slot: the gradient was defined when it was issued
    int64_t pending = 0;              // gradients still to complete this backward
    // overlap_param_gather: reduce-scattered into `shard` (this rank's 1/dp of `flat`, padded to a
    // multiple of dp), all-gathered back into `flat` after the step, applied before first_reader.
    bool split = false;
    int64_t padded = 0;
    at::Tensor shard;
    // Reduced over the data-parallel group, or for the experts of expert parallelism over the
    // ranks that hold the same experts (the expert-data-parallel group).
    int32_t group = DTK_GROUP_DATA_PARALLEL;
    std::optional<dtk::Comm::Work> gather;  // the all-gather of the reduced gradients in flight
    bool update_pending = false;            // gathered or gathering, not yet applied
    int32_t first_reader = -1;              // the lowest module reading its parameters
  };

  // Gradients as views of their bucket (PyTorch DDP's gradient_as_bucket_view, Megatron's
  // main_grad in its contiguous grad buffer): before each step's first backward every gradient of a
  // whole-reduced bucket is a view of the zeroed buffer, so autograd (an fp32 parameter's) and
  // accumulate_one (a master's) add into the buffer in place. Without them each backward allocated
  // its gradients anew beside the buffer kept from the step before: twice the gradients' memory
  // from the second iteration, and a copy of every gradient into the buffer. Which gradients the
  // backward reached is kept per parameter (got_grad_, note_arriving_gradients): one it did not
  // reach leaves the step without a gradient after the reduction, as before (the optimizers skip
  // it). Split buckets (overlap_param_gather) keep their copy: their buffer receives the gathered
  // gradients.
  void attach_gradient_views() {
    at::NoGradGuard no_grad;
    std::fill(got_grad_.begin(), got_grad_.end(), 0);
    for (Bucket& b : buckets_) {
      if (b.split) continue;
      if (!b.flat.defined())
        b.flat = at::zeros({b.numel}, at::TensorOptions().dtype(b.dtype).device(b.device));
      else
        b.flat.zero_();
      // (A strided parameter's gradient follows its layout, not the buffer's: copied in launch.)
      for (const Slot& s : b.slots)
        if (masters_[s.param].is_contiguous()) masters_[s.param].mutable_grad() = slot_view(b, s);
    }
  }

  at::Tensor slot_view(const Bucket& b, const Slot& s) const {
    return b.flat.narrow(0, s.offset, s.numel).view(masters_[s.param].sizes());
  }

  // A hook per parameter notes that its gradient arrived (an fp32 parameter, its own master,
  // accumulates through autograd; a low-precision one's reaches its master in accumulate_one). A
  // gradient that arrives in the last backward after its module's post_backward marked it complete would be
  // added into a buffer the all-reduce is reading (or, for a master, left for the next step): the
  // model read the parameter outside the modules that list it. Refused rather than trained on.
  void note_arriving_gradients() {
    got_grad_.assign(params_.size(), 0);
    for (const Bucket& b : buckets_) {
      if (b.split) continue;
      for (const Slot& s : b.slots) {
        if (!params_[s.param].tensor.requires_grad()) continue;
        const size_t i = s.param;
        gradient_hooks_.emplace_back(i, params_[i].tensor.register_hook([this, i](const at::TensorBase&) {
          if (syncing_ && ready_[i])
            throw dtk::Error("ddp: the gradient of parameter '" + params_[i].name +
                             "' arrived after the post_backward hook of module " + std::to_string(first_reader_[i]) +
                             " (the first module listing it) marked it complete: the model reads it outside the "
                             "modules that list it (dtk::Module::params must name it under every module that reads "
                             "it; docs/plugin-guide.md), or set strategy.overlap_grad_reduce=false");
          got_grad_[i] = 1;
        }));
      }
    }
  }

  // Parameters in the order their gradients complete in backward: a parameter is complete after
  // the backward of the lowest-index module that reads it (a tied embedding: the embedding, the
  // last to run), so descending by that module, and within a module in reverse order (PyTorch
  // DDP's reversed registration order); parameters no module reads last (reduce_gradients).
  void build_buckets(const dtk::ModelHandle& model) {
    const std::vector<dtk::Module> modules = model.modules();
    std::map<std::string, size_t> by_name;
    for (size_t i = 0; i < params_.size(); ++i) by_name[params_[i].name] = i;
    std::vector<int32_t> ready_module(params_.size(), -1);
    int32_t max_index = -1;
    for (const dtk::Module& m : modules) {
      max_index = std::max(max_index, m.index);
      for (const std::string& n : m.params) {
        auto it = by_name.find(n);
        if (it == by_name.end()) continue;  // not trainable here
        int32_t& r = ready_module[it->second];
        if (r < 0 || m.index < r) r = m.index;
      }
    }
    first_reader_ = ready_module;
    hooked_ = overlap_ && !modules.empty();
    split_ = split_asked_ && hooked_;
    ready_at_.assign(static_cast<size_t>(max_index + 1), {});
    std::vector<size_t> order;
    for (size_t i = 0; i < params_.size(); ++i)
      if (masters_[i].is_floating_point() && masters_[i].numel() > 0) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const int64_t ka = ready_module[a] < 0 ? -1 : ready_module[a], kb = ready_module[b] < 0 ? -1 : ready_module[b];
      if (ka != kb) return ka > kb;
      return a > b;
    });
    bucket_of_.assign(params_.size(), -1);
    // overlap_param_gather: the split buckets first (in backward order), then the whole-reduced
    // ones, which complete only in reduce_gradients and so never hold up a split one.
    std::vector<size_t> whole;
    for (size_t i : order) {
      if (split_ && reduced_whole(i, ready_module[i])) {
        whole.push_back(i);
        continue;
      }
      add_to_bucket(i, split_, ready_module[i]);
    }
    for (size_t i : whole) add_to_bucket(i, false, ready_module[i]);
    for (auto& b : buckets_) b.had_grad.assign(b.slots.size(), 0);
    ready_.assign(params_.size(), 0);
    note_arriving_gradients();
    size_t split_count = 0;
    int64_t total = 0;
    for (const auto& b : buckets_) total += b.numel, split_count += b.split;
    std::string how = hooked_    ? "reduced during the last micro-batch's backward"
                      : overlap_ ? "reduced after the backward (the model reports no modules to hook)"
                                 : "reduced after the backward (overlap_grad_reduce=false)";
    if (split_)
      how =
          "reduce-scattered during the last micro-batch's backward, gathered and applied during the next forward "
          "(overlap_param_gather: " +
          std::to_string(split_count) + " split, " + std::to_string(buckets_.size() - split_count) +
          " reduced whole in the step)";
    if (split_asked_ && !split_)
      DTK_LOG(WARNING) << "ddp: overlap_param_gather: the model reports no modules to hook; every bucket is "
                          "all-reduced and applied in the step";
    DTK_LOG(INFO) << "gradients in " << buckets_.size() << " bucket(s) of up to " << bucket_bytes_ / 1048576.0
                  << " MB (" << total << " elements), " << how;
  }

  // overlap_param_gather: a parameter whose reduced gradient the host sums further (a weight tied
  // across pipeline stages, one flagged sequence_parallel: the host's rules, tied_gradients.cpp and
  // sequence_parallel_gradients.cpp) must be whole after reduce_gradients; one that no module
  // reads has no pre_forward to wait in. Both are all-reduced and updated in the step.
  bool reduced_whole(size_t i, int32_t ready_module) const {
    const dtk_param_info& info = params_[i].info;
    return ready_module < 0 || (tied_across_stages_ && info.shared) ||
           (sums_over_tensor_parallel_ && info.sequence_parallel) || held_by_expert_rank(i);
  }

  // A routed expert's weight under expert parallelism: only this expert-parallel rank holds it.
  bool held_by_expert_rank(size_t i) const { return ep_size_ > 1 && dtk::is_routed_expert(params_[i].info); }

  void add_to_bucket(size_t i, bool split, int32_t ready_module) {
    const at::Tensor& m = masters_[i];
    const int64_t elem = static_cast<int64_t>(m.element_size());
    // The experts fill buckets of their own beside the others' (one open bucket per group, as
    // Megatron's separate expert buffers), so each MoE layer does not cut the dense buckets short.
    const int32_t group = held_by_expert_rank(i) ? DTK_GROUP_EXPERT_DATA_PARALLEL : DTK_GROUP_DATA_PARALLEL;
    auto open = open_bucket_.find(group);
    if (open == open_bucket_.end() || buckets_[open->second].dtype != m.scalar_type() ||
        buckets_[open->second].device != m.device() || buckets_[open->second].split != split ||
        buckets_[open->second].numel * elem >= bucket_bytes_) {
      buckets_.emplace_back();
      buckets_.back().dtype = m.scalar_type();
      buckets_.back().device = m.device();
      buckets_.back().split = split;
      buckets_.back().group = group;
      open = open_bucket_.insert_or_assign(group, buckets_.size() - 1).first;
    }
    Bucket& b = buckets_[open->second];
    b.slots.push_back({i, b.numel, m.numel()});
    b.numel += m.numel();
    b.padded = (b.numel + dp_size_ - 1) / dp_size_ * dp_size_;
    // Parameters come in descending ready_module order: the last one added is read first.
    b.first_reader = ready_module;
    bucket_of_[i] = static_cast<int64_t>(open->second);
    if (ready_module >= 0) ready_at_[static_cast<size_t>(ready_module)].push_back(i);
  }

  // Module `module` is about to read its parameters: the updates of the buckets it is the first
  // reader of land now (overlap_param_gather), and those of any earlier module that fired no hook.
  static dtk_status* pre_forward(void* ctx, int32_t module) {
    return dtk::guard([&] {
      auto* self = static_cast<Ddp*>(ctx);
      if (self->split_) self->apply_pending_updates(module);
    });
  }

  // Module `module`'s backward finished (autograd's thread, the training thread waiting in
  // backward()): the gradients it completes are ready.
  static dtk_status* post_backward(void* ctx, int32_t module) {
    return dtk::guard([&] {
      auto* self = static_cast<Ddp*>(ctx);
      if (!self->syncing_ || module < 0 || static_cast<size_t>(module) >= self->ready_at_.size()) return;
      at::NoGradGuard no_grad;
      for (size_t p : self->ready_at_[static_cast<size_t>(module)]) self->mark_ready(p);
    });
  }

  void mark_ready(size_t p) {
    if (bucket_of_[p] < 0 || ready_[p]) return;
    ready_[p] = 1;
    accumulate_one(p);  // a low-precision gradient into its fp32 master's
    --buckets_[static_cast<size_t>(bucket_of_[p])].pending;
    // Buckets are issued in their order on every rank (c10d matches collectives by order).
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) launch(next_launch_++);
  }

  // The bucket's gradients into its flat buffer, and its all-reduce (split: reduce-scatter) issued.
  void launch(size_t index) {
    Bucket& b = buckets_[index];
    dtk::TraceSpan span("compute", [&] { return "ddp: issue bucket " + std::to_string(index); });
    const auto options = at::TensorOptions().dtype(b.dtype).device(b.device);
    if (!b.flat.defined()) {
      b.flat = at::zeros({b.split ? b.padded : b.numel}, options);  // (the padding stays zero)
      if (b.split) b.shard = at::empty({b.padded / dp_size_}, options);
    }
    for (size_t k = 0; k < b.slots.size(); ++k) {
      const Slot& s = b.slots[k];
      at::Tensor& g = masters_[s.param].mutable_grad();
      at::Tensor dst = b.flat.narrow(0, s.offset, s.numel);
      // Already in the buffer where the gradient is its view (attach_gradient_views).
      const bool in_place = g.defined() && g.data_ptr() == dst.data_ptr();
      b.had_grad[k] = in_place ? got_grad_[s.param] : g.defined() ? 1 : 0;
      if (!in_place && g.defined())
        dst.copy_(g.reshape({-1}));
      else if (!in_place)
        dst.zero_();  // every rank sends the same layout
      // Split: the gradient comes back through the all-gather; until then the step must not see it.
      if (b.split) g = at::Tensor();
    }
    const int32_t op = average_ ? DTK_REDUCE_AVG : DTK_REDUCE_SUM;
    if (b.group == DTK_GROUP_EXPERT_DATA_PARALLEL) {
      // Each expert's gradient here already holds the tokens of the whole expert-parallel group:
      // summed over the ranks holding the same experts, it covers every data-parallel rank's, and
      // the average divides by the data-parallel size (Megatron's expert_gradient_scaling_factor).
      if (average_) b.flat.div_(dp_size_);
      b.work.emplace(dtk::Comm::all_reduce_async(b.flat, DTK_GROUP_EXPERT_DATA_PARALLEL, DTK_REDUCE_SUM));
    } else if (b.split)
      b.work.emplace(dtk::Comm::reduce_scatter_async(b.shard, b.flat, DTK_GROUP_DATA_PARALLEL, op));
    else
      b.work.emplace(dtk::Comm::all_reduce_async(b.flat, DTK_GROUP_DATA_PARALLEL, op));
  }

  // Waits for the bucket's all-reduce; the reduced gradients become views of its buffer (split:
  // the reduced shard stays in `shard` until the step gathers it).
  void finish(size_t index) {
    Bucket& b = buckets_[index];
    if (!b.work) return;
    b.work->wait();
    b.work.reset();
    if (b.split) return;
    for (size_t k = 0; k < b.slots.size(); ++k) {
      const Slot& s = b.slots[k];
      // (A view the backward did not reach holds zeros: the step must not see it.)
      masters_[s.param].mutable_grad() = b.had_grad[k] ? slot_view(b, s) : at::Tensor();
    }
  }

  // ------------------------------------------------------------------------------------------
  // overlap_param_gather: the update split across the step
  // ------------------------------------------------------------------------------------------

  // Counted once in the global norm: replicated parameters on TP rank 0 only, and a tied weight
  // across pipeline stages (its gradients summed by the host) on the first stage.
  bool counted_in_norm(size_t i) const {
    if (!params_[i].info.tensor_parallel && tp_rank_ != 0) return false;
    return !(params_[i].info.shared && pp_rank_ != 0);
  }

  // The parts of this rank's reduced shards that belong to parameters counted in the norm.
  std::vector<at::Tensor> counted_shard_pieces() const {
    std::vector<at::Tensor> out;
    for (const Bucket& b : buckets_) {
      if (!b.split || !b.shard.defined()) continue;
      const int64_t chunk = b.padded / dp_size_, lo = dp_rank_ * chunk, hi = lo + chunk;
      for (const Slot& s : b.slots) {
        const int64_t from = std::max(lo, s.offset), to = std::min(hi, s.offset + s.numel);
        if (from < to && counted_in_norm(s.param)) out.push_back(b.shard.narrow(0, from - lo, to - from));
      }
    }
    return out;
  }

  bool any_gradient() const {
    return std::any_of(masters_.begin(), masters_.end(), [](const at::Tensor& m) { return m.grad().defined(); });
  }

  // After the step: every split bucket's reduced (and clipped) shard all-gathered, in the order
  // the next forward reads them (the last bucket holds the first modules' parameters), left in
  // flight; the optimizer reference and this step's arguments kept for the updates.
  void issue_gradient_gathers(const dtk_optimizer_ref& optimizer, const dtk_optimizer_step_args& args) {
    optimizer_ = optimizer;
    step_args_ = dtk::StepArgs(args);  // used again from the next forward: owns the group rates
    for (size_t k = buckets_.size(); k-- > 0;) {
      Bucket& b = buckets_[k];
      if (!b.split || !b.shard.defined()) continue;
      b.gather.emplace(dtk::Comm::all_gather_async(b.flat, b.shard, DTK_GROUP_DATA_PARALLEL));
      b.update_pending = true;
    }
  }

  // Applies, in forward order, every pending bucket whose first reader is `module` or earlier.
  void apply_pending_updates(int32_t module) {
    for (size_t k = buckets_.size(); k-- > 0;) {
      Bucket& b = buckets_[k];
      if (b.update_pending && b.first_reader <= module) apply_update(k);
    }
  }

  // One bucket's update: its gathered gradients become the masters' (every other gradient set
  // aside for the call, so the optimizer steps this bucket alone), stepped, rounded into the
  // low-precision parameters, and let go.
  void apply_update(size_t index) {
    Bucket& b = buckets_[index];
    dtk::TraceSpan span("compute", [&] { return "ddp: update bucket " + std::to_string(index); });
    at::NoGradGuard no_grad;
    b.gather->wait();
    b.gather.reset();
    b.update_pending = false;
    std::vector<std::pair<size_t, at::Tensor>> aside;
    for (size_t i = 0; i < masters_.size(); ++i)
      if (masters_[i].grad().defined()) aside.emplace_back(i, std::exchange(masters_[i].mutable_grad(), at::Tensor()));
    bool any = false;
    for (size_t k = 0; k < b.slots.size(); ++k) {
      if (!b.had_grad[k]) continue;
      const Slot& s = b.slots[k];
      masters_[s.param].mutable_grad() = b.flat.narrow(0, s.offset, s.numel).view(masters_[s.param].sizes());
      any = true;
    }
    if (any) dtk::optimizer_step(&optimizer_, step_args_.get());
    for (const Slot& s : b.slots) {
      masters_[s.param].mutable_grad() = at::Tensor();
      if (!is_self(s.param)) params_[s.param].tensor.copy_(masters_[s.param]);
    }
    for (auto& [i, g] : aside) masters_[i].mutable_grad() = std::move(g);
    if (!step_checked_ &&
        std::none_of(buckets_.begin(), buckets_.end(), [](const Bucket& x) { return x.update_pending; }))
      check_one_step_counted();
  }

  // The optimizer's saved "step" (the Adam plugins'), if it has one.
  static std::optional<int64_t> optimizer_step_count(const dtk_optimizer_ref& optimizer) {
    for (const auto& [name, t] : dtk::optimizer_state(&optimizer))
      if (name == "step" && t.defined() && t.numel() == 1) return t.item<int64_t>();
    return std::nullopt;
  }

  // Once, after the first update split into calls: an optimizer that counts calls instead of
  // updates (abi.md) would take a step per bucket, each with another bias correction: refused.
  void check_one_step_counted() {
    step_checked_ = true;
    if (!step_before_) return;
    const std::optional<int64_t> after = optimizer_step_count(optimizer_);
    if (after && *after - *step_before_ > 1)
      throw dtk::Error(
          "ddp: overlap_param_gather: the optimizer counted " + std::to_string(*after - *step_before_) +
          " steps for one update split into calls (it counts calls, not dtk_optimizer_step_args.iteration); "
          "set strategy.overlap_param_gather=false");
  }

  // A forward that did not fire pre_forward for a module before its backward read stale
  // parameters: refused rather than trained on.
  void refuse_pending_updates() const {
    for (size_t k = 0; k < buckets_.size(); ++k)
      if (buckets_[k].update_pending)
        throw dtk::Error("ddp: overlap_param_gather: the update of bucket " + std::to_string(k) +
                         " (first read by module " + std::to_string(buckets_[k].first_reader) +
                         ") was still pending when the backward began: the model's forward did not fire that "
                         "module's pre_forward hook; set strategy.overlap_param_gather=false");
  }

  bool in_bucket(const at::Tensor& g) const {
    for (const auto& b : buckets_)
      if (b.flat.defined() && g.data_ptr() >= b.flat.data_ptr() &&
          static_cast<const char*>(g.data_ptr()) < static_cast<const char*>(b.flat.data_ptr()) + b.flat.nbytes())
        return true;
    return false;
  }

  static int64_t bytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

  bool average_, masters_enabled_, overlap_, split_asked_;
  int64_t bucket_bytes_;
  int32_t tp_rank_, pp_rank_, dp_size_, dp_rank_, ep_size_;
  bool tied_across_stages_, sums_over_tensor_parallel_;
  // The first split update checks that the optimizer counts one step per update, not per call.
  bool step_checked_ = false;
  std::optional<int64_t> step_before_;
  bool split_ = false;             // overlap_param_gather in effect (asked, DP > 1, hooks installed)
  dtk_optimizer_ref optimizer_{};  // the last step's optimizer and arguments, for the bucket updates
  dtk::StepArgs step_args_;
  std::vector<dtk::Param> params_;
  std::vector<at::Tensor> masters_;  // masters_[i] is params_[i] itself, or its fp32 copy
  dtk_module_hooks hooks_{};
  bool hooked_ = false;    // the hooks are installed (overlap on, DP > 1, a model with modules)
  bool syncing_ = false;   // in the last micro-batch's backward: the hooks issue buckets
  std::vector<Bucket> buckets_;
  std::map<int32_t, size_t> open_bucket_;    // per group: the bucket being filled (build_buckets)
  std::vector<int64_t> bucket_of_;           // per parameter: its bucket or -1
  std::vector<std::vector<size_t>> ready_at_;  // per module: the gradients complete after it
  std::vector<char> ready_;                  // per parameter: complete in this backward
  std::vector<char> got_grad_;               // per parameter: its gradient arrived since zero_grad
  std::vector<int32_t> first_reader_;        // per parameter: the lowest module listing it, or -1
  std::vector<std::pair<size_t, unsigned>> gradient_hooks_;  // (parameter, hook) to remove
  size_t next_launch_ = 0;                   // the next bucket to issue
};

}  // namespace

DTK_PLUGIN("ddp", DTK_KIND_STRATEGY, "1.2.0",
           "Data parallel gradient averaging in buckets overlapped with the backward, with Megatron's global-norm "
           "clipping",
           DTK_TORCH_VERSION, dtk::strategy_api<Ddp>(), kOptions)
