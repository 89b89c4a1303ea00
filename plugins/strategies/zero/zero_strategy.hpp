// zero_strategy.hpp — DeepSpeed's ZeRO as a DTK strategy (see zero.cpp for the plugin entry and
// docs/user-guide.md for the user's view).
//
//   stage 1  fp32 master weights and optimizer state partitioned over the data-parallel (DP)
//            group; gradients accumulate whole (fp32), are reduce-scattered bucket by bucket after
//            the last micro-batch, each rank steps its partition, and the updated parameters are
//            all-gathered bucket by bucket.
//   stage 2  + gradients partitioned: as each bucket's gradients become ready in backward (the
//            module hooks' post_backward) they are copied into a contiguous fp32 bucket and
//            reduce-scattered into the rank's partition, every micro-batch, so no rank ever holds
//            the whole fp32 gradient.
//   stage 3  + parameters partitioned: each rank keeps its chunk of every bucket; a module's
//            buckets are all-gathered just before its forward and again before its backward
//            (pre_forward/pre_backward hooks), with the next modules prefetched, and released after
//            (post_forward/post_backward). Parameters at or below
//            stage3_param_persistence_threshold elements stay whole.
//   offload_optimizer=cpu   masters, optimizer state and the gradient partition live in pinned
//            host memory; the optimizer (cpu_adam) steps them there; updated parameters go back to
//            the device in the parameter dtype. offload_param=cpu (stage 3): the parameter
//            partition lives in host memory too.
//   offload_optimizer=nvme  as cpu, but the fp32 masters and the optimizer state live in a swap
//            file on disk and stream through a bounded host buffer at each step (swap.hpp).
//   offload_param=nvme  (stage 3) the parameter partition lives in a swap file; its chunks are
//            read into param_buffer_count host buffers before their all-gathers (the next modules'
//            reads issued ahead, gather.cpp's prefetch) and written back after the step
//            (param_swap.hpp).
//   expert parallelism (distributed.expert_model_parallel_size): the routed experts' weights
//            are partitioned over the expert-data-parallel group, the ranks that hold the same
//            experts (layout.hpp), their gradients summed there and divided by the data-parallel
//            size (each expert's gradient already holds the tokens of its expert-parallel group),
//            as Megatron's distributed optimizer does with its expert buffers.
//   delayed_param_update (with offload_optimizer=cpu): ZeRO-Offload's one-step delayed update;
//            from iteration 2 the step runs on a host thread during the next forward and backward
//            (launch_delayed_step / finish_delayed_step below).
//
// The layout (layout.hpp) is bucket-major; the optimizer steps one 1-D shard per parameter that
// intersects this rank's partition, named after the parameter, so its state is per parameter and
// checkpoints can re-partition it (abi.h dtk_strategy_info.sharded_state).
#pragma once

#include <dtk/strategy.hpp>

#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "layout.hpp"
#include "offload.hpp"
#include "param_swap.hpp"
#include "swap.hpp"

namespace dtk::zero {

struct Options {
  int stage = 1;
  int64_t reduce_bucket_size = 0, allgather_bucket_size = 0;
  // overlap_comm: elements of reduce-scatters left in flight at once (two buckets at least).
  int64_t reduce_in_flight_size = 0;
  bool overlap_comm = false, average_gradients = true, overlap_param_gather = false;
  int64_t prefetch_bucket_size = 0, max_live_parameters = 0, persistence_threshold = 0;
  bool offload_optimizer = false, offload_param = false;
  bool optimizer_on_disk = false;  // offload_optimizer=nvme (offload_optimizer is true as well)
  bool param_on_disk = false;      // offload_param=nvme (offload_param is true as well)
  std::string nvme_path;
  int64_t nvme_buffer_bytes = 0;
  int64_t param_buffer_count = 0;  // offload_param=nvme: host buffers of one bucket chunk each
  bool delayed_param_update = false;
  bool zero_init = true;  // stage 3: the model is built deferred, each rank keeps its partition
  // Reads and checks the plugin's options (one-line errors naming the option).
  static Options from(const dtk::Options& o);
};

class ZeroStrategy : public Strategy {
 public:
  explicit ZeroStrategy(const BuildContext& ctx);
  ~ZeroStrategy() override;

