// Megatron's samplers (train.dataloader_type):
//   * torch_randperm equals LibTorch's randperm under a CPU generator seeded alike (what
//     torch.randperm(n, generator=g) computes in Megatron);
//   * the cyclic order (MegatronPretrainingRandomSampler, read forever through cyclic_iter) equals
//     what Megatron-LM's own sampler class printed, with and without data sharding, from a start
//     and after a resume, across epochs, including a split whose ranks part ways at an epoch's end;
//   * it equals a re-implementation of that class as Megatron writes it (a stateful iterator over
//     LibTorch's randperm, restarted when it runs out) over a sweep of sizes;
//   * end to end through `dtk` at two data-parallel ranks, the samples each rank reads for
//     training, validation and test are that order; a resumed run reads what the uninterrupted
//     one read and trains to its losses; bad settings are one line.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../common/run_dtk.hpp"
#include "dtk/core/train/sample_order.hpp"

namespace {

using dtk::core::SampleOrder;
using dtk::core::SamplerChoice;

std::vector<int64_t> libtorch_randperm(int64_t n, uint64_t seed) {
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
  const at::Tensor p = at::randperm(n, g, at::TensorOptions().dtype(at::kLong));
  return std::vector<int64_t>(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + n);
}

// MegatronPretrainingRandomSampler as Megatron writes it: __iter__ yields this rank's
// micro-batches of one epoch from consumed_samples on, adding mbs x dp per micro-batch; cyclic_iter
// calls __iter__ again when it runs out.
class MegatronRandomSampler {
 public:
  MegatronRandomSampler(int64_t total, int64_t consumed, int64_t mbs, int64_t rank, int64_t dp, bool sharding)
      : total_(total), consumed_(consumed), mbs_(mbs), rank_(rank), dp_(dp), sharding_(sharding) {}

  std::vector<int64_t> one_pass() {
    const int64_t unit = mbs_ * dp_, active = total_ - total_ % unit;
    const int64_t epoch = consumed_ / active, current = consumed_ % active;
    std::vector<int64_t> idx_range;
    if (sharding_) {
      const int64_t bucket = (total_ / unit) * mbs_, offset = current / dp_, start = rank_ * bucket;
      const std::vector<int64_t> perm = libtorch_randperm(bucket, static_cast<uint64_t>(epoch));
      for (size_t i = static_cast<size_t>(offset); i < perm.size(); ++i) idx_range.push_back(start + perm[i]);
    } else {
      const int64_t full = (total_ / mbs_) * mbs_;
      const std::vector<int64_t> perm = libtorch_randperm(full, static_cast<uint64_t>(epoch));
      std::vector<int64_t> active_part(perm.begin() + current, perm.end());
      for (size_t i = static_cast<size_t>(rank_); i < active_part.size(); i += static_cast<size_t>(dp_))
        idx_range.push_back(active_part[i]);
    }
    std::vector<int64_t> out, batch;
    for (int64_t idx : idx_range) {
      batch.push_back(idx);
      if (static_cast<int64_t>(batch.size()) == mbs_) {
        consumed_ += unit;
        out.insert(out.end(), batch.begin(), batch.end());
        batch.clear();
      }
    }
    return out;
  }

  // The first `micro_batches` micro-batches' samples, in order.
  std::vector<int64_t> read(int64_t micro_batches) {
    std::vector<int64_t> out;
    while (static_cast<int64_t>(out.size()) < micro_batches * mbs_) {
      const std::vector<int64_t> pass = one_pass();
      out.insert(out.end(), pass.begin(), pass.end());
    }
    out.resize(static_cast<size_t>(micro_batches * mbs_));
    return out;
  }

