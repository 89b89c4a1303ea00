#include "dtk/core/train/schedule.hpp"

#include "schedules.hpp"

namespace dtk::core {

std::unique_ptr<ForwardBackwardSchedule> make_schedule(MicroBatchRunner& runner, int virtual_stages,
                                                       std::unique_ptr<StepRecorder> recorder) {
  if (virtual_stages > 1) return make_interleaved_schedule(runner);
  if (runner.topo().pp_size > 1) return make_one_f_one_b_schedule(runner);
  if (recorder) return make_captured_schedule(runner, make_no_pipelining_schedule(runner), std::move(recorder));
  return make_no_pipelining_schedule(runner);
}

std::string schedule_refusal(int virtual_stages, int pp_size, int64_t num_micro) {
  if (virtual_stages > 1) return interleaved_refusal(virtual_stages, pp_size, num_micro);
  return "";
}

}  // namespace dtk::core
