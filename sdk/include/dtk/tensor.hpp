// dtk/tensor.hpp — the compute tier's core: tensor handles <-> at::Tensor, the one dtype table,
// named tensors across the boundary, the build context, collectives, device services and seeds.
// Shared by every compute plugin kind; the kinds themselves are in dtk/model.hpp, dtk/step.hpp,
// dtk/optimizer.hpp and dtk/strategy.hpp.
//
// A compute plugin shares the host's LibTorch (autograd graphs cross the boundary), which is
// why the entry records DTK_TORCH_VERSION and the host refuses a mismatch.
#pragma once

#include <dtk/plugin.hpp>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (ATen/ATen.h no longer brings it in LibTorch 2.x)
#include <torch/csrc/api/include/torch/version.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// The LibTorch version this translation unit is compiled against, e.g. "1.13.0".
#define DTK_TORCH_VERSION TORCH_VERSION

// The private layout of a tensor handle: one owning reference to an at::Tensor.
struct dtk_tensor {
  at::Tensor value;
};

namespace dtk {

// ------------------------------------------------------------------------------------------
// Handles
// ------------------------------------------------------------------------------------------

// A [new] handle holding a reference to `t`.
inline dtk_tensor* wrap(at::Tensor t) { return new dtk_tensor{std::move(t)}; }

// The tensor behind a handle (no ownership change).
inline const at::Tensor& unwrap(const dtk_tensor* h) {
  if (!h) throw Error("null tensor handle", DTK_ERR_INVALID_ARGUMENT);
  return h->value;
}

// Releases a [new] handle.
inline void release(dtk_tensor* h) { delete h; }

// Whether a parameter is one routed expert's weight (dtk_param_info.expert, read where the struct
// is of ABI 2.9 or later): under expert parallelism only its expert-parallel rank holds it.
inline bool is_routed_expert(const dtk_param_info& info) {
  return info.struct_size >= dtk_param_info_STRUCT_SIZE_2_9 && info.expert != 0;
}

// How many routed experts the layer of such a weight has: its own count (dtk_param_info.layer_experts,
// ABI 2.18: DeepSpeed's pyramid MoE gives the layers different counts), else `model_count`
// (dtk_model_info.num_experts).
inline int64_t routed_layer_experts(const dtk_param_info& info, int64_t model_count) {
  const bool own = info.struct_size >= dtk_param_info_STRUCT_SIZE_2_18 && info.layer_experts > 0;
  return own ? info.layer_experts : model_count;
}

// Holds a [new] handle and releases it at scope exit.
struct TensorHandle {
  explicit TensorHandle(dtk_tensor* h = nullptr) : h(h) {}
  ~TensorHandle() { release(h); }
  TensorHandle(const TensorHandle&) = delete;
  TensorHandle& operator=(const TensorHandle&) = delete;
  dtk_tensor* h;
};

// ------------------------------------------------------------------------------------------
// Dtypes and devices: the one table mapping dtk_dtype codes to LibTorch scalar types
// ------------------------------------------------------------------------------------------

namespace detail {
struct DtypePair {
  int32_t code;
  at::ScalarType type;
};
// DTK_DTYPE_UINT16 has no LibTorch 1.13 equivalent and is absent (data tier only).
inline constexpr DtypePair kDtypes[] = {
    {DTK_DTYPE_UINT8, at::kByte},        {DTK_DTYPE_INT8, at::kChar},     {DTK_DTYPE_INT16, at::kShort},
    {DTK_DTYPE_INT32, at::kInt},         {DTK_DTYPE_INT64, at::kLong},    {DTK_DTYPE_FLOAT16, at::kHalf},
    {DTK_DTYPE_BFLOAT16, at::kBFloat16}, {DTK_DTYPE_FLOAT32, at::kFloat}, {DTK_DTYPE_FLOAT64, at::kDouble},
    {DTK_DTYPE_BOOL, at::kBool},
};
}  // namespace detail

// The LibTorch scalar type of a dtk_dtype code; throws for a code without one.
inline at::ScalarType to_scalar_type(int32_t dtype) {
  for (const auto& d : detail::kDtypes)
    if (d.code == dtype) return d.type;
  throw Error("dtype code " + std::to_string(dtype) + " has no LibTorch equivalent");
}

// The dtk_dtype code of a LibTorch scalar type, DTK_DTYPE_INVALID for one without a code.
inline int32_t from_scalar_type(at::ScalarType t) {
  for (const auto& d : detail::kDtypes)
    if (d.type == t) return d.code;
  return DTK_DTYPE_INVALID;
}

inline at::Device to_device(dtk_device d) {
  return d.type == DTK_DEVICE_CUDA ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d.index))
                                   : at::Device(at::kCPU);
}

