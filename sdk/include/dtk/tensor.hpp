// dtk/tensor.hpp — compute-tier helpers: tensor handles <-> at::Tensor, and C++ base classes
// that turn an ordinary C++ class into a model, step, optimizer or strategy vtable.
//
//   class MyModel : public dtk::Model { ... };
//   DTK_PLUGIN("my_model", DTK_KIND_MODEL, "1.0.0", "What it is", DTK_TORCH_VERSION,
//              dtk::model_api<MyModel>(), kOptions)
//
// A compute plugin shares the host's LibTorch (autograd graphs cross the boundary), which is
// why the entry records DTK_TORCH_VERSION and the host refuses a mismatch.
#pragma once

#include <dtk/plugin.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/version.h>

#include <algorithm>
#include <cstring>
#include <functional>
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

// Holds a [new] handle and releases it at scope exit.
struct TensorHandle {
  explicit TensorHandle(dtk_tensor* h = nullptr) : h(h) {}
  ~TensorHandle() { release(h); }
  TensorHandle(const TensorHandle&) = delete;
  TensorHandle& operator=(const TensorHandle&) = delete;
  dtk_tensor* h;
};

inline at::ScalarType to_scalar_type(int32_t dtype) {
  switch (dtype) {
    case DTK_DTYPE_UINT8:
      return at::kByte;
    case DTK_DTYPE_INT8:
      return at::kChar;
    case DTK_DTYPE_INT16:
      return at::kShort;
    case DTK_DTYPE_INT32:
      return at::kInt;
    case DTK_DTYPE_INT64:
      return at::kLong;
    case DTK_DTYPE_FLOAT16:
      return at::kHalf;
    case DTK_DTYPE_BFLOAT16:
      return at::kBFloat16;
    case DTK_DTYPE_FLOAT32:
      return at::kFloat;
    case DTK_DTYPE_FLOAT64:
      return at::kDouble;
    case DTK_DTYPE_BOOL:
      return at::kBool;
    default:
      throw Error("dtype code " + std::to_string(dtype) + " has no LibTorch equivalent");
  }
}

inline int32_t from_scalar_type(at::ScalarType t) {
  switch (t) {
    case at::kByte:
      return DTK_DTYPE_UINT8;
    case at::kChar:
      return DTK_DTYPE_INT8;
    case at::kShort:
      return DTK_DTYPE_INT16;
    case at::kInt:
      return DTK_DTYPE_INT32;
    case at::kLong:
      return DTK_DTYPE_INT64;
    case at::kHalf:
      return DTK_DTYPE_FLOAT16;
    case at::kBFloat16:
      return DTK_DTYPE_BFLOAT16;
    case at::kFloat:
      return DTK_DTYPE_FLOAT32;
    case at::kDouble:
      return DTK_DTYPE_FLOAT64;
    case at::kBool:
      return DTK_DTYPE_BOOL;
    default:
      return DTK_DTYPE_INVALID;
  }
}

inline at::Device to_device(dtk_device d) {
  return d.type == DTK_DEVICE_CUDA ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d.index))
                                   : at::Device(at::kCPU);
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
    for (const auto& kv : list) {
      handles_.push_back(dtk_tensor{kv.second});
    }
    for (size_t i = 0; i < list.size(); ++i) items_.push_back({list[i].first.c_str(), &handles_[i]});
    map_ = {sizeof(dtk_tensor_map), items_.size(), items_.data()};
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
  SinkCollector() { sink_ = {sizeof(dtk_tensor_sink), this, &SinkCollector::put_fn}; }
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

// ------------------------------------------------------------------------------------------
// Build context and host services
// ------------------------------------------------------------------------------------------

struct BuildContext {
  explicit BuildContext(const dtk_build_context* c)
      : options(c->options),
        device(to_device(c->device)),
        params_dtype(to_scalar_type(c->params_dtype)),
        tp_rank(c->tp_rank),
        tp_size(c->tp_size),
        pp_rank(c->pp_rank),
        pp_size(c->pp_size),
        dp_rank(c->dp_rank),
        dp_size(c->dp_size),
        pre_process(c->pre_process != 0),
        post_process(c->post_process != 0),
        seq_length(c->seq_length),
        micro_batch_size(c->micro_batch_size),
        seed(c->seed) {}
  Options options;
  at::Device device;
  at::ScalarType params_dtype;
  int32_t tp_rank, tp_size, pp_rank, pp_size, dp_rank, dp_size;
  bool pre_process, post_process;
  int64_t seq_length, micro_batch_size;
  uint64_t seed;
};

