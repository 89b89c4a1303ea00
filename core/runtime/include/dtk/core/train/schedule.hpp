// dtk/core/train/schedule.hpp — forward-backward schedules: the order in which one iteration's
// micro-batches run their forwards and backwards on this rank, and the forward-only order of an
// evaluation. Chosen once at start by make_schedule (Megatron's get_forward_backward_func) and
// used by Trainer::train_step and Trainer::evaluate alike:
//
//   no_pipelining.cpp   one stage: forward and backward of each micro-batch in turn
//   one_f_one_b.cpp     pipeline stages, one model chunk each: Megatron's 1F1B (PipeDream-flush)
//   interleaved.cpp     pipeline stages, several model chunks each: Megatron's interleaved 1F1B
//   captured.cpp        one stage, each micro-batch replayed from a CUDA graph (train.cuda_graphs)
//
// A new schedule is one new file implementing ForwardBackwardSchedule plus its case in
// make_schedule (schedule.cpp). Schedules run micro-batches through MicroBatchRunner
// (train/micro_batch.hpp) and never see the plugins directly.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "dtk/core/logging/training_log.hpp"
#include "dtk/core/train/batch_loader.hpp"
#include "dtk/core/train/micro_batch.hpp"
#include "dtk/core/device/step_capture.hpp"

namespace dtk::core {

class ForwardBackwardSchedule {
 public:
  virtual ~ForwardBackwardSchedule() = default;
  // Forwards and backwards of `num_micro` micro-batches of `iteration`, gradients accumulated in
  // the parameters; the step's metrics (every rank the same) and the pipeline's communication
  // timing go into `r`. `scale`: the iteration's loss scale.
  virtual void train(int64_t iteration, int64_t num_micro, double scale, IterationResult& r) = 0;
  // Forwards only (the caller holds a NoGradGuard) of `num_batches` micro-batches from `loader`;
  // every rank ends with the same metrics.
  virtual void evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics) = 0;
};

// The schedule for this rank: by the pipeline size and the model chunks per rank
// (distributed.virtual_pipeline_model_parallel_size); with a `recorder` (train.cuda_graphs, one
// stage: cuda_graphs_refusal said yes) the micro-batches are recorded and replayed (captured.cpp).
std::unique_ptr<ForwardBackwardSchedule> make_schedule(MicroBatchRunner& runner, int virtual_stages,
                                                       std::unique_ptr<StepRecorder> recorder = nullptr);

// What decides whether a run's micro-batches are recorded.
struct CaptureSetup {
  bool asked = false;               // train.cuda_graphs
  bool cuda_device = false;         // the run trains on a GPU
  bool torch_cuda = false;          // this dtk was built against a CUDA LibTorch
  bool probe = false;               // DTK_TEST_CUDA_GRAPH_PROBE: the CPU probe stands in for the GPU
  int tp_size = 1, pp_size = 1, dp_size = 1, virtual_stages = 1;
  std::string strategy;             // the strategy plugin's name
  bool loss_hook = false;           // a test hook changes the loss (TrainerHooks::scaled_loss)
  bool per_token_loss = false;      // train.calculate_per_token_loss
  int num_experts = 0;              // the model's mixture-of-experts layers (dtk_model_info.num_experts)
  std::string curriculum;           // train.curriculum_schedule ("" = off)
};

// Why the steps stay uncaptured, as the start-up line says it ("" when they are recorded).
std::string cuda_graphs_refusal(const CaptureSetup& s);

// Why the schedule cannot run `num_micro` micro-batches per step ("" if it can). Checked before
// the model is built, for every iteration size of a batch-size ramp-up.
std::string schedule_refusal(int virtual_stages, int pp_size, int64_t num_micro);

}  // namespace dtk::core
