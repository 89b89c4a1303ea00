// captured.cpp — one pipeline stage (as no_pipelining.cpp), each micro-batch's forward and backward
// recorded once into a CUDA graph and replayed (train.cuda_graphs; dtk/core/device/step_capture.hpp).
//
// A recording holds raw device addresses, so whatever it reads or writes outside itself must stay
// where it was: the batch is copied into fixed input tensors before each replay, and the
// parameters' gradients are fixed tensors the backward adds into, bound again before each replay
// (a strategy that took a gradient away, as ddp moves bf16 gradients into its fp32 masters, gets
// the same tensor back, zeroed; one that swapped it gets its values copied in). What the
// recording returns (the step's metrics, the checks the layers deferred) are fixed
// tensors too, read after each replay; the checks once per iteration, before the optimizer step.
// The dropout masks' seeds are a fixed table the host draws into before each replay
// (capture::RecordedSeeds), so the replays draw the masks an uncaptured run would.
// (The loss itself is only the backward's start: the step reports its value as a metric.)
#include <glog/logging.h>

#include <algorithm>
#include <cstdio>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/host/error.hpp"
#include "schedules.hpp"

namespace dtk::core {

namespace {

constexpr int64_t kEagerIterations = 2;  // first: lazy initialisation and the graph check
constexpr int kMaxRecordings = 4;        // shapes that keep changing are not worth recording

struct Recorded {
  Metrics metrics;
  std::vector<capture::DeferredCheck> checks;
};

// A parameter whose gradient the recording adds into.
struct BoundGradient {
  at::Tensor param, grad;
};

class Captured final : public ForwardBackwardSchedule {
 public:
  Captured(MicroBatchRunner& runner, std::unique_ptr<ForwardBackwardSchedule> eager,
           std::unique_ptr<StepRecorder> recorder)
      : run_(runner), eager_(std::move(eager)), recorder_(std::move(recorder)) {}

  void train(int64_t iteration, int64_t num_micro, double scale, IterationResult& r) override {
    if (!recorder_ || eager_iterations_ < kEagerIterations) {
      eager_->train(iteration, num_micro, scale, r);
      if (recorder_ && ++eager_iterations_ == kEagerIterations) note_trained_parameters();
      return;
    }
    std::vector<std::pair<std::string, at::Tensor>> failed;  // each check by its line, OR-ed over micro-batches
    for (int64_t m = 0; m < num_micro; ++m) {
      // In host memory, its ids checked there: the copy into the fixed inputs is the only transfer.
      const TensorList batch = run_.next_batch(iteration, /*on_host=*/true);
      const std::string key = key_of(batch, num_micro, scale);
      if (recorder_ && key != key_) {
        // A new shape runs once as it always did first, so that the layers' caches (masks, rotary
        // tables) exist before the recording reads them; the next micro-batch records.
        if (warmed_key_ != key) {
          warmed_key_ = key;
          eager_micro_batch(iteration, m, num_micro, scale, batch, r);
          continue;
        }
        record(iteration, batch, key, num_micro, scale);
      }
      if (!recorder_) {  // the recording failed: this micro-batch and the rest run as they always did
        eager_micro_batch(iteration, m, num_micro, scale, batch, r);
        continue;
      }
      run_.before_backward(m, num_micro);
      load(batch);
      bind_gradients();
      seeds_->draw();
      recorder_->replay([&] { body(iteration, num_micro, scale); });
      r.metrics.add(recorded_.metrics);
      for (const capture::DeferredCheck& c : recorded_.checks) {
        const at::Tensor any = c.failed.any();
        auto it = std::find_if(failed.begin(), failed.end(), [&](const auto& f) { return f.first == c.message; });
        if (it == failed.end())
          failed.emplace_back(c.message, any.clone());
        else
          it->second.logical_or_(any);
      }
    }
    verify(failed, iteration);
  }

  void evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics) override {
    eager_->evaluate(loader, num_batches, metrics);
  }

 private:
  // What the recording holds: the step's forward and the loss's backward on the fixed inputs,
  // with the layers told (capturing()) to take their paths without host reads.
  void body(int64_t iteration, int64_t num_micro, double scale) {
    capture::Recording recording(seeds_.get(), /*kernels_run=*/!recording_graph_);
    Recorded out;
    run_.bare_forward_backward(iteration, inputs_, num_micro, scale, &out.metrics);
    out.checks = recording.take();
    recorded_ = std::move(out);
  }

  void record(int64_t iteration, const TensorList& batch, const std::string& key, int64_t num_micro, double scale) {
    if (++recordings_ > kMaxRecordings) {
      give_up("the batch's shapes, the micro-batches per step or the loss scale changed " +
              std::to_string(recordings_ - 1) + " times");
      return;
    }
    inputs_.clear();
    for (const auto& [name, t] : batch)
      inputs_.emplace_back(name, at::empty(t.sizes(), t.options().device(training_device()).pinned_memory(false)));
    load(batch);
    bind_gradients();
    if (!seeds_) seeds_ = std::make_unique<capture::RecordedSeeds>(training_device());
    seeds_->forget();
    recording_graph_ = true;  // the body's kernels are enqueued, not run (the probe does not run it here)
    try {
      recorder_->record([&] { body(iteration, num_micro, scale); });
    } catch (const std::exception& e) {
      recording_graph_ = false;
      give_up(one_line(e.what()));
      return;
    }
    recording_graph_ = false;
    if (!recorder_->replays_body() && !recorded_.metrics.values.empty()) {
      give_up("step plugin reports its metrics as numbers (a plugin built for ABI < 2.5), which a graph cannot update");
      return;
    }
    // A parameter the eager iterations did not train but the recording's backward reached got
    // graph memory as its gradient, which nothing would read: drop it (nothing ran yet) and stay
    // uncaptured.
    for (const Param& p : run_.model().parameters()) {
      const at::Tensor& g = p.tensor.grad();
      if (!g.defined() || std::any_of(bound_.begin(), bound_.end(), [&](const BoundGradient& b) {
            return b.grad.is_same(g);
          }))
        continue;
      p.tensor.mutable_grad() = at::Tensor();
      give_up("parameter '" + p.name + "' got a gradient only in the recorded step");
      return;
    }
    key_ = key;
    if (run_.topo().world_rank == 0)
      std::printf(" > train.cuda_graphs: iteration %lld's micro-batches replay a recorded forward and backward\n",
                  static_cast<long long>(iteration));
  }