inline dtk_device from_device(const at::Device& d) {
  return d.is_cuda() ? dtk_device{DTK_DEVICE_CUDA, d.has_index() ? d.index() : -1} : dtk_device{DTK_DEVICE_CPU, -1};
}

// "[2, 3]"
inline std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// ------------------------------------------------------------------------------------------
// Named tensors across the boundary
// ------------------------------------------------------------------------------------------

using TensorList = std::vector<std::pair<std::string, at::Tensor>>;

inline TensorList from_map(const dtk_tensor_map* map) {
  TensorList out;
  if (!map) return out;
  out.reserve(map->count);
  for (size_t i = 0; i < map->count; ++i) out.emplace_back(map->items[i].name, unwrap(map->items[i].tensor));
  return out;
}

inline const at::Tensor* find(const TensorList& list, const std::string& name) {
  for (const auto& kv : list)
    if (kv.first == name) return &kv.second;
  return nullptr;
}

// Whether any entry's name starts with `prefix` (a checkpoint that holds any "master." entry).
inline bool any_named(const TensorList& list, const std::string& prefix) {
  for (const auto& kv : list)
    if (kv.first.compare(0, prefix.size(), prefix) == 0) return true;
  return false;
}

inline const at::Tensor& get(const TensorList& list, const std::string& name) {
  const at::Tensor* t = find(list, name);
  if (!t) throw Error("missing tensor '" + name + "'", DTK_ERR_NOT_FOUND);
  return *t;
}

// A dtk_tensor_map view over a TensorList, valid while this object lives. Used to pass tensors
// [borrowed] into another plugin's function.
class MapView {
 public:
  explicit MapView(const TensorList& list) {
    handles_.reserve(list.size());
    items_.reserve(list.size());
    for (const auto& kv : list) handles_.push_back(dtk_tensor{kv.second});
    for (size_t i = 0; i < list.size(); ++i) items_.push_back({list[i].first.c_str(), &handles_[i]});
    map_ = {dtk_tensor_map_STRUCT_SIZE, items_.size(), items_.data()};
  }
  MapView(const MapView&) = delete;
  MapView& operator=(const MapView&) = delete;
  const dtk_tensor_map* get() const { return &map_; }

 private:
  std::vector<dtk_tensor> handles_;
  std::vector<dtk_named_tensor> items_;
  dtk_tensor_map map_{};
};

// A dtk_tensor_sink collecting into a TensorList.
class SinkCollector {
 public:
  SinkCollector() { sink_ = {dtk_tensor_sink_STRUCT_SIZE, this, &SinkCollector::put_fn}; }
  SinkCollector(const SinkCollector&) = delete;
  SinkCollector& operator=(const SinkCollector&) = delete;
  const dtk_tensor_sink* sink() const { return &sink_; }
  TensorList& items() { return items_; }

 private:
  static dtk_status* put_fn(void* ctx, const char* name, dtk_tensor* t) {
    return guard([&] {
      TensorHandle owned(t);
      static_cast<SinkCollector*>(ctx)->items_.emplace_back(name ? name : "", unwrap(t));
    });
  }
  dtk_tensor_sink sink_{};
  TensorList items_;
};

inline void put(const dtk_tensor_sink* sink, const std::string& name, const at::Tensor& t) {
  check(sink->put(sink->ctx, name.c_str(), wrap(t)));
}

// Puts every tensor of `list` into `sink`.
inline void put_all(const dtk_tensor_sink* sink, const TensorList& list) {
  for (const auto& kv : list) put(sink, kv.first, kv.second);
}

