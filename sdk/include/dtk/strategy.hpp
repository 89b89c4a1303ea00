// dtk/strategy.hpp — a parallel strategy plugin as an ordinary C++ class.
//
//   class MyStrategy : public dtk::Strategy { ... };  // constructor: (const dtk::BuildContext&)
//   DTK_PLUGIN("my_strategy", DTK_KIND_STRATEGY, "1.0.0", "What it is", DTK_TORCH_VERSION,
//              dtk::strategy_api<MyStrategy>(), kOptions)
#pragma once

#include <dtk/grad_norm.hpp>
#include <dtk/model.hpp>
#include <dtk/optimizer.hpp>

#include <vector>

namespace dtk {

// Base class of a C++ strategy plugin. Every method is [main-thread]; the hooks a strategy
// returns from module_hooks() are called as abi.h's dtk_module_hooks documents.
class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual void setup(const ModelHandle& model) = 0;
  virtual std::vector<Param> optimizer_params() = 0;
  // Before each micro-batch's backward (args.is_last: gradient reduction may overlap it).
  virtual void before_backward(const dtk_backward_args& args) { (void)args; }
  virtual void reduce_gradients() = 0;
  virtual double clip_and_norm(double max_norm) = 0;
  virtual void optimizer_step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args) {
    dtk::optimizer_step(optimizer, args);
  }
  virtual void zero_grad() = 0;
  virtual TensorList state_save() { return {}; }
  virtual void state_load(const TensorList& state) { (void)state; }
  // The per-module hooks this strategy needs installed on the model (ZeRO-3), or nullptr.
  // The table must stay valid as long as the strategy.
  virtual const dtk_module_hooks* module_hooks() { return nullptr; }
  // What the host must know about this strategy's state (abi.h dtk_strategy_info): sharded over
  // data-parallel ranks, parameters partitioned, optimizer on the host. Default: none of these.
  virtual dtk_strategy_info info() {
    dtk_strategy_info i{};
    i.struct_size = dtk_strategy_info_STRUCT_SIZE;
    return i;
  }
  // Only for strategies whose info() reports partitions_parameters (ZeRO-3).
  virtual void gather_parameters(bool whole) { (void)whole; }
  // Partitioned construction (ABI 2.4): true when setup initialises the parameters itself through
  // ModelHandle::init_parameters, so the host creates the model deferred. Asked before setup.
  virtual bool defers_parameters() { return false; }
  // The bytes held now, by kind (abi.h dtk_memory_usage). Default: unknown (zeros).
  virtual dtk_memory_usage memory_usage() {
    dtk_memory_usage u{};
    u.struct_size = dtk_memory_usage_STRUCT_SIZE;
    return u;
  }
};

template <class T>
const dtk_strategy_api* strategy_api() {
  static const dtk_strategy_api api = {
      dtk_strategy_api_STRUCT_SIZE,
      [](const dtk_build_context* ctx, dtk_strategy** out) {
        return guard([&] { *out = reinterpret_cast<dtk_strategy*>(new T(BuildContext(ctx))); });
      },
      [](dtk_strategy* s) { delete reinterpret_cast<T*>(s); },
      [](dtk_strategy* s, const dtk_model_ref* model) {
        return guard([&] { reinterpret_cast<T*>(s)->setup(ModelHandle(model)); });
      },
      [](dtk_strategy* s, const dtk_param_visitor* v) {
        return detail::guard_status([&] { return detail::visit_all(reinterpret_cast<T*>(s)->optimizer_params(), v); });
      },
      [](dtk_strategy* s, const dtk_backward_args* args) {
        return guard([&] {
          reinterpret_cast<T*>(s)->before_backward(
              read_struct(args, dtk_backward_args_STRUCT_SIZE_2_0, "before_backward args"));
        });
      },
      [](dtk_strategy* s) { return guard([&] { reinterpret_cast<T*>(s)->reduce_gradients(); }); },
      [](dtk_strategy* s, dtk_clip_args* args) {
        return guard([&] {
          const auto a = read_struct(args, dtk_clip_args_STRUCT_SIZE_2_0, "clip_and_norm args");
          args->norm = reinterpret_cast<T*>(s)->clip_and_norm(a.max_norm);
        });
      },
      [](dtk_strategy* s, const dtk_strategy_step_args* args) {
        return guard([&] {
          const auto a = read_struct(args, dtk_strategy_step_args_STRUCT_SIZE_2_0, "optimizer_step args");
          reinterpret_cast<T*>(s)->optimizer_step(
              a.optimizer, read_struct(a.step, dtk_optimizer_step_args_STRUCT_SIZE_2_0, "step args"));
        });
      },
      [](dtk_strategy* s) { return guard([&] { reinterpret_cast<T*>(s)->zero_grad(); }); },
      [](dtk_strategy* s, const dtk_tensor_sink* out) {
        return guard([&] { put_all(out, reinterpret_cast<T*>(s)->state_save()); });
      },
      [](dtk_strategy* s, const dtk_tensor_map* state) {
        return guard([&] { reinterpret_cast<T*>(s)->state_load(from_map(state)); });
      },
      [](dtk_strategy* s, const dtk_module_hooks** out) {
        return guard([&] { *out = reinterpret_cast<T*>(s)->module_hooks(); });
      },
      [](dtk_strategy* s, dtk_strategy_info* info) {
        return guard([&] {
          dtk_strategy_info mine = reinterpret_cast<T*>(s)->info();
          mine.struct_size = dtk_strategy_info_STRUCT_SIZE;
          write_struct(info, mine);
        });
      },
      [](dtk_strategy* s, int32_t whole) { return guard([&] { reinterpret_cast<T*>(s)->gather_parameters(whole != 0); }); },
      [](dtk_strategy* s, dtk_memory_usage* usage) {
        return guard([&] {
          dtk_memory_usage mine = reinterpret_cast<T*>(s)->memory_usage();
          mine.struct_size = dtk_memory_usage_STRUCT_SIZE;
          write_struct(usage, mine);
        });
      },
      [](dtk_strategy* s, int32_t* deferred) {
        return guard([&] { *deferred = reinterpret_cast<T*>(s)->defers_parameters() ? 1 : 0; });
      },
  };
  return &api;
}

}  // namespace dtk
