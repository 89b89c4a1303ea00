#include "dtk/core/train/run_setup.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <fcntl.h>
#include <glog/logging.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "../device/cuda_glue.hpp"
#include "dtk/core/checkpoint/checkpoint.hpp"
#include "dtk/core/comm/comm.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/core/launch/distributed.hpp"
#include "dtk/core/launch/run_agreement.hpp"
#include "dtk/core/memory/memory.hpp"
#include "dtk/core/memory/memory_estimate.hpp"
#include "dtk/core/optim/param_groups.hpp"
#include "dtk/core/train/schedule.hpp"

namespace dtk::core {

using host::HostError;

namespace {

// " of 128 channels" where a head's width is not hidden_size / heads (kv_channels, ABI 2.15).
std::string head_width(const dtk_model_info& info) {
  if (info.num_attention_heads <= 0 || attention_width(info) == info.hidden_size) return "";
  return " of " + std::to_string(info.kv_channels) + " channels";
}

int32_t dtype_code(const std::string& s) {
  if (s == "bf16") return DTK_DTYPE_BFLOAT16;
  if (s == "fp16") return DTK_DTYPE_FLOAT16;
  return DTK_DTYPE_FLOAT32;
}

// Ranks of this machine (torchrun's LOCAL_WORLD_SIZE; 1 without it).
int local_ranks() {
  const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
  return local_world ? std::max(1, std::atoi(local_world)) : 1;
}

// Intra-op threads, seed, the memory accounting and the device budget: train.memory_limit_mb,
// else (CPU) this machine's memory shared by the ranks on it, so an absurd size fails with one
// line instead of growing until the kernel kills it. On a GPU train.memory_limit_mb caps
// LibTorch's caching allocator (a smaller GPU, for capacity measurements), else the budget is the
// memory estimate's against the GPU (and CUDA's own out-of-memory error); host memory is counted,
// not budgeted.
void initialize_runtime(const config::TrainingConfig& train) {
  // Default: the cores shared among the ranks of this machine (N ranks x all cores would
  // oversubscribe the CPU N-fold).
  const int threads = train.threads() > 0
                          ? train.threads()
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / local_ranks());
  at::set_num_threads(std::max(1, threads));
  at::manual_seed(train.seed());
  memory::install();  // count tensor bytes from here on
#if DTK_HAVE_CUDA
  if (const c10::Device device = training_device(); device.is_cuda()) {
    cuda_glue::use_gpu_memory_pool(device.index());
    if (train.memory_limit_mb() > 0) cuda_glue::cap_gpu_memory(device.index(), train.memory_limit_mb());
  }
#endif
  if (train.memory_limit_mb() > 0 && !training_device().is_cuda())
    memory::set_device_limit(train.memory_limit_mb() * (int64_t{1} << 20));
  else
    memory::set_device_limit(memory::machine_memory_bytes() / local_ranks(), /*machine=*/true);
}

// What reaches the optimizer through a field of dtk_optimizer_step_args appended in ABI 2.`minor`,
// passed on by the strategy, needs both built for that minor: an older one would silently ignore
// it (a weight-decay schedule, 2.2: the end value throughout; per-group rates, 2.8: lr x lr_scale).
void require_minor(uint32_t minor, const std::string& setting, const PluginSlot& slot) {
  const dtk_plugin_entry* e = slot.plugin.entry;
  if (e->abi_major == DTK_ABI_MAJOR && e->abi_minor < minor)
    throw HostError("config: " + setting + " needs " + host::kind_name(e->kind) + " plugin '" + slot.name() +
                    "' built for DTK ABI 2." + std::to_string(minor) + " or later (it is " +
                    std::to_string(e->abi_major) + "." + std::to_string(e->abi_minor) +
                    "; rebuild it against this SDK)");
}
void require_step_args_minor(uint32_t minor, const std::string& setting, const RunPlugins& plugins) {
  for (const PluginSlot* slot : {&plugins.optimizer, &plugins.strategy}) require_minor(minor, setting, *slot);
}

// train.calculate_per_token_loss asks the step for its summed loss (ABI 2.8, refused before any
// work with an older step) and divides the gradients by tokens / dp, which assumes the strategy
// averages them over the data-parallel ranks (summed, they would be dp times Megatron's).
// eval.full_validation, before anything is built: a step that sums its loss, a dataset that
// builds a split whole (the step's token count itself is checked at the first evaluation).
// eval.validation_sets need full validation, as Megatron's --multiple-validation-sets needs
// --full-validation (each set is read whole; there is no position in several sets to keep).
void check_full_validation(const config::RunConfig& cfg, const RunPlugins& plugins) {
  if (cfg.eval().validation_sets_size() > 0 && !cfg.eval().full_validation())
    throw HostError(
        "config: eval.validation_sets (Megatron's --multiple-validation-sets) needs eval.full_validation=true "
        "(--full-validation): each set is read whole");
  if (!cfg.eval().full_validation()) return;
  require_minor(8, "eval.full_validation (the loss over every token of a split)", plugins.step);
  require_minor(17, "eval.full_validation (a split read whole)", plugins.data);
  resolve_validation_sets(cfg, plugins.data);  // names and options, before anything is built
}

// distributed.cp_comm_type as dtk_build_context.cp_comm_type (validated: a2a, all_gather or empty).
int32_t cp_comm_type(const config::RunConfig& cfg) {
  return cfg.distributed().cp_comm_type() == "all_gather" ? DTK_CP_COMM_ALL_GATHER : DTK_CP_COMM_A2A;
}

// Context parallelism: the step splits each sequence (dtk_build_context.cp_size, ABI 2.20); one
// built before would hand the model whole sequences.
void check_context_parallel_step(const config::RunConfig& cfg, const RunPlugins& plugins) {
  if (cfg.distributed().context_parallel_size() > 1)
    require_minor(20, "distributed.context_parallel_size", plugins.step);
}

void check_per_token_loss(const config::RunConfig& cfg, const RunPlugins& plugins) {
  if (!cfg.train().calculate_per_token_loss()) return;
  require_minor(8, "train.calculate_per_token_loss", plugins.step);
  const auto& options = cfg.strategy().options();
  const auto it = options.find("average_gradients");
  if (it != options.end() && (it->second == "false" || it->second == "0" || it->second == "False"))
    throw HostError(
        "config: train.calculate_per_token_loss divides the gradients by the global batch's tokens; "
        "strategy.average_gradients=false would make them data-parallel-size times that: drop one");
}

// Every schedule size of the run (each iteration size of a ramp-up) must suit the schedule.
void check_schedule_fits(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan) {
  const int v = virtual_stages(cfg);
  if (const std::string refusal = schedule_refusal(v, topo.pp_size, plan.micro_batches_per_step()); !refusal.empty())
    throw HostError(refusal + (plan.steps_batch() ? " (validation's and test's batch: micro_batch_size x data-parallel "
                                                    "size under train.step_batch_size_schedule)"
                                                  : ""));
  for (int64_t i = 1; plan.ramps_up() && i <= std::min(plan.ramp_iterations() + 1, plan.train_iters()); ++i)
    if (const std::string refusal = schedule_refusal(v, topo.pp_size, plan.micro_batches_of(i)); !refusal.empty())
      throw HostError(refusal +
                      (plan.steps_batch() ? " (train.step_batch_size_schedule" : " (train.rampup_batch_size") +
                      ", iteration " + std::to_string(i) + ")");
}

// The layers of this pipeline rank's chunks (chunk k is stage k x pp + rank), as `split` gives
// them; none for a split that does not hold `layers` (a model that built what it chose).
std::vector<StageLayers> rank_chunk_layers(const PipelineSplit& split, int64_t layers, const Topology& topo) {
  std::vector<StageLayers> out;
  if (!pipeline_split_refusal(split, layers).empty()) return out;
  const std::vector<StageLayers> stages = pipeline_stage_layers(split, layers);
  for (int k = 0; k < split.chunks; ++k) out.push_back(stages.at(static_cast<size_t>(k * topo.pp_size + topo.pp_rank)));
  return out;
}

// Which layers this pipeline rank holds ("layers 0-3 of 6", a range per model chunk), and the split
// when it is not the even one: where an uneven split put them.
void print_stage_layers(const std::string& who, const Topology& topo, const ModelInstance& model) {
  const PipelineSplit& split = model.split();
  const int64_t layers = model.info().num_layers;
  const std::vector<StageLayers> chunks = rank_chunk_layers(split, layers, topo);
  if (chunks.empty()) return;
  std::string held;
  int64_t count = 0;
  for (const StageLayers& s : chunks) {
    const std::string range = s.count == 0   ? std::string("none")
                              : s.count == 1 ? std::to_string(s.offset)
                                             : std::to_string(s.offset) + "-" + std::to_string(s.offset + s.count - 1);
    held += (held.empty() ? "" : ", ") + range;
    count += s.count;
  }
  const std::string what = count == 0 ? "none of the " + std::to_string(layers) + " layers"
                                      : (count == 1 ? "layer " : "layers ") + held + " of " + std::to_string(layers);
  std::printf("%s > pipeline rank %d holds %s (%s)\n", who.c_str(), topo.pp_rank, what.c_str(),
              describe_pipeline_split(split).c_str());
}

// As Megatron: every first data-parallel rank reports its shard (the line names the rank); the
// optimizer groups by the model's own parameters (a ZeRO shard list would show this rank's part).
void print_model(const Topology& topo, const TrainingParts& parts, const ParamGroups& groups) {
  // (Under expert parallelism each expert-parallel rank holds other experts: each says its count.)
  if (topo.edp_rank() == 0) {
    const std::string who = topo.world_size > 1 ? "[rank " + std::to_string(topo.world_rank) + "]" : "";
    const std::string experts = topo.ep_size > 1 ? ", expert-parallel rank " + std::to_string(topo.ep_rank()) + " of " +
                                                       std::to_string(topo.ep_size)
                                                 : "";
    std::printf("%s > number of parameters on (tensor, pipeline) model parallel rank (%d, %d)%s: %lld\n", who.c_str(),
                topo.tp_rank, topo.pp_rank, experts.c_str(), static_cast<long long>(parts.stats.num_parameters));
    if (topo.pp_size > 1 && topo.tp_rank == 0) print_stage_layers(who, topo, *parts.model);
    std::fflush(stdout);
  }
  if (topo.world_rank == 0)
    for (const auto& line : groups.describe(parts.model->parameters())) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// Rank 0 builds the dataset first; then a bounded world collective tells every other rank
// whether it succeeded, so they neither race rank 0 on the caches nor wait for files that a
// failed rank 0 will never write.
std::unique_ptr<DatasetInstance> build_dataset_rank0_first(const host::Plugin& plugin, const dtk_dataset_context& ctx,
                                                           const Topology& topo) {
  if (topo.world_size == 1) return std::make_unique<DatasetInstance>(plugin, ctx);
  std::unique_ptr<DatasetInstance> data;
  std::string error;
  if (topo.world_rank == 0) {
    try {
      data = std::make_unique<DatasetInstance>(plugin, ctx);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  agree(error, topo, "waiting for rank 0 to build the dataset",
        "dataset plugin '" + plugin.name() + "': rank 0 failed to build the dataset (its error is above)");
  if (!data) data = std::make_unique<DatasetInstance>(plugin, ctx);
  return data;
}

}  // namespace

// OneCycle's momentum cycling reaches an optimizer with Adam's betas (its options include beta1)
// through dtk_optimizer_step_args.has_betas (ABI 2.14). DeepSpeed skips it, with a warning, for an
// optimizer whose defaults hold no betas; so does DTK, with a line saying so.
bool hands_optimizer_betas(const LrParams& schedule, const RunPlugins& plugins, std::string& note) {
  note.clear();
  if (!cycles_momentum(schedule)) return false;
  bool has_betas = false;
  for (const dtk_option_spec* spec : plugins.optimizer.plugin.options())
    has_betas = has_betas || std::string(spec->name) == "beta1";
  if (!has_betas) {
    note = " > lr.cycle_momentum does nothing: optimizer '" + plugins.optimizer.name() +
           "' has no Adam betas (DeepSpeed's OneCycle skips it too)";
    return false;
  }
  require_step_args_minor(14, "lr.lr_decay_style=OneCycle with lr.cycle_momentum (Adam's betas per update)", plugins);
  char text[256];
  std::snprintf(text, sizeof text,
                " > lr: OneCycle cycles beta1 from %g to %g and back against the rate, with beta2 0.99 (DeepSpeed's "
                "OneCycle sets it; optimizer.beta1/beta2 are not used)",
                schedule.cycle.max_mom, schedule.cycle.min_mom);
  note = text;
  return true;
}

const Topology& initialize(const config::RunConfig& cfg, const host::PluginHost& plugins) {
  validate_config(cfg);
  set_run_config(cfg);
  // The device first: NCCL's communicators are created on it.
  select_training_device(cfg.train().device(), launch_env_from_environment().local_rank);
  // Rendezvous and process groups (a no-op for a single process); the ranks first compare what
  // they will run (run_agreement.hpp).
  init_distributed(cfg, describe_run(cfg, plugin_lines(cfg, plugins)));
  const Topology& topo = topology();
  // Megatron prints from one rank: the others log nothing but errors.
  if (topo.world_rank != 0) FLAGS_minloglevel = google::GLOG_ERROR;
  initialize_runtime(cfg.train());
  return topo;
}

PluginSlot resolve_plugin(host::PluginHost& plugins, int32_t kind, const config::PluginChoice& choice) {
  const host::Plugin& plugin = plugins.get(kind, choice.name());
  const std::map<std::string, std::string> user(choice.options().begin(), choice.options().end());
  return PluginSlot{plugin, host::OptionValues(host::resolve_options(plugin, user))};
}

RunPlugins resolve_plugins(host::PluginHost& plugins, const config::RunConfig& cfg) {
  return RunPlugins{
      resolve_plugin(plugins, DTK_KIND_MODEL, cfg.model()), resolve_plugin(plugins, DTK_KIND_DATASET, cfg.dataset()),
      resolve_plugin(plugins, DTK_KIND_STEP, cfg.step()), resolve_plugin(plugins, DTK_KIND_OPTIMIZER, cfg.optimizer()),
      resolve_plugin(plugins, DTK_KIND_STRATEGY, cfg.strategy())};
}

std::vector<std::string> plugin_lines(const config::RunConfig& cfg, const host::PluginHost& plugins) {
  std::vector<std::string> lines;
  const std::pair<int32_t, const config::PluginChoice*> slots[] = {{DTK_KIND_MODEL, &cfg.model()},
                                                                   {DTK_KIND_DATASET, &cfg.dataset()},
                                                                   {DTK_KIND_STEP, &cfg.step()},
                                                                   {DTK_KIND_OPTIMIZER, &cfg.optimizer()},
                                                                   {DTK_KIND_STRATEGY, &cfg.strategy()}};
  for (const auto& [kind, choice] : slots) {
    const dtk_plugin_entry* e = plugins.get(kind, choice->name()).entry;
    lines.push_back(std::string("plugin.") + host::kind_name(kind) + "=" + e->name + " " + e->version + " (ABI " +
                    std::to_string(e->abi_major) + "." + std::to_string(e->abi_minor) + ")");
  }
  return lines;
}

int virtual_stages(const config::RunConfig& cfg) {
  return std::max(1, cfg.distributed().virtual_pipeline_model_parallel_size());
}

// Sequence parallelism splits the sequence over the tensor-parallel ranks: nothing to split at 1.
bool sequence_parallel(const config::RunConfig& cfg, const Topology& topo) {
  return cfg.distributed().sequence_parallel() && topo.tp_size > 1;
}

// The run's split of the layers over the stages of its (virtual) pipeline.
PipelineSplit run_pipeline_split(const config::RunConfig& cfg, const Topology& topo) {
  const auto& d = cfg.distributed();
  PipelineSplit s;
  s.chunks = virtual_stages(cfg), s.stages = s.chunks * std::max(1, topo.pp_size);
  s.first_stage_layers = d.decoder_first_pipeline_num_layers();
  s.last_stage_layers = d.decoder_last_pipeline_num_layers();
  s.embedding_in_split = d.account_for_embedding_in_pipeline_split();
  s.loss_in_split = d.account_for_loss_in_pipeline_split();
  return s;
}

dtk_build_context build_context(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                                const PluginSlot& slot, int chunk) {
  dtk_build_context c{};
  c.struct_size = dtk_build_context_STRUCT_SIZE;
  c.options = slot.options.get();
  c.device = dtk::from_device(training_device());
  c.params_dtype = dtype_code(cfg.train().params_dtype());
  c.tp_rank = topo.tp_rank, c.tp_size = topo.tp_size;
  c.pp_rank = topo.pp_rank, c.pp_size = topo.pp_size;
  // A chunk of the interleaved schedule is a stage of the virtual pipeline: its layers, whether it
  // holds the embedding or the output layer, follow from its place there (Megatron's virtual rank).
  if (chunk >= 0) c.pp_rank = chunk * topo.pp_size + topo.pp_rank, c.pp_size = virtual_stages(cfg) * topo.pp_size;
  c.dp_rank = topo.dp_rank, c.dp_size = topo.dp_size;
  c.pre_process = c.pp_rank == 0;
  c.post_process = c.pp_rank == c.pp_size - 1;
  c.seq_length = plan.seq_length();
  c.micro_batch_size = plan.micro_batch_size();
  c.seed = cfg.train().seed();
  c.sequence_parallel = sequence_parallel(cfg, topo) ? 1 : 0;
  c.ep_rank = topo.ep_rank(), c.ep_size = topo.ep_size;  // (0 and 1 without expert parallelism)
  c.cp_rank = topo.cp_rank(), c.cp_size = topo.cp_size;  // (0 and 1 without context parallelism)
  c.cp_comm_type = topo.cp_size > 1 ? cp_comm_type(cfg) : DTK_CP_COMM_A2A;
  PipelineSplit split = run_pipeline_split(cfg, topo);
  if (chunk < 0) split.chunks = 1;  // a context for the pipeline rank, not one of its chunks
  dtk::put_pipeline_split(split, c);
  return c;
}

// This rank's memory budget and whose it is: train.memory_limit_mb, else the GPU's memory, else
// this machine's shared by the ranks on it.
struct MemoryBudget {
  int64_t bytes = 0;
  std::string whose;
};
MemoryBudget memory_budget(const config::TrainingConfig& t) {
  const c10::Device device = training_device();
  if (t.memory_limit_mb() > 0) return {t.memory_limit_mb() * (int64_t{1} << 20), "of train.memory_limit_mb"};
  if (device.is_cuda()) return {cuda_device_memory_bytes(device), "of " + device.str()};
  return {memory::machine_memory_bytes() / local_ranks(),
          "this machine has for each of its " + std::to_string(local_ranks()) + " rank(s)"};
}

// The parameters a model will hold on this rank (each listed once: ModelInstance checks it): their
// shapes and dtypes, which a model created without values (placeholders) already has.
int64_t parameter_bytes(const std::vector<Param>& params) {
  int64_t bytes = 0;
  for (const Param& p : params) bytes += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
  return bytes;
}

// The model's and the run's part of the memory estimate (activations, logits, batches); the
// strategy's part (what it holds, the optimizer's elements) is check_run_memory's.
MemoryEstimateInputs run_memory_inputs(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                                       const dtk_model_info& info) {
  const auto& t = cfg.train();
  MemoryEstimateInputs in;
  in.seq_length = plan.seq_length(), in.micro_batch_size = plan.micro_batch_size();
  in.hidden_size = info.hidden_size, in.num_attention_heads = info.num_attention_heads;
  in.attention_width = attention_width(info);
  in.num_layers = info.num_layers, in.vocab_size = info.vocab_size, in.recompute = info.recompute != 0;
  // Selective: the sub-layers the model says; a recomputed MLP counts where the model's layers are
  // of its kind (MoE or dense).
  const int32_t modules = selective_recompute_modules(info);
  in.selective_recompute = (modules & DTK_RECOMPUTE_CORE_ATTENTION) != 0,
  in.recompute_block = info.recompute_method == 1;
  in.recompute_mlp = (modules & (info.num_experts > 0 ? DTK_RECOMPUTE_MOE : DTK_RECOMPUTE_MLP)) != 0;
  in.recompute_num_layers = std::max(1, info.recompute_num_layers), in.sequence_parallel = info.sequence_parallel != 0;
  in.dtype_bytes = t.params_dtype() == "fp32" ? 4.0 : 2.0;
  in.tp_size = topo.tp_size, in.pp_size = topo.pp_size, in.pp_rank = topo.pp_rank, in.cp_size = topo.cp_size;
  in.cp_gathers_keys = topo.cp_size > 1 && cp_comm_type(cfg) == DTK_CP_COMM_ALL_GATHER;
  in.virtual_stages = virtual_stages(cfg), in.micro_batches_per_step = plan.most_micro_batches();
  // This rank's chunks' layers, as the split gives them (a split the model refuses: the even share).
  const std::vector<StageLayers> chunks = rank_chunk_layers(run_pipeline_split(cfg, topo), info.num_layers, topo);
  if (!chunks.empty()) in.rank_layers = 0;
  for (const StageLayers& chunk : chunks) in.rank_layers += chunk.count;
  in.on_gpu = training_device().is_cuda();
  in.device_budget = t.memory_limit_mb() > 0 || in.on_gpu;
  return in;
}

// Before the model's values exist: its parameters and the run's activations alone, a lower bound
// of check_run_memory's estimate (no gradients, masters or optimizer state yet, which depend on the
// strategy), against the budget. "" when they fit.
std::string early_memory_refusal(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                                 const std::string& model, const dtk_model_info& info, int64_t bytes) {
  const MemoryBudget budget = memory_budget(cfg.train());
  if (budget.bytes <= 0) return "";
  auto mb = [](double b) { return std::to_string(static_cast<int64_t>(b / (1 << 20))) + " MB"; };
  const std::string over = ", more than the " + mb(static_cast<double>(budget.bytes)) + " " + budget.whose + ": ";
  if (bytes > budget.bytes)
    return "config: model plugin '" + model + "' would hold " + mb(static_cast<double>(bytes)) +
           " of parameters on this rank before gradients, optimizer state or activations" + over +
           "a smaller model, more tensor or pipeline parallel ranks, or --strategy zero (stage 3, offload), or set "
           "train.skip_memory_check=true";
  MemoryEstimateInputs in = run_memory_inputs(cfg, topo, plan, info);
  in.parameter_bytes = bytes;
  return memory_refusal(estimate_memory(in), budget.bytes, budget.whose, /*lower_bound=*/true);
}

// Creates the model. Under a strategy that does not initialise the parameters itself the model
// exists whole on this rank, and an absurd size used to spend minutes drawing initial values until
// an allocation failed: a model that can defer its parameters (every SDK model) is first created
// without values, in a moment, and its parameters alone are checked against the budget
// (check_run_memory checks the whole run once the model exists). A model that ignores the flag
// has been built whole by then and is the one kept; so is the global CPU generator's state, which
// a model's construction might draw from.
std::unique_ptr<ModelInstance> create_model(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                                            const PluginSlot& slot, std::vector<dtk_build_context> chunks,
                                            bool strategy_defers) {
  auto create = [&](bool deferred) {
    for (dtk_build_context& c : chunks) c.deferred_parameters = deferred ? 1 : 0;
    return std::make_unique<ModelInstance>(slot.plugin, chunks);
  };
  if (strategy_defers || cfg.train().skip_memory_check()) return create(strategy_defers);
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  const at::Tensor rng_state = [&] {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    return cpu.get_state();
  }();
  std::unique_ptr<ModelInstance> probe = create(true);
  const dtk_model_info info = probe->info();
  if (info.struct_size < dtk_model_info_STRUCT_SIZE_2_4 || !info.deferred_parameters) {
    // Every rank reaches the agreement below once, even if a plugin defers on some stages only.
    agree("", topo, "checking the model's size");
    return probe;
  }
  const int64_t bytes = parameter_bytes(probe->parameters());
  probe.reset();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(rng_state);
  }
  const std::string error = early_memory_refusal(cfg, topo, plan, slot.name(), info, bytes);
  agree(error, topo, "checking the model's size");  // pipeline stages differ: all fail together
  return create(false);
}

// Expert parallelism needs a model that keeps only its share of the experts (ABI 2.12) ...
static void require_expert_parallel_model(const dtk_model_info& info, const std::string& model) {
  if (info.struct_size < dtk_model_info_STRUCT_SIZE_2_9 || info.num_experts == 0)
    throw HostError(
        "distributed.expert_model_parallel_size splits the experts of mixture-of-experts layers, and model '" + model +
        "' has none (set model.num_experts, or expert_model_parallel_size=1)");
  if (info.struct_size < dtk_model_info_STRUCT_SIZE_2_12 || info.expert_parallel == 0)
    throw HostError("model plugin '" + model +
                    "' does not run expert parallelism (its dtk_model_info.expert_parallel is 0): build its MoE layers "
                    "with the SDK's dtk::layers::MoeMlp (docs/plugin-guide.md) or set "
                    "distributed.expert_model_parallel_size=1");
}

// ... and a strategy that reduces their gradients over the ranks holding the same experts.
static void require_expert_parallel_strategy(const StrategyInstance& strategy, const std::string& name) {
  const dtk_strategy_info& s = strategy.info();
  if (s.struct_size < dtk_strategy_info_STRUCT_SIZE_2_12 || s.expert_parallel == 0)
    throw HostError("strategy '" + name +
                    "' does not run expert parallelism (its dtk_strategy_info.expert_parallel is 0: it would average "
                    "the experts' gradients over ranks that hold other experts); use strategy ddp or zero, or set "
                    "distributed.expert_model_parallel_size=1");
}

TrainingParts setup_model_and_optimizer(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                                        const RunPlugins& plugins, const LearningRateSchedule& schedule) {
  check_schedule_fits(cfg, topo, plan);
  check_per_token_loss(cfg, plugins);
  check_context_parallel_step(cfg, plugins);
  check_full_validation(cfg, plugins);
  const int v = virtual_stages(cfg);
  TrainingParts parts;
  // The strategy first: one that initialises the parameters itself (ZeRO-3's partitioned
  // construction) has the model created without their values.
  parts.strategy =
      std::make_unique<StrategyInstance>(plugins.strategy.plugin, build_context(cfg, topo, plan, plugins.strategy));
  std::vector<dtk_build_context> chunks;
  for (int k = 0; k < v; ++k) chunks.push_back(build_context(cfg, topo, plan, plugins.model, v > 1 ? k : -1));
  parts.model = create_model(cfg, topo, plan, plugins.model, std::move(chunks), parts.strategy->defers_parameters());
  const dtk_model_info info = parts.model->info();
  if (sequence_parallel(cfg, topo) && info.sequence_parallel == 0)
    throw HostError("model plugin '" + plugins.model.name() +
                    "' does not run sequence parallelism (its dtk_model_info.sequence_parallel is 0): build its layers "
                    "with the SDK's tensor-parallel layers (docs/plugin-guide.md) or set "
                    "distributed.sequence_parallel=false");
  if (topo.ep_size > 1) require_expert_parallel_model(info, plugins.model.name());
  if (topo.cp_size > 1 && (info.struct_size < dtk_model_info_STRUCT_SIZE_2_20 || info.context_parallel == 0))
    throw HostError("model plugin '" + plugins.model.name() +
                    "' does not run context parallelism (its dtk_model_info.context_parallel is 0): build it on the "
                    "SDK's dtk::layers::DecoderLM (docs/plugin-guide.md) or set distributed.context_parallel_size=1");
  if (topo.cp_size > 1 && (info.context_parallel & (1 << cp_comm_type(cfg))) == 0)
    throw HostError("model plugin '" + plugins.model.name() + "' does not run distributed.cp_comm_type " +
                    (cp_comm_type(cfg) == DTK_CP_COMM_ALL_GATHER ? "all_gather" : "a2a") +
                    " (its dtk_model_info.context_parallel lacks that exchange's bit, ABI 2.21): choose the other "
                    "exchange or build the model on the SDK's dtk::layers::DecoderLM");
  // (One stage: a split that holds the layers gives it all of them, as the even one does.)
  if (!parts.model->split().even() && parts.model->split().stages > 1 && !builds_pipeline_split(info))
    throw HostError("model plugin '" + plugins.model.name() +
                    "' builds only the even split of its layers over the pipeline stages (its "
                    "dtk_model_info.pipeline_split is 0): unset distributed.decoder_first_pipeline_num_layers, "
                    "decoder_last_pipeline_num_layers and account_for_embedding/loss_in_pipeline_split, or build its "
                    "layers from dtk::pipeline_layers (dtk/pipeline_split.hpp)");
  parts.stats = model_stats(parts.model->parameters(), info, plan.seq_length(), topo.tp_size, topo.pp_rank,
                            topo.pp_size, topo.ep_size);
  parts.strategy->setup(*parts.model);
  if (topo.ep_size > 1) require_expert_parallel_strategy(*parts.strategy, plugins.strategy.name());
  if (info.struct_size >= dtk_model_info_STRUCT_SIZE_2_4 && info.deferred_parameters && parts.model->info().deferred_parameters)
    throw HostError("strategy plugin '" + plugins.strategy.name() +
                    "' asked for the model without parameter values (defers_parameters) but its setup did not take "
                    "them (dtk_model_api.init_parameters); the parameters would be placeholders");
  const ParamGroups groups(cfg.lr(), schedule.reference_weight_decay());
  if (topo.pp_size == 1) groups.require_every_rule_matches(parts.model->parameters());
  if (schedule.weight_decay_varies())
    require_step_args_minor(2, "lr.weight_decay_incr_style=" + cfg.lr().weight_decay_incr_style(), plugins);
  if (groups.own_schedules()) require_step_args_minor(8, "an lr.param_rules entry with max_lr or min_lr", plugins);
  parts.optimizer =
      std::make_unique<OptimizerInstance>(plugins.optimizer.plugin, build_context(cfg, topo, plan, plugins.optimizer),
                                          parts.strategy->optimizer_params(), groups);
  for (int k = 0; k < v; ++k)
    parts.steps.push_back(std::make_unique<StepInstance>(plugins.step.plugin,
                                                         build_context(cfg, topo, plan, plugins.step, v > 1 ? k : -1)));
  LOG(INFO) << "model '" << plugins.model.name() << "': " << info.num_layers << " layers, hidden " << info.hidden_size
            << ", heads " << info.num_attention_heads << head_width(info) << ", seq " << info.seq_length
            << ", padded vocab " << info.vocab_size;
  print_model(topo, parts, groups);
  return parts;
}

void check_output_paths(const config::RunConfig& cfg) {
  namespace fs = std::filesystem;
  auto writable_dir = [](const std::string& dir, const std::string& what) {
    std::error_code created, checked;  // the creation's error is the one to report (EACCES, not ENOENT)
    fs::create_directories(dir, created);
    if (!fs::is_directory(dir, checked))
      throw HostError(what + " '" + dir + "': cannot create the directory" +
                      (created ? " (" + created.message() + ")" : checked ? " (" + checked.message() + ")" : ""));
    if (::access(dir.c_str(), W_OK | X_OK) != 0)
      throw HostError(what + " '" + dir + "': cannot write there (" + std::strerror(errno) + ")");
  };
  auto writable_file = [&](const std::string& file, const std::string& what) {
    if (file.empty()) return;
    const fs::path parent = fs::path(file).parent_path();
    writable_dir(parent.empty() ? "." : parent.string(), what + " '" + file + "': its directory");
    if (fs::is_directory(file)) throw HostError(what + " '" + file + "' is a directory, not a file");
    // Written at the end: a directory where no file can be created (a read-only mount, /proc)
    // would fail only after the whole run. The probe's name is this rank's alone, also on a
    // shared filesystem (host, process, a random part).
    char host[256] = "host";
    ::gethostname(host, sizeof host - 1);
    const std::string probe =
        file + ".probe-" + host + "-" + std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}());
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) throw HostError(what + " '" + file + "': cannot create a file there (" + std::strerror(errno) + ")");
    ::close(fd);
    ::unlink(probe.c_str());
  };
  const auto& ck = cfg.checkpoint();
  if (!ck.save().empty()) {
    writable_dir(ck.save(), "checkpoint.save");
    const std::string tracker = checkpoint_tracker_file(ck.save());
    if (fs::exists(tracker) && !fs::is_regular_file(tracker))
      throw HostError("checkpoint.save '" + ck.save() + "': " + tracker + " exists and is not a file");
    const std::string progress = (fs::path(ck.save()) / "progress.txt").string();
    if (cfg.logging().log_progress() && fs::exists(progress) &&
        (!fs::is_regular_file(progress) || ::access(progress.c_str(), W_OK) != 0))
      throw HostError("logging.log_progress: " + progress + " exists and is not a file this run can append to");
  }
  if (!ck.load().empty() && !fs::is_directory(ck.load()))
    throw HostError("checkpoint.load '" + ck.load() + "': " +
                    (fs::exists(ck.load()) ? "not a directory (a checkpoint is a save folder)" : "no such directory"));
  const auto& lg = cfg.logging();
  if (!lg.tensorboard_dir().empty()) writable_dir(lg.tensorboard_dir(), "logging.tensorboard_dir");
  writable_file(lg.trace_file(), "logging.trace_file");
  writable_file(lg.metrics_jsonl(), "logging.metrics_jsonl");
  writable_file(lg.bench_out(), "logging.bench_out (--bench_out)");
  if (!lg.profile_steps().empty())
    writable_dir(lg.profile_dir().empty() ? "profile" : lg.profile_dir(), "logging.profile_dir");
}