// ------------------------------------------------------------------------------------------
// Build context
// ------------------------------------------------------------------------------------------

struct BuildContext {
  explicit BuildContext(const dtk_build_context* in)
      : BuildContext(read_struct(in, dtk_build_context_STRUCT_SIZE_2_0, "build context")) {}
  explicit BuildContext(const dtk_build_context& c)
      : options(c.options),
        device(to_device(c.device)),
        params_dtype(to_scalar_type(c.params_dtype)),
        tp_rank(c.tp_rank),
        tp_size(c.tp_size),
        pp_rank(c.pp_rank),
        pp_size(c.pp_size),
        dp_rank(c.dp_rank),
        dp_size(c.dp_size),
        pre_process(c.pre_process != 0),
        post_process(c.post_process != 0),
        seq_length(c.seq_length),
        micro_batch_size(c.micro_batch_size),
        seed(c.seed),
        sequence_parallel(c.sequence_parallel != 0 && c.tp_size > 1),
        deferred_parameters(c.deferred_parameters != 0),
        ep_rank(c.ep_size > 1 ? c.ep_rank : 0),
        ep_size(c.ep_size > 1 ? c.ep_size : 1),
        pipeline_chunks(c.pipeline_chunks > 1 ? c.pipeline_chunks : 1),
        first_stage_layers(c.first_stage_layers),
        last_stage_layers(c.last_stage_layers),
        embedding_in_split(c.embedding_in_split != 0),
        loss_in_split(c.loss_in_split != 0),
        cp_rank(c.cp_size > 1 ? c.cp_rank : 0),
        cp_size(c.cp_size > 1 ? c.cp_size : 1),
        cp_comm_type(c.cp_size > 1 ? c.cp_comm_type : DTK_CP_COMM_A2A) {}
  Options options;
  at::Device device;
  at::ScalarType params_dtype;
  int32_t tp_rank, tp_size, pp_rank, pp_size, dp_rank, dp_size;
  bool pre_process, post_process;
  int64_t seq_length, micro_batch_size;
  uint64_t seed;
  bool sequence_parallel;  // ABI 2.3 (false from a 2.2 host): dtk_build_context.sequence_parallel
  // ABI 2.4 (false from an earlier host): create parameters without values; dtk::layers::ParamFactory
  // with a DeferredInit does it (dtk/layers/param_factory.hpp).
  bool deferred_parameters;
  // ABI 2.12 (0 and 1 from an earlier host): expert parallelism, dtk_build_context.ep_rank/ep_size.
  int32_t ep_rank, ep_size;
  // ABI 2.13 (the even split from an earlier host): how the layers split over the pipeline's
  // stages, dtk_build_context.pipeline_chunks and after; dtk::pipeline_layers reads them.
  int32_t pipeline_chunks;
  int32_t first_stage_layers, last_stage_layers;
  bool embedding_in_split, loss_in_split;
  // ABI 2.20 (0 and 1 from an earlier host): context parallelism, dtk_build_context.cp_rank/cp_size
  // (dtk/context_parallel.hpp splits a sequence so).
  int32_t cp_rank, cp_size;
  // ABI 2.21 (a2a from an earlier host): dtk_build_context.cp_comm_type, DTK_CP_COMM_*.
  int32_t cp_comm_type;
};

// ------------------------------------------------------------------------------------------
// Collectives through the host's process groups
// ------------------------------------------------------------------------------------------

// Every call is synchronous unless it returns a Work, whose wait() must be called before the
// tensor is read (abi.h: issue, compute, wait). Collectives are [main-thread].
class Comm {
 public:
  class Work {
   public:
    Work(const dtk_comm_services* c, dtk_comm_work* w) : c_(c), w_(w) {}
    Work(Work&& o) noexcept
        : c_(o.c_), w_(o.w_), out_splits_(std::move(o.out_splits_)), in_splits_(std::move(o.in_splits_)) {
      o.w_ = nullptr;
    }
    Work(const Work&) = delete;
    // A Work dropped without wait() still completes (bounded by the run's timeout): the
    // collective's result, e.g. the division of an AVG, must not be silently skipped.
    ~Work() {
      if (!w_) return;
      dtk_status_release(c_->wait(c_->ctx, w_, 0));
      c_->work_release(c_->ctx, w_);
    }
    // Bounded: timeout_ms <= 0 = the run's collective timeout.
    void wait(int64_t timeout_ms = 0) {
      if (!w_) return;
      dtk_status* s = c_->wait(c_->ctx, w_, timeout_ms);
      c_->work_release(c_->ctx, w_);
      w_ = nullptr;
      check(s);
    }

