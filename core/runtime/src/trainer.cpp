#include "dtk/core/trainer.hpp"

#include <ATen/Parallel.h>
#include <unistd.h>
#include <dtk/gemm.hpp>
#include <dtk/strategy.hpp>  // sum_of_squares
#include <glog/logging.h>

#include <filesystem>
#include <cstring>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include <chrono>

#include "cuda_glue.hpp"
#include "dtk/core/allocator.hpp"
#include "dtk/core/config.hpp"
#include "dtk/core/cuda_support.hpp"
#include "dtk/core/distributed.hpp"
#include "dtk/core/exit_conditions.hpp"
#include "dtk/core/graph_check.hpp"
#include "dtk/core/memory.hpp"
#include "dtk/core/run_agreement.hpp"
#include "dtk/core/trace.hpp"

namespace dtk::core {

using host::HostError;

namespace {

int32_t dtype_code(const std::string& s) {
  if (s == "bf16") return DTK_DTYPE_BFLOAT16;
  if (s == "fp16") return DTK_DTYPE_FLOAT16;
  return DTK_DTYPE_FLOAT32;
}

// The plugins of the run's slots: "plugin.<kind>=<name> <version> (ABI M.m)" (what every rank must
// agree on, with the config; recorded in checkpoints).
std::vector<std::string> plugin_lines(const config::RunConfig& cfg, const host::PluginHost& plugins) {
  std::vector<std::string> lines;
  const std::pair<int32_t, const config::PluginChoice*> slots[] = {
      {DTK_KIND_MODEL, &cfg.model()},         {DTK_KIND_DATASET, &cfg.dataset()},   {DTK_KIND_STEP, &cfg.step()},
      {DTK_KIND_OPTIMIZER, &cfg.optimizer()}, {DTK_KIND_STRATEGY, &cfg.strategy()}};
  for (const auto& [kind, choice] : slots) {
    const dtk_plugin_entry* e = plugins.get(kind, choice->name()).entry;
    lines.push_back(std::string("plugin.") + host::kind_name(kind) + "=" + e->name + " " + e->version + " (ABI " +
                    std::to_string(e->abi_major) + "." + std::to_string(e->abi_minor) + ")");
  }
  return lines;
}

// Megatron's initialize_megatron for this process: config checks, process groups, then the
// runtime (intra-op threads, seed, device). Returns the topology of the run.
const Topology& initialize(const config::RunConfig& cfg, const host::PluginHost& plugins) {
  validate_config(cfg);
  set_run_config(cfg);
  // The device first: NCCL's communicators are created on it.
  select_training_device(cfg.train().device());
  // Rendezvous and process groups (a no-op for a single process); the ranks first compare what
  // they will run (run_agreement.hpp).
  init_distributed(cfg, describe_run(cfg, plugin_lines(cfg, plugins)));
  const Topology& topo = topology();
  // Megatron prints from one rank: the others log nothing but errors.
  if (topo.world_rank != 0) FLAGS_minloglevel = google::GLOG_ERROR;
  const auto& train = cfg.train();
  // Default: the cores shared among the ranks of this machine (N ranks x all cores would
  // oversubscribe the CPU N-fold).
  const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
  const int local_ranks = local_world ? std::max(1, std::atoi(local_world)) : 1;
  const int threads = train.threads() > 0
                          ? train.threads()
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / local_ranks);
  at::set_num_threads(std::max(1, threads));
  at::manual_seed(train.seed());
  // Count tensor bytes from here on (the memory report; the device budget).
  memory::install();
#if DTK_HAVE_CUDA
  if (const c10::Device device = training_device(); device.is_cuda()) cuda_glue::use_gpu_memory_pool(device.index());
#endif
  // The device budget: train.memory_limit_mb, else (CPU) this machine's memory shared by the ranks
  // on it, so an absurd size fails with one line instead of growing until the kernel kills it.
  // On a GPU the budget is the memory estimate's against the GPU (and CUDA's own out-of-memory
  // error); host memory is counted, not budgeted.
  if (train.memory_limit_mb() > 0 && !training_device().is_cuda())
    memory::set_device_limit(train.memory_limit_mb() * (int64_t{1} << 20));
  else
    memory::set_device_limit(memory::machine_memory_bytes() / local_ranks, /*machine=*/true);
  return topo;
}

// Rank 0 builds the dataset first (that is where index caches get written); then a bounded world
// collective tells every other rank whether it succeeded, so they neither race rank 0 on the
// caches nor wait for files that a failed rank 0 will never write.
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

// Test hook: DTK_TEST_NONFINITE_ITERS=3,7 makes the gradients of those iterations infinite (the
// first micro-batch's loss times inf), to test the skipped-step path of every strategy and the
// loss scaler; "3@1" does it on world rank 1 only (the other ranks must skip with it).
std::set<int64_t> nonfinite_iterations_from_environment(int world_rank) {
  std::set<int64_t> out;
  const char* v = std::getenv("DTK_TEST_NONFINITE_ITERS");
  if (!v) return out;
  std::string s = v;
  for (size_t at = 0; at < s.size();) {
    const size_t comma = s.find(',', at);
    const std::string item = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const size_t rank_at = item.find('@');
    try {
      size_t used = 0;
      const int64_t it = std::stoll(item.substr(0, rank_at), &used);
      if (used != item.substr(0, rank_at).size()) throw std::invalid_argument(item);
      if (rank_at == std::string::npos || std::stoi(item.substr(rank_at + 1)) == world_rank) out.insert(it);
    } catch (const std::exception&) {
      throw HostError("DTK_TEST_NONFINITE_ITERS: '" + item + "' is not ITERATION or ITERATION@RANK");
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

}  // namespace

Trainer::Trainer(const config::RunConfig& cfg, host::PluginHost& plugins)
    : cfg_(cfg),
      topo_(initialize(cfg, plugins)),
      plan_(cfg, topo_),
      schedule_(cfg.lr(), plan_.train_iters()),
      scaler_(cfg.train()),
      timers_(cfg.logging().timing_log_level()),
      model_slot_(resolve(plugins, DTK_KIND_MODEL, cfg.model())),
      data_slot_(resolve(plugins, DTK_KIND_DATASET, cfg.dataset())),
      step_slot_(resolve(plugins, DTK_KIND_STEP, cfg.step())),
      optimizer_slot_(resolve(plugins, DTK_KIND_OPTIMIZER, cfg.optimizer())),
      strategy_slot_(resolve(plugins, DTK_KIND_STRATEGY, cfg.strategy())),
      nonfinite_iterations_(nonfinite_iterations_from_environment(topo_.world_rank)),
      writers_(plugin_lines(cfg, plugins)) {
#if DTK_HAVE_CUDA
  if (const c10::Device device = training_device(); device.is_cuda())
    timers_.set_device_clock(cuda_glue::make_event_clock(device.index()));
#endif
  // MFU needs the device's peak: given, or (bench mode on a CPU) measured here, before the
  // model takes memory and threads.
  const bool bench_mode = cfg.train().bench_steps() > 0;
  if (cfg.logging().peak_tflops() > 0) {
    peak_tflops_ = cfg.logging().peak_tflops(), peak_source_ = "logging.peak_tflops";
  } else if (bench_mode && training_device().is_cuda()) {
    // A GPU's dense peak is its datasheet's (H100 SXM: 989 bf16), not a matmul measured here.
    LOG(WARNING) << "bench mode on " << training_device().str()
                 << ": MFU needs the GPU's peak TFLOP/s: set logging.peak_tflops (e.g. 989 for bf16 on an H100 SXM)";
  } else if (bench_mode) {
    peak_tflops_ = measure_matmul_tflops();
    memory::reset_peak();
    peak_measured_ = true;
    peak_source_ = "measured: best 2048x2048 fp32 matmul of LibTorch's BLAS and " + dtk::cpu_gemm_engine() + " on " +
                   std::to_string(at::get_num_threads()) + " threads, before and after the steps";
  }
  if (plan_.ramps_up()) {
    // Megatron's scheduler counts samples: with a ramp-up the iterations differ in size, so every
    // length is in samples, an iteration count times the (final) global batch; the decay defaults
    // to train_samples (Megatron's lr_decay_samples) and the weight-decay schedule spans it.
    LrParams p = schedule_.params();
    const int64_t gbs = plan_.global_batch_size(), samples = cfg.train().train_samples();
    const auto& lr = cfg.lr();
    p.decay_iters = lr.lr_decay_samples() > 0 ? lr.lr_decay_samples()
                    : lr.lr_decay_iters() > 0  ? lr.lr_decay_iters() * gbs
                                               : samples;
    p.warmup_iters = lr.lr_warmup_fraction() > 0 ? lr.lr_warmup_fraction() * static_cast<double>(p.decay_iters)
                     : lr.lr_warmup_samples() > 0 ? static_cast<double>(lr.lr_warmup_samples())
                                                  : static_cast<double>(lr.lr_warmup_iters() * gbs);
    p.wsd_decay_iters = lr.lr_wsd_decay_iters() * gbs;
    p.wd_incr_iters = static_cast<double>(samples);
    schedule_.set_params(p);
  } else if (cfg.lr().lr_decay_samples() > 0 || cfg.lr().lr_warmup_samples() > 0) {
    // Without a ramp-up every iteration is one global batch and the schedule counts iterations:
    // Megatron's sample lengths are whole numbers of them.
    LrParams p = schedule_.params();
    const int64_t gbs = plan_.global_batch_size();
    auto in_iterations = [gbs](int64_t samples, const char* name) {
      if (samples % gbs != 0)
        throw HostError(std::string("config: lr.") + name + " (" + std::to_string(samples) +
                        ") is not a whole number of global batches of " + std::to_string(gbs) +
                        " samples (without a batch-size ramp-up the schedule counts iterations)");
      return samples / gbs;
    };
    if (cfg.lr().lr_decay_samples() > 0) p.decay_iters = in_iterations(cfg.lr().lr_decay_samples(), "lr_decay_samples");
    if (cfg.lr().lr_warmup_samples() > 0)
      p.warmup_iters = static_cast<double>(in_iterations(cfg.lr().lr_warmup_samples(), "lr_warmup_samples"));
    schedule_.set_params(p);
  }
  if (cfg.train().train_samples() > 0) {
    // The checks validate_config could not make before the global batch was known.
    const LrParams& l = schedule_.params();
    const std::string unit = plan_.ramps_up() ? " samples" : " iterations";  // a ramp-up's schedule counts samples
    const std::string decay =
        std::to_string(l.decay_iters) + unit +
        (plan_.ramps_up() ? " (train.train_samples, or lr.lr_decay_iters x global batch " +
                                std::to_string(plan_.global_batch_size()) + ")"
                          : " (train.train_samples / global batch " + std::to_string(plan_.global_batch_size()) +
                                ", or lr.lr_decay_iters)");
    if (l.style != "constant" && l.warmup_iters >= static_cast<double>(l.decay_iters))
      throw HostError("config: the warm-up (" + std::to_string(static_cast<int64_t>(std::ceil(l.warmup_iters))) +
                      unit + ") is not shorter than the decay, " + decay);
    if (l.style == "WSD" && l.wsd_decay_iters > l.decay_iters)
      throw HostError("config: lr.lr_wsd_decay_iters (" + std::to_string(l.wsd_decay_iters) +
                      ") is longer than the decay, " + decay);
  }
  TrainingLog::Setup log;
  log.train_iters = plan_.train_iters();
  log.log_interval = cfg.logging().log_interval();
  log.global_batch_size = plan_.global_batch_size();
  log.seq_length = plan_.seq_length();
  log.world_size = topo_.world_size;
  log.tp_size = topo_.tp_size;
  log.dp_size = topo_.dp_size;
  log.pp_size = topo_.pp_size;
  log.virtual_stages = virtual_stages();
  log.printer = topo_.world_rank == 0;
  log.tensorboard_dir = cfg.logging().tensorboard_dir();
  log.metrics_jsonl = cfg.logging().metrics_jsonl();
  log.peak_tflops = peak_tflops_;
  log.tensorboard_log_interval = cfg.logging().tensorboard_log_interval();
  log.timers = &timers_;
  log.topo = &topo_;
  // Checks every rank makes before any work; all fail together (a rank that left would make the
  // others wait at their next collective).
  auto on_every_rank = [&](const char* what, auto&& check) {
    std::string error;
    try {
      check();
    } catch (const std::exception& e) {
      error = e.what();
    }
    agree(error, topo_, what);
  };
  on_every_rank("checking the output paths", [&] { check_output_paths(); });
  setup_model_and_optimizer();
  on_every_rank("estimating the memory of the run", [&] { check_memory_estimate(); });
  log.flops_per_token = stats_.flops_per_token;
  log_ = std::make_unique<TrainingLog>(log);
  if (!cfg.logging().trace_file().empty()) {
    trace::Settings ts;
    ts.path = cfg.logging().trace_file();
    trace::parse_iterations(cfg.logging().trace_iterations().empty() ? "2-3" : cfg.logging().trace_iterations(),
                            &ts.first, &ts.last);
    ts.rank = topo_.world_rank;
    ts.world_size = topo_.world_size;
    trace::configure(ts);
  }
  load_checkpoint();
  char line[512];
  std::snprintf(line, sizeof line,
                " > training FLOPs per token: %.4g (2cN + 4cLhs with c = %d%s, N = %lld parameters of the whole "
                "model, L = %lld layers, h = %lld, s = %lld); TFLOP/s per device = FLOPs per token x tokens/s / %d "
                "ranks",
                stats_.flops_per_token, stats_.passes, stats_.passes == 4 ? " (full recompute)" : "",
                static_cast<long long>(stats_.model_parameters), static_cast<long long>(model_->info().num_layers),
                static_cast<long long>(model_->info().hidden_size), static_cast<long long>(plan_.seq_length()),
                topo_.world_size);
  log_->print(line);
  // bf16 on a CPU: fast with native bf16 arithmetic (AVX512-BF16, AMX), many times slower than
  // fp32 where LibTorch emulates it. Measured here (a few 256x256 products), said in one line.
  if (cfg.train().params_dtype() == "bf16" && cfg.train().device() == "cpu") {
    const double slowdown = bf16_matmul_slowdown();
    memory::reset_peak();
    if (slowdown > 1.5)
      std::snprintf(line, sizeof line,
                    " > warning: bf16 matrix products run %.1fx slower than fp32 on this CPU (no native bf16 "
                    "arithmetic; measured at start, 256x256): train.params_dtype=fp32 trains faster here",
                    slowdown);
    else
      std::snprintf(line, sizeof line,
                    " > bf16 matrix products run %.1fx the speed of fp32 on this CPU (measured at start, 256x256)",
                    1.0 / slowdown);
    log_->print(line);
  }
  if (!training_device().is_cuda())
    log_->print(" > CPU matrix products: " + dtk::cpu_gemm_engine() +
                " (DTK_CPU_GEMM=aten selects LibTorch's BLAS; dtk/gemm.hpp)");
  // glibc malloc re-faults large activations every iteration (dtk/core/allocator.hpp).
  if (malloc_name() == "tcmalloc")
    log_->print(" > memory allocator: tcmalloc (DTK_ALLOCATOR=system selects glibc malloc)");
  else
    log_->print(" > memory allocator: glibc malloc (training runs several times slower than on tcmalloc: "
                "apt-get install libtcmalloc-minimal4, and leave DTK_ALLOCATOR unset)");
  if (scaler_.kind() != GradScaler::Kind::kNone) {
    std::snprintf(line, sizeof line, " > loss scaling: %s, scale %.6g", scaler_.dynamic() ? "dynamic" : "static",
                  scaler_.scale());
    log_->print(line);
  }
  if (bench_mode || !cfg.logging().bench_out().empty()) {
    BenchSetup b;
    b.warmup_steps = cfg.train().perf_warmup_steps();
    b.tokens_per_iteration = plan_.global_batch_size() * plan_.seq_length();
    b.flops_per_token = stats_.flops_per_token;
    b.world_size = topo_.world_size;
    b.peak_tflops = peak_tflops_;
    b.peak_source = peak_source_;
    b.tp_size = topo_.tp_size;
    b.dp_size = topo_.dp_size;
    bench_ = std::make_unique<BenchReport>(b);
  }
  build_data_iterators();
}

Trainer::~Trainer() = default;


Trainer::Slot Trainer::resolve(host::PluginHost& plugins, int32_t kind, const config::PluginChoice& choice) const {
  const host::Plugin& plugin = plugins.get(kind, choice.name());
  const std::map<std::string, std::string> user(choice.options().begin(), choice.options().end());
  return Slot{plugin, host::OptionValues(host::resolve_options(plugin, user))};
}

int Trainer::virtual_stages() const { return std::max(1, cfg_.distributed().virtual_pipeline_model_parallel_size()); }

dtk_build_context Trainer::build_context(const Slot& slot, int chunk) const {
  dtk_build_context c{};
  c.struct_size = sizeof(c);
  c.options = slot.options.get();
  c.device = dtk::from_device(training_device());
  c.params_dtype = dtype_code(cfg_.train().params_dtype());
  c.tp_rank = topo_.tp_rank, c.tp_size = topo_.tp_size;
  c.pp_rank = topo_.pp_rank, c.pp_size = topo_.pp_size;
  // A chunk of the interleaved schedule is a stage of the virtual pipeline: its layers, whether it
  // holds the embedding or the output layer, follow from its place there (Megatron's virtual rank).
  if (chunk >= 0) c.pp_rank = chunk * topo_.pp_size + topo_.pp_rank, c.pp_size = virtual_stages() * topo_.pp_size;
  c.dp_rank = topo_.dp_rank, c.dp_size = topo_.dp_size;
  c.pre_process = c.pp_rank == 0;
  c.post_process = c.pp_rank == c.pp_size - 1;
  c.seq_length = plan_.seq_length();
  c.micro_batch_size = plan_.micro_batch_size();
  c.seed = cfg_.train().seed();
  return c;
}

// Megatron's setup_model_and_optimizer: the model for this rank, the strategy wrapping it, the
// optimizer over the strategy's parameters, and the forward step.
void Trainer::setup_model_and_optimizer() {
  if (const std::string refusal = interleaving_refusal(plan_.micro_batches_per_step()); !refusal.empty())
    throw HostError(refusal);
  for (int64_t i = 1; plan_.ramps_up() && i <= plan_.ramp_iterations() + 1; ++i)
    if (const std::string refusal = interleaving_refusal(plan_.micro_batches_of(i)); !refusal.empty())
      throw HostError(refusal + " (train.rampup_batch_size, iteration " + std::to_string(i) + ")");
  std::vector<dtk_build_context> chunks;
  for (int k = 0; k < virtual_stages(); ++k)
    chunks.push_back(build_context(model_slot_, virtual_stages() > 1 ? k : -1));
  model_ = std::make_unique<ModelInstance>(model_slot_.plugin, chunks);
  // Counted before the strategy wraps the model (ZeRO-3 partitions its parameters).
  const dtk_model_info info = model_->info();
  stats_ = model_stats(model_->parameters(), info, topo_.tp_size, topo_.pp_rank, topo_.pp_size);
  strategy_ = std::make_unique<StrategyInstance>(strategy_slot_.plugin, build_context(strategy_slot_));
  strategy_->setup(*model_);
  const ParamGroups groups(cfg_.lr(), schedule_.reference_weight_decay());
  if (topo_.pp_size == 1) groups.require_every_rule_matches(model_->parameters());
  if (schedule_.weight_decay_varies()) require_weight_decay_scale();
  optimizer_ = std::make_unique<OptimizerInstance>(optimizer_slot_.plugin, build_context(optimizer_slot_),
                                                   strategy_->optimizer_params(), groups);
  for (int k = 0; k < virtual_stages(); ++k)
    steps_.push_back(
        std::make_unique<StepInstance>(step_slot_.plugin, build_context(step_slot_, virtual_stages() > 1 ? k : -1)));
  setup_tied_gradients();  // pipeline parallelism with tied embeddings
  LOG(INFO) << "model '" << model_slot_.plugin.name() << "': " << info.num_layers << " layers, hidden "
            << info.hidden_size << ", heads " << info.num_attention_heads << ", seq " << info.seq_length
            << ", padded vocab " << info.vocab_size;
  // As Megatron: every first data-parallel rank reports its shard; the line names the rank.
  if (topo_.dp_rank == 0) {
    const std::string who = topo_.world_size > 1 ? "[rank " + std::to_string(topo_.world_rank) + "]" : "";
    std::printf("%s > number of parameters on (tensor, pipeline) model parallel rank (%d, %d): %lld\n", who.c_str(),
                topo_.tp_rank, topo_.pp_rank, static_cast<long long>(stats_.num_parameters));
    std::fflush(stdout);
  }
  // The groups by the model's own parameters (a ZeRO shard list would show this rank's part).
  if (topo_.world_rank == 0)
    for (const auto& line : groups.describe(model_->parameters())) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// Where the run will write, checked before any work: an unwritable checkpoint.save used to be
// found at the first save, after the training it was meant to keep.
void Trainer::check_output_paths() const {
  namespace fs = std::filesystem;
  auto writable_dir = [](const std::string& dir, const std::string& what) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (!fs::is_directory(dir, ec))
      throw HostError(what + " '" + dir + "': cannot create the directory" + (ec ? " (" + ec.message() + ")" : ""));
    if (::access(dir.c_str(), W_OK | X_OK) != 0)
      throw HostError(what + " '" + dir + "': cannot write there (" + std::strerror(errno) + ")");
  };
  auto writable_file = [&](const std::string& file, const std::string& what) {
    if (file.empty()) return;
    const fs::path parent = fs::path(file).parent_path();
    writable_dir(parent.empty() ? "." : parent.string(), what + " '" + file + "': its directory");
    if (fs::is_directory(file)) throw HostError(what + " '" + file + "' is a directory, not a file");
  };
  const auto& ck = cfg_.checkpoint();
  if (!ck.save().empty()) {
    writable_dir(ck.save(), "checkpoint.save");
    const std::string tracker = checkpoint_tracker_file(ck.save());
    if (fs::exists(tracker) && !fs::is_regular_file(tracker))
      throw HostError("checkpoint.save '" + ck.save() + "': " + tracker + " exists and is not a file");
  }
  if (!ck.load().empty() && !fs::is_directory(ck.load()))
    throw HostError("checkpoint.load '" + ck.load() + "': no such directory");
  const auto& lg = cfg_.logging();
  if (!lg.tensorboard_dir().empty()) writable_dir(lg.tensorboard_dir(), "logging.tensorboard_dir");
  writable_file(lg.trace_file(), "logging.trace_file");
  writable_file(lg.metrics_jsonl(), "logging.metrics_jsonl");
  writable_file(lg.bench_out(), "logging.bench_out (--bench_out)");
}

// Before the first step: what a rank will hold, against what it may use (train.memory_limit_mb, or
// this machine's memory shared by its ranks). Parameters and the strategy's gradient and master
// buffers are counted as allocated; the optimizer state (allocated at the first step) as two fp32
// values per optimized element (Adam); activations by Megatron's formula (Korthikanti et al.:
// s b h (34 + 5 a s / h) bytes per layer in 16-bit, twice in fp32, divided over TP ranks, one
// layer's worth plus the layer inputs with full recomputation) times the micro-batches that may
// be alive at once (one), plus the output layer's logits and the prefetched batches.
void Trainer::check_memory_estimate() {
  const auto& t = cfg_.train();
  if (t.skip_memory_check()) return;
  const char* local_world = std::getenv("LOCAL_WORLD_SIZE");
  const int64_t local_ranks = local_world ? std::max(1, std::atoi(local_world)) : 1;
  const c10::Device device = training_device();
  const int64_t budget = t.memory_limit_mb() > 0 ? t.memory_limit_mb() * (int64_t{1} << 20)
                         : device.is_cuda()      ? cuda_device_memory_bytes(device)
                                                 : memory::machine_memory_bytes() / local_ranks;
  if (budget <= 0) return;
  const dtk_model_info info = model_->info();
  const dtk_memory_usage held = strategy_->memory_usage();
  int64_t optimized = 0;
  for (const Param& p : optimizer_->params()) optimized += p.tensor.numel();
  const double dtype_bytes = t.params_dtype() == "fp32" ? 4.0 : 2.0;
  const double s = static_cast<double>(plan_.seq_length()), b = static_cast<double>(plan_.micro_batch_size());
  const double h = static_cast<double>(info.hidden_size), a = static_cast<double>(std::max<int64_t>(1, info.num_attention_heads));
  const double layers = static_cast<double>(info.num_layers) / topo_.pp_size;
  const double per_layer = s * b * h * (34.0 + 5.0 * a * s / h) / topo_.tp_size * (dtype_bytes / 2.0);
  // 1F1B: stage s holds the activations of up to pp_size - s micro-batches at once. Interleaved:
  // its warm-up forwards plus one, each through one of its virtual_stages() chunks.
  const int64_t num_micro = plan_.micro_batches_per_step(), v = virtual_stages();
  int64_t chunk_forwards = std::min<int64_t>(topo_.pp_size - topo_.pp_rank, num_micro) * v;
  if (v > 1)
    chunk_forwards =
        num_micro == topo_.pp_size
            ? num_micro * v
            : std::min<int64_t>(num_micro * v, 2 * (topo_.pp_size - topo_.pp_rank - 1) + (v - 1) * topo_.pp_size + 1);
  const double in_flight = std::max(1.0, static_cast<double>(chunk_forwards) / static_cast<double>(v));
  const double activations =
      in_flight * (info.recompute ? layers * s * b * h * dtype_bytes + per_layer : layers * per_layer);
  const double vocab = static_cast<double>(info.vocab_size) / topo_.tp_size;
  const bool last_stage = topo_.pp_rank == topo_.pp_size - 1;  // the output layer's logits live there
  const double logits = last_stage ? std::min(s * b, 512.0) * vocab * 4.0 * 2.0 : 0.0;
  // The loader's queue and the batch in use; the interleaved schedule fetches a step's micro-batches
  // first, and holds up to its warm-up plus 2 p + 1 stage outputs' gradients on their way back.
  const double batches = (v > 1 ? 4.0 + static_cast<double>(num_micro) : 5.0) * b * (s + 1) * 8.0;
  const double gradients_in_flight =
      v > 1 ? static_cast<double>(chunk_forwards + 2 * topo_.pp_size + 1) * s * b * h * dtype_bytes : 0.0;
  // What lives in host memory (offload) is outside a device budget (not outside the machine's).
  const bool device_budget = t.memory_limit_mb() > 0 || device.is_cuda();
  const double optimizer =
      device_budget && strategy_->info().optimizer_on_host ? 0.0 : 8.0 * static_cast<double>(optimized);
  const double params = static_cast<double>(held.parameter_bytes + held.gradient_bytes + held.master_bytes -
                                            (device_budget ? held.host_bytes : 0));
  const double total = params + optimizer + activations + logits + batches + gradients_in_flight;
  if (total <= static_cast<double>(budget)) return;
  auto mb = [](double bytes) { return std::to_string(static_cast<int64_t>(bytes / (1 << 20))) + " MB"; };
  throw HostError(
      "config: this run needs about " + mb(total) + " per rank (parameters, gradients and masters " + mb(params) +
      ", optimizer state " + mb(optimizer) + ", activations " + mb(activations + logits + gradients_in_flight) +
      ", batches " + mb(batches) + "), more than the " + mb(static_cast<double>(budget)) +
      (t.memory_limit_mb() > 0 ? " of train.memory_limit_mb"
       : device.is_cuda()      ? " of " + device.str()
                               : " this machine has for each of its " + std::to_string(local_ranks) + " rank(s)") +
      "; lower train.micro_batch_size or train.seq_length, or set train.skip_memory_check=true");
}

// A weight-decay schedule reaches the optimizer through dtk_optimizer_step_args.weight_decay_scale
// (ABI 2.2), passed on by the strategy: a plugin built for an earlier minor would silently decay
// by the schedule's end value throughout.
void Trainer::require_weight_decay_scale() const {
  for (const Slot* slot : {&optimizer_slot_, &strategy_slot_}) {
    const dtk_plugin_entry* e = slot->plugin.entry;
    if (e->abi_major == DTK_ABI_MAJOR && e->abi_minor < 2)
      throw HostError("config: lr.weight_decay_incr_style=" + cfg_.lr().weight_decay_incr_style() + " needs " +
                      host::kind_name(e->kind) + " plugin '" + slot->plugin.name() + "' built for DTK ABI 2.2 or later (it is " +
                      std::to_string(e->abi_major) + "." + std::to_string(e->abi_minor) +
                      "; rebuild it against this SDK)");
  }
}

// Megatron's load_checkpoint at the end of setup_model_and_optimizer.
void Trainer::load_checkpoint() {
  const auto& ck = cfg_.checkpoint();
  const std::string& dir = ck.load();
  if (dir.empty()) return;
  LoadOptions what;
  what.optimizer = !ck.no_load_optim() && !ck.finetune();
  what.rng = !ck.no_load_rng() && !ck.finetune();
  what.verify = !ck.no_verify_checksums();
  what.fallback = ck.fallback();
  std::vector<std::string> skipped;
  progress_ = core::load_checkpoint(dir, *model_, *optimizer_, *strategy_, topo_, what, &skipped);
  for (const auto& s : skipped) log_->print(" checkpoint.fallback: " + s);
  if (ck.finetune()) {
    // Megatron's --finetune: the weights, and a run of its own from iteration 0.
    log_->print(" finetuning from the model of " + dir + " at iteration " + std::to_string(progress_.iteration) +
                ": optimizer, scheduler and RNG start fresh, training starts at iteration 0");
    progress_ = TrainProgress{};
    return;
  }
  if (!what.optimizer) {
    // Megatron's --no-load-optim skips the scheduler's state with the optimizer's.
    progress_.scheduler_step = 0;
    progress_.grad_scaler.reset();
    progress_.schedule.reset();
    log_->print(" checkpoint.no_load_optim: optimizer state, loss scaler and learning-rate schedule start fresh");
  }
  if (progress_.schedule) check_schedule(*progress_.schedule, dir);
  if (progress_.iteration < 0 || progress_.iteration > plan_.train_iters())
    throw HostError("checkpoint in " + dir + " is at iteration " + std::to_string(progress_.iteration) +
                    (progress_.iteration < 0 ? "" : ", beyond train.train_iters " + std::to_string(plan_.train_iters())));
  const int64_t gbs = plan_.global_batch_size();
  if (progress_.consumed_train_samples != plan_.consumed_before(progress_.iteration + 1) ||
      progress_.consumed_valid_samples % gbs != 0)
    throw HostError("checkpoint in " + dir + " consumed " + std::to_string(progress_.consumed_train_samples) +
                    " train samples in " + std::to_string(progress_.iteration) +
                    " iterations: resuming needs the same global batch size (" + std::to_string(gbs) +
                    ") and ramp-up (train.rampup_batch_size)");
  resumed_iteration_ = progress_.iteration;
  log_->print(" loaded checkpoint from " + dir + " at iteration " + std::to_string(progress_.iteration));
  if (scaler_.dynamic()) {
    if (progress_.grad_scaler) {
      scaler_.load(*progress_.grad_scaler);
    } else {
      char buf[160];
      std::snprintf(buf, sizeof buf, " the checkpoint has no loss-scaler state: the scale starts at %.6g",
                    scaler_.scale());
      log_->print(buf);
    }
  }
}

// Megatron's OptimizerParamScheduler._check_and_set on load: the schedule must be the one the
// checkpoint trained with, unless the config says which of the two to use. DTK compares what
// decides the rates (the WSD fields only under WSD).
void Trainer::check_schedule(const LrParams& saved, const std::string& dir) {
  const LrParams& now = schedule_.params();
  std::vector<std::string> differ;
  auto num = [&](const char* name, double a, double b) {
    if (a != b) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s %.9g (checkpoint) vs %.9g (this run)", name, a, b);
      differ.emplace_back(buf);
    }
  };
  auto str = [&](const char* name, const std::string& a, const std::string& b) {
    if (a != b) differ.push_back(std::string(name) + " " + a + " (checkpoint) vs " + b + " (this run)");
  };
  num("lr.lr", saved.max_lr, now.max_lr);
  num("lr.min_lr", saved.min_lr, now.min_lr);
  num("lr.lr_warmup_init", saved.init_lr, now.init_lr);
  num("warm-up iterations", saved.warmup_iters, now.warmup_iters);
  num("decay iterations (lr.lr_decay_iters, or train.train_iters when 0)", static_cast<double>(saved.decay_iters),
      static_cast<double>(now.decay_iters));
  str("lr.lr_decay_style", saved.style, now.style);
  if (saved.has_wd) {  // Megatron's _check_and_set covers the weight-decay schedule as well
    str("lr.weight_decay_incr_style", saved.wd_style, now.wd_style);
    num("start weight decay (lr.start_weight_decay, or lr.weight_decay when constant)", saved.start_wd, now.start_wd);
    num("end weight decay (lr.end_weight_decay, or lr.weight_decay when constant)", saved.end_wd, now.end_wd);
    if (saved.wd_style != "constant" || now.wd_style != "constant")
      num("weight-decay iterations (train.train_iters)", saved.wd_incr_iters, now.wd_incr_iters);
  }
  if (saved.style == "WSD" && now.style == "WSD") {
    str("lr.lr_wsd_decay_style", saved.wsd_style, now.wsd_style);
    num("lr.lr_wsd_decay_iters", static_cast<double>(saved.wsd_decay_iters), static_cast<double>(now.wsd_decay_iters));
  }
  if (differ.empty()) return;
  std::string list;
  for (const auto& d : differ) list += (list.empty() ? "" : "; ") + d;
  const auto& ck = cfg_.checkpoint();
  if (ck.override_opt_param_scheduler()) {
    log_->print(" learning-rate schedule from this run's config (checkpoint.override_opt_param_scheduler): " + list);
  } else if (ck.use_checkpoint_opt_param_scheduler()) {
    schedule_.set_params(saved);
    log_->print(" learning-rate schedule from the checkpoint (checkpoint.use_checkpoint_opt_param_scheduler): " + list);
  } else {
    throw HostError("checkpoint in " + dir + " was trained with another learning-rate schedule: " + list +
                    "; set checkpoint.override_opt_param_scheduler=true to use this run's or "
                    "checkpoint.use_checkpoint_opt_param_scheduler=true to keep the checkpoint's");
  }
}

// Megatron's build_train_valid_test_data_iterators: the dataset serves every split's samples
// for the whole run; the train iterator starts after what a resumed run already consumed.
void Trainer::build_data_iterators() {
  dtk_dataset_context ctx{};
  ctx.struct_size = sizeof(ctx);
  ctx.options = data_slot_.options.get();
  ctx.seq_length = plan_.seq_length();
  ctx.num_samples[DTK_SPLIT_TRAIN] = plan_.train_samples();
  ctx.num_samples[DTK_SPLIT_VALID] = plan_.valid_samples();
  ctx.num_samples[DTK_SPLIT_TEST] = plan_.test_samples();
  ctx.seed = cfg_.train().seed();
  ctx.rank = topo_.world_rank;
  ctx.world_size = topo_.world_size;
  data_ = build_dataset_rank0_first(data_slot_.plugin, ctx, topo_);
  const std::string who = "dataset plugin '" + data_slot_.plugin.name() + "': ";
  if (data_->num_samples(DTK_SPLIT_TRAIN) < plan_.train_samples())
    throw HostError(who + "train split has " + std::to_string(data_->num_samples(DTK_SPLIT_TRAIN)) +
                    " samples, the run needs " + std::to_string(plan_.train_samples()));
  const int64_t model_vocab = model_->info().vocab_size;
  if (data_->vocab_size() > model_vocab)
    throw HostError("dataset vocabulary (" + std::to_string(data_->vocab_size()) + ") is larger than the model's (" +
                    std::to_string(model_vocab) + ")");
  const int64_t first_iteration = progress_.iteration + 1;
  const int64_t remaining =
      plan_.micro_batches_before(plan_.train_iters() + 1) - plan_.micro_batches_before(first_iteration);
  train_loader_ = std::make_unique<BatchLoader>(
      *data_, DTK_SPLIT_TRAIN, plan_.micro_batch_size(), remaining,
      [this, first_iteration](int64_t k, int64_t j) { return plan_.train_sample_index(first_iteration, k, j); });
}

// The dataset contract on the first batches (cheap: a max over a few micro-batches). Token ids
// are below the vocabulary: the tokenizer's when the run names its files, else the dataset's
// declared one, else the model's. A larger id would otherwise surface as an index error deep in
// the model. "text" (what the shipped steps read) holds seq_length + 1 tokens per sample: with
// one fewer, the step would train on shorter sequences without a word.
void Trainer::check_batch(const TensorList& batch, int64_t iteration) const {
  int64_t limit = cfg_.tokenizer().vocab_size();
  std::string what = "the tokenizer's vocabulary (" + cfg_.tokenizer().vocab_file() + ")";
  if (limit <= 0 && data_->vocab_size() > 0)
    limit = data_->vocab_size(), what = "the vocabulary the dataset declares";
  if (limit <= 0) limit = model_->info().vocab_size, what = "the model's vocabulary";
  std::string error;
  if (const at::Tensor* text = find(batch, "text"); text && text->dim() == 2 && text->size(1) != plan_.seq_length() + 1)
    error = "dataset plugin '" + data_slot_.plugin.name() + "': samples of 'text' hold " +
            std::to_string(text->size(1)) + " tokens, the run needs seq_length + 1 = " +
            std::to_string(plan_.seq_length() + 1) + " (the step shifts them into seq_length tokens and their labels)";
  for (const auto& [name, t] : batch) {
    if (!error.empty()) break;
    // The buffers that hold token ids (the shipped steps read "text"; others may pass tokens and
    // labels themselves).
    if ((name != "text" && name != "tokens" && name != "labels") || !t.defined() || t.numel() == 0 ||
        at::isFloatingType(t.scalar_type()) || t.scalar_type() == at::kBool)
      continue;
    const int64_t hi = t.max().item<int64_t>(), lo = t.min().item<int64_t>();
    const std::string where = "dataset plugin '" + data_slot_.plugin.name() + "': token id ";
    const std::string batch_of = " in '" + name + "' of a training batch of iteration " + std::to_string(iteration);
    if (lo < 0) error = where + std::to_string(lo) + batch_of + " is negative";
    if (hi >= limit)
      error = where + std::to_string(hi) + batch_of + " is not below " + what + " of " + std::to_string(limit) +
              " tokens";
    if (!error.empty()) break;
  }
  // Data-parallel ranks read other samples: all decide together, before any collective of the
  // step, so a rank with good data does not wait for one that left.
  agree(error, topo_, "checking the token ids of the first batches");
}

void Trainer::check_loss(const at::Tensor& loss, const at::Tensor& stage_input) {
  const std::string step = "step plugin '" + step_slot_.plugin.name() + "'";
  const std::string model = "model plugin '" + model_slot_.plugin.name() + "'";
  std::string error;
  if (!loss.requires_grad()) {
    if (!model_->outputs_attached())
      error = model + ": forward returned outputs that do not require grad (detached from the parameters, or "
                      "computed under no_grad), so the loss of " + step + " cannot train anything";
    else
      error = step + ": forward_step returned a loss that does not require grad (detached from the outputs of " +
              model + "): nothing would train";
  } else if (!graph_checked_.count(model_->selected_chunk())) {
    std::vector<Param> listed = model_->parameters();
    if (stage_input.defined()) {  // a pipeline stage's input: its gradient goes to the previous stage
      Param in;
      in.name = "(the previous pipeline stage's output)";
      in.tensor = stage_input;
      listed.push_back(std::move(in));
    }
    error = unlisted_trained_tensors(loss, listed);
    if (!error.empty()) error = model + ": " + error;
  }
  // The first micro-batch decides on every rank together (a rank that left would make the others
  // wait at their next collective); later ones throw at once (the others' next collective then
  // fails within the collective timeout).
  if (graph_checked_.count(model_->selected_chunk())) {
    if (!error.empty()) throw HostError(error);
    return;
  }
  graph_checked_.insert(model_->selected_chunk());
  agree(error, topo_, "checking the loss of the first micro-batch");
}

TensorList Trainer::next_batch(int64_t iteration) {
  TensorList batch;
  {
    auto t = timers_.scope(Phase::kBatchGenerator);
    batch = train_loader_->next();
  }
  if (cfg_.train().check_every_batch() || iteration <= resumed_iteration_ + kCheckedIterations)
    check_batch(batch, iteration);
  return batch;
}

at::Tensor Trainer::forward_micro_batch(int64_t iteration, int64_t m,
                                        std::vector<std::pair<std::string, double>>* metrics,
                                        const std::function<void()>& before_forward, const TensorList* fetched) {
  int64_t forward_start = trace::now_ns();
  TensorList own;
  if (!fetched) own = next_batch(iteration);
  const TensorList& batch = fetched ? *fetched : own;
  if (before_forward) {
    before_forward();
    forward_start = trace::now_ns();  // the timeline shows the wait in it on its own
  }
  at::Tensor out;
  {
    auto t = timers_.scope(Phase::kForwardCompute);
    model_->reset_forward_watch();
    out = step().forward_step(*model_, batch, metrics);
  }
  if (trace::active()) {
    const std::string chunk = model_->num_chunks() > 1 ? " chunk " + std::to_string(model_->selected_chunk()) : "";
    trace::span(("forward " + std::to_string(m) + chunk).c_str(), "step", forward_start, trace::now_ns());
  }
  return out;
}

void Trainer::check_forward_output(const at::Tensor& out, const at::Tensor& stage_input) {
  if (out.dim() != 0 && out.numel() != 1)
    throw HostError("step plugin '" + step_slot_.plugin.name() + "': forward_step returned a loss of shape " +
                    Model::shape_str(out) + ", expected a scalar");
  check_loss(out, stage_input);
}

void Trainer::backward_micro_batch(int64_t iteration, int64_t m, int64_t num_micro, double scale, const at::Tensor& out,
                                   const at::Tensor& out_grad, int64_t pass, int64_t passes) {
  strategy_->before_backward(pass < 0 ? m : pass, passes < 0 ? num_micro : passes);
  const int64_t backward_start = trace::now_ns();
  auto t = timers_.scope(Phase::kBackwardCompute);
  try {
    if (out_grad.defined()) {
      out.backward(out_grad);  // a stage before the last: the gradient the next stage sent
    } else {
      // Megatron scales each micro-batch loss by 1/num_microbatches so gradients average.
      at::Tensor scaled = out.reshape({}) / static_cast<double>(num_micro);
      if (scale != 1.0) scaled = scaled * scale;  // loss scaling
      if (m == 0 && nonfinite_iterations_.count(iteration)) scaled = scaled * INFINITY;  // test hook
      scaled.backward();
    }
  } catch (const HostError&) {
    throw;
  } catch (const std::exception& e) {
    // Autograd runs the model's and the step's backward functions, and the strategy's module
    // hooks where it installed them (ZeRO-3): name them all.
    VLOG(1) << "backward failed: " << e.what();
    const std::string hooks = strategy_->hooks_model() ? " and the module hooks of strategy plugin '" +
                                                              strategy_slot_.plugin.name() + "'"
                                                        : "";
    throw HostError("backward of the loss of step plugin '" + step_slot_.plugin.name() + "' through model plugin '" +
                    model_slot_.plugin.name() + "'" + hooks + " failed: " + one_line(e.what()));
  }
  if (trace::active()) {
    const std::string chunk = model_->num_chunks() > 1 ? " chunk " + std::to_string(model_->selected_chunk()) : "";
    trace::span(("backward " + std::to_string(m) + chunk).c_str(), "step", backward_start, trace::now_ns());
  }
}

// One iteration, Megatron's train_step: every micro-batch's forward step and backward, then the
// strategy's gradient reduction, clipping and the optimizer step. A step whose gradients are not
// finite is skipped (DTK skips in every precision; Megatron only under fp16 loss scaling).
IterationResult Trainer::train_step(int64_t iteration) {
  reset_traffic();  // the iteration's communication volume, for the first report
  reset_comm_timing();
  IterationResult r;
  r.iteration = iteration;
  const double learning_rate = schedule_.rate(progress_.scheduler_step);  // what this update uses
  const int64_t num_micro = plan_.micro_batches_of(iteration);  // changes during a batch-size ramp-up
  const double scale = scaler_.scale();  // this iteration's loss scale
  std::optional<Timers::Scope> forward_backward(std::in_place, timers_, Phase::kForwardBackward);
  if (virtual_stages() > 1) {
    interleaved_forward_backward(iteration, num_micro, scale, r);
  } else if (topo_.pp_size > 1) {
    pipeline_forward_backward(iteration, num_micro, scale, r);
  } else {
    for (int64_t m = 0; m < num_micro; ++m) {
      std::vector<std::pair<std::string, double>> metrics;
      const at::Tensor loss = forward_micro_batch(iteration, m, &metrics);
      check_forward_output(loss);
      backward_micro_batch(iteration, m, num_micro, scale, loss, at::Tensor());
      r.metrics.add(metrics);
    }
  }
  forward_backward.reset();
  const int64_t reduce_start = trace::now_ns();
  {
    auto t = timers_.scope(Phase::kGradsReduce);
    strategy_->reduce_gradients();
    if (tied_numel_ > 0) sync_tied_gradients();  // Megatron's embedding-group all-reduce
  }
  std::optional<Timers::Scope> optimizer(std::in_place, timers_, Phase::kOptimizer);
  std::optional<Timers::Scope> clip(std::in_place, timers_, Phase::kOptimizerClip);
  // The strategy sees the scaled gradients: the clip threshold is scaled with them (clipping the
  // scaled gradients to clip x scale is clipping the true ones to clip) and the norm unscaled.
  // The norm is global over data and tensor parallel ranks, so every rank finds the same
  // overflow and skips the same iterations (Megatron all-reduces found_inf).
  const double scaled_norm = strategy_->clip_and_norm(cfg_.train().clip_grad() * scale);
  r.grad_norm = scaled_norm / scale;
  clip.reset();
  if (cfg_.logging().log_num_zeros_in_grad()) r.num_zeros = num_zeros_in_grad();
  if (trace::active()) trace::span("reduce gradients, norm", "step", reduce_start, trace::now_ns());
  const int64_t update_start = trace::now_ns();
  r.skipped = !std::isfinite(scaled_norm);
  scaler_.update(/*found_inf=*/r.skipped);
  r.loss_scale = scaler_.scale();
  if (!r.skipped) {
    // The optimizer divides the gradients by the scale they carry.
    const dtk_optimizer_step_args args{dtk_optimizer_step_args_STRUCT_SIZE, learning_rate, iteration, scale,
                                       schedule_.weight_decay_scale(progress_.scheduler_step)};
    {
      auto t = timers_.scope(Phase::kOptimizerStep);
      // An offloaded optimizer's state is host memory, wherever the process allocates it.
      std::optional<memory::HostScope> host;
      if (strategy_->info().optimizer_on_host) host.emplace();
      strategy_->optimizer_step(*optimizer_, args);
    }
    // The scheduler advances only after a successful update; during a ramp-up it counts samples.
    progress_.scheduler_step += plan_.ramps_up() ? plan_.global_batch_of(iteration) : 1;
  }
  optimizer.reset();
  // Megatron logs the optimizer's rate after the scheduler step: the next update's.
  r.learning_rate = schedule_.rate(progress_.scheduler_step);
  r.global_batch_size = plan_.global_batch_of(iteration);
  r.consumed_samples = plan_.consumed_before(iteration + 1);
  if (trace::active()) trace::span("optimizer step", "step", update_start, trace::now_ns());
  if (!memory_reported_ && log_->logs(iteration)) {
    r.memory = memory_sample();
    memory_reported_ = true;
  }
  if (cfg_.logging().log_params_norm() && log_->logs(iteration)) r.params_norm = params_norm();
  strategy_->zero_grad();
  r.tensor_parallel_comm = comm_timing(DTK_GROUP_TENSOR_PARALLEL);
  r.data_parallel_comm = comm_timing(DTK_GROUP_DATA_PARALLEL);
  r.micro_batches = num_micro;  // (pipeline_parallel_comm: taken by the schedule, before its other collectives)
  return r;
}

// Megatron's calc_params_l2_norm: every parameter once (a tensor-parallel shard on each TP rank,
// a replicated tensor on TP rank 0 only, tied weights once), summed over the model-parallel group.
// Under ZeRO-3 the parameters are gathered for it (a collective, at log intervals only).
double Trainer::params_norm() {
  const bool partitioned = strategy_->info().partitions_parameters != 0;
  if (partitioned) strategy_->gather_parameters(true);
  // Summed on the training device (one host sync at the end; every rank the same backend).
  at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(training_device()));
  {
    at::NoGradGuard no_grad;
    std::set<const void*> seen;
    for (const Param& p : model_->parameters()) {
      if (!seen.insert(p.tensor.unsafeGetTensorImpl()).second) continue;
      if (!p.info.tensor_parallel && topo_.tp_rank != 0) continue;
      if (p.info.shared && topo_.pp_rank != 0) continue;  // a tied weight, counted on the first stage
      total += sum_of_squares(p.tensor).to(total.device());  // offloaded parameters live on the host
    }
  }
  if (partitioned) strategy_->gather_parameters(false);
  if (topo_.tp_size * topo_.pp_size > 1) all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM).wait();
  return std::sqrt(total.item<double>());
}