void check_run_memory(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                      const TrainingParts& parts) {
  const auto& t = cfg.train();
  if (t.skip_memory_check()) return;
  const MemoryBudget budget = memory_budget(t);
  const dtk_memory_usage held = parts.strategy->memory_usage();
  MemoryEstimateInputs in = run_memory_inputs(cfg, topo, plan, parts.model->info());
  // ddp makes its gradients (buckets) at the first backward: a strategy holding none yet will hold
  // one per parameter element (ZeRO's partitions exist from its setup and are counted as held).
  in.parameter_bytes = held.parameter_bytes;
  in.gradient_bytes = held.gradient_bytes > 0 ? held.gradient_bytes : held.parameter_bytes;
  in.master_bytes = held.master_bytes, in.host_bytes = held.host_bytes;
  for (const Param& p : parts.optimizer->params()) in.optimized_elements += p.tensor.numel();
  in.optimizer_on_host = parts.strategy->info().optimizer_on_host != 0;
  if (const std::string refusal = memory_refusal(estimate_memory(in), budget.bytes, budget.whose); !refusal.empty())
    throw HostError(refusal);
}

namespace {

dtk_dataset_context dataset_context(const config::RunConfig& cfg, const Topology& topo, const BatchPlan& plan,
                                    const PluginSlot& data) {
  dtk_dataset_context ctx{};
  ctx.struct_size = dtk_dataset_context_STRUCT_SIZE;
  ctx.options = data.options.get();
  ctx.seq_length = plan.seq_length();
  ctx.num_samples[DTK_SPLIT_TRAIN] = plan.requested_train_samples();
  ctx.num_samples[DTK_SPLIT_VALID] = plan.valid_samples();
  ctx.num_samples[DTK_SPLIT_TEST] = plan.test_samples();
  ctx.whole_splits = plan.whole_splits();  // its plugin's minor: check_full_validation
  ctx.seed = cfg.train().seed();
  ctx.rank = topo.world_rank;
  ctx.world_size = topo.world_size;
  return ctx;
}

void check_vocab_fits(const DatasetInstance& dataset, const ModelInstance& model) {
  const int64_t model_vocab = model.info().vocab_size;
  if (dataset.vocab_size() > model_vocab)
    throw HostError("dataset vocabulary (" + std::to_string(dataset.vocab_size()) + ") is larger than the model's (" +
                    std::to_string(model_vocab) + ")");
}

}  // namespace

