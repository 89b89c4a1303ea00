// The schedules' factories (schedule.cpp picks one) and what the pipelined ones share: the
// previous stage's output set as the model's input for one forward, and sends waited in order.
#pragma once

#include <cstdint>
#include <exception>
#include <limits>
#include <list>
#include <memory>
#include <string>
#include <utility>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/train/schedule.hpp"
#include "dtk/core/device/step_capture.hpp"

namespace dtk::core {

std::unique_ptr<ForwardBackwardSchedule> make_no_pipelining_schedule(MicroBatchRunner& runner);
std::unique_ptr<ForwardBackwardSchedule> make_one_f_one_b_schedule(MicroBatchRunner& runner);
std::unique_ptr<ForwardBackwardSchedule> make_interleaved_schedule(MicroBatchRunner& runner);
std::string interleaved_refusal(int virtual_stages, int pp_size, int64_t num_micro);
// `eager` (the no-pipelining schedule) with each micro-batch recorded by `recorder` and replayed
// after the first iterations (train.cuda_graphs, captured.cpp).
std::unique_ptr<ForwardBackwardSchedule> make_captured_schedule(MicroBatchRunner& runner,
                                                                std::unique_ptr<ForwardBackwardSchedule> eager,
                                                                std::unique_ptr<StepRecorder> recorder);

// The previous stage's output as the model's "hidden_states" for one forward, taken back after
// it however it ends.
class StageInput {
 public:
  explicit StageInput(ModelInstance& model) : model_(model) {}
  ~StageInput() { model_.set_pipeline_input(at::Tensor()); }
  void set(const at::Tensor& input) { model_.set_pipeline_input(input); }
  StageInput(const StageInput&) = delete;
  StageInput& operator=(const StageInput&) = delete;

 private:
  ModelInstance& model_;
};

// Sends in flight, each waited once it is known to be done. On an error the ones left are handed
// over unwaited (the process is ending): a send whose receiver will never come would otherwise
// hold the error back for a whole collective timeout each.
class PendingSends {
 public:
  ~PendingSends() {
    if (!std::uncaught_exceptions()) return;
    for (auto& [index, work] : sends_) (void)work.release();
  }
  void add(int64_t index, Work w) { sends_.emplace_back(index, std::move(w)); }
  // Waits every send of an index <= `index`, in the order added (done: their receiver has moved on).
  void wait_through(int64_t index) {
    while (!sends_.empty() && sends_.front().first <= index) {
      sends_.front().second.wait();
      sends_.pop_front();
    }
  }
  // Waits the send of index `index`, wherever it is (the interleaved schedule learns them done out
  // of order).
  void wait_for(int64_t index) {
    for (auto it = sends_.begin(); it != sends_.end(); ++it)
      if (it->first == index) {
        it->second.wait();
        sends_.erase(it);
        return;
      }
  }
  void wait_all() { wait_through(std::numeric_limits<int64_t>::max()); }

 private:
  std::list<std::pair<int64_t, Work>> sends_;
};

// A stage's input and output of one micro-batch, kept from its forward to its backward.
struct StageActivations {
  at::Tensor input, output;
};

}  // namespace dtk::core