// Megatron's count_zeros_fp32: zero entries of the gradients the optimizer steps, every element of
// the model once: a tensor-parallel shard on each TP rank, a replicated tensor on TP rank 0 only;
// under a sharded strategy (ZeRO) each data-parallel rank counts its own shard, else one DP rank's
// (replicated) gradients stand for all. Tied tensors count once.
double Trainer::num_zeros_in_grad() {
  at::Tensor total = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(training_device()));
  {
    at::NoGradGuard no_grad;
    std::set<const void*> seen;
    for (const Param& p : optimizer_->params()) {
      const at::Tensor& g = p.tensor.grad();
      if (!g.defined() || !seen.insert(p.tensor.unsafeGetTensorImpl()).second) continue;
      if (!p.info.tensor_parallel && topo_.tp_rank != 0) continue;
      if (p.info.shared && topo_.pp_rank != 0) continue;  // a tied weight, counted on the first stage
      total += (g == 0).sum().to(total.device(), at::kDouble);
    }
  }
  const bool sharded = strategy_->info().sharded_state != 0;
  if (sharded && topo_.world_size > 1)
    all_reduce(total, DTK_GROUP_WORLD, DTK_REDUCE_SUM).wait();
  else if (topo_.tp_size * topo_.pp_size > 1)
    all_reduce(total, DTK_GROUP_MODEL_PARALLEL, DTK_REDUCE_SUM).wait();
  return total.item<double>();
}