std::vector<ValidationSetSpec> resolve_validation_sets(const config::RunConfig& cfg, const PluginSlot& data) {
  std::vector<ValidationSetSpec> sets;
  std::set<std::string> names;
  for (int k = 0; k < cfg.eval().validation_sets_size(); ++k) {
    const config::ValidationSet& v = cfg.eval().validation_sets(k);
    std::string name = v.name().empty() ? std::to_string(k) : v.name();
    const std::string where = "eval.validation_sets[" + std::to_string(k) + "]";
    if (name.find_first_of(" \t\n\r\f\v|") != std::string::npos)
      throw HostError("config: " + where + ": name '" + name +
                      "' is not one word (it ends up in the log line \"validation-NAME loss at ...\")");
    if (!names.insert(name).second)
      throw HostError("config: " + where + ": name '" + name + "' is given to an earlier set too");
    std::map<std::string, std::string> user(cfg.dataset().options().begin(), cfg.dataset().options().end());
    for (const auto& [key, value] : v.options()) user[key] = value;
    try {
      sets.push_back({name, std::make_unique<PluginSlot>(
                                data.plugin, host::OptionValues(host::resolve_options(data.plugin, user)))});
    } catch (const HostError& e) {
      throw HostError("config: " + where + " '" + name + "': " + e.what());
    }
  }
  return sets;
}