 private:
  int64_t total_, consumed_, mbs_, rank_, dp_;
  bool sharding_;
};

std::vector<int64_t> dtk_order(int64_t total, int64_t consumed, int64_t mbs, int64_t rank, int64_t dp, bool sharding,
                               int64_t micro_batches) {
  SamplerChoice choice;
  choice.cyclic = true, choice.data_sharding = sharding;
  const SampleOrder order(choice, total, mbs, rank, dp);
  std::vector<int64_t> out;
  for (int64_t k = 0; k < micro_batches; ++k)
    for (int64_t j = 0; j < mbs; ++j) out.push_back(order.index(consumed, k, j));
  return out;
}

std::vector<int64_t> numbers(const std::string& text) {
  std::istringstream in(text);
  std::vector<int64_t> out;
  for (int64_t v; in >> v;) out.push_back(v);
  return out;
}

}  // namespace

TEST(TorchRandperm, EqualsLibTorchsRandpermUnderASeededGenerator) {
  for (int64_t n : {0, 1, 2, 7, 100, 4097})
    for (uint64_t seed : {0ull, 1ull, 5ull, 1234ull, (1ull << 32) + 3})
      EXPECT_EQ(dtk::core::torch_randperm(n, seed), libtorch_randperm(n, seed)) << "n " << n << ", seed " << seed;
  EXPECT_NE(dtk::core::torch_randperm(100, 0), dtk::core::torch_randperm(100, 1));
}

// From 2^32/20 elements on, PyTorch (2.7 and later) shuffles inside out over 64-bit draws; LibTorch
// 1.13 here does not, so the branch is checked with its threshold moved down against ATen's loop
// as randperm_cpu writes it (r[i] = i; r[i] = r[z]; r[z] = i with z = random64() % (i + 1), the
// 64 bits the first draw high).
TEST(TorchRandperm, TheInsideOutBranchIsATensLoop) {
  EXPECT_EQ(dtk::core::kTorchInsideOutFrom, 214748364);
  for (uint64_t seed : {0ull, 3ull}) {
    const int64_t n = 1000;
    std::mt19937 engine(static_cast<uint32_t>(seed));
    std::vector<int64_t> r(n);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t hi = engine(), lo = engine();
      const auto z = static_cast<int64_t>(((hi << 32) | lo) % static_cast<uint64_t>(i + 1));
      r[i] = i;
      r[i] = r[z];
      r[z] = i;
    }
    const std::vector<int64_t> got = dtk::core::torch_randperm(n, seed, /*inside_out_from=*/n);
    EXPECT_EQ(got, r);
    EXPECT_NE(got, dtk::core::torch_randperm(n, seed));  // the other branch orders differently
    std::vector<int64_t> sorted = got;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(sorted[i], i);
  }
}

