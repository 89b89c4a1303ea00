// dtk/core/components/components.hpp — the named parts the pipeline is wired from. Each wraps one plugin
// object behind RAII and turns a plugin's error status into a HostError that names the plugin
// and the call, so the driver (pipeline.cpp) reads top to bottom.
#pragma once

#include <dtk/model.hpp>
#include <dtk/optimizer.hpp>
#include <dtk/pipeline_split.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtk/core/logging/step_metrics.hpp"
#include "dtk/core/optim/param_groups.hpp"
#include "dtk/host/plugin_host.hpp"

namespace dtk::core {

// Throws HostError "<kind> plugin '<name>': <call>: <message>" for a non-NULL status.
void check_plugin(dtk_status* s, const host::Plugin& plugin, const char* call);

// Whether a model built dtk_build_context's split of the layers (ABI 2.13's
// dtk_model_info.pipeline_split); one that did not builds the even split only.
inline bool builds_pipeline_split(const dtk_model_info& info) {
  return info.struct_size >= dtk_model_info_STRUCT_SIZE_2_13 && info.pipeline_split != 0;
}

class ModelInstance {
 public:
  // Creates the model, then moves it (the model's `to`) if a parameter is not on the context's
  // device or a floating-point one not of its params_dtype.
  ModelInstance(const host::Plugin& plugin, const dtk_build_context& ctx);
  // Several model chunks of one plugin, each created from its context (the interleaved pipeline
  // schedule: chunk k of pipeline rank r is virtual stage k x pp_size + r, built as that stage of
  // a virtual_size x pp_size stage pipeline). With more than one, every name the host and the
  // strategy see (parameters, buffers, state) reads "model<k>.<the chunk's own name>", after
  // Megatron's model0, model1 ... checkpoint keys; forwards go to the selected chunk.
  ModelInstance(const host::Plugin& plugin, const std::vector<dtk_build_context>& chunks);
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  // The chunk ref()'s forward, the forward watch and set_pipeline_input act on (0 at start).
  void select_chunk(int k);
  int selected_chunk() const { return selected_; }
  // "model<k>." with several chunks, "" with one: chunk k's names in checkpoints and to strategies.
  static std::string chunk_prefix(int64_t k, int64_t chunks);
  std::string chunk_prefix(int k) const { return chunk_prefix(k, num_chunks()); }
  // Chunk k's own reference (blaming; k < 0: the selected chunk).
  const dtk_model_ref* chunk_ref(int k = -1) const;
  ~ModelInstance();
  ModelInstance(const ModelInstance&) = delete;
  ModelInstance& operator=(const ModelInstance&) = delete;
  // The reference other plugins (steps, strategies) call the model through. It forwards every
  // call to the plugin and prefixes an error with "model plugin '<name>': <call>: ", so a failure
  // inside the model is blamed on the model and not only on the step that called it.
  const dtk_model_ref* ref() const { return chunks_.size() > 1 ? &composite_ref_ : &chunks_[0]->blaming_ref; }
  // Whether a forward through ref() since reset_forward_watch() returned a floating-point output
  // that requires grad, or had none (false: every such output was detached from the parameters).
  // True when no forward ran.
  void reset_forward_watch() { selected().outputs_attached = false, selected().forwards = 0; }
  bool outputs_attached() const { return selected().forwards == 0 || selected().outputs_attached; }
  // Pipeline parallelism (Megatron's set_input_tensor): a forward through ref() receives `t` as its
  // "hidden_states" input, the previous stage's output, whatever the step passed; undefined
  // (the default) passes the step's inputs unchanged.
  void set_pipeline_input(const at::Tensor& t) { selected().pipeline_input = t; }
  // The context behind ref(): what its forwarding table needs to reach the real model.
  struct Blaming {
    const dtk_model_api* api = nullptr;
    dtk_model* model = nullptr;
    std::string name;
    bool outputs_attached = true;
    int64_t forwards = 0;
    at::Tensor pipeline_input;
  };
  // Every chunk's parameters, each tensor once under one name (checked when the model is created).
  std::vector<Param> parameters() const;
  void set_training(bool training);
  dtk_model_info info() const;
  TensorList state_save() const;
  void state_load(const TensorList& state, bool strict);
  // Moves/casts parameters and buffers in place (dtype nullopt keeps each dtype).
  void to(at::Device device, std::optional<at::ScalarType> dtype);
  // The model's modules (ZeRO-3 units), in forward order.
  std::vector<Module> modules() const;
  // Installs per-module hooks on the model (nullptr removes them).
  void set_module_hooks(const dtk_module_hooks* hooks);
  const host::Plugin& plugin() const { return plugin_; }
  // How the layers split over the pipeline stages, as the chunks were asked to build them
  // (dtk_build_context's split; recorded in checkpoints).
  const PipelineSplit& split() const { return split_; }

  // One plugin model: the host calls it through the plugin's own table, other plugins through
  // the blaming one.
  struct Chunk {
    Chunk(const dtk_model_api* api, dtk_model* m) : model(m), api(api) {}
    ~Chunk() { api->destroy(model); }
    Chunk(const Chunk&) = delete;
    Chunk& operator=(const Chunk&) = delete;
    dtk_model* model;
    const dtk_model_api* api;
    Blaming blaming;
    dtk_model_ref blaming_ref{};
    // With several chunks, module indices run on over the chunks: this chunk's first module's,
    // and the hooks installed on it (a copy of the caller's table, which abi.h lets the caller
    // free after the call, and the table that shifts indices into it).
    int32_t module_offset = 0;
    dtk_module_hooks outer_hooks{};
    dtk_module_hooks shifted_hooks{};
  };
  // For the composite table (components.cpp): chunk k's module index offset and hook storage.
  Chunk& chunk(int k) const { return *chunks_[static_cast<size_t>(k)]; }