std::unique_ptr<DatasetInstance> build_validation_set(const config::RunConfig& cfg, const Topology& topo,
                                                      const BatchPlan& plan, const ValidationSetSpec& set,
                                                      const ModelInstance& model) {
  dtk_dataset_context ctx = dataset_context(cfg, topo, plan, *set.data);
  ctx.num_samples[DTK_SPLIT_TRAIN] = ctx.num_samples[DTK_SPLIT_VALID] = ctx.num_samples[DTK_SPLIT_TEST] = 0;
  ctx.whole_splits = 1u << DTK_SPLIT_VALID;
  const std::string which = "eval.validation_sets: set '" + set.name + "': ";
  std::unique_ptr<DatasetInstance> dataset;
  try {
    dataset = build_dataset_rank0_first(set.data->plugin, ctx, topo);
  } catch (const HostError& e) {
    throw HostError(which + e.what());
  }
  if (dataset->num_samples(DTK_SPLIT_VALID) == 0)
    throw HostError(which + "dataset plugin '" + set.data->name() +
                    "' has no validation samples under the set's options (a split without documents?)");
  try {
    check_vocab_fits(*dataset, model);
  } catch (const HostError& e) {
    throw HostError(which + e.what());
  }
  return dataset;
}

std::unique_ptr<DatasetInstance> build_dataset(const config::RunConfig& cfg, const Topology& topo,
                                               const BatchPlan& plan, const PluginSlot& data,
                                               const ModelInstance& model) {
  const dtk_dataset_context ctx = dataset_context(cfg, topo, plan, data);
  std::unique_ptr<DatasetInstance> dataset = build_dataset_rank0_first(data.plugin, ctx, topo);
  // Megatron's cyclic sampler reads a split again when it runs out: any split with a micro-batch
  // for every rank will do (SampleOrder checks that).
  if (!plan.skip_train() && !sampler_choice(cfg.train()).cyclic &&
      dataset->num_samples(DTK_SPLIT_TRAIN) < plan.train_samples())
    throw HostError("dataset plugin '" + data.name() + "': train split has " +
                    std::to_string(dataset->num_samples(DTK_SPLIT_TRAIN)) + " samples, the run needs " +
                    std::to_string(plan.train_samples()));
  // Full validation asked for a split that is not there (no documents under the split, or a
  // plugin that ignores whole_splits and sees the split unused): refused rather than skipped.
  if (plan.full_validation() && !plan.has_validation_sets() && dataset->num_samples(DTK_SPLIT_VALID) == 0)
    throw HostError("eval.full_validation: dataset plugin '" + data.name() +
                    "' has no validation samples (a split without documents, or a plugin that does not build the "
                    "splits dtk_dataset_context.whole_splits asks for whole, ABI 2.17)");
  check_vocab_fits(*dataset, model);
  return dataset;
}

std::unique_ptr<BatchLoader> make_train_loader(const DatasetInstance& data, const BatchPlan& plan,
                                               const config::TrainingConfig& t, const Topology& topo,
                                               int64_t first_iteration) {
  const int64_t remaining =
      plan.micro_batches_before(plan.train_iters() + 1) - plan.micro_batches_before(first_iteration);
  auto order = std::make_shared<const SampleOrder>(sampler_choice(t), data.num_samples(DTK_SPLIT_TRAIN),
                                                   plan.micro_batch_size(), topo.data_rank(), topo.data_size());
  return std::make_unique<BatchLoader>(data, DTK_SPLIT_TRAIN, plan.micro_batch_size(), remaining,
                                       [order, consumed = plan.consumed_before(first_iteration)](int64_t k, int64_t j) {
                                         return order->index(consumed, k, j);
                                       });
}

}  // namespace dtk::core