  void setup(const ModelHandle& model) override;
  std::vector<Param> optimizer_params() override { return optimizer_params_; }
  void before_backward(const dtk_backward_args& args) override;
  void reduce_gradients() override;
  double clip_and_norm(double max_norm) override;
  void optimizer_step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args) override;
  void zero_grad() override;
  TensorList state_save() override;
  void state_load(const TensorList& state) override;
  const dtk_module_hooks* module_hooks() override {
    return opt_.stage >= 2 || gather_overlapped_ || reduce_overlapped_ ? &hooks_ : nullptr;
  }
  dtk_strategy_info info() override;
  void gather_parameters(bool whole) override;
  dtk_memory_usage memory_usage() override;
  bool defers_parameters() override { return opt_.stage == 3 && opt_.zero_init; }

 private:
  // setup
  void read_parameters(const ModelHandle& model);
  void build_layout();
  void allocate_parameters(bool deferred);
  void init_deferred_parameters(const ModelHandle& model);  // zero_init: the model's values, one at a time
  void allocate_masters_and_gradients();
  at::Tensor host_or_device(int64_t numel, at::ScalarType dtype, bool host) const;
  at::Tensor param_values_of(const Shard& s) const;  // the shard in the parameter dtype
  // offload_param=nvme: its values, a copy read from the swap file (setup), and the shard's new
  // values written (the step: on-demand buckets through the write-back slot, others in full_),
  // `values` for the shard's elements [offset, offset + values.numel()) (a piece on disk).
  at::Tensor shard_values(const Shard& s);
  void store_updated(const Shard& s, int64_t offset, const at::Tensor& values);
  void finish_write_back();          // the last write-back slot's write is issued
  bool on_disk(size_t bucket) const { return param_swap_ && layout_->buckets()[bucket].on_demand; }
  at::Tensor master_of(const Shard& s) const;        // the fp32 values the optimizer steps
  size_t index_of(const Shard& s) const { return static_cast<size_t>(&s - shards_.data()); }  // s in shards_
  void create_swap();                                // offload_optimizer=nvme
  void create_param_swap();                          // offload_param=nvme
  void step_from_disk(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args);
  bool low_precision() const { return dtype_ != at::kFloat; }
  // A bucket's ranks: the data-parallel group, or for experts the expert-data-parallel group
  // (layout.hpp); this rank's chunk starts at own_offset within the bucket.
  int32_t group_of(const Bucket& b) const {
    return b.expert ? DTK_GROUP_EXPERT_DATA_PARALLEL : DTK_GROUP_DATA_PARALLEL;
  }
  int64_t own_offset(const Bucket& b) const { return static_cast<int64_t>(b.expert ? edp_rank_ : dp_rank_) * b.chunk; }

  // gradients
  void collect_into_flat();               // stage 1: low-precision .grad -> the fp32 flat buffer
  void add_into_flat(size_t p);           // stage 1: one parameter's .grad into the flat buffer
  void collect(size_t param);             // stage 2/3: .grad -> its bucket's fp32 staging buffer
  at::Tensor take_staging(int64_t numel);
  void return_staging(at::Tensor buffer);
  // `staging`: the pooled buffer behind `input`, returned when the reduction completed (stage 2/3).
  void reduce_bucket(size_t bucket, const at::Tensor& input, at::Tensor staging);
  void finish_reductions(size_t keep);    // completes in-flight reduce-scatters down to `keep`
  void flush_buckets();                   // stage 2/3: reduce what backward did not complete

  // parameters
  void gather_after_step();               // all-gathers the always-whole buckets
  void issue_gathers_after_step();        // stages 1/2, overlap_param_gather: the same, left in flight
  void finish_gather(size_t bucket);      // stages 1/2: a gather left in flight completes
  void acquire_module(int32_t module);    // stage 3: gather a module's buckets (or take a prefetch)
  void release_module(int32_t module);
  void gather_bucket(size_t bucket, bool async);
  void wait_bucket(size_t bucket);        // a pending gather completes; parameters point into it
  void free_bucket(size_t bucket);
  void prefetch(int32_t from_module, int direction);
  void write_back_partition(size_t bucket);  // stage 3: whole bucket values -> this rank's chunk
  void apply_step();                      // updated masters -> the parameters (and gathers)