// What Megatron-LM's MegatronPretrainingRandomSampler printed (python3-torch 1.13, the class
// from megatron/training/datasets/data_samplers.py, restarted as cyclic_iter does), for
// "total mbs dp sharding consumed rank": the samples of its first micro-batches in order.
TEST(CyclicSampler, EqualsWhatMegatronsSamplerPrinted) {
  const char* kMegatron[] = {
      "22 2 2 1 0 0: 4 1 7 5 3 9 0 8 6 2 5 6 1 2 0 8 9 3 7 4 8 7 1 5 6 9 0 4",
      "22 2 2 1 0 1: 14 11 17 15 13 19 10 18 16 12 15 16 11 12 10 18 19 13 17 14 18 17 11 15 16 19 10 14",
      "22 2 2 0 0 0: 10 15 11 9 19 2 18 7 6 17 11 6 3 17 15 9 10 19 16 8 14 3 12 5 1 16 21 19",
      "22 2 2 0 0 1: 4 3 5 20 13 0 16 8 14 1 18 0 12 1 7 5 21 20 4 2 4 7 8 17 20 0 11 10",
      "22 2 2 1 8 0: 3 9 0 8 6 2 5 6 1 2 0 8 9 3 7 4 8 7 1 5",
      "22 2 2 1 8 1: 13 19 10 18 16 12 15 16 11 12 10 18 19 13 17 14 18 17 11 15",
      "22 2 2 0 8 0: 19 2 18 7 6 17 11 6 3 17 15 9 10 19 16 8 14 3 12 5",
      "22 2 2 0 8 1: 13 0 16 8 14 1 18 0 12 1 7 5 21 20 4 2 4 7 8 17",
      // 10 samples over 4 ranks of 1 without sharding: rank 0 and 1 read 3 of an epoch, 2 and 3
      // read 2, and from then on the ranks stand at different places (as in Megatron).
      "10 1 4 0 0 0: 4 3 6 0 7 6 2 8 2",
      "10 1 4 0 0 1: 1 9 2 8 4 9 3 5 4",
      "10 1 4 0 0 2: 7 0 1 9 1 0 3 1 9",
      "10 1 4 0 0 3: 5 8 2 3 5 4 7 9 6",
      "23 3 2 1 12 0: 4 5 6 4 0 6 5 7 2 8 3 1 0 8 6 3 7 1 2 5 4 4 1 5 6 0 2",
      "23 3 2 1 12 1: 13 14 15 13 9 15 14 16 11 17 12 10 9 17 15 12 16 10 11 14 13 13 10 14 15 9 11",
  };
  for (const std::string line : kMegatron) {
    const std::vector<int64_t> head = numbers(line.substr(0, line.find(':')));
    const std::vector<int64_t> want = numbers(line.substr(line.find(':') + 1));
    const int64_t total = head[0], mbs = head[1], dp = head[2], consumed = head[4], rank = head[5];
    const bool sharding = head[3] != 0;
    const int64_t micro_batches = static_cast<int64_t>(want.size()) / mbs;
    EXPECT_EQ(dtk_order(total, consumed, mbs, rank, dp, sharding, micro_batches), want) << line;
  }
}

TEST(CyclicSampler, EqualsMegatronsSamplerAsWrittenOverASweep) {
  int checked = 0;
  for (int64_t total : {8, 9, 22, 37, 64})
    for (int64_t mbs : {1, 2, 3})
      for (int64_t dp : {1, 2, 4})
        for (bool sharding : {true, false}) {
          const int64_t unit = mbs * dp;
          if (total < unit) continue;
          for (int64_t consumed : {int64_t{0}, unit, 5 * unit}) {
            for (int64_t rank = 0; rank < dp; ++rank) {
              MegatronRandomSampler megatron(total, consumed, mbs, rank, dp, sharding);
              const int64_t micro_batches = 3 * total / mbs + 2;  // three epochs and more
              ASSERT_EQ(dtk_order(total, consumed, mbs, rank, dp, sharding, micro_batches),
                        megatron.read(micro_batches))
                  << "total " << total << " mbs " << mbs << " dp " << dp << " sharding " << sharding << " consumed "
                  << consumed << " rank " << rank;
              ++checked;
            }
          }
        }
  EXPECT_GT(checked, 300);
}

// Within one epoch the ranks together read each of its samples once (with data sharding, each
// rank its own bucket); the single sampler is consecutive.
TEST(CyclicSampler, OneEpochReadsEverySampleOnceAndSingleIsConsecutive) {
  for (bool sharding : {true, false}) {
    std::map<int64_t, int> seen;
    for (int64_t rank = 0; rank < 4; ++rank)
      for (int64_t s : dtk_order(/*total=*/40, 0, /*mbs=*/2, rank, /*dp=*/4, sharding, /*micro_batches=*/5)) ++seen[s];
    EXPECT_EQ(seen.size(), 40u);
    for (const auto& [s, n] : seen) EXPECT_EQ(n, 1) << "sample " << s;
  }
  const SampleOrder single(SamplerChoice{}, 40, 2, /*rank=*/1, /*dp=*/4);
  EXPECT_EQ(single.index(16, 0, 0), 18);
  EXPECT_EQ(single.index(16, 1, 1), 27);
  SamplerChoice cyclic;
  cyclic.cyclic = true;
  try {
    SampleOrder(cyclic, 40, 2, 0, 4).index(6, 0, 0);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_STREQ(e.what(),
                 "sample order: 6 consumed samples are not a multiple of 8 (micro_batch_size x data-parallel size)");
  }
  try {
    SampleOrder(cyclic, 7, 2, 0, 4);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_STREQ(e.what(),
                 "train.dataloader_type=cyclic: a split of 7 samples holds no micro-batch for each of the 4 "
                 "data-parallel ranks (8 samples)");
  }
}

