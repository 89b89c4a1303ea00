// dtk/core/train/sample_order.hpp — which sample each row of a micro-batch reads: Megatron's two
// samplers (train.dataloader_type).
//
// A loader starts after `consumed` samples of its split (a multiple of micro_batch_size x
// data-parallel size: Megatron's consumed_train_samples or consumed_valid_samples) and this rank
// then draws micro-batches k = 0, 1, ... from it.
//
//   single (MegatronPretrainingSampler): micro-batch k of DP rank r holds the samples
//     consumed + k*mbs*dp + r*mbs + j (j < mbs), in the dataset's own order.
//   cyclic (MegatronPretrainingRandomSampler, read forever by Megatron's cyclic_iter): the split
//     of N samples is read in epochs of A = N - N % (mbs*dp) samples; epoch e = consumed / A
//     starts at offset consumed % A of a permutation torch.randperm(n, Generator().manual_seed(e)):
//       data_sharding (Megatron's default): rank r owns the bucket [r*B, (r+1)*B), B = A / dp,
//         and reads r*B + perm_B[offset/dp + k*mbs + j];
//       without: perm_F (F = N - N % mbs) dealt out round-robin, rank r reads
//         perm_F[offset + (k*mbs + j)*dp + r].
//     The last N - A (sharding) or N % mbs (without) samples of a split are never read. When its
//     part of the epoch runs out the rank starts the next epoch, a new permutation, where its own
//     count stands, as Megatron's sampler does: without data sharding a rank whose round-robin
//     share of F holds a whole micro-batch more than A's (with mbs 1: when N is not a multiple
//     of dp) reads one micro-batch more of the epoch, and the ranks' counts part, as in Megatron.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "dtk_config.pb.h"

namespace dtk::core {

struct SamplerChoice {
  bool cyclic = false;        // dataloader_type cyclic
  bool data_sharding = true;  // cyclic: each rank permutes its own bucket
};
// train.dataloader_type and train.data_sharding (checked by validate_config).
SamplerChoice sampler_choice(const config::TrainingConfig& t);
// "single", "cyclic" or "cyclic without data sharding", for the start-up report.
const char* sampler_name(SamplerChoice s);

class SampleOrder {
 public:
  // Throws HostError when a cyclic split holds less than one micro-batch per rank.
  SampleOrder(SamplerChoice choice, int64_t split_samples, int64_t micro_batch_size, int64_t dp_rank, int64_t dp_size);
  ~SampleOrder();
  // Row j of the k-th micro-batch this rank draws from a loader that began after `consumed`
  // samples (a multiple of micro_batch_size x dp_size: throws HostError otherwise). Thread-safe
  // (the batch loader's thread calls it); cheapest when a loader asks for k in order.
  int64_t index(int64_t consumed, int64_t k, int64_t j) const;

 private:
  const std::vector<int64_t>& permutation(int64_t epoch) const;  // of this rank's bucket (cyclic)
  SamplerChoice choice_;
  int64_t n_, mbs_, rank_, dp_;
  int64_t epoch_samples_ = 0;  // A: what one epoch consumes over all ranks
  int64_t permuted_ = 0;       // B (data sharding) or F (without)
  mutable std::mutex mutex_;   // guards what follows: the walk's last place, the epoch's permutation
  // Micro-batch `micro_batch` of the loader that began after `from` samples begins at `at` (an
  // epoch boundary of this rank's walk, or its start).
  struct Walk {
    int64_t from = -1, micro_batch = 0, at = 0;
  };
  mutable Walk walk_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_;
};

// torch.randperm(n, generator=g) after g.manual_seed(seed) on the CPU: PyTorch's Fisher-Yates over
// mt19937 (swap i with i + random() % (n - i)) for n < 2^32 / 20, and from there the inside-out
// shuffle over random64() that PyTorch uses from 2.7 on (before it, the Fisher-Yates for every n),
// with the same draws as torch's CPU generator, whichever LibTorch DTK is built against.
// `inside_out_from` moves PyTorch's threshold (tests only).
constexpr int64_t kTorchInsideOutFrom = 4294967295LL / 20;
std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed, int64_t inside_out_from = kTorchInsideOutFrom);

}  // namespace dtk::core
