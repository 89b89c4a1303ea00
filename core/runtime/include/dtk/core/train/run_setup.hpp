// dtk/core/train/run_setup.hpp — everything a run builds before its first iteration, in the
// order of Megatron's pretrain(): initialize (config checks, process groups, threads, seed,
// device, memory budget), the run's plugins with their options, setup_model_and_optimizer (the
// model chunks of this rank, the strategy wrapping them, the optimizer over the strategy's
// parameters, one step per chunk), the checks every rank makes before any work (output paths,
// memory), and the dataset with its train iterator.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtk/core/components/components.hpp"
#include "dtk/core/optim/lr_schedule.hpp"
#include "dtk/core/perf/flops.hpp"
#include "dtk/core/train/batch_loader.hpp"
#include "dtk/core/train/batch_plan.hpp"
#include "dtk/core/train/sample_order.hpp"
#include "dtk/host/plugin_host.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

// Megatron's initialize_megatron for this process. Returns the topology of the run.
const Topology& initialize(const config::RunConfig& cfg, const host::PluginHost& plugins);

// A plugin of the run and its validated options (alive as long as the objects built with them;
// never copied: the option values point into themselves).
struct PluginSlot {
  const host::Plugin& plugin;
  host::OptionValues options;
  // A constructor, not aggregate initialisation: C++20 (LibTorch 2.12+ builds) has no aggregates
  // with user-declared constructors, and the deleted copy is one.
  PluginSlot(const host::Plugin& plugin, host::OptionValues options) : plugin(plugin), options(std::move(options)) {}
  PluginSlot(const PluginSlot&) = delete;
  PluginSlot& operator=(const PluginSlot&) = delete;
  std::string name() const { return plugin.name(); }
};
PluginSlot resolve_plugin(host::PluginHost& plugins, int32_t kind, const config::PluginChoice& choice);

struct RunPlugins {
  PluginSlot model, data, step, optimizer, strategy;
};
RunPlugins resolve_plugins(host::PluginHost& plugins, const config::RunConfig& cfg);
// Whether the optimizer gets each update's Adam betas from the schedule (OneCycle's
// cycle_momentum, for an optimizer whose options include beta1; refused for a plugin built before
// ABI 2.14); `note` is the start-up line that says what happens, "" when nothing cycles.
bool hands_optimizer_betas(const LrParams& schedule, const RunPlugins& plugins, std::string& note);
// "plugin.<kind>=<name> <version> (ABI M.m)" of each slot (what every rank must agree on, with
// the config; recorded in checkpoints).
std::vector<std::string> plugin_lines(const config::RunConfig& cfg, const host::PluginHost& plugins);

// Model chunks per pipeline rank (distributed.virtual_pipeline_model_parallel_size; 1 = 1F1B).
int virtual_stages(const config::RunConfig& cfg);
// The run's split of the layers over the stages of its (virtual) pipeline (distributed.*:
// dtk/pipeline_split.hpp): pipeline ranks x model chunks stages.
PipelineSplit run_pipeline_split(const config::RunConfig& cfg, const Topology& topo);

// The context a plugin is created with. `chunk` >= 0: model chunk `chunk` of the interleaved
// schedule, built as virtual stage chunk x pp_size + pp_rank of virtual_stages() x pp_size.
dtk_build_context build_context(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                                const PluginSlot& slot, int chunk = -1);

// What trains: the model chunks, the strategy, the optimizer, a step per chunk.
// Destroyed in reverse: the strategy goes before the optimizer (an optimizer step the strategy
// left running, ZeRO's delayed_param_update, still uses the optimizer until the strategy's
// destructor waited for it), and before the model (whose hooks point into it).
struct TrainingParts {
  std::unique_ptr<ModelInstance> model;
  std::unique_ptr<OptimizerInstance> optimizer;
  std::unique_ptr<StrategyInstance> strategy;
  std::vector<std::unique_ptr<StepInstance>> steps;
  ModelStats stats;  // counted before the strategy wraps the model (ZeRO-3 partitions it)
};
// Megatron's setup_model_and_optimizer; prints the model and its parameter count.
TrainingParts setup_model_and_optimizer(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                                        const RunPlugins& plugins, const LearningRateSchedule& schedule);

// Where the run will write, checked before any work (an unwritable checkpoint.save used to be
// found at the first save, after the training it was meant to keep).
void check_output_paths(const config::RunConfig& cfg);
// The memory estimate (memory/memory_estimate.hpp) against this rank's budget; throws when over.
void check_run_memory(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                      const TrainingParts& parts);

// Megatron's build_train_valid_test_data_iterators: the dataset serves every split's samples for
// the whole run (rank 0 builds it first: that is where index caches get written).
std::unique_ptr<DatasetInstance> build_dataset(const config::RunConfig& cfg, const Topology& topo,
                                               const BatchPlan& plan, const PluginSlot& data,
                                               const ModelInstance& model);
// eval.validation_sets (Megatron's --multiple-validation-sets): each set's name (its position
// when unnamed, as Megatron's without --validation-set-names) and the dataset plugin with the
// set's options over the run's. Throws HostError for a name given twice or not one word, and for
// an option the plugin does not have.
struct ValidationSetSpec {
  std::string name;
  std::unique_ptr<PluginSlot> data;
};
std::vector<ValidationSetSpec> resolve_validation_sets(const config::RunConfig& cfg, const PluginSlot& data);
// One validation set's dataset: its validation split alone, read whole.
std::unique_ptr<DatasetInstance> build_validation_set(const config::RunConfig& cfg, const Topology& topo,
                                                      const BatchPlan& plan, const ValidationSetSpec& set,
                                                      const ModelInstance& model);
// The train iterator from `first_iteration` on (after what a resumed run consumed), in the order
// of train.dataloader_type.
std::unique_ptr<BatchLoader> make_train_loader(const DatasetInstance& data, const BatchPlan& plan,
                                               const config::TrainingConfig& t, const Topology& topo,
                                               int64_t first_iteration);

}  // namespace dtk::core
