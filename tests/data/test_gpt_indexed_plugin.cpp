// Loads the gpt_indexed plugin through its C ABI only (dlopen + dtk_plugin_get_entry).
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <dtk/abi.h>

#include <cstring>
#include <string>
#include <vector>

#include "dtk/data/indexed_dataset.hpp"
#include "test_util.hpp"

namespace dtk::data {
namespace {

struct Sink {
  std::vector<int64_t> tokens;
  std::vector<float> loss_mask;
  std::string name;  // the first buffer's
  static dtk_status* put(void* ctx, const char* name, dtk_buffer* b) {
    auto* self = static_cast<Sink*>(ctx);
    EXPECT_EQ(b->ndim, 1);
    if (std::string(name) == "loss_mask") {
      EXPECT_EQ(b->dtype, DTK_DTYPE_FLOAT32);
      const auto* p = static_cast<const float*>(b->data);
      self->loss_mask.assign(p, p + b->shape[0]);
    } else {
      self->name = name;
      self->loss_mask.clear();
      EXPECT_EQ(b->dtype, DTK_DTYPE_INT64);
      const auto* p = static_cast<const int64_t*>(b->data);
      self->tokens.assign(p, p + b->shape[0]);
    }
    if (b->deleter) b->deleter(b);
    return nullptr;
  }
};

TEST(GptIndexedPlugin, ServesMegatronSamplesThroughTheAbi) {
  void* h = dlopen(DTK_GPT_INDEXED_PLUGIN, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr) << dlerror();
  auto entry_fn = reinterpret_cast<dtk_plugin_entry_fn>(dlsym(h, DTK_PLUGIN_ENTRY_SYMBOL));
  ASSERT_NE(entry_fn, nullptr);
  const dtk_plugin_entry* e = entry_fn();
  EXPECT_STREQ(e->name, "gpt_indexed");
  EXPECT_EQ(e->kind, DTK_KIND_DATASET);
  EXPECT_EQ(e->torch_version, nullptr);
  const auto* api = static_cast<const dtk_dataset_api*>(e->get_api());

  test::TempDir dir;
  {
    IndexedDatasetBuilder b(bin_path(dir / "d"), DType::kUInt16);
    for (int d = 0; d < 100; ++d) b.add_document(std::vector<int64_t>(static_cast<size_t>(10 + d % 7), d));
    b.finalize(idx_path(dir / "d"));
  }
  const std::string data_path = dir / "d";
  std::vector<dtk_key_value> kv = {
      {"data_path", data_path.c_str()},
      {"split", "90,10,0"},
      {"cache_dir", ""},
      {"order", "megatron_core"},
      {"megatron_tokenizer", "null"},
      {"vocab_size", "100"},
      {"wait_timeout_s", "5"},
      {"train_data_path", ""},
      {"valid_data_path", ""},
      {"test_data_path", ""},
      {"add_extra_token", "true"},
      {"drop_last_partial_validation", "true"},
  };
  dtk_option_values values{sizeof(dtk_option_values), kv.size(), kv.data()};
  dtk_dataset_context ctx{};
  ctx.struct_size = sizeof(ctx);
  ctx.options = &values;
  ctx.seq_length = 16;
  ctx.num_samples[0] = 50;
  ctx.num_samples[1] = 5;
  ctx.seed = 1234;
  ctx.rank = 0;
  ctx.world_size = 1;
  const std::string cache = dir.path();
  ctx.cache_dir = cache.c_str();
  dtk_dataset* ds = nullptr;
  dtk_status* st = api->create(&ctx, &ds);
  ASSERT_EQ(st, nullptr) << dtk_status_get_message(st);
  int64_t n = 0;
  ASSERT_EQ(api->num_samples(ds, DTK_SPLIT_TRAIN, &n), nullptr);
  EXPECT_GE(n, 50);
  ASSERT_EQ(api->num_samples(ds, DTK_SPLIT_TEST, &n), nullptr);
  EXPECT_EQ(n, 0);
  Sink sink;
  dtk_buffer_sink bs{sizeof(dtk_buffer_sink), &sink, &Sink::put};
  const dtk_sample_args valid0{dtk_sample_args_STRUCT_SIZE, DTK_SPLIT_VALID, 0, &bs};
  ASSERT_EQ(api->get_sample(ds, &valid0), nullptr);
  EXPECT_EQ(sink.name, "text");
  EXPECT_TRUE(sink.loss_mask.empty()) << "a loss mask without padding";
  ASSERT_EQ(sink.tokens.size(), 17u);
  for (int64_t t : sink.tokens) EXPECT_GE(t, 90);  // valid split = documents 90..99
  const dtk_sample_args past_end{dtk_sample_args_STRUCT_SIZE, DTK_SPLIT_TRAIN, 1 << 30, &bs};
  st = api->get_sample(ds, &past_end);
  ASSERT_NE(st, nullptr);
  EXPECT_EQ(dtk_status_get_code(st), DTK_ERR_OUT_OF_RANGE);
  dtk_status_release(st);
  api->destroy(ds);

  // A bad data_path is a clean error status naming the file.
  kv[0].value = "/nonexistent/prefix";
  st = api->create(&ctx, &ds);
  ASSERT_NE(st, nullptr);
  EXPECT_NE(std::string(dtk_status_get_message(st)).find("/nonexistent/prefix.idx"), std::string::npos)
      << dtk_status_get_message(st);
  dtk_status_release(st);
  // An unknown order is one line naming it.
  kv[0].value = data_path.c_str();
  kv[3].value = "megatron";
  st = api->create(&ctx, &ds);
  ASSERT_NE(st, nullptr);
  EXPECT_EQ(std::string(dtk_status_get_message(st)),
            "unknown dataset order 'megatron': expected megatron_core or megatron_legacy");
  dtk_status_release(st);
  kv[3].value = "megatron_core";
  kv[4].value = "{\"class\": }";
  st = api->create(&ctx, &ds);
  ASSERT_NE(st, nullptr);
  EXPECT_EQ(std::string(dtk_status_get_message(st))
                .rfind("'megatron_tokenizer (the tokenizer's description)' is not the JSON", 0),
            0u)
      << dtk_status_get_message(st);
  dtk_status_release(st);
  kv[4].value = "null";

  // add_extra_token=false: "text" is the 16 tokens and a padding label (0), "loss_mask" masks it.
  kv[10].value = "false";
  ASSERT_EQ(api->create(&ctx, &ds), nullptr);
  ASSERT_EQ(api->get_sample(ds, &valid0), nullptr);
  ASSERT_EQ(sink.tokens.size(), 17u);
  EXPECT_EQ(sink.tokens[16], 0);
  ASSERT_EQ(sink.loss_mask.size(), 16u);
  for (size_t k = 0; k < 15; ++k) EXPECT_EQ(sink.loss_mask[k], 1.0f) << k;
  EXPECT_EQ(sink.loss_mask[15], 0.0f);
  api->destroy(ds);
  kv[3].value = "megatron_legacy";  // legacy Megatron has no such option: one line naming it
  st = api->create(&ctx, &ds);
  ASSERT_NE(st, nullptr);
  EXPECT_NE(std::string(dtk_status_get_message(st)).find("megatron_legacy has no add_extra_token=false"),
            std::string::npos)
      << dtk_status_get_message(st);
  dtk_status_release(st);
  kv[3].value = "megatron_core";
  kv[10].value = "true";

  // Per-split paths: the valid split from its own prefix (all 100 documents); exclusive with data_path.
  kv[8].value = data_path.c_str();
  st = api->create(&ctx, &ds);
  ASSERT_NE(st, nullptr);
  EXPECT_NE(std::string(dtk_status_get_message(st)).find("are exclusive"), std::string::npos)
      << dtk_status_get_message(st);
  dtk_status_release(st);
  kv[0].value = "";
  ASSERT_EQ(api->create(&ctx, &ds), nullptr);
  ASSERT_EQ(api->num_samples(ds, DTK_SPLIT_TRAIN, &n), nullptr);
  EXPECT_EQ(n, 0);
  ASSERT_EQ(api->num_samples(ds, DTK_SPLIT_VALID, &n), nullptr);
  EXPECT_GE(n, 5);
  api->destroy(ds);
}

}  // namespace
}  // namespace dtk::data