namespace {

const std::string kPlugins = std::string(" --plugin_path ") + DTK_LOOP_TEST_PLUGIN_DIR + " ";

// Per rank, the indices recorded for `split`, in the order they were read.
std::vector<int64_t> recorded(const std::string& record, int rank, int split) {
  std::ifstream in(record + "." + std::to_string(rank));
  std::vector<int64_t> out;
  for (int64_t s, i; in >> s >> i;)
    if (s == split) out.push_back(i);
  return out;
}

}  // namespace

// Two data-parallel ranks, micro-batches of 2, global batch 8; splits of 22, 10 and 6 samples
// (epochs of 20, 8 and 4): six iterations read the train split 2.4 times over; validation after
// iterations 3 and 6 (the last, as Megatron's loop) and at the end, test at the end.
TEST(CyclicSampler, TrainingReadsMegatronsOrderAndAResumeReadsOnFromWhereItStood) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "cyclic");
  const std::string run = std::string(" launch --nproc_per_node 2 train --config ") + DTK_SOURCE_DIR +
                          "/configs/gpt-tiny.pbtxt --dataset recording_data" + kPlugins +
                          "--threads 1 --set model.vocab_size=1024 --set model.hidden_dropout=0 "
                          "--set model.attention_dropout=0 --set train.seq_length=16 --set train.micro_batch_size=2 "
                          "--set train.global_batch_size=8 --set train.train_iters=6 --set lr.lr_warmup_iters=0 "
                          "--set logging.log_interval=1 --set eval.eval_interval=3 --set eval.eval_iters=1 "
                          "--set dataset.train_samples=22 --set dataset.valid_samples=10 "
                          "--set dataset.test_samples=6 --set train.dataloader_type=cyclic ";
  const dtk_test::Result whole = dtk_test::run_dtk(run + "--set dataset.record=" + dir + "/whole");
  ASSERT_EQ(whole.code, 0) << whole.out;
  EXPECT_NE(whole.out.find("samples in random order every epoch (cyclic)"), std::string::npos) << whole.out;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(recorded(dir + "/whole", rank, 0), MegatronRandomSampler(22, 0, 2, rank, 2, true).read(12))
        << "train, rank " << rank;
    EXPECT_EQ(recorded(dir + "/whole", rank, 1), MegatronRandomSampler(10, 0, 2, rank, 2, true).read(6))
        << "validation, rank " << rank;
    EXPECT_EQ(recorded(dir + "/whole", rank, 2), MegatronRandomSampler(6, 0, 2, rank, 2, true).read(2))
        << "test, rank " << rank;
  }

  // Stopped after iteration 3 and resumed: the train split from 24 consumed samples on,
  // validation from 8 (the one evaluation before the stop).
  const std::string save = " --set checkpoint.save=" + dir + "/ckpt --set checkpoint.save_interval=3 ";
  const dtk_test::Result first =
      dtk_test::run_dtk(run + save + "--set train.exit_interval=3 --set dataset.record=" + dir + "/first");
  ASSERT_EQ(first.code, 0) << first.out;
  const dtk_test::Result rest =
      dtk_test::run_dtk(run + save + "--set checkpoint.load=" + dir + "/ckpt --set dataset.record=" + dir + "/rest");
  ASSERT_EQ(rest.code, 0) << rest.out;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(recorded(dir + "/rest", rank, 0), MegatronRandomSampler(22, 24, 2, rank, 2, true).read(6))
        << "resumed train, rank " << rank;
    EXPECT_EQ(recorded(dir + "/rest", rank, 1), MegatronRandomSampler(10, 8, 2, rank, 2, true).read(4))
        << "resumed validation, rank " << rank;
  }
  const auto a = dtk_test::printed_losses(whole.out), b = dtk_test::printed_losses(rest.out);
  ASSERT_EQ(a.size(), 6u) << whole.out;
  ASSERT_EQ(b.size(), 3u) << rest.out;
  for (int it = 4; it <= 6; ++it) EXPECT_EQ(b.at(it), a.at(it)) << "iteration " << it;

  std::filesystem::remove_all(dir);
}