  void give_up(const std::string& why) {
    recorder_.reset();
    inputs_.clear();
    bound_.clear();  // the parameters keep theirs until zero_grad drops them
    recorded_ = Recorded();
    seeds_.reset();  // nothing drew from the recording's slots: the generators are where they were
    std::fprintf(stderr, "dtk: warning: train.cuda_graphs: the step could not be recorded; it runs uncaptured: %s\n",
                 why.c_str());
  }

  static std::string key_of(const TensorList& batch, int64_t num_micro, double scale) {
    char exact[40];
    std::snprintf(exact, sizeof exact, "%a", scale);  // every bit of it: the graph holds it as a constant
    std::string key = std::to_string(num_micro) + "|" + exact;
    for (const auto& [name, t] : batch) {
      key += "|" + name + ":" + std::string(c10::toString(t.scalar_type()));
      for (int64_t d : t.sizes()) key += "," + std::to_string(d);
    }
    return key;
  }

  void load(const TensorList& batch) {
    for (size_t i = 0; i < batch.size(); ++i) inputs_[i].second.copy_(batch[i].second, /*non_blocking=*/true);
  }

  // The parameters the eager iterations trained: the ones the recording's backward adds into.
  void note_trained_parameters() {
    for (const Param& p : run_.model().parameters())
      if (p.tensor.grad().defined()) bound_.push_back({p.tensor, at::zeros_like(p.tensor)});
  }

  void bind_gradients() {
    for (BoundGradient& b : bound_) {
      at::Tensor& g = b.param.mutable_grad();
      if (!g.defined()) {
        b.grad.zero_();
        g = b.grad;
      } else if (!g.is_same(b.grad)) {
        b.grad.copy_(g);
        g = b.grad;
      }
    }
  }

  void eager_micro_batch(int64_t iteration, int64_t m, int64_t num_micro, double scale, const TensorList& batch,
                         IterationResult& r) {
    Metrics metrics;
    run_.forward_backward(iteration, m, num_micro, scale, &metrics, &batch);
    r.metrics.add(metrics);
  }

  // The iteration's deferred checks in one host read, before the gradients are used.
  static void verify(const std::vector<std::pair<std::string, at::Tensor>>& failed, int64_t iteration) {
    if (failed.empty()) return;
    std::vector<at::Tensor> flags;
    for (const auto& f : failed) flags.push_back(f.second.reshape({1}));
    const at::Tensor read = at::cat(flags).to(at::kCPU);
    for (size_t i = 0; i < failed.size(); ++i)
      if (read[static_cast<int64_t>(i)].item<bool>())
        throw host::HostError(failed[i].first + " (iteration " + std::to_string(iteration) + ")");
  }

  MicroBatchRunner& run_;
  std::unique_ptr<ForwardBackwardSchedule> eager_;
  std::unique_ptr<StepRecorder> recorder_;
  int64_t eager_iterations_ = 0;
  int recordings_ = 0;
  std::string key_, warmed_key_;
  TensorList inputs_;
  std::vector<BoundGradient> bound_;
  Recorded recorded_;
  std::unique_ptr<capture::RecordedSeeds> seeds_;
  bool recording_graph_ = false;
};

}  // namespace

std::string cuda_graphs_refusal(const CaptureSetup& s) {
  if (!s.asked) return "not asked for (train.cuda_graphs=false)";
  if (!s.probe) {
    if (!s.cuda_device) return "the run trains on the CPU";
    if (!s.torch_cuda) return "this dtk was built against a CPU-only LibTorch";
  }
  if (s.pp_size > 1 || s.virtual_stages > 1) return "pipeline stages exchange activations inside the step";
  if (s.tp_size > 1) return "tensor-parallel collectives run inside the step";
  if (s.dp_size > 1)
    return "data-parallel ranks average the loss inside the step and reduce gradients during the backward";
  if (s.strategy != "ddp")
    return "strategy '" + s.strategy + "' manages the gradients' memory itself; only ddp's steps are recorded";
  if (s.loss_hook) return "a test hook changes the loss of some micro-batches";
  if (s.per_token_loss)
    return "train.calculate_per_token_loss divides the gradients by the step's token count, read on the host";
  if (s.num_experts > 0)
    return "the mixture-of-experts layers (num_experts " + std::to_string(s.num_experts) +
           ") size each expert's rows by the routing, read on the host";
  if (!s.curriculum.empty())
    return "train.curriculum_schedule " + s.curriculum +
           " changes the sequence length, and a recorded step's shapes, "
           "between iterations";
  return "";
}

std::unique_ptr<ForwardBackwardSchedule> make_captured_schedule(MicroBatchRunner& runner,
                                                                std::unique_ptr<ForwardBackwardSchedule> eager,
                                                                std::unique_ptr<StepRecorder> recorder) {
  return std::make_unique<Captured>(runner, std::move(eager), std::move(recorder));
}

}  // namespace dtk::core
