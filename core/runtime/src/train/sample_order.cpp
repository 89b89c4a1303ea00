#include "dtk/core/train/sample_order.hpp"

#include <algorithm>
#include <random>
#include <string>
#include <utility>

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

std::vector<int64_t> torch_randperm(int64_t n, uint64_t seed, int64_t inside_out_from) {
  std::vector<int64_t> r(static_cast<size_t>(std::max<int64_t>(n, 0)));
  // torch.Generator().manual_seed(seed) seeds its mt19937 with the low 32 bits, as std::mt19937 does.
  std::mt19937 engine(static_cast<uint32_t>(seed & 0xffffffffu));
  if (n < inside_out_from) {
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
  const int64_t unit = mbs_ * dp_;
  if (!choice_.cyclic) return consumed + k * unit + rank_ * mbs_ + j;
  // Megatron asserts it: its counts only ever move by whole micro-batches of every rank.
  if (consumed % unit != 0)
    throw HostError("sample order: " + std::to_string(consumed) + " consumed samples are not a multiple of " +
                    std::to_string(unit) + " (micro_batch_size x data-parallel size)");
  const std::lock_guard<std::mutex> lock(mutex_);
  // Walk this rank's epochs as Megatron's sampler, restarted by cyclic_iter, does: each restart
  // begins at epoch consumed / A, offset consumed % A, and adds mbs*dp per micro-batch it yields.
  // A loader asks for k in order: start from the last epoch boundary reached when it can.
  int64_t at = consumed, first = 0;  // where micro-batch `first` of this loader begins
  if (walk_.from == consumed && walk_.micro_batch <= k) at = walk_.at, first = walk_.micro_batch;
  for (;;) {
    const int64_t epoch = at / epoch_samples_, offset = at % epoch_samples_;
    // The micro-batches this rank reads before its part of the epoch runs out (at least one:
    // offset <= A - mbs*dp and A <= F).
    const int64_t left =
        choice_.data_sharding ? permuted_ - offset / dp_ : (permuted_ - offset - rank_ + dp_ - 1) / dp_;
    const int64_t batches = left / mbs_;
    if (k - first < batches) {
      walk_ = {consumed, first, at};
      const std::vector<int64_t>& perm = permutation(epoch);
      const int64_t row = (k - first) * mbs_ + j;
      if (choice_.data_sharding) return rank_ * permuted_ + perm[static_cast<size_t>(offset / dp_ + row)];
      return perm[static_cast<size_t>(offset + row * dp_ + rank_)];
    }
    first += batches;
    at += batches * unit;
  }
}

}  // namespace dtk::core