// Without data sharding, micro-batches of 1 over two ranks and splits of odd sizes (23, 9, 5): rank
// 0 reads one sample more of each epoch than rank 1, so the ranks' counts part, as in Megatron.
// Validation runs after every second iteration and at the end, 2 samples per rank each time: its
// one iterator carries on across the 8 evaluations (an iterator started afresh at each
// evaluation's consumed samples would read otherwise from the third on).
TEST(CyclicSampler, WithoutDataShardingRanksPartAndValidationCarriesOn) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "cyclic-unsharded");
  const dtk_test::Result r = dtk_test::run_dtk(
      std::string(" launch --nproc_per_node 2 train --config ") + DTK_SOURCE_DIR +
      "/configs/gpt-tiny.pbtxt --dataset recording_data" + kPlugins +
      "--threads 1 --set model.vocab_size=1024 --set train.seq_length=16 --set train.micro_batch_size=1 "
      "--set train.global_batch_size=2 --set train.train_iters=14 --set lr.lr_warmup_iters=0 "
      "--set eval.eval_interval=2 --set eval.eval_iters=2 --set dataset.train_samples=23 "
      "--set dataset.valid_samples=9 --set dataset.test_samples=5 --set train.dataloader_type=cyclic "
      "--set train.data_sharding=false --set dataset.record=" +
      dir + "/reads");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(cyclic without data sharding)"), std::string::npos) << r.out;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(recorded(dir + "/reads", rank, 0), MegatronRandomSampler(23, 0, 1, rank, 2, false).read(14))
        << "train, rank " << rank;
    EXPECT_EQ(recorded(dir + "/reads", rank, 1), MegatronRandomSampler(9, 0, 1, rank, 2, false).read(16))
        << "validation, rank " << rank;
    EXPECT_EQ(recorded(dir + "/reads", rank, 2), MegatronRandomSampler(5, 0, 1, rank, 2, false).read(2))
        << "test, rank " << rank;
  }
  std::filesystem::remove_all(dir);
}

TEST(CyclicSampler, BadSettingsAreOneLine) {
  const std::string run = std::string(" train --config ") + DTK_SOURCE_DIR +
                          "/configs/gpt-tiny.pbtxt --dataset recording_data" + kPlugins +
                          "--threads 1 --set model.vocab_size=1024 --set train.seq_length=16 "
                          "--set train.micro_batch_size=4 --set train.global_batch_size=8 --set train.train_iters=2 "
                          "--set lr.lr_warmup_iters=0 ";
  dtk_test::expect_one_line_error(dtk_test::run_dtk(run + "--set train.dataloader_type=random"),
                                  "train.dataloader_type must be single or cyclic, got 'random'");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(run + "--set train.data_sharding=false"),
                                  "train.data_sharding applies to train.dataloader_type=cyclic only");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(run + "--set train.dataloader_type=cyclic --set dataset.train_samples=3"),
      "a split of 3 samples holds no micro-batch for each of the 1 data-parallel ranks (4 samples)");
  // The single sampler still needs every sample the run reads.
  dtk_test::expect_one_line_error(dtk_test::run_dtk(run + "--set dataset.train_samples=12"),
                                  "train split has 12 samples, the run needs 16");
}
