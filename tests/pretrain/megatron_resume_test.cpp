// Continuing a run in Megatron's order: the samples each data-parallel rank trains on after
// iteration N (a DTK checkpoint's, or a Megatron checkpoint's consumed_train_samples) are the ones
// Megatron's MegatronPretrainingSampler hands it over Megatron's blended GPT dataset, at DP 1 and
// 2, for both Megatrons. The reference (tests/data/fixtures/megatron_caches.txt, "resume" lines)
// was made once by tools/fixtures/megatron_caches.py from its own re-implementation of the sampler,
// the datasets and numpy's RandomState.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "dtk/core/config/config.hpp"
#include "dtk/core/train/batch_plan.hpp"
#include "dtk/core/train/sample_order.hpp"
#include "dtk/data/gpt_dataset.hpp"
#include "dtk/data/megatron_cache.hpp"

namespace {

namespace fs = std::filesystem;

// The fixture's corpora (as tests/data/test_megatron_caches.cpp builds them).
void make_corpora(const std::string& dir) {
  for (const char* name : {"a_text_document", "b_text_document"}) {
    const bool a = name[0] == 'a';
    dtk::data::IndexedDatasetBuilder b(dtk::data::bin_path(dir + "/" + name), dtk::data::DType::kInt32);
    for (int d = 0; d < (a ? 60 : 45); ++d) {
      const int len = a ? (d * 37) % 23 + 1 : (d * 11) % 17 + 3;
      std::vector<int64_t> doc;
      for (int t = 0; t < len; ++t) doc.push_back(d * 1000 + t);
      b.add_document(doc);
    }
    b.finalize(dtk::data::idx_path(dir + "/" + name));
  }
}

TEST(MegatronResume, RanksGetMegatronsSamplesAfterIterationN) {
  const std::string dir = fs::temp_directory_path() / ("dtk_resume_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  make_corpora(dir);
  std::ifstream in(std::string(DTK_DATA_FIXTURES) + "/megatron_caches.txt");
  ASSERT_TRUE(in.good());
  int checked = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("resume ", 0) != 0) continue;
    std::istringstream head(line.substr(7, line.find(':') - 7));
    std::string order;
    int dp = 0, rank = 0, n = 0;
    head >> order >> dp >> rank >> n;
    dtk::data::GptDatasetOptions o;
    o.order = dtk::data::parse_order(order);
    o.seq_length = 16;
    o.seed = 1234;
    o.split = "969, 30, 1";
    o.cache_mode = dtk::data::GptDatasetOptions::CacheMode::kNoCache;
    const auto tvt = dtk::data::build_train_valid_test_datasets(
        "0.3 " + dir + "/a_text_document 0.7 " + dir + "/b_text_document", {700, 40, 0}, o);
    dtk::config::RunConfig cfg = dtk::core::default_config();
    cfg.mutable_train()->set_micro_batch_size(2);
    cfg.mutable_train()->set_global_batch_size(8);
    cfg.mutable_train()->set_train_iters(80);
    dtk::core::Topology topo;
    topo.dp_rank = rank;
    topo.dp_size = dp;
    topo.world_size = dp;
    const dtk::core::BatchPlan plan(cfg, topo);
    const dtk::core::SampleOrder sampler(dtk::core::SamplerChoice{}, static_cast<int64_t>(tvt.train->size()),
                                         plan.micro_batch_size(), rank, dp);
    std::string got;
    for (int64_t k = 0; k < 3 * plan.micro_batches_per_step(); ++k) {
      for (int64_t j = 0; j < plan.micro_batch_size(); ++j) {
        const auto tokens = tvt.train->get(static_cast<size_t>(sampler.index(plan.consumed_before(n + 1), k, j)));
        std::string text;
        for (int64_t t : tokens) text += (text.empty() ? "" : " ") + std::to_string(t);
        got += (got.empty() ? "" : " ") + dtk::data::md5_hex(text).substr(0, 8);
      }
    }
    EXPECT_EQ(got, line.substr(line.find(": ") + 2)) << line.substr(0, line.find(':'));
    ++checked;
  }
  EXPECT_EQ(checked, 6);
  fs::remove_all(dir);
}

}  // namespace