   private:
    friend class Comm;
    const dtk_comm_services* c_;
    dtk_comm_work* w_;
    // An all_to_all's split lists, which the host reads until the wait (abi.h).
    std::shared_ptr<const std::vector<int64_t>> out_splits_, in_splits_;
  };

  static const dtk_comm_services* services() {
    if (!host_services() || !host_services()->comm)
      throw Error("host communication services unavailable", DTK_ERR_COMM);
    return host_services()->comm;
  }
  static int rank(int32_t group) { return services()->rank(services()->ctx, group); }
  static int size(int32_t group) { return services()->size(services()->ctx, group); }
  static void all_reduce(const at::Tensor& t, int32_t group, int32_t op = DTK_REDUCE_SUM) {
    dtk_tensor h{t};
    run(&dtk_comm_services::all_reduce, args(group, op, &h, nullptr, 0));
  }
  static Work all_reduce_async(const at::Tensor& t, int32_t group, int32_t op = DTK_REDUCE_SUM) {
    dtk_tensor h{t};
    return run_async(&dtk_comm_services::all_reduce, args(group, op, &h, nullptr, 0));
  }
  static void broadcast(const at::Tensor& t, int32_t group, int32_t src_group_rank = 0) {
    dtk_tensor h{t};
    run(&dtk_comm_services::broadcast, args(group, DTK_REDUCE_SUM, &h, nullptr, src_group_rank));
  }
  static void all_gather(const at::Tensor& out, const at::Tensor& in, int32_t group) {
    dtk_tensor ho{out}, hi{in};
    run(&dtk_comm_services::all_gather, args(group, DTK_REDUCE_SUM, &hi, &ho, 0));
  }
  static Work all_gather_async(const at::Tensor& out, const at::Tensor& in, int32_t group) {
    dtk_tensor ho{out}, hi{in};
    return run_async(&dtk_comm_services::all_gather, args(group, DTK_REDUCE_SUM, &hi, &ho, 0));
  }
  static void reduce_scatter(const at::Tensor& out, const at::Tensor& in, int32_t group, int32_t op = DTK_REDUCE_SUM) {
    dtk_tensor ho{out}, hi{in};
    run(&dtk_comm_services::reduce_scatter, args(group, op, &hi, &ho, 0));
  }
  static Work reduce_scatter_async(const at::Tensor& out, const at::Tensor& in, int32_t group,
                                   int32_t op = DTK_REDUCE_SUM) {
    dtk_tensor ho{out}, hi{in};
    return run_async(&dtk_comm_services::reduce_scatter, args(group, op, &hi, &ho, 0));
  }
  static void barrier(int32_t group) {
    run(&dtk_comm_services::barrier, args(group, DTK_REDUCE_SUM, nullptr, nullptr, 0));
  }
  // ABI 2.19: in's rows in size(group) consecutive parts, in_splits[j] rows to rank j; out
  // receives rank j's part (out_splits[j] rows), in rank order. Empty splits: equal parts.
  static void all_to_all(const at::Tensor& out, const at::Tensor& in, int32_t group,
                         const std::vector<int64_t>& out_splits = {}, const std::vector<int64_t>& in_splits = {}) {
    check_all_to_all(group, out_splits, in_splits);
    dtk_tensor ho{out}, hi{in};
    dtk_collective_args a = args(group, DTK_REDUCE_SUM, &hi, &ho, 0);
    a.output_splits = out_splits.empty() ? nullptr : out_splits.data();
    a.input_splits = in_splits.empty() ? nullptr : in_splits.data();
    run(&dtk_comm_services::all_to_all, a);
  }
  // all_to_all issued; out is written by the time the Work's wait() returns (the Work keeps the
  // split lists).
  static Work all_to_all_async(const at::Tensor& out, const at::Tensor& in, int32_t group,
                               std::vector<int64_t> out_splits = {}, std::vector<int64_t> in_splits = {}) {
    check_all_to_all(group, out_splits, in_splits);
    auto outs = std::make_shared<const std::vector<int64_t>>(std::move(out_splits));
    auto ins = std::make_shared<const std::vector<int64_t>>(std::move(in_splits));
    dtk_tensor ho{out}, hi{in};
    dtk_collective_args a = args(group, DTK_REDUCE_SUM, &hi, &ho, 0);
    a.output_splits = outs->empty() ? nullptr : outs->data();
    a.input_splits = ins->empty() ? nullptr : ins->data();
    Work w = run_async(&dtk_comm_services::all_to_all, a);
    w.out_splits_ = std::move(outs);
    w.in_splits_ = std::move(ins);
    return w;
  }