 private:
  void create_chunk(const dtk_build_context& ctx);
  void check_each_parameter_once() const;  // throws HostError naming the plugin
  Blaming& selected() { return chunks_[selected_]->blaming; }
  const Blaming& selected() const { return chunks_[selected_]->blaming; }
  const host::Plugin& plugin_;
  const dtk_model_api* api_;
  std::vector<std::unique_ptr<Chunk>> chunks_;  // stable addresses: the refs point into them
  int selected_ = 0;
  PipelineSplit split_;
  dtk_model_api blaming_api_{};
  // Several chunks: one table over all of them (composite_api), what strategies and steps get.
  dtk_model_api composite_api_{};
  dtk_model_ref composite_ref_{};
};

class StepInstance {
 public:
  StepInstance(const host::Plugin& plugin, const dtk_build_context& ctx);
  ~StepInstance();
  // Runs the step on one micro-batch; returns the loss and adds metrics into `metrics`. With a
  // `num_tokens` (train.calculate_per_token_loss) the step is asked for its summed loss (ABI 2.8)
  // and *num_tokens gets the count it returns: undefined where it returned none.
  at::Tensor forward_step(const ModelInstance& model, const TensorList& batch, StepMetrics* metrics,
                          at::Tensor* num_tokens = nullptr);

 private:
  const host::Plugin& plugin_;
  const dtk_step_api* api_;
  dtk_step* step_ = nullptr;
};

class OptimizerInstance {
 public:
  // Creates the optimizer over `params` in the groups of `groups` (param_groups.hpp), every group
  // passed in its fixed order, empty or not (abi.h).
  OptimizerInstance(const host::Plugin& plugin, const dtk_build_context& ctx, std::vector<Param> params,
                    const ParamGroups& groups);
  ~OptimizerInstance();
  const dtk_optimizer_ref* ref() const { return &ref_; }
  TensorList state_save() const;
  void state_load(const TensorList& state);
  // The tensors the optimizer steps, with their infos (shards under ZeRO): what checkpoints
  // re-partition optimizer state against.
  const std::vector<Param>& params() const { return params_; }
  const host::Plugin& plugin() const { return plugin_; }
  // The groups it was created with, in their order (each step's per-group rates follow them).
  const std::vector<GroupSpec>& group_specs() const { return specs_; }

 private:
  const host::Plugin& plugin_;
  const dtk_optimizer_api* api_;
  std::vector<Param> params_;
  std::vector<GroupSpec> specs_;
  dtk_optimizer_ref ref_{};
};

class StrategyInstance {
 public:
  StrategyInstance(const host::Plugin& plugin, const dtk_build_context& ctx);
  // Removes the module hooks it installed on the model before destroying the strategy.
  ~StrategyInstance();
  // Sets the strategy up over the model, then installs the strategy's module hooks (if any) on
  // it; a model that cannot fire them is refused naming both plugins.
  // Partitioned construction (ABI 2.4): the strategy initialises the parameters in setup, so the
  // model is created with deferred_parameters. Asked before the model exists.
  bool defers_parameters() const;
  void setup(ModelInstance& model);
  std::vector<Param> optimizer_params();
  // Before the backward of micro-batch `micro_batch` (0-based) of `num_micro_batches`.
  void before_backward(int64_t micro_batch, int64_t num_micro_batches);
  void reduce_gradients();
  double clip_and_norm(double max_norm);
  void optimizer_step(const OptimizerInstance& opt, const dtk_optimizer_step_args& args);
  void zero_grad();
  TensorList state_save() const;
  void state_load(const TensorList& state);
  // abi.h dtk_strategy_info (all zeros for a 2.0 strategy), read once after setup.
  const dtk_strategy_info& info() const { return info_; }
  // Whether it installed module hooks on the model (they run inside the model's forward and backward).
  bool hooks_model() const { return hooked_ != nullptr; }
  // Around reads and writes of the model's parameters outside a step (ZeRO-3); a no-op unless
  // info().partitions_parameters.
  void gather_parameters(bool whole);
  // The bytes the strategy holds now (zeros for a strategy that does not say).
  dtk_memory_usage memory_usage() const;
  const host::Plugin& plugin() const { return plugin_; }

 private:
  const host::Plugin& plugin_;
  const dtk_strategy_api* api_;
  dtk_strategy* strategy_ = nullptr;
  ModelInstance* hooked_ = nullptr;  // the model carrying this strategy's module hooks
  dtk_strategy_info info_{};
};

class DatasetInstance {
 public:
  DatasetInstance(const host::Plugin& plugin, const dtk_dataset_context& ctx);
  ~DatasetInstance();
  int64_t num_samples(int32_t split) const;
  int64_t vocab_size() const;
  // One sample: every buffer the dataset put, by name, copied into tensors (integer buffers
  // widened to int64). Called from the loader thread.
  TensorList get_sample(int32_t split, int64_t index) const;
  const host::Plugin& plugin() const { return plugin_; }

 private:
  const host::Plugin& plugin_;
  const dtk_dataset_api* api_;
  dtk_dataset* dataset_ = nullptr;
};

}  // namespace dtk::core