// Collectives through the host's process groups. Every call is synchronous unless it returns
// a Work, whose wait() must be called before the tensor is read.
class Comm {
 public:
  class Work {
   public:
    Work(const dtk_comm_services* c, dtk_comm_work* w) : c_(c), w_(w) {}
    Work(Work&& o) noexcept : c_(o.c_), w_(o.w_) { o.w_ = nullptr; }
    Work(const Work&) = delete;
    // A Work dropped without wait() still completes (bounded by the run's timeout): the
    // collective's result, e.g. the division of an AVG, must not be silently skipped.
    ~Work() {
      if (!w_) return;
      dtk_status_release(c_->wait(c_->ctx, w_, 0));
      c_->work_release(c_->ctx, w_);
    }
    void wait(int64_t timeout_ms = 0) {
      if (!w_) return;
      dtk_status* s = c_->wait(c_->ctx, w_, timeout_ms);
      c_->work_release(c_->ctx, w_);
      w_ = nullptr;
      check(s);
    }

   private:
    const dtk_comm_services* c_;
    dtk_comm_work* w_;
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
    check(services()->all_reduce(services()->ctx, group, &h, op, 0, nullptr));
  }
  static Work all_reduce_async(const at::Tensor& t, int32_t group, int32_t op = DTK_REDUCE_SUM) {
    dtk_tensor h{t};
    dtk_comm_work* w = nullptr;
    check(services()->all_reduce(services()->ctx, group, &h, op, 1, &w));
    return Work(services(), w);
  }
  static void broadcast(const at::Tensor& t, int32_t group, int32_t src_group_rank = 0) {
    dtk_tensor h{t};
    check(services()->broadcast(services()->ctx, group, &h, src_group_rank, 0, nullptr));
  }
  static void all_gather(const at::Tensor& out, const at::Tensor& in, int32_t group) {
    dtk_tensor ho{out}, hi{in};
    check(services()->all_gather(services()->ctx, group, &ho, &hi, 0, nullptr));
  }
  static void reduce_scatter(const at::Tensor& out, const at::Tensor& in, int32_t group, int32_t op = DTK_REDUCE_SUM) {
    dtk_tensor ho{out}, hi{in};
    check(services()->reduce_scatter(services()->ctx, group, &ho, &hi, op, 0, nullptr));
  }
};

inline uint64_t rng_seed(int32_t stream) {
  if (!host_services() || !host_services()->rng_seed) return 1234;
  return host_services()->rng_seed(host_services()->ctx, stream);
}

// ------------------------------------------------------------------------------------------
// Model
// ------------------------------------------------------------------------------------------

struct Param {
  std::string name;
  at::Tensor tensor;
  dtk_param_info info{sizeof(dtk_param_info), 0, -1, 1, 0, 0, 0};
};

// Base class of a C++ model plugin. Constructor: Class(const dtk::BuildContext&).
class Model {
 public:
  virtual ~Model() = default;
  virtual TensorList forward(const TensorList& inputs) = 0;
  virtual std::vector<Param> parameters() = 0;
  virtual std::vector<Param> buffers() { return {}; }
  virtual void set_training(bool training) = 0;
  virtual dtk_model_info info() = 0;

  // Moves/casts every parameter and buffer in place (keeping tensor identity for optimizers).
  virtual void to(at::Device device, std::optional<at::ScalarType> dtype) {
    auto move = [&](const at::Tensor& t) {
      at::Tensor moved = dtype && t.is_floating_point() ? t.to(device, *dtype) : t.to(device);
      t.set_data(moved);
    };
    for (auto& p : parameters()) move(p.tensor);
    for (auto& b : buffers()) move(b.tensor);
  }

  // Checkpoint state: parameters and buffers under their names, tied duplicates once.
  virtual TensorList state_save() {
    TensorList out;
    for (auto& p : parameters())
      if (!find(out, p.name)) out.emplace_back(p.name, p.tensor.detach());
    for (auto& b : buffers())
      if (!find(out, b.name)) out.emplace_back(b.name, b.tensor.detach());
    return out;
  }

