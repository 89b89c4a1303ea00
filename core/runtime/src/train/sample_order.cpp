#include "dtk/core/train/sample_order.hpp"

#include <limits>
#include <random>
#include <string>

#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

SamplerChoice sampler_choice(const config::TrainingConfig& t) {
  SamplerChoice s;
  s.cyclic = t.dataloader_type() == "cyclic";
  if (t.has_data_sharding()) s.data_sharding = t.data_sharding();
  return s;
}

const char* sampler_name(SamplerChoice s) {
  if (!s.cyclic) return "single";
  return s.data_sharding ? "cyclic" : "cyclic without data sharding";
}

std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed) {
  std::vector<int64_t> r(static_cast<size_t>(std::max<int64_t>(n, 0)));
  // torch.Generator().manual_seed(seed) seeds its mt19937 with the low 32 bits, as std::mt19937 does.
  std::mt19937 engine(static_cast<uint32_t>(seed & 0xffffffffu));
  if (n < static_cast<int64_t>(std::numeric_limits<uint32_t>::max() / 20)) {
    for (int64_t i = 0; i < n; ++i) r[static_cast<size_t>(i)] = i;
    for (int64_t i = 0; i + 1 < n; ++i) {
      const int64_t z = static_cast<int64_t>(engine()) % (n - i);
      std::swap(r[static_cast<size_t>(i)], r[static_cast<size_t>(i + z)]);
    }
    return r;
  }
  // Large n: the random() % (n - i) above would be skewed; PyTorch draws 64 bits (high word first).
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t hi = engine(), lo = engine();
    const auto z = static_cast<size_t>(((hi << 32) | lo) % static_cast<uint64_t>(i + 1));
    r[static_cast<size_t>(i)] = r[z];
    r[z] = i;
  }
  return r;
}

SampleOrder::SampleOrder(SamplerChoice choice, int64_t split_samples, int64_t micro_batch_size, int64_t dp_rank,
                         int64_t dp_size)
    : choice_(choice), n_(split_samples), mbs_(micro_batch_size), rank_(dp_rank), dp_(dp_size) {
  if (!choice_.cyclic) return;
  const int64_t unit = mbs_ * dp_;
  epoch_samples_ = n_ - n_ % unit;
  if (epoch_samples_ <= 0)
    throw HostError("train.dataloader_type=cyclic: a split of " + std::to_string(n_) +
                    " samples holds no micro-batch for each of the " + std::to_string(dp_) + " data-parallel ranks (" +
                    std::to_string(unit) + " samples)");
  permuted_ = choice_.data_sharding ? epoch_samples_ / dp_ : n_ - n_ % mbs_;
}

SampleOrder::~SampleOrder() = default;

const std::vector<int64_t>& SampleOrder::permutation(int64_t epoch) const {
  if (cached_epoch_ != epoch) {
    cached_ = torch_randperm(permuted_, static_cast<uint64_t>(epoch));
    cached_epoch_ = epoch;
  }
  return cached_;
}

int64_t SampleOrder::index(int64_t consumed, int64_t k, int64_t j) const {
  if (!choice_.cyclic) return consumed + k * mbs_ * dp_ + rank_ * mbs_ + j;
  // Walk this rank's epochs as Megatron's sampler, restarted by cyclic_iter, does: each restart
  // begins at epoch consumed / A, offset consumed % A, and adds mbs*dp per micro-batch it yields.
  for (;;) {
    const int64_t epoch = consumed / epoch_samples_, offset = consumed % epoch_samples_;
    // The micro-batches this rank reads before its part of the epoch runs out.
    const int64_t left = choice_.data_sharding ? permuted_ - offset / dp_
                                               : (permuted_ - offset - rank_ + dp_ - 1) / dp_;  // > 0: offset < A <= F
    const int64_t batches = left / mbs_;
    if (k < batches) {
      const std::lock_guard<std::mutex> lock(mutex_);
      const std::vector<int64_t>& perm = permutation(epoch);
      if (choice_.data_sharding) return rank_ * permuted_ + perm[static_cast<size_t>(offset / dp_ + k * mbs_ + j)];
      return perm[static_cast<size_t>(offset + (k * mbs_ + j) * dp_ + rank_)];
    }
    k -= batches;
    consumed += batches * mbs_ * dp_;
  }
}

}  // namespace dtk::core
