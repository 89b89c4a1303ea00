// One pipeline stage (Megatron's forward_backward_no_pipelining): each micro-batch's forward,
// then its backward, gradients accumulating in the parameters.
#include "schedules.hpp"

namespace dtk::core {

namespace {

class NoPipelining final : public ForwardBackwardSchedule {
 public:
  explicit NoPipelining(MicroBatchRunner& runner) : run_(runner) {}

  void train(int64_t iteration, int64_t num_micro, double scale, IterationResult& r) override {
    for (int64_t m = 0; m < num_micro; ++m) {
      Metrics metrics;
      run_.forward_backward(iteration, m, num_micro, scale, &metrics);
      r.metrics.add(metrics);
    }
  }

  void evaluate(BatchLoader& loader, int64_t num_batches, MetricAverager& metrics) override {
    for (int64_t k = 0; k < num_batches; ++k) {
      Metrics m;
      run_.forward_only(loader.next(), &m);
      metrics.add(m);
    }
  }

 private:
  MicroBatchRunner& run_;
};

}  // namespace

std::unique_ptr<ForwardBackwardSchedule> make_no_pipelining_schedule(MicroBatchRunner& runner) {
  return std::make_unique<NoPipelining>(runner);
}

}  // namespace dtk::core