  virtual void state_load(const TensorList& state, bool strict) {
    TensorList mine = state_save();
    for (auto& kv : mine) {
      const at::Tensor* src = find(state, kv.first);
      if (!src) {
        if (strict) throw Error("checkpoint state has no tensor '" + kv.first + "'", DTK_ERR_NOT_FOUND);
        continue;
      }
      if (src->sizes() != kv.second.sizes())
        throw Error("tensor '" + kv.first + "': checkpoint shape " + shape_str(*src) + " does not match the model's " +
                    shape_str(kv.second));
      at::NoGradGuard no_grad;
      kv.second.copy_(*src);
    }
    if (strict)
      for (auto& kv : state)
        if (!find(mine, kv.first))
          throw Error("checkpoint has unexpected tensor '" + kv.first + "'", DTK_ERR_INVALID_ARGUMENT);
  }

  static std::string shape_str(const at::Tensor& t) {
    std::string s = "[";
    for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
    return s + "]";
  }
};

namespace detail {
inline dtk_status* visit_all(const std::vector<Param>& params, const dtk_param_visitor* v) {
  for (const auto& p : params) {
    dtk_tensor h{p.tensor};
    if (dtk_status* s = v->visit(v->ctx, p.name.c_str(), &h, &p.info)) return s;
  }
  return nullptr;
}
}  // namespace detail

template <class T>
const dtk_model_api* model_api() {
  static const dtk_model_api api = {
      sizeof(dtk_model_api),
      [](const dtk_build_context* ctx, dtk_model** out) {
        return guard([&] { *out = reinterpret_cast<dtk_model*>(new T(BuildContext(ctx))); });
      },
      [](dtk_model* m) { delete reinterpret_cast<T*>(m); },
      [](dtk_model* m, const dtk_tensor_map* in, const dtk_tensor_sink* out) {
        return guard([&] {
          for (auto& kv : reinterpret_cast<T*>(m)->forward(from_map(in))) put(out, kv.first, kv.second);
        });
      },
      [](dtk_model* m, const dtk_param_visitor* v) {
        dtk_status* s = nullptr;
        dtk_status* g = guard([&] { s = detail::visit_all(reinterpret_cast<T*>(m)->parameters(), v); });
        return g ? g : s;
      },
      [](dtk_model* m, const dtk_param_visitor* v) {
        dtk_status* s = nullptr;
        dtk_status* g = guard([&] { s = detail::visit_all(reinterpret_cast<T*>(m)->buffers(), v); });
        return g ? g : s;
      },
      [](dtk_model* m, int32_t training) {
        return guard([&] { reinterpret_cast<T*>(m)->set_training(training != 0); });
      },
      [](dtk_model* m, dtk_device device, int32_t dtype) {
        return guard([&] {
          std::optional<at::ScalarType> st;
          if (dtype != DTK_DTYPE_INVALID) st = to_scalar_type(dtype);
          reinterpret_cast<T*>(m)->to(to_device(device), st);
        });
      },
      [](dtk_model* m, const dtk_tensor_sink* out) {
        return guard([&] {
          for (auto& kv : reinterpret_cast<T*>(m)->state_save()) put(out, kv.first, kv.second);
        });
      },
      [](dtk_model* m, const dtk_tensor_map* state, int32_t strict) {
        return guard([&] { reinterpret_cast<T*>(m)->state_load(from_map(state), strict != 0); });
      },
      [](dtk_model* m, dtk_model_info* info) {
        return guard([&] {
          dtk_model_info mine = reinterpret_cast<T*>(m)->info();
          // Copy only what the caller's struct has room for (append-only growth), and report
          // how much of it was filled.
          const size_t n = std::min(info->struct_size, sizeof(dtk_model_info));
          std::memcpy(info, &mine, n);
          info->struct_size = n;
        });
      },
  };
  return &api;
}

// A dtk_param_visitor that appends every visited parameter (name, tensor, info) to `out`,
// reading the info through its own struct_size (it may come from an older or newer plugin).
inline dtk_param_visitor collecting_visitor(std::vector<Param>* out) {
  return {sizeof(dtk_param_visitor), out, [](void* ctx, const char* name, dtk_tensor* t, const dtk_param_info* info) {
            return guard([&] {
              Param p;
              p.name = name ? name : "";
              p.tensor = unwrap(t);
              if (info) std::memcpy(&p.info, info, std::min(info->struct_size, sizeof(dtk_param_info)));
              p.info.struct_size = sizeof(dtk_param_info);
              static_cast<std::vector<Param>*>(ctx)->push_back(std::move(p));
            });
          }};
}