// What this rank holds at the end of the step, before the gradients are cleared.
MemorySample Trainer::memory_sample() const {
  MemorySample m;
  m.allocator = memory::stats();
  m.strategy = strategy_->memory_usage();
  m.optimizer_on_host = strategy_->info().optimizer_on_host != 0;
  m.data_parallel = traffic(DTK_GROUP_DATA_PARALLEL);
  m.tensor_parallel = traffic(DTK_GROUP_TENSOR_PARALLEL);
  m.pipeline_parallel = traffic(DTK_GROUP_PIPELINE_PARALLEL);
  m.dp_size = topo_.dp_size;
  m.tp_size = topo_.tp_size;
  m.pp_size = topo_.pp_size;
  std::set<const void*> seen;  // count each storage once (views, shared buffers)
  for (const auto& [name, t] : optimizer_->state_save()) {
    if (!t.defined() || !seen.insert(t.storage().data()).second) continue;
    m.optimizer_state_bytes += static_cast<int64_t>(t.storage().nbytes());
  }
  return m;
}

void Trainer::train() {
  log_->print("[" + timestamp() + "] training: " + std::to_string(plan_.train_iters()) + " iterations, global batch " +
              std::to_string(plan_.global_batch_size()) + " (" + std::to_string(plan_.micro_batches_per_step()) +
              " micro-batches of " + std::to_string(plan_.micro_batch_size()) + "), seq " +
              std::to_string(plan_.seq_length()) +
              (plan_.ramps_up() ? ", ramping up from " + std::to_string(plan_.global_batch_of(1)) + " (" +
                                      cfg_.train().rampup_batch_size() + ") over the first " +
                                      std::to_string(plan_.ramp_iterations()) + " iterations"
                                : std::string()));
  ExitConditions exit(cfg_.train(), topo_);
  model_->set_training(true);
  strategy_->zero_grad();
  const int64_t eval_interval = cfg_.eval().eval_interval(), save_interval = cfg_.checkpoint().save_interval();
  const bool saving = !cfg_.checkpoint().save().empty();
  if (!saving && save_interval > 0 && topo_.world_rank == 0)
    std::printf(" > checkpoint.save_interval %lld has no effect without checkpoint.save (as Megatron's --save-interval "
                "without --save)\n",
                static_cast<long long>(save_interval));
  for (int64_t it = progress_.iteration + 1; it <= plan_.train_iters(); ++it) {
    trace::begin_iteration(it);
    const auto step_start = std::chrono::steady_clock::now();
    IterationResult result = train_step(it);
    if (bench_ && it - resumed_iteration_ > cfg_.train().perf_warmup_steps())
      bench_->add_step(std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count(),
                       StepComm{result.tensor_parallel_comm.in_flight_ms, result.tensor_parallel_comm.exposed_ms,
                                result.data_parallel_comm.in_flight_ms, result.data_parallel_comm.exposed_ms});
    log_->record(result);
    trace::end_iteration(it);
    progress_.iteration = it;
    progress_.consumed_train_samples = plan_.consumed_before(it + 1);
    if (eval_interval > 0 && it % eval_interval == 0 && it != plan_.train_iters()) {
      evaluate(DTK_SPLIT_VALID, "validation", "iteration " + std::to_string(it), it);
      progress_.consumed_valid_samples += plan_.eval_iters() * plan_.global_batch_size();
    }
    if (saving && save_interval > 0 && it % save_interval == 0) save(it);
    if (it == plan_.train_iters()) break;
    // Megatron's checkpoint_and_decide_exit: every rank agrees, saves, and leaves the loop.
    const std::string why = exit.check(it);
    if (!why.empty()) {
      if (saving && last_saved_ != it) save(it);
      log_->print(" exiting program " + why + ": stopped after iteration " + std::to_string(it) + " of " +
                  std::to_string(plan_.train_iters()) +
                  (saving ? "; resume with --set checkpoint.load=" + cfg_.checkpoint().save()
                          : " (no checkpoint: checkpoint.save is not set)"));
      stopped_early_ = true;
      break;
    }
  }
  trace::flush();  // a run shorter than the traced range writes what it traced
  // As Megatron with --save: a final checkpoint unless the last iteration was just saved.
  if (!stopped_early_ && saving && last_saved_ != plan_.train_iters() && resumed_iteration_ < plan_.train_iters())
    save(plan_.train_iters());
  if (bench_) {
    // Every rank again, as at the start (ranks sharing a host's cores measure it together).
    if (peak_measured_) bench_->raise_peak(measure_matmul_tflops());
    print_bench_summary();
  }
}

