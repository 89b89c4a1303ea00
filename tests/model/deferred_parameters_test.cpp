// Partitioned construction (ABI 2.4, DeepSpeed's zero.Init) at the model's ABI: a model created
// under dtk_build_context.deferred_parameters holds placeholders (the parameter's shape, dtype and
// device over one element of storage) and its init_parameters hands out, one parameter at a time,
// exactly the values an ordinary build gives it: gpt and llama, TP 1 and each rank of TP 2, fp32
// and bf16, tied and untied output layers.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>

#include <dtk/layers/param_factory.hpp>
#include <dtk/layers/dropout.hpp>  // seeded_generator

#include "gpt_harness.hpp"

namespace {

using dtk_test_gpt::Ctx;
using dtk_test_gpt::GPT;
using dtk_test_gpt::Opts;
using dtk_test_gpt::plugins;

Opts small(bool llama, bool untie) {
  Opts o{{"num_layers", "2"},      {"hidden_size", "32"}, {"num_attention_heads", "4"},
         {"ffn_hidden_size", "64"}, {"seq_length", "16"},  {"vocab_size", "100"},
         {"untie_embeddings_and_output_weights", untie ? "true" : "false"}};
  if (llama) o["num_query_groups"] = "2";
  return o;
}

TEST(DeferredParameters, InitParametersGiveTheValuesOfAWholeBuild) {
  for (const bool llama : {false, true})
    for (const bool untie : {false, true})
      for (const int tp_rank : {-1, 0, 1})  // -1: TP 1
        for (const int32_t dtype : {DTK_DTYPE_FLOAT32, DTK_DTYPE_BFLOAT16}) {
          const std::string what = std::string(llama ? "llama" : "gpt") + (untie ? " untied" : " tied") +
                                   " tp_rank " + std::to_string(tp_rank) + " dtype " + std::to_string(dtype);
          Ctx c;
          c.dtype = dtype;
          c.tp_size = tp_rank < 0 ? 1 : 2;
          c.tp_rank = tp_rank < 0 ? 0 : tp_rank;
          const dtk::host::Plugin* plugin = llama ? plugins().llama : plugins().gpt;
          GPT whole(small(llama, untie), c, plugin);
          c.deferred = true;
          GPT deferred(small(llama, untie), c, plugin);
          const dtk::ModelHandle w(whole.ref()), d(deferred.ref());
          EXPECT_FALSE(w.defers_parameters()) << what;
          ASSERT_TRUE(d.defers_parameters()) << what;
          std::map<std::string, at::Tensor> expected = whole.param_map();
          std::map<std::string, at::Tensor> placeholders = deferred.param_map();
          ASSERT_EQ(placeholders.size(), expected.size()) << what;
          for (const auto& [name, p] : placeholders) {
            ASSERT_TRUE(expected.count(name)) << what << ": " << name;
            EXPECT_EQ(p.sizes(), expected[name].sizes()) << what << ": " << name;
            EXPECT_EQ(p.scalar_type(), expected[name].scalar_type()) << what << ": " << name;
            EXPECT_TRUE(p.requires_grad()) << what << ": " << name;
            EXPECT_LE(p.storage().nbytes(), p.element_size()) << what << ": " << name << " holds values";
          }
          std::set<std::string> given;
          d.init_parameters([&](const std::string& name, const at::Tensor& value) {
            EXPECT_TRUE(given.insert(name).second) << what << ": " << name << " given twice";
            ASSERT_TRUE(expected.count(name)) << what << ": " << name;
            const at::Tensor& e = expected[name];
            EXPECT_TRUE(value.device().is_cpu()) << what << ": " << name;
            EXPECT_TRUE(at::equal(value.to(e.scalar_type()), e)) << what << ": " << name;
          });
          EXPECT_EQ(given.size(), expected.size()) << what;
          // init_parameters only reads: the placeholders are still placeholders.
          for (const auto& [name, p] : deferred.param_map()) EXPECT_LE(p.storage().nbytes(), p.element_size()) << name;
          EXPECT_THROW(w.init_parameters([](const std::string&, const at::Tensor&) {}), std::exception) << what;
        }
}

}  // namespace

namespace {

// What a replay cannot reproduce is refused when the model is built, not trained on: a parameter
// computed from masters, a master changed in place, a generator drawn from outside the factory.
TEST(DeferredParameters, WhatTheReplayCannotReproduceIsRefused) {
  auto factory = [](dtk::layers::DeferredInit& d) {
    dtk::layers::ParamFactory f;
    f.gen = dtk::layers::seeded_generator(7);
    f.deferred = &d;
    return f;
  };
  {
    dtk::layers::DeferredInit d;
    dtk::layers::ParamFactory f = factory(d);
    EXPECT_THROW(f.param(f.normal({4, 4}, 0.02) * 2), std::exception);
  }
  {
    dtk::layers::DeferredInit d;
    dtk::layers::ParamFactory f = factory(d);
    at::Tensor master = f.normal({4, 4}, 0.02);
    master.mul_(2);
    EXPECT_THROW(f.param(master), std::exception);
  }
  {
    dtk::layers::DeferredInit d;
    dtk::layers::ParamFactory f = factory(d);
    f.param(f.normal({4, 4}, 0.02));
    at::empty({3}).normal_(0.0, 1.0, f.gen);
    EXPECT_THROW(f.normal({4, 4}, 0.02), std::exception);
  }
  {
    // Views with offsets and strides replay to the whole build's values.
    dtk::layers::DeferredInit d;
    dtk::layers::ParamFactory deferred = factory(d), whole;
    whole.gen = dtk::layers::seeded_generator(7);
    const at::Tensor a = whole.param(whole.normal({6, 4}, 0.5).narrow(0, 2, 3));
    const at::Tensor b = whole.param(whole.normal({6, 4}, 0.5).t().narrow(0, 1, 2));
    const at::Tensor pa = deferred.param(deferred.normal({6, 4}, 0.5).narrow(0, 2, 3));
    const at::Tensor pb = deferred.param(deferred.normal({6, 4}, 0.5).t().narrow(0, 1, 2));
    std::map<const void*, at::Tensor> got;
    d.replay([&](const at::Tensor& p, const at::Tensor& v) { got[p.unsafeGetTensorImpl()] = v.contiguous(); });
    ASSERT_EQ(got.size(), 2u);
    EXPECT_TRUE(at::equal(got.at(pa.unsafeGetTensorImpl()), a));
    EXPECT_TRUE(at::equal(got.at(pb.unsafeGetTensorImpl()), b));
  }
}

}  // namespace