// Calls another plugin's model through its vtable (used by step and strategy plugins).
class ModelHandle {
 public:
  explicit ModelHandle(const dtk_model_ref* ref) : ref_(ref) {
    if (!ref || !ref->api || !ref->model) throw Error("invalid model reference");
  }
  TensorList forward(const TensorList& inputs) const {
    MapView view(inputs);
    SinkCollector out;
    check(ref_->api->forward(ref_->model, view.get(), out.sink()));
    return std::move(out.items());
  }
  std::vector<Param> parameters() const { return visit(ref_->api->visit_parameters); }
  std::vector<Param> buffers() const { return visit(ref_->api->visit_buffers); }
  const dtk_model_ref* ref() const { return ref_; }

 private:
  using VisitFn = dtk_status* (*)(dtk_model*, const dtk_param_visitor*);
  std::vector<Param> visit(VisitFn fn) const {
    std::vector<Param> out;
    dtk_param_visitor v = collecting_visitor(&out);
    check(fn(ref_->model, &v));
    return out;
  }
  const dtk_model_ref* ref_;
};

// ------------------------------------------------------------------------------------------
// Step
// ------------------------------------------------------------------------------------------

class Metrics {
 public:
  explicit Metrics(const dtk_metric_sink* sink) : sink_(sink) {}
  void put(const std::string& name, double value) const {
    if (sink_ && sink_->put) sink_->put(sink_->ctx, name.c_str(), value);
  }

 private:
  const dtk_metric_sink* sink_;
};

// Base class of a C++ step plugin. Constructor: Class(const dtk::BuildContext&).
class Step {
 public:
  virtual ~Step() = default;
  // Returns the scalar loss to differentiate; reports metrics (DP-averaged) into `metrics`.
  virtual at::Tensor forward_step(const ModelHandle& model, const TensorList& batch, const Metrics& metrics) = 0;
};

template <class T>
const dtk_step_api* step_api() {
  static const dtk_step_api api = {
      sizeof(dtk_step_api),
      [](const dtk_build_context* ctx, dtk_step** out) {
        return guard([&] { *out = reinterpret_cast<dtk_step*>(new T(BuildContext(ctx))); });
      },
      [](dtk_step* s) { delete reinterpret_cast<T*>(s); },
      [](dtk_step* s, const dtk_model_ref* model, const dtk_tensor_map* batch, dtk_tensor** loss,
         const dtk_metric_sink* metrics) {
        return guard([&] {
          at::Tensor l = reinterpret_cast<T*>(s)->forward_step(ModelHandle(model), from_map(batch), Metrics(metrics));
          *loss = wrap(std::move(l));
        });
      },
  };
  return &api;
}

// ------------------------------------------------------------------------------------------
// Optimizer
// ------------------------------------------------------------------------------------------

struct ParamGroup {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  double weight_decay = 0.0;
  double lr_scale = 1.0;
};

// Arrays of versioned structs are walked with their elements' own struct_size (abi.h rule 2):
// a host of a newer minor may pass larger elements than this plugin knows.
inline std::vector<ParamGroup> from_groups(const dtk_param_group* groups, size_t n) {
  std::vector<ParamGroup> out(n);
  if (n == 0) return out;
  const size_t stride = groups[0].struct_size;
  if (stride < offsetof(dtk_param_group, lr_scale) + sizeof(double))
    throw Error("parameter group struct_size " + std::to_string(stride) + " is too small", DTK_ERR_ABI);
  for (size_t g = 0; g < n; ++g) {
    const auto& group = *reinterpret_cast<const dtk_param_group*>(reinterpret_cast<const char*>(groups) + g * stride);
    for (size_t i = 0; i < group.count; ++i) {
      out[g].params.push_back(unwrap(group.params[i]));
      out[g].names.push_back(group.names ? group.names[i] : "p" + std::to_string(i));
    }
    out[g].weight_decay = group.weight_decay;
    out[g].lr_scale = group.lr_scale;
  }
  return out;
}

// Base class of a C++ optimizer plugin.
// Constructor: Class(const dtk::BuildContext&, std::vector<dtk::ParamGroup>).
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual void step(const dtk_optimizer_step_args& args) = 0;
  virtual TensorList state_save() = 0;
  virtual void state_load(const TensorList& state) = 0;
};