void Trainer::print_bench_summary() {
  if (topo_.world_rank != 0) return;
  for (const auto& line : bench_->lines()) log_->print(line);
  const std::string& path = cfg_.logging().bench_out();
  if (path.empty()) return;
  write_file_atomically(path, bench_->json().str() + "\n");
  log_->print(" wrote the performance summary to " + path);
}

// Megatron's evaluate_and_print_results: eval_iters global batches of `split`, no gradients.
// Validation continues through its split across evaluations (and across a resume: the loop
// advances consumed_valid_samples after each periodic one); test starts at its beginning.
void Trainer::evaluate(int32_t split, const char* what, const std::string& label, int64_t iteration) {
  TrainingLog::Excluded not_training_time(*log_);
  auto timer = timers_.scope(Phase::kEvaluate);
  const int64_t eval_iters = plan_.eval_iters(), gbs = plan_.global_batch_size();
  const int64_t first_batch = split == DTK_SPLIT_VALID ? progress_.consumed_valid_samples / gbs : 0;
  if (eval_iters <= 0 || data_->num_samples(split) < (first_batch + eval_iters) * gbs) {
    if (eval_iters > 0) LOG(WARNING) << "skipping " << what << " evaluation: the split has too few samples";
    return;
  }
  const int64_t num_batches = eval_iters * plan_.micro_batches_per_step();
  BatchLoader loader(*data_, split, plan_.micro_batch_size(), num_batches,
                     [this, first_batch](int64_t k, int64_t j) { return plan_.sample_index(first_batch, k, j); });
  model_->set_training(false);
  MetricAverager metrics;
  {
    at::NoGradGuard no_grad;
    if (virtual_stages() > 1) {
      interleaved_evaluate(loader, num_batches, metrics);
    } else if (topo_.pp_size > 1) {
      pipeline_evaluate(loader, num_batches, metrics);
    } else {
      for (int64_t k = 0; k < num_batches; ++k) {
        std::vector<std::pair<std::string, double>> m;
        step().forward_step(*model_, loader.next(), &m);
        metrics.add(m);
      }
    }
  }
  model_->set_training(true);
  log_->report_evaluation(what, label, iteration, metrics);
}

