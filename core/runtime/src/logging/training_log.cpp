#include "dtk/core/logging/training_log.hpp"

#include <ATen/ATen.h>

#include "dtk/core/memory/memory.hpp"  // peak_rss_bytes
#include "dtk/host/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <tuple>

namespace dtk::core {

using Clock = std::chrono::steady_clock;

// ---- MetricAverager -------------------------------------------------------------------------
// A plain value counts with weight 1 (the mean over micro-batches); a [numerator, denominator]
// tensor (ABI 2.8's ratio metrics) adds its numerator to the sum and its denominator to the weight.
void MetricAverager::add_sum(const std::string& name, double sum, double weight) {
  auto it = std::find_if(sums_.begin(), sums_.end(), [&](const auto& s) { return s.first == name; });
  if (it == sums_.end())
    sums_.emplace_back(name, sum);  // keeps the first-seen order
  else
    it->second += sum;
  weights_[name] += weight;
}

void MetricAverager::add(const std::vector<std::pair<std::string, double>>& metrics) {
  for (const auto& [name, value] : metrics) add_sum(name, value, 1.0);
}

void MetricAverager::add(const StepMetrics& metrics) {
  add(metrics.values);
  for (const auto& [name, value] : metrics.tensors) {
    add_sum(name, 0.0, 0.0);  // the name, in order; the values stay on the device until read
    auto it = std::find_if(device_sums_.begin(), device_sums_.end(), [&](const auto& s) { return s.first == name; });
    at::Tensor v = value.reshape({-1}).to(at::kDouble);
    if (v.numel() != 1 && v.numel() != 2)
      throw host::HostError("the step reported metric '" + name + "' as " + std::to_string(v.numel()) +
                            " values: a metric is one value, or (ABI 2.8) two: [numerator, denominator]");
    if (v.numel() == 1) v = at::cat({v, at::ones({1}, v.options())});
    if (it == device_sums_.end())
      device_sums_.emplace_back(name, v.clone());
    else
      it->second.add_(v.to(it->second.device()));
  }
}

void MetricAverager::read_device_sums() const {
  if (device_sums_.empty()) return;
  std::vector<at::Tensor> sums;
  for (const auto& kv : device_sums_) sums.push_back(kv.second.to(device_sums_[0].second.device()));
  const at::Tensor read = at::stack(sums).to(at::kCPU).contiguous();
  const double* v = read.data_ptr<double>();
  for (size_t i = 0; i < device_sums_.size(); ++i) {
    for (auto& s : sums_)
      if (s.first == device_sums_[i].first) s.second += v[2 * i];
    weights_[device_sums_[i].first] += v[2 * i + 1];
  }
  device_sums_.clear();
}

void MetricAverager::merge(const MetricAverager& other) {
  read_device_sums();
  other.read_device_sums();
  for (const auto& [name, sum] : other.sums_) add_sum(name, sum, other.weights_.at(name));
}

void MetricAverager::broadcast(int32_t group, int32_t root) {
  if (group_size(group) <= 1) return;
  read_device_sums();
  // Names, sums and weights as text (printed exactly: %a), its length first.
  std::string text;
  if (group_rank(group) == root) {
    char buf[96];
    for (const auto& [name, sum] : sums_) {
      std::snprintf(buf, sizeof buf, "%a\t%a\n", sum, weights_.at(name));
      text += name + "\t" + buf;
    }
  }
  at::Tensor length = at::tensor({static_cast<int64_t>(text.size())}, at::kLong);
  dtk::core::broadcast(length, group, root).wait();
  if (length.item<int64_t>() == 0) {  // the root has no metrics
    clear();
    return;
  }
  at::Tensor bytes = at::zeros({length.item<int64_t>()}, at::kByte);
  if (group_rank(group) == root) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  dtk::core::broadcast(bytes, group, root).wait();
  if (group_rank(group) == root) return;
  clear();
  const std::string received(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
  size_t at_line = 0;
  while (at_line < received.size()) {
    const size_t end = received.find('\n', at_line);
    const std::string line = received.substr(at_line, end - at_line);
    at_line = end == std::string::npos ? received.size() : end + 1;
    const size_t tab1 = line.find('\t'), tab2 = line.rfind('\t');
    if (tab1 == std::string::npos || tab2 == tab1) continue;
    add_sum(line.substr(0, tab1), std::strtod(line.substr(tab1 + 1, tab2 - tab1 - 1).c_str(), nullptr),
            std::strtod(line.substr(tab2 + 1).c_str(), nullptr));
  }
}

// A ratio whose weights sum to 0 (every token masked) is 0/0: NaN, as Megatron-LM's.
double MetricAverager::mean(const std::string& name) const {
  read_device_sums();
  for (const auto& [n, sum] : sums_)
    if (n == name) return sum / weights_.at(n);
  return NAN;
}

std::vector<std::string> MetricAverager::names() const {
  read_device_sums();
  std::vector<std::string> out;
  for (const auto& kv : sums_) out.push_back(kv.first);
  return out;
}

void MetricAverager::clear() { sums_.clear(), device_sums_.clear(), weights_.clear(); }

// ---- TrainingLog ----------------------------------------------------------------------------
std::string timestamp() {
  char buf[32];
  std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

TrainingLog::TrainingLog(Setup setup) : setup_(std::move(setup)), window_start_(Clock::now()), start_(Clock::now()) {
  // TensorBoard scalars from rank 0, whose metrics are already averaged over data parallel.
  if (setup_.printer && !setup_.tensorboard_dir.empty())
    tensorboard_ = std::make_unique<TensorBoardWriter>(setup_.tensorboard_dir);
  if (setup_.printer && !setup_.metrics_jsonl.empty()) metrics_ = std::make_unique<JsonlWriter>(setup_.metrics_jsonl);
}

namespace {

// "H:MM:SS" (hours unbounded).
std::string clock_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  const long long s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  return buf;
}

// One log window's figures: what the progress line, the metrics file and TensorBoard report.
struct WindowFigures {
  double secs = 0, n_it = 1, ms_per_it = 0, tokens_per_s = 0, tflops = 0, mfu = NAN, norm = NAN;
  double elapsed = 0, eta = 0, rss_mb = 0;
  int64_t consumed = 0, batch = 0, skipped = 0, nan_iterations = 0;
  CommTiming tp, dp, pp, ep, cp;  // sums over the window's iterations
};

// Communication per iteration: time in flight, and how much of it the training thread waited
// (not hidden behind computation; Domino's figure of merit for tensor parallelism, and the MoE
// layers' token dispatch's under expert parallelism). Pipeline
// stages: how long this rank's stage waited for activations and gradients (its share of the
// bubble, and the transfers), next to the bubble in theory: (p - 1) / (m + p - 1) for 1F1B, v
// times smaller in ideal time with v chunks per rank, (p - 1) / v / (m + (p - 1) / v).
void append_comm_fields(std::string& line, const WindowFigures& w, const IterationResult& last,
                        const TrainingLog::Setup& setup) {
  char buf[512];
  for (const auto& [name, sum, n] : {std::tuple<const char*, const CommTiming&, int>{"tensor", w.tp, setup.tp_size},
                                     std::tuple<const char*, const CommTiming&, int>{"data", w.dp, setup.dp_size},
                                     std::tuple<const char*, const CommTiming&, int>{"expert", w.ep, setup.ep_size},
                                     std::tuple<const char*, const CommTiming&, int>{"context", w.cp, setup.cp_size}}) {
    if (n <= 1) continue;
    std::snprintf(buf, sizeof buf, " %s-parallel comm (ms) in flight: %.1f | exposed: %.1f |", name,
                  sum.in_flight_ms / w.n_it, sum.exposed_ms / w.n_it);
    line += buf;
  }
  if (setup.pp_size > 1) {
    const double p = setup.pp_size, m = static_cast<double>(std::max<int64_t>(1, last.micro_batches));
    const double idle = (p - 1) / std::max(1, setup.virtual_stages);
    std::snprintf(buf, sizeof buf, " pipeline wait (ms): %.1f (bubble in theory %.0f%%) |", w.pp.exposed_ms / w.n_it,
                  100.0 * idle / (m + idle));
    line += buf;
  }
}

// Megatron's progress line, with DTK's fields (MFU, communication, memory, ETA) where they apply.
std::string progress_line(const WindowFigures& w, const IterationResult& last, const TrainingLog::Setup& setup,
                          const MetricAverager& window) {
  char buf[512];
  std::snprintf(buf, sizeof buf,
                " [%s] iteration %8lld/%8lld | consumed samples: %12lld | elapsed time per iteration (ms): %.1f | "
                "throughput per device (TFLOP/s): %.3f |",
                timestamp().c_str(), static_cast<long long>(last.iteration), static_cast<long long>(setup.train_iters),
                static_cast<long long>(w.consumed), w.ms_per_it, w.tflops);
  std::string line = buf;
  if (std::isfinite(w.mfu)) {
    std::snprintf(buf, sizeof buf, " MFU: %.1f%% |", 100.0 * w.mfu);
    line += buf;
  }
  std::snprintf(buf, sizeof buf, " tokens per second: %.0f | learning rate: %.6E | global batch size: %5lld |",
                w.tokens_per_s, last.learning_rate, static_cast<long long>(w.batch));
  line += buf;
  for (const auto& name : window.names()) {
    std::snprintf(buf, sizeof buf, " %s: %.6E |", name.c_str(), window.mean(name));
    line += buf;
  }
  std::snprintf(buf, sizeof buf, " loss scale: %.1f | grad norm: %.3f |", last.loss_scale, w.norm);
  line += buf;
  if (std::isfinite(last.num_zeros)) {
    std::snprintf(buf, sizeof buf, " num zeros: %.1f |", last.num_zeros);
    line += buf;
  }
  if (std::isfinite(last.params_norm)) {
    std::snprintf(buf, sizeof buf, " params norm: %.3f |", last.params_norm);
    line += buf;
  }
  if (setup.curriculum) {  // Megatron-DeepSpeed's field, in its place
    std::snprintf(buf, sizeof buf, " curriculum seqlen: %5lld |",
                  static_cast<long long>(last.seq_length > 0 ? last.seq_length : setup.seq_length));
    line += buf;
  }
  std::snprintf(buf, sizeof buf, " number of skipped iterations: %3lld | number of nan iterations: %3lld |",
                static_cast<long long>(w.skipped), static_cast<long long>(w.nan_iterations));
  line += buf;
  append_comm_fields(line, w, last, setup);
  std::snprintf(buf, sizeof buf, " peak memory (MB): %.0f | elapsed: %s | ETA: %s |", w.rss_mb,
                clock_text(w.elapsed).c_str(), clock_text(w.eta).c_str());
  line += buf;
  return line;
}

// The metrics file's record of the window: the progress line's fields and the timers.
JsonObject window_record(const WindowFigures& w, const IterationResult& last, const TrainingLog::Setup& setup,
                         const MetricAverager& window, const std::vector<Timers::Row>& timer_rows) {
  JsonObject o;
  o.add("kind", "train")
      .add("iteration", last.iteration)
      .add("train_iters", setup.train_iters)
      .add("consumed_samples", w.consumed)
      .add("iteration_time_ms", w.ms_per_it)
      .add("tflops_per_device", w.tflops)
      .add("mfu", w.mfu)
      .add("tokens_per_second", w.tokens_per_s)
      .add("learning_rate", last.learning_rate)
      .add("global_batch_size", w.batch);
  for (const auto& name : window.names()) o.add(name, window.mean(name));
  o.add("loss_scale", last.loss_scale).add("grad_norm", w.norm);
  if (std::isfinite(last.params_norm)) o.add("params_norm", last.params_norm);
  if (std::isfinite(last.num_zeros)) o.add("num_zeros", last.num_zeros);
  if (setup.curriculum) o.add("curriculum_seqlen", last.seq_length > 0 ? last.seq_length : setup.seq_length);
  o.add("skipped_iterations", w.skipped)
      .add("nan_iterations", w.nan_iterations)
      .add("peak_rss_mb", w.rss_mb)
      .add("elapsed_s", w.elapsed)
      .add("eta_s", w.eta);
  if (setup.tp_size > 1)
    o.add("tensor_parallel_comm_in_flight_ms", w.tp.in_flight_ms / w.n_it)
        .add("tensor_parallel_comm_exposed_ms", w.tp.exposed_ms / w.n_it);
  if (setup.dp_size > 1)
    o.add("data_parallel_comm_in_flight_ms", w.dp.in_flight_ms / w.n_it)
        .add("data_parallel_comm_exposed_ms", w.dp.exposed_ms / w.n_it);
  if (setup.ep_size > 1)
    o.add("expert_parallel_comm_in_flight_ms", w.ep.in_flight_ms / w.n_it)
        .add("expert_parallel_comm_exposed_ms", w.ep.exposed_ms / w.n_it);
  if (setup.cp_size > 1)
    o.add("context_parallel_comm_in_flight_ms", w.cp.in_flight_ms / w.n_it)
        .add("context_parallel_comm_exposed_ms", w.cp.exposed_ms / w.n_it);
  if (setup.pp_size > 1) o.add("pipeline_wait_ms", w.pp.exposed_ms / w.n_it);
  for (const auto& row : timer_rows) o.add(row.name + "_ms_max", row.max_ms).add(row.name + "_ms_min", row.min_ms);
  return o;
}

// The window's TensorBoard scalars, under Megatron's training_log tags.
void write_window_scalars(TensorBoardWriter& tb, const WindowFigures& w, int64_t it, const TrainingLog::Setup& setup,
                          const std::vector<Timers::Row>& timer_rows) {
  for (const auto& row : timer_rows) tb.add_scalar(row.name + "-time", row.max_ms / 1e3, it);
  if (std::isfinite(w.mfu)) tb.add_scalar("mfu", w.mfu, it);
  tb.add_scalar("iteration-time", w.secs / w.n_it, it);
  tb.add_scalar("tokens-per-second", w.tokens_per_s, it);
  tb.add_scalar("throughput-tflops", w.tflops, it);
  tb.add_scalar("skipped-iterations", static_cast<double>(w.skipped), it);
  if (setup.tp_size > 1) {
    tb.add_scalar("tensor-parallel-comm-in-flight-ms", w.tp.in_flight_ms / w.n_it, it);
    tb.add_scalar("tensor-parallel-comm-exposed-ms", w.tp.exposed_ms / w.n_it, it);
  }
  tb.flush();
}

}  // namespace

void TrainingLog::print(const std::string& line) const {
  if (setup_.printer) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

double TrainingLog::flops_of(const IterationResult& r) const {
  return static_cast<double>(batch_of(r) * seq_of(r)) *
         (setup_.flops_per_token +
          setup_.attention_flops_per_position * static_cast<double>(seq_of(r) - setup_.seq_length));
}

void TrainingLog::record(const IterationResult& r) {
  ++iterations_;
  window_tokens_ += batch_of(r) * seq_of(r);
  window_flops_ += flops_of(r);
  last_iteration_ = r.iteration, last_consumed_ = consumed_of(r);
  // Megatron's training_log: a skipped iteration (overflowed gradients) adds neither its loss
  // nor its norm to the window; a NaN iteration is one whose loss itself is NaN or infinite. The
  // window averages the iterations' values, each counted once (a ratio metric's iteration value
  // is its own token-weighted one; a ramp-up's larger iterations do not weigh more).
  if (r.skipped) {
    ++skipped_;
  } else {
    std::vector<std::pair<std::string, double>> values;
    for (const auto& name : r.metrics.names()) values.emplace_back(name, r.metrics.mean(name));
    window_.add(values);
  }
  for (const auto& name : r.metrics.names())
    if (!std::isfinite(r.metrics.mean(name))) {
      ++nan_iterations_;
      break;
    }
  for (auto [sum, t] : {std::pair<CommTiming*, const CommTiming*>{&tp_comm_sum_, &r.tensor_parallel_comm},
                        std::pair<CommTiming*, const CommTiming*>{&dp_comm_sum_, &r.data_parallel_comm},
                        std::pair<CommTiming*, const CommTiming*>{&pp_comm_sum_, &r.pipeline_parallel_comm},
                        std::pair<CommTiming*, const CommTiming*>{&ep_comm_sum_, &r.expert_parallel_comm},
                        std::pair<CommTiming*, const CommTiming*>{&cp_comm_sum_, &r.context_parallel_comm}}) {
    sum->in_flight_ms += t->in_flight_ms;
    sum->exposed_ms += t->exposed_ms;
    sum->collectives += t->collectives;
  }
  if (tensorboard_ && r.iteration % std::max<int64_t>(1, setup_.tensorboard_log_interval) == 0)
    write_iteration_scalars(r);
  if (logs(r.iteration)) {
    print_window(r);
    if (r.memory) print_memory(r.iteration, *r.memory);
    clear_window();
  }
}

// Megatron's training_log writes the iteration's own values (not the window's means), each against
// the iteration and against the samples consumed; a skipped iteration has no loss and no norm.
void TrainingLog::write_iteration_scalars(const IterationResult& r) {
  const int64_t it = r.iteration;
  add_scalar("learning-rate", r.learning_rate, it, consumed_of(r));
  add_scalar("batch-size", static_cast<double>(batch_of(r)), it, consumed_of(r));
  if (!r.skipped)
    for (const auto& name : r.metrics.names()) add_scalar(name, r.metrics.mean(name), it, consumed_of(r));
  add_scalar("loss-scale", r.loss_scale, it, consumed_of(r));
  add_scalar("world-size", static_cast<double>(setup_.world_size), it, consumed_of(r));
  if (!r.skipped) add_scalar("grad-norm", r.grad_norm, it, consumed_of(r));
  if (std::isfinite(r.num_zeros)) add_scalar("num-zeros", r.num_zeros, it, consumed_of(r));
  if (std::isfinite(r.params_norm)) add_scalar("params-norm", r.params_norm, it, consumed_of(r));
  if (setup_.curriculum) add_scalar("seqlen/curriculum_seqlen", static_cast<double>(seq_of(r)), it, consumed_of(r));
  tensorboard_->flush();
}

void TrainingLog::add_scalar(const std::string& tag, double value, int64_t iteration, int64_t consumed) {
  tensorboard_->add_scalar(tag, value, iteration);
  tensorboard_->add_scalar(tag + " vs samples", value, consumed);
}

// Megatron's report_memory line (after the first logged iteration), with DTK's breakdown: the
// allocator's device pool (what a GPU would hold; on a CPU run every tensor outside pinned host
// memory and an offloaded optimizer) and what the strategy and the optimizer hold of it.
void TrainingLog::print_memory(int64_t iteration, const MemorySample& m) const {
  auto mb = [](int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  char buf[512];
  std::snprintf(buf, sizeof buf,
                " [Rank 0] (after %lld iterations) memory (MB) | allocated: %.2f | max allocated: %.2f | "
                "parameters: %.2f | gradients: %.2f | fp32 masters: %.2f | optimizer state: %.2f%s | "
                "host allocated: %.2f | host max allocated: %.2f | activations per micro-batch: %.2f",
                static_cast<long long>(iteration), mb(m.allocator.device.bytes), mb(m.allocator.device.peak),
                mb(m.strategy.parameter_bytes), mb(m.strategy.gradient_bytes), mb(m.strategy.master_bytes),
                mb(m.optimizer_state_bytes), m.optimizer_on_host ? " (host)" : "", mb(m.allocator.host.bytes),
                mb(m.allocator.host.peak), mb(m.activation_bytes));
  print(buf);
  // The communication volume of the iteration, a line per group: its parts and their total.
  auto traffic_line = [&](const char* group, const std::vector<std::pair<const char*, int64_t>>& parts, int64_t total) {
    std::string line = " [Rank 0] (after " + std::to_string(iteration) + " iterations) " + group +
                       "-parallel traffic sent per iteration (MB)";
    for (const auto& [name, bytes] : parts) {
      std::snprintf(buf, sizeof buf, " | %s: %.2f", name, mb(bytes));
      line += buf;
    }
    std::snprintf(buf, sizeof buf, " | total: %.2f", mb(total));
    print(line + buf);
  };
  // Under ZeRO reduce-scatter + all-gather move what ddp's all-reduce moves.
  for (const auto& [name, t, n] :
       {std::tuple<const char*, const Traffic&, int>{"data", m.data_parallel, m.dp_size},
        std::tuple<const char*, const Traffic&, int>{"tensor", m.tensor_parallel, m.tp_size}}) {
    if (n <= 1) continue;
    std::vector<std::pair<const char*, int64_t>> parts = {{"all-reduce", t.all_reduce},
                                                          {"reduce-scatter", t.reduce_scatter},
                                                          {"all-gather", t.all_gather},
                                                          {"broadcast", t.broadcast}};
    // (All-to-alls here: the alltoall MoE dispatcher's uneven gathers over TP; shown only then.)
    if (t.all_to_all > 0) parts.emplace_back("all-to-all", t.all_to_all);
    traffic_line(name, parts, t.total());
  }
  // Pipeline stages: the activations and gradients rank 0's stage sent, and what the schedule and
  // the tied embeddings' sum moved besides.
  if (const Traffic& t = m.pipeline_parallel; m.pp_size > 1)
    traffic_line("pipeline", {{"point-to-point", t.point_to_point}, {"collectives", t.total() - t.point_to_point}},
                 t.total());
  // Expert parallelism: the MoE layers' tokens to their experts and back (all-to-all, or
  // all-gather and reduce-scatter: model.moe_token_dispatcher).
  if (const Traffic& t = m.expert_parallel; m.ep_size > 1)
    traffic_line("expert",
                 {{"all-to-all", t.all_to_all}, {"all-gather", t.all_gather}, {"reduce-scatter", t.reduce_scatter}},
                 t.total());
  // Context parallelism: the attention's all-to-alls (a2a) or its keys' and values' all-gather and
  // their gradients' reduce-scatter (all_gather), the positions' all-gather and the loss's token
  // count.
  if (const Traffic& t = m.context_parallel; m.cp_size > 1)
    traffic_line("context",
                 {{"all-to-all", t.all_to_all},
                  {"all-gather", t.all_gather},
                  {"reduce-scatter", t.reduce_scatter},
                  {"all-reduce", t.all_reduce}},
                 t.total());
  if (!tensorboard_) return;
  tensorboard_->add_scalar("mem-allocated-bytes", static_cast<double>(m.allocator.device.bytes), iteration);
  tensorboard_->add_scalar("mem-max-allocated-bytes", static_cast<double>(m.allocator.device.peak), iteration);
  tensorboard_->flush();
}

void TrainingLog::print_window(const IterationResult& last) {
  WindowFigures w;
  w.secs = std::chrono::duration<double>(Clock::now() - window_start_ - excluded_).count();
  w.n_it = static_cast<double>(iterations_);
  w.ms_per_it = 1000.0 * w.secs / w.n_it;
  w.tokens_per_s = static_cast<double>(window_tokens_) / w.secs;
  w.tflops = window_flops_ / w.secs / 1e12 / setup_.world_size;
  w.mfu = setup_.peak_tflops > 0 ? w.tflops / setup_.peak_tflops : NAN;
  // Megatron prints the last iteration's norm (none when it was skipped: DTK prints nan, so every
  // line has the same fields).
  w.norm = last.skipped ? NAN : last.grad_norm;
  trained_seconds_ += w.secs, trained_iterations_ += iterations_;
  w.elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  w.eta = static_cast<double>(last_iteration() - last.iteration) * trained_seconds_ /
          static_cast<double>(std::max<int64_t>(trained_iterations_, 1));
  w.rss_mb = static_cast<double>(memory::peak_rss_bytes()) / (1 << 20);
  w.consumed = consumed_of(last), w.batch = batch_of(last);
  w.skipped = skipped_, w.nan_iterations = nan_iterations_;
  w.tp = tp_comm_sum_, w.dp = dp_comm_sum_, w.pp = pp_comm_sum_, w.ep = ep_comm_sum_, w.cp = cp_comm_sum_;
  print(progress_line(w, last, setup_, window_));
  // Megatron's timers block: every rank takes part in the min/max.
  std::vector<Timers::Row> timer_rows;
  if (setup_.timers && setup_.topo) {
    timer_rows = setup_.timers->window(iterations_, *setup_.topo);
    setup_.timers->reset();
    if (!timer_rows.empty()) print(Timers::format(timer_rows));
  }
  if (metrics_) metrics_->write(window_record(w, last, setup_, window_, timer_rows));
  if (!tensorboard_) return;
  write_window_scalars(*tensorboard_, w, last.iteration, setup_, timer_rows);
}

void TrainingLog::clear_window() {
  window_.clear();
  iterations_ = skipped_ = nan_iterations_ = window_tokens_ = 0;
  window_flops_ = 0;
  tp_comm_sum_ = dp_comm_sum_ = pp_comm_sum_ = ep_comm_sum_ = cp_comm_sum_ = CommTiming();
  window_start_ = Clock::now();
  excluded_ = {};
}

void TrainingLog::report_evaluation(const std::string& what, const std::string& label, int64_t iteration,
                                    const MetricAverager& metrics, bool after_training) {
  // Megatron prints "validation" for the test split too, and a validation set's own name
  // ("validation-NAME", --multiple-validation-sets).
  std::string line =
      " " + (what.rfind("validation", 0) == 0 ? what : std::string("validation")) + " loss at " + label + " | ";
  char buf[256];
  for (const auto& name : metrics.names()) {
    const double v = metrics.mean(name);
    std::snprintf(buf, sizeof buf, "%s value: %.6E | %s PPL: %.6E | ", name.c_str(), v, name.c_str(),
                  std::exp(std::min(v, 20.0)));
    line += buf;
  }
  const std::string rule(line.size(), '-');
  print(rule + "\n" + line + "\n" + rule);
  if (metrics_) {
    JsonObject o;
    o.add("kind", what).add("iteration", iteration);
    if (after_training) o.add_raw("after_training", "true");
    for (const auto& name : metrics.names()) {
      const double v = metrics.mean(name);
      o.add(name, v).add(name + " ppl", std::exp(std::min(v, 20.0)));
    }
    metrics_->write(o);
  }
  if (!tensorboard_) return;
  const int64_t consumed = iteration == last_iteration_ ? last_consumed_ : iteration * setup_.global_batch_size;
  for (const auto& name : metrics.names()) {
    const double v = metrics.mean(name);
    add_scalar(name + " " + what, v, iteration, consumed);
    add_scalar(name + " " + what + " ppl", std::exp(std::min(v, 20.0)), iteration, consumed);
  }
  tensorboard_->flush();
}

}  // namespace dtk::core