template <class T>
const dtk_optimizer_api* optimizer_api() {
  static const dtk_optimizer_api api = {
      sizeof(dtk_optimizer_api),
      [](const dtk_build_context* ctx, const dtk_param_group* groups, size_t n, dtk_optimizer** out) {
        return guard(
            [&] { *out = reinterpret_cast<dtk_optimizer*>(new T(BuildContext(ctx), from_groups(groups, n))); });
      },
      [](dtk_optimizer* o) { delete reinterpret_cast<T*>(o); },
      [](dtk_optimizer* o, const dtk_optimizer_step_args* args) {
        return guard([&] {
          dtk_optimizer_step_args a{sizeof(a), 0.0, 0, 1.0};
          std::memcpy(&a, args, std::min(args->struct_size, sizeof(a)));
          reinterpret_cast<T*>(o)->step(a);
        });
      },
      [](dtk_optimizer* o, const dtk_tensor_sink* out) {
        return guard([&] {
          for (auto& kv : reinterpret_cast<T*>(o)->state_save()) put(out, kv.first, kv.second);
        });
      },
      [](dtk_optimizer* o, const dtk_tensor_map* state) {
        return guard([&] { reinterpret_cast<T*>(o)->state_load(from_map(state)); });
      },
  };
  return &api;
}

// ------------------------------------------------------------------------------------------
// Strategy
// ------------------------------------------------------------------------------------------

// Base class of a C++ strategy plugin. Constructor: Class(const dtk::BuildContext&).
class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual void setup(const ModelHandle& model) = 0;
  virtual std::vector<Param> optimizer_params() = 0;
  virtual void before_backward(bool is_last) {}
  virtual void reduce_gradients() = 0;
  virtual double clip_and_norm(double max_norm) = 0;
  virtual void optimizer_step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args) {
    check(optimizer->api->step(optimizer->optimizer, &args));
  }
  virtual void zero_grad() = 0;
  virtual TensorList state_save() { return {}; }
  virtual void state_load(const TensorList& state) {}
};

template <class T>
const dtk_strategy_api* strategy_api() {
  static const dtk_strategy_api api = {
      sizeof(dtk_strategy_api),
      [](const dtk_build_context* ctx, dtk_strategy** out) {
        return guard([&] { *out = reinterpret_cast<dtk_strategy*>(new T(BuildContext(ctx))); });
      },
      [](dtk_strategy* s) { delete reinterpret_cast<T*>(s); },
      [](dtk_strategy* s, const dtk_model_ref* model) {
        return guard([&] { reinterpret_cast<T*>(s)->setup(ModelHandle(model)); });
      },
      [](dtk_strategy* s, const dtk_param_visitor* v) {
        dtk_status* st = nullptr;
        dtk_status* g = guard([&] { st = detail::visit_all(reinterpret_cast<T*>(s)->optimizer_params(), v); });
        return g ? g : st;
      },
      [](dtk_strategy* s, int32_t is_last) {
        return guard([&] { reinterpret_cast<T*>(s)->before_backward(is_last != 0); });
      },
      [](dtk_strategy* s) { return guard([&] { reinterpret_cast<T*>(s)->reduce_gradients(); }); },
      [](dtk_strategy* s, double max_norm, double* norm) {
        return guard([&] { *norm = reinterpret_cast<T*>(s)->clip_and_norm(max_norm); });
      },
      [](dtk_strategy* s, const dtk_optimizer_ref* opt, const dtk_optimizer_step_args* args) {
        return guard([&] {
          dtk_optimizer_step_args a{sizeof(a), 0.0, 0, 1.0};
          std::memcpy(&a, args, std::min(args->struct_size, sizeof(a)));
          reinterpret_cast<T*>(s)->optimizer_step(opt, a);
        });
      },
      [](dtk_strategy* s) { return guard([&] { reinterpret_cast<T*>(s)->zero_grad(); }); },
      [](dtk_strategy* s, const dtk_tensor_sink* out) {
        return guard([&] {
          for (auto& kv : reinterpret_cast<T*>(s)->state_save()) put(out, kv.first, kv.second);
        });
      },
      [](dtk_strategy* s, const dtk_tensor_map* state) {
        return guard([&] { reinterpret_cast<T*>(s)->state_load(from_map(state)); });
      },
  };
  return &api;
}

}  // namespace dtk
