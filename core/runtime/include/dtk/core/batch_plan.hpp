// dtk/core/batch_plan.hpp — how samples become micro-batches: Megatron's batch sizes and sampler.
//
//   global batch (gbs) = micro_batch_size (mbs) x data-parallel size (dp) x micro-batches per step
//   global batch k holds samples [k*gbs, (k+1)*gbs); micro-batch m of DP rank r takes the rows
//   m*mbs*dp + r*mbs + j (j < mbs), as Megatron's MegatronPretrainingSampler hands them out.
#pragma once

#include <cstdint>

#include "dtk/core/services.hpp"
#include "dtk_config.pb.h"

namespace dtk::core {

class BatchPlan {
 public:
  // Every batch-size check of a run in one place; throws HostError naming the field.
  BatchPlan(const config::RunConfig& cfg, const Topology& topo);

  int64_t micro_batch_size() const { return mbs_; }
  int64_t global_batch_size() const { return gbs_; }
  int64_t micro_batches_per_step() const { return num_micro_; }
  int64_t train_iters() const { return train_iters_; }
  int64_t eval_iters() const { return eval_iters_; }
  int64_t seq_length() const { return seq_length_; }
  int64_t tokens_per_step() const { return gbs_ * seq_length_; }

  // Samples each split must provide for the whole run (Megatron's train_val_test_num_samples):
  // validation runs every eval_interval iterations plus once at the end; test once.
  int64_t train_samples() const { return train_iters_ * gbs_; }
  int64_t valid_samples() const { return num_evals_ * eval_iters_ * gbs_; }
  int64_t test_samples() const { return eval_iters_ * gbs_; }

  // Sample index of row j of the k-th micro-batch this rank consumes, counting from global
  // batch `first_global_batch`.
  int64_t sample_index(int64_t first_global_batch, int64_t k, int64_t j) const {
    const int64_t gb = first_global_batch + k / num_micro_, m = k % num_micro_;
    return gb * gbs_ + m * mbs_ * dp_size_ + dp_rank_ * mbs_ + j;
  }

 private:
  int64_t mbs_ = 1, gbs_ = 1, num_micro_ = 1;
  int64_t train_iters_ = 0, eval_iters_ = 0, num_evals_ = 1, seq_length_ = 0;
  int64_t dp_rank_ = 0, dp_size_ = 1;
};

}  // namespace dtk::core