  // delayed_param_update (ZeRO-Offload's DPU): the step of iteration t runs on a host thread
  // during iteration t+1's forward and backward, on a copy of its gradients; its values reach the
  // parameters when t+1's gradients are reduced, so t+1 computes on the parameters of t-1.
  void launch_delayed_step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args);
  void finish_delayed_step();             // waits for the step in flight, applies it
  void point_optimizer_grads(const at::Tensor& grads);

  // module hooks
  static dtk_status* pre_forward(void* ctx, int32_t module);
  static dtk_status* post_forward(void* ctx, int32_t module);
  static dtk_status* pre_backward(void* ctx, int32_t module);
  static dtk_status* post_backward(void* ctx, int32_t module);

  const Options opt_;
  const at::Device device_;
  const int dp_rank_, dp_size_, tp_rank_, tp_size_, pp_rank_, pp_size_;
  const int ep_size_, edp_rank_, edp_size_;  // expert parallelism (ep_size_ 1: edp is dp)
  at::ScalarType dtype_ = at::kFloat;
  dtk_module_hooks hooks_{};

  std::vector<Param> params_;
  std::map<std::string, size_t> index_of_name_;  // params_ by name                    // the model's (tensors shared with the model)
  std::vector<std::vector<size_t>> module_reads_;  // per module: the parameters it reads
  std::vector<std::vector<size_t>> ready_at_;      // per module: gradients complete after it
  std::vector<std::vector<size_t>> module_buckets_;  // per module: the buckets of what it reads
  bool gather_overlapped_ = false;  // stages 1/2 with overlap_param_gather and a model with modules
  // Stage 1 with overlap_comm, DP > 1 and a model with modules: buckets are reduce-scattered from
  // the module hooks during the last micro-batch's backward (reducing_in_backward_ while it runs),
  // as Megatron's distributed optimizer does with --overlap-grad-reduce.
  bool reduce_overlapped_ = false;
  bool reducing_in_backward_ = false;
  int32_t first_module_ = 0;                     // lowest module index: the end of backward
  std::optional<Layout> layout_;
  std::vector<Shard> shards_;                    // this rank's, in partition order
  std::vector<int64_t> shard_of_;                // per parameter: its shard index or -1

  // storage (see the file comment)
  bool masters_alias_ = false;  // the optimizer steps the parameters' own fp32 storage
  std::vector<at::Tensor> full_;  // per bucket: whole values in the parameter dtype (stages 1/2:
                                  // always; stage 3: persistent buckets, and others while gathered)
  at::Tensor part_params_;      // stage 3: this rank's chunks, parameter dtype
  at::Tensor masters_;          // fp32 partition unless masters_alias_ or on disk (swap_)
  std::unique_ptr<OptimizerSwap> swap_;  // offload_optimizer=nvme: masters and optimizer state on disk
  std::unique_ptr<ParamSwap> param_swap_;  // offload_param=nvme: the partition on disk (part_params_ unused)
  std::vector<int> gather_slot_;  // per bucket: the param_swap_ slot its all-gather reads, or -1
  int write_slot_ = -1;           // the write-back slot being filled (its bucket: write_bucket_)
  size_t write_bucket_ = 0;
  at::Tensor part_grads_;       // fp32 partition of the reduced gradients
  at::Tensor grad_flat_;        // stage 1: the whole fp32 gradient
  at::Tensor nan_;              // stage 3: what a released parameter shows (NaN, any shape)
  std::vector<Param> optimizer_params_;

  // stage 2/3 reduction state
  std::vector<at::Tensor> staging_;    // per bucket, while its gradients arrive
  std::vector<at::Tensor> spare_;      // staging buffers to reuse
  std::vector<int64_t> pending_;       // per bucket: gradients still to arrive this backward
  std::vector<char> collected_;        // per parameter: collected this backward (stage 1: the last one)
  struct InFlight {
    size_t bucket;
    at::Tensor input, output;
    std::optional<Comm::Work> work;
    at::Tensor staging;  // stage 2/3: the pool buffer behind input
  };
  std::deque<InFlight> in_flight_;
  int64_t in_flight_numel_ = 0;        // the buckets' elements in in_flight_
  size_t max_spares_ = 3;              // staging buffers kept for reuse (reduce_in_flight_size)
  // GPU runs with offload_optimizer=cpu: the reduced chunks' copies to the host partition.
  std::unique_ptr<OffloadCopier> offload_;
  static constexpr size_t kOffloadCopiesInFlight = 4;
  std::future<void> delayed_;   // the delayed step in flight
  at::Tensor step_grads_;       // its gradients (a copy of part_grads_), host memory

  // stage 3 gathering state
  std::vector<int> refs_;                 // per bucket: modules holding it
  std::vector<char> module_live_;         // per module: its buckets are held for it
  std::vector<std::optional<Comm::Work>> gathering_;  // per bucket: an issued, unfinished gather
  bool backward_phase_ = false;
};

}  // namespace dtk::zero
