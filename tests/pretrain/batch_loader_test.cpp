// The host's batch loader: every buffer a dataset puts reaches the step by name, collated to
// [micro_batch_size, ...] in the sampler's order (integer buffers as int64, floats kept).
#include <gtest/gtest.h>

#include "dtk/core/train/batch_loader.hpp"
#include "dtk/core/components/services.hpp"
#include "dtk/host/plugin_host.hpp"

namespace {

const dtk::host::Plugin& named_buffers() {
  // Never destroyed: plugins are never unloaded (abi.h rule 13).
  static auto* host = new dtk::host::PluginHost(dtk::core::host_torch_version(), dtk::core::host_services());
  static const dtk::host::Plugin& p = host->load_file(std::string(DTK_PRETRAIN_TEST_PLUGIN_DIR) + "/named_buffers.so");
  return p;
}

std::unique_ptr<dtk::core::DatasetInstance> dataset(int64_t seq, int64_t drop_mask_at,
                                                    std::unique_ptr<dtk::host::OptionValues>* keep) {
  const auto& p = named_buffers();
  *keep = std::make_unique<dtk::host::OptionValues>(
      dtk::host::resolve_options(p, {{"drop_mask_at", std::to_string(drop_mask_at)}}));
  dtk_dataset_context ctx{};
  ctx.struct_size = dtk_dataset_context_STRUCT_SIZE;
  ctx.options = (*keep)->get();
  ctx.seq_length = seq;
  return std::make_unique<dtk::core::DatasetInstance>(p, ctx);
}

}  // namespace

TEST(BatchLoader, EveryNamedBufferIsCollatedInSamplerOrder) {
  std::unique_ptr<dtk::host::OptionValues> opts;
  const auto data = dataset(/*seq=*/4, /*drop_mask_at=*/-1, &opts);
  // Two micro-batches of 3; row j of batch k is sample 100 + 7k + 2j (any sampler will do).
  dtk::core::BatchLoader loader(*data, DTK_SPLIT_TRAIN, 3, 2, [](int64_t k, int64_t j) { return 100 + 7 * k + 2 * j; });
  for (int64_t k = 0; k < 2; ++k) {
    const dtk::TensorList batch = loader.next();
    ASSERT_EQ(batch.size(), 3u);
    EXPECT_EQ(batch[0].first, "text");
    EXPECT_EQ(batch[1].first, "loss_mask");
    EXPECT_EQ(batch[2].first, "grid");
    const at::Tensor& text = *dtk::find(batch, "text");
    const at::Tensor& mask = *dtk::find(batch, "loss_mask");
    const at::Tensor& grid = *dtk::find(batch, "grid");
    EXPECT_EQ(text.scalar_type(), at::kLong);
    EXPECT_EQ(mask.scalar_type(), at::kFloat);
    EXPECT_EQ(grid.scalar_type(), at::kLong);
    EXPECT_EQ(text.sizes(), (std::vector<int64_t>{3, 5}));
    EXPECT_EQ(mask.sizes(), (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(grid.sizes(), (std::vector<int64_t>{3, 2, 3}));
    for (int64_t j = 0; j < 3; ++j) {
      const int64_t i = 100 + 7 * k + 2 * j;
      for (int64_t t = 0; t < 5; ++t) EXPECT_EQ(text[j][t].item<int64_t>(), i + t);
      EXPECT_TRUE(at::all(mask[j] == 0.5f * static_cast<float>(i)).item<bool>());
      for (int64_t a = 0; a < 2; ++a)
        for (int64_t b = 0; b < 3; ++b) EXPECT_EQ(grid[j][a][b].item<int64_t>(), 10 * i + b * 2 + a);
    }
  }
  EXPECT_THROW(loader.next(), dtk::host::HostError);  // more batches than planned
}

TEST(BatchLoader, SamplesThatDifferInTheirBuffersAreOneLineErrors) {
  std::unique_ptr<dtk::host::OptionValues> opts;
  const auto data = dataset(4, /*drop_mask_at=*/11, &opts);
  dtk::core::BatchLoader loader(*data, DTK_SPLIT_TRAIN, 2, 1, [](int64_t, int64_t j) { return 10 + j; });
  try {
    loader.next();
    FAIL() << "expected an error";
  } catch (const dtk::host::HostError& e) {
    EXPECT_STREQ(e.what(),
                 "dataset plugin 'named_buffers': samples of one batch differ in their buffers ('loss_mask' missing)");
  }
}