void Trainer::save(int64_t iteration) {
  TrainingLog::Excluded not_training_time(*log_);
  auto timer = timers_.scope(Phase::kSaveCheckpoint);
  progress_.grad_scaler.reset();
  if (scaler_.dynamic()) progress_.grad_scaler = scaler_.state();
  progress_.schedule = schedule_.params();
  const std::string& dir = cfg_.checkpoint().save();
  const SaveReport r =
      save_checkpoint(dir, progress_, *model_, *optimizer_, *strategy_, to_text(cfg_), writers_, topo_,
                      cfg_.checkpoint().keep_last());
  last_saved_ = iteration;
  char buf[64];
  std::snprintf(buf, sizeof buf, " (%.1f MB, %.2f s)", r.megabytes, r.seconds);
  std::string removed;
  for (int64_t it : r.removed) removed += (removed.empty() ? "; removed iteration " : ", ") + std::to_string(it);
  if (!removed.empty()) removed += " (checkpoint.keep_last=" + std::to_string(cfg_.checkpoint().keep_last()) + ")";
  log_->print(" saved checkpoint at iteration " + std::to_string(iteration) + " to " + dir + buf + removed);
}

void Trainer::final_evaluation() {
  // Megatron's labels for the evaluation after training.
  const std::string at = "iteration " + std::to_string(plan_.train_iters());
  evaluate(DTK_SPLIT_VALID, "validation", at + " on validation set", plan_.train_iters());
  evaluate(DTK_SPLIT_TEST, "test", at + " on test set", plan_.train_iters());
}

}  // namespace dtk::core
