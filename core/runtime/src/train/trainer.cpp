#include "dtk/core/train/trainer.hpp"

#include <ATen/ATen.h>
#include <glog/logging.h>
#include <dtk/gemm.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>

#include "../device/cuda_glue.hpp"
#include "dtk/core/checkpoint/checkpoint_model.hpp"
#include "dtk/core/comm/comm.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/core/launch/distributed.hpp"
#include "dtk/core/memory/allocator.hpp"
#include "dtk/core/memory/memory.hpp"
#include "dtk/core/perf/startup_report.hpp"
#include "dtk/core/timeline/trace.hpp"
#include "dtk/core/train/resume.hpp"
#include "dtk/core/train/run_schedule.hpp"
#include "dtk/core/train/step_metrics.hpp"

namespace dtk::core {

namespace {

// Checks every rank makes before any work; all fail together (a rank that left would make the
// others wait at their next collective).
template <class Check>
void on_every_rank(const Topology& topo, const char* what, Check&& check) {
  std::string error;
  try {
    check();
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree(error, topo, what);
}

void configure_trace(const config::LoggingConfig& logging, const Topology& topo) {
  if (logging.trace_file().empty()) return;
  trace::Settings ts;
  ts.path = logging.trace_file();
  trace::parse_iterations("logging.trace_iterations",
                          logging.trace_iterations().empty() ? "2-3" : logging.trace_iterations(), &ts.first, &ts.last);
  ts.rank = topo.world_rank;
  ts.world_size = topo.world_size;
  trace::configure(ts);
}

std::string training_banner(const BatchPlan& plan, const config::TrainingConfig& train) {
  std::string ramp;
  if (plan.ramps_up() && !plan.steps_batch())
    ramp = ", ramping up from " + std::to_string(plan.global_batch_of(1)) + " (" + train.rampup_batch_size() +
           ") over the first " + std::to_string(plan.ramp_iterations()) + " iterations";
  std::string tokens_end;
  if (plan.ends_on_tokens())
    tokens_end = "; train.train_tokens " + std::to_string(train.train_tokens()) + " ends it after iteration " +
                 std::to_string(plan.final_iteration()) + " (" +
                 std::to_string(plan.tokens_before(plan.final_iteration() + 1)) + " tokens)";
  const std::string curriculum = plan.curriculum().active() ? "; " + plan.curriculum().describe() : "";
  const SamplerChoice sampler = sampler_choice(train);
  const std::string order =
      sampler.cyclic ? std::string("; samples in random order every epoch (") + sampler_name(sampler) + ")" : "";
  // Under a schedule the configured batch is validation's and test's only.
  const std::string batch = plan.steps_batch()
                                ? "global batch " + plan.describe_batch_steps() +
                                      " (train.step_batch_size_schedule), micro-batches of " +
                                      std::to_string(plan.micro_batch_size()) + ", validation batch " +
                                      std::to_string(plan.global_batch_size())
                                : "global batch " + std::to_string(plan.global_batch_size()) + " (" +
                                      std::to_string(plan.micro_batches_per_step()) + " micro-batches of " +
                                      std::to_string(plan.micro_batch_size()) + ")";
  return "[" + timestamp() + "] training: " + std::to_string(plan.train_iters()) + " iterations, " + batch + ", seq " +
         std::to_string(plan.seq_length()) + ramp + curriculum + order + tokens_end;
}

// A strategy whose parameters are not whole outside its hooks while its state is replicated
// (ddp's overlap_param_gather) leaves updates to the next forward (abi.md, dtk_strategy_info).
bool defers_updates(const StrategyInstance& strategy) {
  const dtk_strategy_info info = strategy.info();
  return info.partitions_parameters && !info.sharded_state;
}

}  // namespace

Trainer::Trainer(const config::RunConfig& cfg, host::PluginHost& plugins, TrainerHooks hooks)
    : cfg_(cfg),
      topo_(initialize(cfg, plugins)),
      plan_(cfg, topo_),
      schedule_(make_run_schedule(cfg, plan_)),
      scaler_(cfg.train()),
      timers_(cfg.logging().timing_log_level()),
      plugins_(resolve_plugins(plugins, cfg)),
      writers_(plugin_lines(cfg, plugins)),
      peak_(find_peak_throughput(cfg, training_device())) {  // before the model takes memory and threads
#if DTK_HAVE_CUDA
  if (const c10::Device device = training_device(); device.is_cuda())
    timers_.set_device_clock(cuda_glue::make_event_clock(device.index(), collective_timeout()));
#endif
  on_every_rank(topo_, "checking the output paths", [&] {
    check_output_paths(cfg_);
    if (const std::string ahead =
            save_folder_ahead_of_run(cfg_.checkpoint(), plan_.final_iteration(), plan_.ends_on_tokens());
        !ahead.empty())
      throw host::HostError(ahead);
  });
  parts_ = setup_model_and_optimizer(cfg_, topo_, plan_, plugins_, schedule_);
  on_every_rank(topo_, "checking the strategy's gradients", [&] { refuse_unreadable_gradients(); });
  tied_ = std::make_unique<TiedGradients>(*parts_.model, *parts_.optimizer, topo_, plugins_.model.name(),
                                          plugins_.strategy.name());
  sequence_parallel_ = std::make_unique<SequenceParallelGradients>(*parts_.optimizer, topo_);
  num_experts_ = num_experts(parts_.model->info());
  layer_metrics_ = std::make_unique<LayerMetrics>(num_experts_ > 0);
  on_every_rank(topo_, "estimating the memory of the run", [&] { check_run_memory(cfg_, topo_, plan_, parts_); });
  log_ = make_log();
  configure_trace(cfg_.logging(), topo_);
  profile_ = make_op_profile();
  progress_ = resume_from_checkpoint(cfg_, plan_, topo_, parts_, schedule_, scaler_,
                                     [this](const std::string& line) { log_->print(line); });
  resumed_iteration_ = progress_.iteration;
  std::string betas_note;  // after the resume: the checkpoint's schedule may be the one that runs
  hands_betas_ = hands_optimizer_betas(schedule_.params(), plugins_, betas_note);
  if (hands_betas_) check_cycled_momentum(schedule_.params(), plan_.train_iters());
  if (!betas_note.empty()) log_->print(betas_note);
  print_startup_report();
  bench_ = make_bench_report();
  data_ = build_dataset(cfg_, topo_, plan_, plugins_.data, *parts_.model);
  for (const ValidationSetSpec& set : resolve_validation_sets(cfg_, plugins_.data))
    validation_sets_.push_back(
        {"validation-" + set.name, build_validation_set(cfg_, topo_, plan_, set, *parts_.model)});
  // eval.skip_train reads no training sample, and validates from the split's start (Megatron's
  // validation loader under --skip-train starts at 0).
  if (plan_.skip_train())
    progress_.consumed_valid_samples = 0;
  else
    train_loader_ = make_train_loader(*data_, plan_, cfg_.train(), topo_, progress_.iteration + 1);
  valid_loader_start_ = progress_.consumed_valid_samples;
  start_micro_batches(std::move(hooks));
}

Trainer::~Trainer() = default;

// Such a strategy keeps the reduced gradients sharded over data-parallel ranks until the next
// forward: the host cannot count their zeros (a sharded-state strategy hands the optimizer its
// shards, whose zeros add up).
void Trainer::refuse_unreadable_gradients() const {
  if (cfg_.logging().log_num_zeros_in_grad() && defers_updates(*parts_.strategy))
    throw host::HostError("logging.log_num_zeros_in_grad: strategy plugin '" + plugins_.strategy.name() +
                          "' keeps the reduced gradients sharded over data-parallel ranks until the next forward "
                          "(ddp: overlap_param_gather=true), so their zeros cannot be counted; drop one of them");
}

std::unique_ptr<trace::OpProfile> Trainer::make_op_profile() {
  const config::LoggingConfig& logging = cfg_.logging();
  if (logging.profile_steps().empty()) return nullptr;
  trace::OpProfile::Settings s;
  trace::parse_iterations("logging.profile_steps", logging.profile_steps(), &s.first, &s.last);
  s.dir = logging.profile_dir().empty() ? "profile" : logging.profile_dir();
  s.rank = topo_.world_rank;
  s.cuda = training_device().is_cuda();
  if (topo_.world_rank == 0) s.print = [this](const std::string& table) { log_->print(table); };
  return std::make_unique<trace::OpProfile>(std::move(s));
}

std::unique_ptr<TrainingLog> Trainer::make_log() {
  TrainingLog::Setup log;
  log.train_iters = plan_.train_iters();
  log.final_iteration = plan_.final_iteration();
  log.log_interval = cfg_.logging().log_interval();
  log.global_batch_size = plan_.global_batch_size();
  log.seq_length = plan_.seq_length();
  log.world_size = topo_.world_size;
  log.tp_size = topo_.tp_size, log.dp_size = topo_.dp_size, log.pp_size = topo_.pp_size, log.ep_size = topo_.ep_size;
  log.cp_size = topo_.cp_size;
  log.virtual_stages = virtual_stages(cfg_);
  log.printer = topo_.world_rank == 0;
  log.tensorboard_dir = cfg_.logging().tensorboard_dir();
  log.metrics_jsonl = cfg_.logging().metrics_jsonl();
  log.peak_tflops = peak_.tflops;
  log.tensorboard_log_interval = cfg_.logging().tensorboard_log_interval();
  log.timers = &timers_;
  log.topo = &topo_;
  log.flops_per_token = parts_.stats.flops_per_token;
  log.attention_flops_per_position = parts_.stats.attention_flops_per_position;
  log.curriculum = plan_.curriculum().active();
  return std::make_unique<TrainingLog>(log);
}

// The start-up lines (perf/startup_report.hpp).
void Trainer::print_startup_report() {
  StartupFacts f;
  f.stats = parts_.stats;
  const dtk_model_info info = parts_.model->info();
  f.num_layers = info.num_layers, f.hidden_size = info.hidden_size, f.seq_length = plan_.seq_length();
  f.world_size = topo_.world_size;
  f.bf16_line = bf16_speed_line(cfg_);
  if (!training_device().is_cuda()) f.cpu_gemm_engine = dtk::cpu_gemm_engine();
  f.malloc_name = malloc_name();
  f.loss_scaling = scaler_.kind() != GradScaler::Kind::kNone;
  f.dynamic_scale = scaler_.dynamic(), f.loss_scale = scaler_.scale();
  for (const std::string& line : startup_report(f)) log_->print(line);
}

// Bench mode or --bench_out: the summary printed (and written) at the end.
std::unique_ptr<BenchReport> Trainer::make_bench_report() const {
  if (cfg_.train().bench_steps() <= 0 && cfg_.logging().bench_out().empty()) return nullptr;
  BenchSetup b;
  b.warmup_steps = cfg_.train().perf_warmup_steps();
  b.tokens_per_iteration = plan_.global_batch_size() * plan_.seq_length();
  b.flops_per_token = parts_.stats.flops_per_token;
  b.world_size = topo_.world_size;
  b.peak_tflops = peak_.tflops, b.peak_source = peak_.source;
  b.tp_size = topo_.tp_size, b.dp_size = topo_.dp_size, b.ep_size = topo_.ep_size, b.cp_size = topo_.cp_size;
  return std::make_unique<BenchReport>(b);
}

// The micro-batch runner and the schedule it runs under, chosen once (Megatron's
// get_forward_backward_func).
void Trainer::start_micro_batches(TrainerHooks hooks) {
  MicroBatchParts p;
  p.cfg = &cfg_, p.topo = &topo_, p.plan = &plan_, p.timers = &timers_;
  p.model = parts_.model.get(), p.strategy = parts_.strategy.get(), p.steps = &parts_.steps;
  p.data = data_.get(), p.train_loader = train_loader_.get();
  p.stage_dtype = to_scalar_type(build_context(cfg_, topo_, plan_, plugins_.model).params_dtype);
  p.model_name = plugins_.model.name(), p.step_name = plugins_.step.name();
  p.strategy_name = plugins_.strategy.name(), p.dataset_name = plugins_.data.name();
  p.resumed_iteration = resumed_iteration_;
  p.per_token_loss = cfg_.train().calculate_per_token_loss();
  std::unique_ptr<StepRecorder> recorder = step_recorder(hooks);
  p.hooks = std::move(hooks);
  runner_ = std::make_unique<MicroBatchRunner>(std::move(p));
  forward_backward_ = make_schedule(*runner_, virtual_stages(cfg_), std::move(recorder));
}

// train.cuda_graphs: what records the micro-batches, or nullptr and (when asked) one line why not.
std::unique_ptr<StepRecorder> Trainer::step_recorder(const TrainerHooks& hooks) const {
  CaptureSetup s;
  s.asked = cfg_.train().cuda_graphs();
  s.cuda_device = training_device().is_cuda();
  s.torch_cuda = DTK_TORCH_CUDA != 0;
  s.probe = hooks.cuda_graph_probe;
  s.tp_size = topo_.tp_size, s.pp_size = topo_.pp_size, s.dp_size = topo_.dp_size;
  s.virtual_stages = virtual_stages(cfg_);
  s.strategy = plugins_.strategy.name();
  s.loss_hook = static_cast<bool>(hooks.scaled_loss);
  s.per_token_loss = cfg_.train().calculate_per_token_loss();
  s.num_experts = num_experts_;
  s.curriculum = cfg_.train().curriculum_schedule();
  if (const std::string refusal = cuda_graphs_refusal(s); !refusal.empty()) {
    if (s.asked && topo_.world_rank == 0) std::printf(" > train.cuda_graphs: off: %s\n", refusal.c_str());
    return nullptr;
  }
  if (!s.cuda_device) return make_probe_recorder();
  return make_cuda_graph_recorder(training_device().index());
}

// One iteration, Megatron's train_step: the schedule's forward steps and backwards, then the
// strategy's gradient reduction, clipping and the optimizer step.
IterationResult Trainer::train_step(int64_t iteration) {
  reset_traffic();  // the iteration's communication volume, for the first report
  reset_comm_timing();
  IterationResult r;
  r.iteration = iteration;
  const int64_t num_micro = plan_.micro_batches_of(iteration);  // changes during a batch-size ramp-up
  const double scale = scaler_.scale();                         // this iteration's loss scale
  r.seq_length = plan_.seq_length_of(iteration);                // a curriculum's length
  {
    auto t = timers_.scope(Phase::kForwardBackward);
    runner_->set_sequence_length(r.seq_length);
    // Evaluation (and whatever runs after a failure) at train.seq_length.
    const std::shared_ptr<void> full_length(nullptr, [this](void*) { runner_->set_sequence_length(0); });
    forward_backward_->train(iteration, num_micro, scale, r);
  }
  layer_metrics_->collect(num_micro, topo_, r.metrics);
  const int64_t activation_bytes = runner_->take_activation_bytes();
  reduce_clip_and_update(iteration, scale * gradient_token_factor(), r);
  check_skipped_in_a_row(r);
  // Megatron logs the optimizer's rate after the scheduler step: the next update's.
  r.learning_rate = schedule_.rate(progress_.scheduler);
  r.global_batch_size = plan_.global_batch_of(iteration);
  r.consumed_samples = plan_.consumed_before(iteration + 1);
  if (!memory_reported_ && log_->logs(iteration)) {
    // A strategy that leaves updates to the next forward (ddp's overlap_param_gather) lands them
    // first, so the optimizer state their first step creates is in the report.
    const bool defers = defers_updates(*parts_.strategy);
    if (defers) parts_.strategy->gather_parameters(true);
    r.memory = memory_sample(*parts_.optimizer, *parts_.strategy, topo_);
    if (defers) parts_.strategy->gather_parameters(false);
    r.memory->activation_bytes = activation_bytes;
    memory_reported_ = true;
  }
  if (cfg_.logging().log_params_norm() && log_->logs(iteration))
    r.params_norm = params_norm(*parts_.model, *parts_.strategy, topo_);
  parts_.strategy->zero_grad();
  r.tensor_parallel_comm = comm_timing(DTK_GROUP_TENSOR_PARALLEL);
  r.expert_parallel_comm = comm_timing(DTK_GROUP_EXPERT_PARALLEL);
  r.context_parallel_comm = comm_timing(DTK_GROUP_CONTEXT_PARALLEL);
  // (Expert parallelism's experts reduce, and zero gathers them, over the expert-data-parallel group.)
  r.data_parallel_comm = comm_timing({DTK_GROUP_DATA_PARALLEL, DTK_GROUP_EXPERT_DATA_PARALLEL});
  r.micro_batches = num_micro;  // (pipeline_parallel_comm: taken by the schedule, before its other collectives)
  return r;
}

void Trainer::check_skipped_in_a_row(const IterationResult& r) {
  // A dynamic scale changes between overflows (fp16 starts at 2^32 and halves its way down); any
  // other skip leaves the next step where this one was.
  skipped_in_a_row_ = r.skipped && !scaler_.dynamic() ? skipped_in_a_row_ + 1 : 0;
  const int64_t limit = cfg_.train().skipped_steps_limit() == 0 ? 10 : cfg_.train().skipped_steps_limit();
  if (limit < 0 || skipped_in_a_row_ < limit) return;
  const auto number = [](double v) {
    if (std::isnan(v)) return std::string("nan");  // not printf's "-nan"
    char text[32];
    std::snprintf(text, sizeof text, "%g", v);
    return std::string(text);
  };
  throw host::HostError(
      "train: " +
      (limit == 1 ? "iteration " + std::to_string(r.iteration)
                  : "iterations " + std::to_string(r.iteration - limit + 1) + "-" + std::to_string(r.iteration)) +
      " had gradients that are not finite (grad norm " + number(r.grad_norm) +
      ") and were skipped; without a dynamic loss scale nothing changes between such steps: the weights or the data "
      "are "
      "broken (lr.lr " +
      number(cfg_.lr().lr()) + ", lr.weight_decay " + number(cfg_.lr().weight_decay()) +
      "?). Stopped before saving; train.skipped_steps_limit=-1 skips on");
}

// What the reduced gradients carry besides the loss scale. 1, except under
// train.calculate_per_token_loss (Megatron-LM's --calculate-per-token-loss): each micro-batch's
// backward ran on its summed loss, and the strategy averaged over the data-parallel ranks, so the
// gradients are (tokens of the global batch / data-parallel size) times the per-token mean's.
// Megatron clamps the count to at least 1; the last stage's TP rank 0 of each replica counts.
double Trainer::gradient_token_factor() {
  if (!cfg_.train().calculate_per_token_loss()) return 1.0;
  at::Tensor tokens = runner_->take_tokens();
  if (topo_.tp_rank != 0) tokens.zero_();
  if (topo_.world_size > 1) all_reduce(tokens, DTK_GROUP_WORLD, DTK_REDUCE_SUM).wait();
  return std::max(tokens.item<double>(), 1.0) / topo_.dp_size;
}

// Each optimizer group's rate for this update when a group has its own peak or floor (lr.param_rules
// max_lr/min_lr), in the groups' order; empty otherwise (every group then runs at lr x lr_scale).
const std::vector<double>& Trainer::group_rates() {
  group_lr_.clear();
  const auto& specs = parts_.optimizer->group_specs();
  if (std::none_of(specs.begin(), specs.end(), [](const GroupSpec& s) { return s.own_schedule(); })) return group_lr_;
  const LrParams& p = schedule_.params();
  for (const GroupSpec& s : specs)
    group_lr_.push_back(schedule_.rate(progress_.scheduler, s.max_lr.value_or(p.max_lr), s.min_lr.value_or(p.min_lr)) *
                        s.lr_scale);
  return group_lr_;
}

// A step whose gradients are not finite is skipped (DTK skips in every precision; Megatron only
// under fp16 loss scaling).
void Trainer::reduce_clip_and_update(int64_t iteration, double scale, IterationResult& r) {
  const double learning_rate = schedule_.rate(progress_.scheduler);  // what this update uses
  const int64_t reduce_start = trace::now_ns();
  {
    auto t = timers_.scope(Phase::kGradsReduce);
    parts_.strategy->reduce_gradients();
    if (tied_->active()) tied_->sync(*parts_.optimizer);  // Megatron's embedding-group all-reduce
    if (sequence_parallel_->active()) sequence_parallel_->sync(*parts_.optimizer);
  }
  auto optimizer = timers_.scope(Phase::kOptimizer);
  {
    // The strategy sees the scaled gradients: the clip threshold is scaled with them (clipping the
    // scaled gradients to clip x scale is clipping the true ones to clip) and the norm unscaled.
    // The norm is global over data and tensor parallel ranks, so every rank finds the same
    // overflow and skips the same iterations (Megatron all-reduces found_inf).
    auto clip = timers_.scope(Phase::kOptimizerClip);
    const double scaled_norm = parts_.strategy->clip_and_norm(cfg_.train().clip_grad() * scale);
    r.grad_norm = scaled_norm / scale;
    r.skipped = !std::isfinite(scaled_norm);
  }
  if (cfg_.logging().log_num_zeros_in_grad())
    r.num_zeros = num_zeros_in_grad(*parts_.optimizer, *parts_.strategy, topo_);
  if (trace::active()) trace::span("reduce gradients, norm", "step", reduce_start, trace::now_ns());
  const int64_t update_start = trace::now_ns();
  scaler_.update(/*found_inf=*/r.skipped);
  r.loss_scale = scaler_.scale();
  if (!r.skipped) {
    // The optimizer divides the gradients by the scale they carry.
    const std::vector<double>& group_lr = group_rates();
    dtk_optimizer_step_args args{dtk_optimizer_step_args_STRUCT_SIZE,
                                 learning_rate,
                                 iteration,
                                 scale,
                                 schedule_.weight_decay_scale(progress_.scheduler.step),
                                 group_lr.empty() ? nullptr : group_lr.data(),
                                 group_lr.size()};
    if (const auto betas = hands_betas_ ? schedule_.betas(progress_.scheduler) : std::nullopt)
      args.has_betas = 1, args.beta1 = betas->beta1, args.beta2 = betas->beta2;
    {
      auto t = timers_.scope(Phase::kOptimizerStep);
      // An offloaded optimizer's state is host memory, wherever the process allocates it.
      std::optional<memory::HostScope> host;
      if (parts_.strategy->info().optimizer_on_host) host.emplace();
      parts_.strategy->optimizer_step(*parts_.optimizer, args);
    }
    // The scheduler advances only after a successful update; during a ramp-up it counts samples.
    schedule_.advance(progress_.scheduler, plan_.ramps_up() ? plan_.global_batch_of(iteration) : 1,
                      plan_.tokens_before(iteration));
  }
  // What the iteration's forwards gathered for the model itself (ABI 2.11: the MoE expert bias),
  // after the step whether it was taken or skipped, as Megatron's finalize_model_grads.
  dtk::ModelHandle(parts_.model->ref()).end_iteration();
  if (trace::active()) trace::span("optimizer step", "step", update_start, trace::now_ns());
}

void Trainer::train() {
  if (plan_.skip_train()) {  // Megatron's words
    log_->print(" skipping training (eval.skip_train is on) ..." +
                std::string(cfg_.checkpoint().load().empty()
                                ? " evaluating the model as initialised (no checkpoint was loaded)"
                                : ""));
    return;
  }
  log_->print(training_banner(plan_, cfg_.train()));
  if (cfg_.logging().log_progress() && !saving() && topo_.world_rank == 0)
    std::printf(
        " > logging.log_progress has no effect without checkpoint.save (progress.txt is written there, as "
        "Megatron's --log-progress writes it into --save)\n");
  if (cfg_.logging().log_progress() && saving()) {
    // The job's clock: its earliest rank's process start (Megatron's _TRAIN_START_TIME,
    // min-reduced), agreed on as a wall-clock time, which a rank waiting here does not move.
    const auto wall_ms = [] {
      return static_cast<int64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
              .count());
    };
    const int64_t mine = wall_ms() - static_cast<int64_t>(seconds_since_process_start() * 1000);
    const int64_t start_ms = -world_max(-mine, topo_, "logging.log_progress: agreeing on when the job started");
    if (topo_.world_rank == 0)
      progress_log_ =
          std::make_unique<ProgressLog>(cfg_.checkpoint().save(), topo_.world_size, progress_.floating_point_operations,
                                        static_cast<double>(wall_ms() - start_ms) / 1000.0);
  }
  ExitConditions exit(cfg_.train(), topo_);
  parts_.model->set_training(true);
  parts_.strategy->zero_grad();
  const int64_t save_interval = cfg_.checkpoint().save_interval();
  if (!saving() && save_interval > 0 && topo_.world_rank == 0)
    std::printf(
        " > checkpoint.save_interval %lld has no effect without checkpoint.save (as Megatron's --save-interval "
        "without --save)\n",
        static_cast<long long>(save_interval));
  const int64_t last = plan_.final_iteration();  // train_iters, or where train.train_tokens ends it
  for (int64_t it = progress_.iteration + 1; it <= last; ++it) {
    run_iteration(it);
    if (it == last || should_stop(it, exit)) break;
  }
  finish_async_save();
  trace::flush();  // a run shorter than the traced range writes what it traced
  if (profile_) profile_->finish();  // and the profiled one
  // As Megatron with --save: a final checkpoint unless the last iteration was just saved.
  if (!stopped_early_ && saving() && last_saved_ != last && resumed_iteration_ < last) save(last);
  if (bench_) {
    // Every rank again, as at the start (ranks sharing a host's cores measure it together).
    if (peak_.measured) bench_->raise_peak(remeasure_peak(peak_));
    print_bench_summary();
  }
}

void Trainer::run_iteration(int64_t it) {
  trace::begin_iteration(it);
  if (profile_) profile_->before_iteration(it);
  const auto step_start = std::chrono::steady_clock::now();
  IterationResult result = train_step(it);
  if (profile_)
    profile_->after_iteration(it, std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count());
  if (bench_ && it - resumed_iteration_ > cfg_.train().perf_warmup_steps())
    bench_->add_step(std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count(),
                     StepComm{result.tensor_parallel_comm.in_flight_ms, result.tensor_parallel_comm.exposed_ms,
                              result.data_parallel_comm.in_flight_ms, result.data_parallel_comm.exposed_ms,
                              result.expert_parallel_comm.in_flight_ms, result.expert_parallel_comm.exposed_ms,
                              result.context_parallel_comm.in_flight_ms, result.context_parallel_comm.exposed_ms});
  log_->record(result);
  progress_.floating_point_operations += log_->flops_of(result);
  trace::end_iteration(it);
  progress_.iteration = it;
  progress_.consumed_train_samples = plan_.consumed_before(it + 1);
  const int64_t save_interval = cfg_.checkpoint().save_interval();
  if (plan_.validates_after(it)) {
    evaluate(DTK_SPLIT_VALID, "validation", "iteration " + std::to_string(it), it);
    // Full validation starts at the split's beginning every time.
    if (!plan_.full_validation()) progress_.consumed_valid_samples += plan_.eval_iters() * plan_.global_batch_size();
  }
  poll_async_save();
  // The last iteration's save ends the run: written at once (train()).
  const bool may_defer = it < plan_.final_iteration();
  if (saving() && save_interval > 0 && it % save_interval == 0) save(it, may_defer);
  // As Megatron: a checkpoint before the first iteration of another micro-batch count (a
  // ramp-up's or a schedule's step).
  if (saving() && last_saved_ != it && it < plan_.final_iteration() &&
      plan_.micro_batches_of(it + 1) != plan_.micro_batches_of(it))
    save(it, may_defer);
}

// Megatron's checkpoint_and_decide_exit: every rank agrees, saves, and leaves the loop.
bool Trainer::should_stop(int64_t it, ExitConditions& exit) {
  const std::string why = exit.check(it);
  if (why.empty()) return false;
  // The run ends here: its checkpoint is published before the line that says to resume from it.
  if (saving() && last_saved_ != it) save(it);
  finish_async_save();
  const std::string of_tokens =
      plan_.ends_on_tokens() ? " (train.train_tokens " + std::to_string(cfg_.train().train_tokens()) + ")" : "";
  log_->print(" exiting program " + why + ": stopped after iteration " + std::to_string(it) + " of " +
              std::to_string(plan_.final_iteration()) + of_tokens +
              (saving() ? "; resume with --set checkpoint.load=" + cfg_.checkpoint().save()
                        : " (no checkpoint: checkpoint.save is not set)"));
  stopped_early_ = true;
  return true;
}

void Trainer::print_bench_summary() {
  if (topo_.world_rank != 0) return;
  for (const auto& line : bench_->lines()) log_->print(line);
  const std::string& path = cfg_.logging().bench_out();
  if (path.empty()) return;
  try {
    write_file_atomically(path, bench_->json().str() + "\n");
  } catch (const host::HostError& e) {
    throw host::HostError(std::string("logging.bench_out: ") + e.what());
  }
  log_->print(" wrote the performance summary to " + path);
}

// Megatron's evaluate_and_print_results: eval_iters global batches of `split`, no gradients, in
// the training's schedule. Validation continues through its split across evaluations (and across
// a resume: the loop advances consumed_valid_samples after each periodic one), as Megatron's one
// validation iterator, made at start after consumed_valid_samples, does; test starts at its
// beginning.
void Trainer::evaluate(int32_t split, const char* what, const std::string& label, int64_t iteration,
                       bool after_training) {
  TrainingLog::Excluded not_training_time(*log_);
  auto timer = timers_.scope(Phase::kEvaluate);
  if (split == DTK_SPLIT_VALID && !validation_sets_.empty()) {
    // Megatron's evaluate_and_print_results over --multiple-validation-sets: each set in turn.
    for (ValidationSet& set : validation_sets_)
      evaluate_whole(*set.data, split, set.what, set.announced, label, iteration, after_training);
    return;
  }
  if (plan_.full_validation())
    return evaluate_whole(*data_, split, what, announced_whole_[static_cast<size_t>(split)], label, iteration,
                          after_training);
  const int64_t eval_iters = plan_.eval_iters(), gbs = plan_.global_batch_size();
  const int64_t consumed = split == DTK_SPLIT_VALID ? progress_.consumed_valid_samples : 0;
  const SamplerChoice sampler = sampler_choice(cfg_.train());
  const int64_t split_samples = data_->num_samples(split), unit = plan_.micro_batch_size() * topo_.data_size();
  // The single sampler reads each sample once; the cyclic one reads the split again when it runs out.
  if (eval_iters <= 0 || split_samples < (sampler.cyclic ? unit : consumed + eval_iters * gbs)) {
    if (eval_iters > 0) LOG(WARNING) << "skipping " << what << " evaluation: the split has too few samples";
    return;
  }
  const int64_t num_batches = eval_iters * plan_.micro_batches_per_step();
  std::unique_ptr<const SampleOrder>& order = eval_orders_[split == DTK_SPLIT_VALID ? 0 : 1];
  if (!order)
    order = std::make_unique<const SampleOrder>(sampler, split_samples, plan_.micro_batch_size(), topo_.data_rank(),
                                                topo_.data_size());
  // Micro-batches this rank drew from the split before this evaluation, and where its iterator began.
  const int64_t start = split == DTK_SPLIT_VALID ? valid_loader_start_ : 0;
  const int64_t drawn = (consumed - start) / unit;
  BatchLoader loader(*data_, split, plan_.micro_batch_size(), num_batches,
                     [sample_order = order.get(), start, drawn](int64_t k, int64_t j) {
                       return sample_order->index(start, drawn + k, j);
                     });
  log_->report_evaluation(what, label, iteration, run_evaluation(loader, num_batches), after_training);
}

// The evaluation's forward passes, without gradients, in the training's schedule.
MetricAverager Trainer::run_evaluation(BatchLoader& loader, int64_t num_batches) {
  parts_.model->set_training(false);
  MetricAverager metrics;
  {
    at::NoGradGuard no_grad;
    forward_backward_->evaluate(loader, num_batches, metrics);
  }
  parts_.model->set_training(true);
  return metrics;
}

// eval.full_validation (Megatron's --full-validation): the whole split, every sample once, in
// ceil(N / global batch) steps of the training's micro-batches, Megatron's pretraining sampler's
// layout from sample 0 (at micro-batch 1, its full-validation sampler's order). Rows past the end
// hold sample 0 under a zero loss mask, and the steps sum their losses, so the figure is the mean
// over the split's tokens whatever the data-parallel size. (Megatron's sampler instead cycles: a
// rank whose samples ran out reads its first again, counting it twice, when N is not a multiple
// of the data-parallel size.)
void Trainer::evaluate_whole(const DatasetInstance& data, int32_t split, const std::string& what, bool& announced,
                             const std::string& label, int64_t iteration, bool after_training) {
  const int64_t n = data.num_samples(split);
  if (n == 0) {
    LOG(WARNING) << "skipping " << what << " evaluation: the split is empty";
    return;
  }
  const int64_t gbs = plan_.global_batch_size(), mbs = plan_.micro_batch_size(), unit = mbs * topo_.data_size();
  const int64_t num_batches = (n + gbs - 1) / gbs * plan_.micro_batches_per_step();
  BatchLoader loader(
      data, split, mbs, num_batches,
      [n, unit, mbs, rank = topo_.data_rank()](int64_t k, int64_t j) -> int64_t {
        const int64_t i = k * unit + rank * mbs + j;
        return i < n ? i : -1;
      },
      /*depth=*/4, /*padding_mask_length=*/plan_.seq_length());
  if (!announced) {
    announced = true;
    log_->print(" " + what + " reads its whole split (eval.full_validation): " + std::to_string(n) + " samples in " +
                std::to_string(num_batches / plan_.micro_batches_per_step()) + " global batches, each sample once");
  }
  runner_->set_summed_evaluation(true);
  const std::shared_ptr<void> restore(nullptr, [this](void*) { runner_->set_summed_evaluation(false); });
  MetricAverager metrics = run_evaluation(loader, num_batches);
  agree(runner_->take_evaluation_error(), topo_, "checking the full validation's losses");
  log_->report_evaluation(what, label, iteration, metrics, after_training);
}

void Trainer::save(int64_t iteration, bool may_defer) {
  finish_async_save();
  TrainingLog::Excluded not_training_time(*log_);
  auto timer = timers_.scope(Phase::kSaveCheckpoint);
  progress_.grad_scaler.reset();
  if (scaler_.dynamic()) progress_.grad_scaler = scaler_.state();
  progress_.schedule = schedule_.params();
  const std::string& dir = cfg_.checkpoint().save();
  // The model's options recorded with every default filled in: a later load compares them all
  // (checkpoint_model.hpp), whatever the plugin's defaults are by then.
  config::RunConfig recorded = cfg_;
  recorded.mutable_model()->clear_options();
  for (const auto& [key, value] : plugins_.model.options.items())
    (*recorded.mutable_model()->mutable_options())[key] = value;
  SaveOptions what;
  what.optimizer = !cfg_.checkpoint().no_save_optim();
  what.rng = !cfg_.checkpoint().no_save_rng();
  what.keep_last = cfg_.checkpoint().keep_last();
  last_saved_ = iteration;
  if (may_defer && cfg_.checkpoint().async_save()) {
    async_save_ = std::make_unique<AsyncSave>(dir, progress_, *parts_.model, *parts_.optimizer, *parts_.strategy,
                                              to_text(recorded), writers_, topo_, what);
    if (progress_log_) log_progress_save(iteration, true);
    return;
  }
  log_saved(iteration,
            save_checkpoint(dir, progress_, *parts_.model, *parts_.optimizer, *parts_.strategy, to_text(recorded),
                            writers_, topo_, what),
            false);
}

void Trainer::poll_async_save() {
  if (!async_save_) return;
  bool written = false;
  {
    TrainingLog::Excluded not_training_time(*log_);
    auto timer = timers_.scope(Phase::kSaveCheckpoint);
    written = async_save_->written_everywhere();
  }
  if (written) finish_async_save();
}

void Trainer::finish_async_save() {
  if (!async_save_) return;
  TrainingLog::Excluded not_training_time(*log_);
  auto timer = timers_.scope(Phase::kSaveCheckpoint);
  const std::unique_ptr<AsyncSave> save = std::move(async_save_);
  log_saved(save->iteration(), save->finish(), true);
}

void Trainer::log_saved(int64_t iteration, const SaveReport& r, bool in_background) {
  char timing[96];
  if (in_background)
    std::snprintf(timing, sizeof timing, "written in the background in %.2f s, training waited %.2f s", r.seconds,
                  r.blocked_seconds);
  else
    std::snprintf(timing, sizeof timing, "%.2f s", r.seconds);
  char buf[200];
  std::snprintf(buf, sizeof buf, " (%.1f MB, %s%s%s)", r.megabytes, timing,
                cfg_.checkpoint().no_save_optim() ? ", without the optimizer's state" : "",
                cfg_.checkpoint().no_save_rng() ? ", without the RNG states" : "");
  std::string removed;
  for (int64_t it : r.removed) removed += (removed.empty() ? "; removed iteration " : ", ") + std::to_string(it);
  if (!removed.empty()) removed += " (checkpoint.keep_last=" + std::to_string(cfg_.checkpoint().keep_last()) + ")";
  log_->print(" saved checkpoint at iteration " + std::to_string(iteration) + " to " + cfg_.checkpoint().save() + buf +
              removed);
  if (!progress_log_) return;
  for (int64_t it : r.removed) progress_log_->deleted(it);
  if (in_background)
    progress_log_->async_saved(iteration);
  else
    log_progress_save(iteration, false);
}

void Trainer::log_progress_save(int64_t iteration, bool async) {
  progress_log_->saved(iteration, progress_.floating_point_operations,
                       progress_.consumed_train_samples * cfg_.train().seq_length(), async);
}

void Trainer::final_evaluation() {
  // Megatron's labels for the evaluation after training.
  // A run resumed past where train.train_tokens now ends it trained no iteration: its model is
  // the checkpoint's (Megatron-DeepSpeed labels it with the loaded iteration too).
  // eval.skip_train: the model as loaded (or built: iteration 0).
  const int64_t last =
      plan_.skip_train() ? progress_.iteration : std::max(plan_.final_iteration(), progress_.iteration);
  const std::string at = "iteration " + std::to_string(last);
  evaluate(DTK_SPLIT_VALID, "validation", at + " on validation set", last, true);
  evaluate(DTK_SPLIT_TEST, "test", at + " on test set", last, true);
}

}  // namespace dtk::core
