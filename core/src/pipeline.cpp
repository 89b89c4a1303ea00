// The pretrain pipeline, top to bottom, as Megatron's pretrain():
//   initialize -> setup model, strategy, optimizer -> build data iterators -> train loop
//   (micro-batches: forward step + backward; reduce grads; clip; optimizer step; log;
//   periodic eval) -> final evaluation on valid and test.
// Every plugin call goes through core/components so errors name the plugin and the call.
#include "dtk/core/pipeline.hpp"

#include <ATen/Parallel.h>
#include <glog/logging.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>
#include <memory>
#include <thread>

#include "dtk/core/checkpoint.hpp"
#include "dtk/core/components.hpp"
#include "dtk/core/config.hpp"
#include "dtk/core/distributed.hpp"
#include "dtk/core/services.hpp"
#include "dtk/core/tensorboard.hpp"

namespace dtk::core {

using dtk::Model;

using host::HostError;
using Clock = std::chrono::steady_clock;

namespace {

int32_t dtype_code(const std::string& s) {
  if (s == "bf16") return DTK_DTYPE_BFLOAT16;
  if (s == "fp16") return DTK_DTYPE_FLOAT16;
  return DTK_DTYPE_FLOAT32;
}

std::map<std::string, std::string> user_options(const config::PluginChoice& c) {
  return {c.options().begin(), c.options().end()};
}

std::string timestamp() {
  char buf[32];
  std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

// Averages of the step's metrics over the micro-batches of one or more iterations.
struct MetricAverager {
  std::vector<std::pair<std::string, double>> sums;
  std::map<std::string, int64_t> counts;
  void add(const std::vector<std::pair<std::string, double>>& m) {
    for (const auto& kv : m) {
      auto it = std::find_if(sums.begin(), sums.end(), [&](const auto& s) { return s.first == kv.first; });
      if (it == sums.end())
        sums.emplace_back(kv.first, kv.second);
      else
        it->second += kv.second;
      counts[kv.first]++;
    }
  }
  void merge(const MetricAverager& o) {
    for (const auto& kv : o.sums) {
      auto it = std::find_if(sums.begin(), sums.end(), [&](const auto& s) { return s.first == kv.first; });
      if (it == sums.end())
        sums.emplace_back(kv.first, kv.second);
      else
        it->second += kv.second;
      counts[kv.first] += o.counts.at(kv.first);
    }
  }
  double mean(const std::string& k) const {
    for (const auto& kv : sums)
      if (kv.first == k) return kv.second / static_cast<double>(counts.at(k));
    return NAN;
  }
  void clear() { sums.clear(), counts.clear(); }
};

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

}  // namespace

int pretrain(const config::RunConfig& cfg, host::PluginHost& plugins) {
  // ---- initialize ----------------------------------------------------------------------------
  validate_config(cfg);
  set_run_config(cfg);
  init_distributed(cfg);  // rendezvous and process groups; a no-op for a single process
  const Topology& topo = topology();
  // Megatron prints from one rank: the others log nothing but errors.
  const bool printer = topo.world_rank == 0;
  // TensorBoard scalars from rank 0 (whose metrics are already averaged over data parallel).
  std::unique_ptr<TensorBoardWriter> tensorboard;
  if (printer && !cfg.logging().tensorboard_dir().empty())
    tensorboard = std::make_unique<TensorBoardWriter>(cfg.logging().tensorboard_dir());
  if (!printer) FLAGS_minloglevel = google::GLOG_ERROR;
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
  if (train.device() == "cuda")
    throw HostError("config: train.device=cuda needs a CUDA build of dtk (this one is CPU-only)");

  const int64_t mbs = train.micro_batch_size();
  const int64_t gbs = train.global_batch_size() > 0 ? train.global_batch_size() : mbs * topo.dp_size;
  if (gbs % (mbs * topo.dp_size) != 0)
    throw HostError("config: global_batch_size " + std::to_string(gbs) + " is not divisible by micro_batch_size x " +
                    "data-parallel size = " + std::to_string(mbs * topo.dp_size));
  const int64_t num_micro = gbs / (mbs * topo.dp_size);
  const int64_t iters = train.train_iters();
  // Sample counts are products of user numbers: refuse values whose products overflow int64.
  const int64_t evals_bound = (cfg.eval().eval_interval() > 0 ? iters / cfg.eval().eval_interval() : 0) + 2;
  if (gbs > (int64_t{1} << 40) / std::max<int64_t>(1, iters) ||
      gbs > (int64_t{1} << 40) / std::max<int64_t>(1, evals_bound * cfg.eval().eval_iters()))
    throw HostError("config: train_iters x global_batch_size (or the evaluation sample count) is too large");

  // ---- resolve plugins and their options -------------------------------------------------
  const auto& model_p = plugins.get(DTK_KIND_MODEL, cfg.model().name());
  const auto& data_p = plugins.get(DTK_KIND_DATASET, cfg.dataset().name());
  const auto& step_p = plugins.get(DTK_KIND_STEP, cfg.step().name());
  const auto& opt_p = plugins.get(DTK_KIND_OPTIMIZER, cfg.optimizer().name());
  const auto& strat_p = plugins.get(DTK_KIND_STRATEGY, cfg.strategy().name());
  host::OptionValues model_opts(host::resolve_options(model_p, user_options(cfg.model())));
  host::OptionValues data_opts(host::resolve_options(data_p, user_options(cfg.dataset())));
  host::OptionValues step_opts(host::resolve_options(step_p, user_options(cfg.step())));
  host::OptionValues opt_opts(host::resolve_options(opt_p, user_options(cfg.optimizer())));
  host::OptionValues strat_opts(host::resolve_options(strat_p, user_options(cfg.strategy())));

  auto build_ctx = [&](const host::OptionValues& opts) {
    dtk_build_context c{};
    c.struct_size = sizeof(c);
    c.options = opts.get();
    c.device = {DTK_DEVICE_CPU, -1};
    c.params_dtype = dtype_code(train.params_dtype());
    c.tp_rank = topo.tp_rank, c.tp_size = topo.tp_size;
    c.pp_rank = topo.pp_rank, c.pp_size = topo.pp_size;
    c.dp_rank = topo.dp_rank, c.dp_size = topo.dp_size;
    c.pre_process = topo.pp_rank == 0;
    c.post_process = topo.pp_rank == topo.pp_size - 1;
    c.seq_length = train.seq_length();
    c.micro_batch_size = mbs;
    c.seed = train.seed();
    return c;
  };

  // ---- setup_model_and_optimizer ------------------------------------------------------------
  ModelInstance model(model_p, build_ctx(model_opts));
  StrategyInstance strategy(strat_p, build_ctx(strat_opts));
  strategy.setup(model);
  OptimizerInstance optimizer(opt_p, build_ctx(opt_opts), strategy.optimizer_params(), cfg.lr().weight_decay());
  StepInstance step(step_p, build_ctx(step_opts));
  const dtk_model_info info = model.info();
  const ModelStats stats = model_stats(model.parameters(), info);
  LOG(INFO) << "model '" << model_p.name() << "': " << info.num_layers << " layers, hidden " << info.hidden_size
            << ", heads " << info.num_attention_heads << ", seq " << info.seq_length << ", padded vocab "
            << info.vocab_size;
  // As Megatron: every first data-parallel rank reports its shard; the line names the rank.
  if (topo.dp_rank == 0) {
    const std::string who = topo.world_size > 1 ? "[rank " + std::to_string(topo.world_rank) + "]" : "";
    std::printf("%s > number of parameters on (tensor, pipeline) model parallel rank (%d, %d): %lld\n", who.c_str(),
                topo.tp_rank, topo.pp_rank, static_cast<long long>(stats.num_parameters));
    std::fflush(stdout);
  }
  // Megatron's load_checkpoint at the end of setup_model_and_optimizer.
  TrainProgress resumed;
  const std::string& load_dir = cfg.checkpoint().load();
  if (!load_dir.empty()) {
    resumed = load_checkpoint(load_dir, model, optimizer, strategy, topo);
    if (resumed.consumed_train_samples != resumed.iteration * gbs || resumed.consumed_valid_samples % gbs != 0)
      throw HostError("checkpoint in " + load_dir + " consumed " + std::to_string(resumed.consumed_train_samples) +
                      " train samples in " + std::to_string(resumed.iteration) +
                      " iterations: resuming needs the same global batch size (" + std::to_string(gbs) + ")");
    if (resumed.iteration > iters)
      throw HostError("checkpoint in " + load_dir + " is at iteration " + std::to_string(resumed.iteration) +
                      ", beyond train.train_iters " + std::to_string(iters));
    if (printer)
      std::printf(" loaded checkpoint from %s at iteration %lld\n", load_dir.c_str(),
                  static_cast<long long>(resumed.iteration));
  }
  if (printer)
    std::printf(" > training FLOPs per token: %.4g (%s)\n", stats.flops_per_token,
                info.recompute ? "8N + 8Lhs, full recompute" : "6N + 6Lhs");

  // ---- data iterators -------------------------------------------------------------------
  const int64_t eval_interval = cfg.eval().eval_interval();
  const int64_t eval_iters = cfg.eval().eval_iters();
  const int64_t num_evals = (eval_interval > 0 ? iters / eval_interval : 0) + 1;
  dtk_dataset_context dctx{};
  dctx.struct_size = sizeof(dctx);
  dctx.options = data_opts.get();
  dctx.seq_length = train.seq_length();
  dctx.num_samples[DTK_SPLIT_TRAIN] = iters * gbs;
  dctx.num_samples[DTK_SPLIT_VALID] = num_evals * eval_iters * gbs;
  dctx.num_samples[DTK_SPLIT_TEST] = eval_iters * gbs;
  dctx.seed = train.seed();
  dctx.rank = topo.world_rank;
  dctx.world_size = topo.world_size;
  const std::unique_ptr<DatasetInstance> data_owner = build_dataset_rank0_first(data_p, dctx, topo);
  DatasetInstance& data = *data_owner;
  if (data.num_samples(DTK_SPLIT_TRAIN) < iters * gbs)
    throw HostError("dataset plugin '" + data_p.name() + "': train split has " +
                    std::to_string(data.num_samples(DTK_SPLIT_TRAIN)) + " samples, the run needs " +
                    std::to_string(iters * gbs));
  if (data.vocab_size() > info.vocab_size)
    throw HostError("dataset vocabulary (" + std::to_string(data.vocab_size()) + ") is larger than the model's (" +
                    std::to_string(info.vocab_size) + ")");

  // Megatron's sampler: global batch k holds samples [k*gbs, (k+1)*gbs); micro-batch m of DP
  // rank r takes rows m*mbs*dp + r*mbs + j.
  auto sampler = [&](int64_t first_global_batch) {
    return [=, &topo](int64_t k, int64_t j) {
      const int64_t gb = first_global_batch + k / num_micro, m = k % num_micro;
      return gb * gbs + m * mbs * topo.dp_size + topo.dp_rank * mbs + j;
    };
  };
  // A resumed run starts at the next global batch; validation continues where it was.
  const int64_t start_iter = resumed.iteration;
  BatchLoader train_loader(data, DTK_SPLIT_TRAIN, mbs, (iters - start_iter) * num_micro,
                           sampler(resumed.consumed_train_samples / gbs));
  int64_t valid_batches_used = resumed.consumed_valid_samples / gbs;

  auto evaluate = [&](int32_t split, int64_t first_global_batch, const char* what, int64_t iteration) {
    if (eval_iters <= 0 || data.num_samples(split) < (first_global_batch + eval_iters) * gbs) {
      if (eval_iters > 0) LOG(WARNING) << "skipping " << what << " evaluation: the split has too few samples";
      return;
    }
    BatchLoader loader(data, split, mbs, eval_iters * num_micro, sampler(first_global_batch));
    model.set_training(false);
    MetricAverager avg;
    {
      at::NoGradGuard no_grad;
      for (int64_t k = 0; k < eval_iters * num_micro; ++k) {
        std::vector<std::pair<std::string, double>> m;
        step.forward_step(model, {{"text", loader.next()}}, &m);
        avg.add(m);
      }
    }
    model.set_training(true);
    std::string line = std::string(" ") + what + " loss at iteration " + std::to_string(iteration) + " | ";
    char buf[128];
    for (const auto& kv : avg.sums) {
      const double v = avg.mean(kv.first);
      std::snprintf(buf, sizeof buf, "%s value: %.6E | %s PPL: %.6E | ", kv.first.c_str(), v, kv.first.c_str(),
                    std::exp(std::min(v, 20.0)));
      line += buf;
    }
    if (printer)
      std::printf("%s\n%s\n%s\n", std::string(line.size(), '-').c_str(), line.c_str(),
                  std::string(line.size(), '-').c_str());
    std::fflush(stdout);
    if (tensorboard) {
      for (const auto& kv : avg.sums) {
        const double v = avg.mean(kv.first);
        tensorboard->add_scalar(kv.first + " " + what, v, iteration);
        tensorboard->add_scalar(kv.first + " " + what + " ppl", std::exp(std::min(v, 20.0)), iteration);
      }
      tensorboard->flush();
    }
  };

  // ---- train --------------------------------------------------------------------------------
  const int64_t log_interval = cfg.logging().log_interval();
  const int64_t decay_iters = cfg.lr().lr_decay_iters() > 0 ? cfg.lr().lr_decay_iters() : iters;
  MetricAverager window;
  int64_t scheduler_step = resumed.scheduler_step;
  int64_t skipped = 0, nan_iters = 0;
  double norm_sum = 0;
  int64_t norm_count = 0;
  auto window_start = Clock::now();
  model.set_training(true);
  strategy.zero_grad();
  if (printer)
    std::printf("[%s] training: %lld iterations, global batch %lld (%lld micro-batches of %lld), seq %lld\n",
                timestamp().c_str(), static_cast<long long>(iters), static_cast<long long>(gbs),
                static_cast<long long>(num_micro), static_cast<long long>(mbs),
                static_cast<long long>(train.seq_length()));
  std::fflush(stdout);

  const std::string& save_dir = cfg.checkpoint().save();
  const int64_t save_interval = cfg.checkpoint().save_interval();
  int64_t last_saved = -1;
  auto save = [&](int64_t it) {
    TrainProgress p{it, it * gbs, valid_batches_used * gbs, scheduler_step};
    const SaveReport r = save_checkpoint(save_dir, p, model, optimizer, strategy, to_text(cfg), topo);
    last_saved = it;
    if (printer)
      std::printf(" saved checkpoint at iteration %lld to %s (%.1f MB, %.2f s)\n", static_cast<long long>(it),
                  save_dir.c_str(), r.megabytes, r.seconds);
    std::fflush(stdout);
  };

  for (int64_t it = start_iter + 1; it <= iters; ++it) {
    // Megatron's OptimizerParamScheduler: the rate of an update is that of the scheduler's
    // current step, which starts at 0 and advances only after a successful update.
    const double lr = learning_rate(scheduler_step, cfg.lr().lr(), cfg.lr().min_lr(), cfg.lr().lr_warmup_iters(),
                                    decay_iters, cfg.lr().lr_decay_style());
    MetricAverager iteration_metrics;
    for (int64_t m = 0; m < num_micro; ++m) {
      std::vector<std::pair<std::string, double>> metrics;
      at::Tensor loss = step.forward_step(model, {{"text", train_loader.next()}}, &metrics);
      if (loss.dim() != 0 && loss.numel() != 1)
        throw HostError("step plugin '" + step_p.name() + "': forward_step returned a loss of shape " +
                        Model::shape_str(loss) + ", expected a scalar");
      strategy.before_backward(m, num_micro);
      // Megatron scales each micro-batch loss by 1/num_microbatches so gradients average.
      (loss.reshape({}) / static_cast<double>(num_micro)).backward();
      iteration_metrics.add(metrics);
    }
    strategy.reduce_gradients();
    const double norm = strategy.clip_and_norm(train.clip_grad());
    if (!std::isfinite(norm)) {
      // Non-finite gradients: skip the update (DTK skips in every precision; Megatron does so
      // only under fp16 loss scaling). The scheduler does not advance; the loss is not logged.
      ++nan_iters, ++skipped;
    } else {
      dtk_optimizer_step_args args{sizeof(args), lr, it, 1.0};
      strategy.optimizer_step(optimizer, args);
      ++scheduler_step;
      norm_sum += norm, ++norm_count;
      window.merge(iteration_metrics);
    }
    strategy.zero_grad();

    if (it % log_interval == 0 || it == iters) {
      const double secs = std::chrono::duration<double>(Clock::now() - window_start).count();
      const int64_t n_it = std::min(it % log_interval == 0 ? log_interval : it % log_interval, it - start_iter);
      const double ms_per_it = 1000.0 * secs / static_cast<double>(n_it);
      const double tokens_per_s = static_cast<double>(gbs * train.seq_length()) * static_cast<double>(n_it) / secs;
      const double tflops = stats.flops_per_token * tokens_per_s / 1e12 / topo.world_size;
      std::string line;
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    " [%s] iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
                    "throughput per device (TFLOP/s): %.3f | tokens per second: %.0f | learning rate: %.6E | "
                    "global batch size: %5lld |",
                    timestamp().c_str(), static_cast<long long>(it), static_cast<long long>(iters),
                    static_cast<long long>(it * gbs), ms_per_it, tflops, tokens_per_s, lr, static_cast<long long>(gbs));
      line += buf;
      for (const auto& kv : window.sums) {
        std::snprintf(buf, sizeof buf, " %s: %.6E |", kv.first.c_str(), window.mean(kv.first));
        line += buf;
      }
      std::snprintf(buf, sizeof buf,
                    " loss scale: 1.0 | grad norm: %.3f | number of skipped iterations: %3lld | number of nan "
                    "iterations: %3lld |",
                    norm_count ? norm_sum / static_cast<double>(norm_count) : NAN, static_cast<long long>(skipped),
                    static_cast<long long>(nan_iters));
      line += buf;
      if (printer) std::printf("%s\n", line.c_str());
      std::fflush(stdout);
      if (tensorboard) {  // Megatron's training_log tags
        tensorboard->add_scalar("learning-rate", lr, it);
        tensorboard->add_scalar("batch-size", static_cast<double>(gbs), it);
        for (const auto& kv : window.sums) tensorboard->add_scalar(kv.first, window.mean(kv.first), it);
        tensorboard->add_scalar("loss-scale", 1.0, it);
        if (norm_count) tensorboard->add_scalar("grad-norm", norm_sum / static_cast<double>(norm_count), it);
        tensorboard->add_scalar("iteration-time", secs / static_cast<double>(n_it), it);
        tensorboard->add_scalar("tokens-per-second", tokens_per_s, it);
        tensorboard->add_scalar("throughput-tflops", tflops, it);
        tensorboard->add_scalar("skipped-iterations", static_cast<double>(skipped), it);
        tensorboard->flush();
      }
      window.clear();
      skipped = nan_iters = 0;
      norm_sum = 0, norm_count = 0;
      window_start = Clock::now();
    }
    if (eval_interval > 0 && it % eval_interval == 0 && it != iters) {
      evaluate(DTK_SPLIT_VALID, valid_batches_used, "validation", it);
      valid_batches_used += eval_iters;
      window_start = Clock::now();
    }
    if (!save_dir.empty() && save_interval > 0 && it % save_interval == 0) {
      save(it);
      window_start = Clock::now();
    }
  }
  // As Megatron with --save: a final checkpoint unless the last iteration was just saved.
  if (!save_dir.empty() && last_saved != iters && start_iter < iters) save(iters);

  // ---- final evaluation -------------------------------------------------------------------
  evaluate(DTK_SPLIT_VALID, valid_batches_used, "validation", iters);
  evaluate(DTK_SPLIT_TEST, 0, "test", iters);
  shutdown_distributed();
  return 0;
}

}  // namespace dtk::core