 private:
  using Fn = dtk_status* (*dtk_comm_services::*)(void*, const dtk_collective_args*);
  static dtk_collective_args args(int32_t group, int32_t op, dtk_tensor* tensor, dtk_tensor* output, int32_t root) {
    dtk_collective_args a{};
    a.struct_size = dtk_collective_args_STRUCT_SIZE;
    a.group = group;
    a.op = op;
    a.tensor = tensor;
    a.output = output;
    a.root = root;
    return a;
  }
  static void check_all_to_all(int32_t group, const std::vector<int64_t>& out_splits,
                               const std::vector<int64_t>& in_splits) {
    if (!DTK_HAS_FIELD(dtk_comm_services, services(), all_to_all))
      throw Error("all_to_all needs a host of ABI 2.19 or later (this host is ABI 2." +
                      std::to_string(host_services()->abi_minor) + ")",
                  DTK_ERR_UNSUPPORTED);
    // (The host reads size(group) entries of each list it is given.)
    for (const std::vector<int64_t>* splits : {&out_splits, &in_splits})
      if (!splits->empty() && static_cast<int>(splits->size()) != size(group))
        throw Error("all_to_all: " + std::to_string(splits->size()) + " splits for a group of " +
                        std::to_string(size(group)) + " (one per rank, or none for equal parts)",
                    DTK_ERR_INVALID_ARGUMENT);
  }
  static void run(Fn fn, dtk_collective_args a) { check((services()->*fn)(services()->ctx, &a)); }
  static Work run_async(Fn fn, dtk_collective_args a) {
    dtk_comm_work* w = nullptr;
    a.async = 1;
    a.work = &w;
    check((services()->*fn)(services()->ctx, &a));
    return Work(services(), w);
  }
};

// ------------------------------------------------------------------------------------------
// Device services: streams, events, pinned host memory (CPU runs: valid no-ops)
// ------------------------------------------------------------------------------------------

class Device {
 public:
  static const dtk_device_services* services() {
    if (!host_services() || !host_services()->device)
      throw Error("host device services unavailable", DTK_ERR_UNSUPPORTED);
    return host_services()->device;
  }
  // A contiguous, uninitialized host tensor in page-locked memory (plain memory on CPU runs).
  static at::Tensor pinned_empty(at::IntArrayRef shape, at::ScalarType dtype) {
    dtk_tensor* out = nullptr;
    check(services()->alloc_pinned(services()->ctx, shape.data(), static_cast<int32_t>(shape.size()),
                                   from_scalar_type(dtype), &out));
    TensorHandle owned(out);
    return unwrap(out);
  }
  // The calling thread's current stream on `device` ([borrowed]).
  static dtk_stream* current_stream(const at::Device& device) {
    return services()->current_stream(services()->ctx, from_device(device));
  }
};

// Seed of an RNG stream for this rank (dtk_rng_stream).
inline uint64_t rng_seed(int32_t stream) {
  if (!host_services() || !host_services()->rng_seed) return 1234;
  return host_services()->rng_seed(host_services()->ctx, stream);
}

}  // namespace dtk
