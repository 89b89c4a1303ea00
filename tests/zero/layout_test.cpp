// ZeRO's arithmetic on its own: the bucket-major partition layout (every element owned exactly
// once, balanced chunks, buckets in backward order, ZeRO-3 buckets one module each), and the
// checkpoint state assembler that moves per-parameter state between layouts.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <numeric>

#include "dtk/core/checkpoint/checkpoint_shards.hpp"
#include "layout.hpp"

using dtk::zero::Layout;
using dtk::zero::LayoutParam;

namespace {

std::vector<LayoutParam> gpt_like() {
  // embedding (module 0), two layers (1, 2), output (3) reading the tied embedding.
  return {
      {"emb.word", 5000, 0, true}, {"emb.pos", 640, 0, true},   {"l0.w", 4096, 1, true},  {"l0.b", 64, 1, false},
      {"l1.w", 4096, 2, true},     {"l1.b", 64, 2, false},      {"final.ln", 64, 3, false}, {"orphan", 7, -1, false},
  };
}

}  // namespace

TEST(ZeroLayout, EveryElementOwnedOnceAndChunksBalanced) {
  for (int dp : {1, 2, 3, 4, 7}) {
    for (int64_t bucket : {1, 100, 5000, 1000000}) {
      std::vector<LayoutParam> params = gpt_like();
      for (auto& p : params) p.on_demand = false;
      const Layout l(params, dp, bucket);
      std::map<size_t, std::vector<int>> owned;  // param -> ownership count per element
      for (size_t p = 0; p < params.size(); ++p) owned[p].assign(static_cast<size_t>(params[p].numel), 0);
      int64_t partition = -1;
      for (int r = 0; r < dp; ++r) {
        int64_t used = 0;
        for (const auto& s : l.shards(r)) {
          for (int64_t i = 0; i < s.numel; ++i) owned[s.param][static_cast<size_t>(s.param_offset + i)]++;
          EXPECT_GE(s.partition_offset, used) << "shards in partition order";
          used = s.partition_offset + s.numel;
        }
        EXPECT_LE(used, l.partition_numel());
        if (partition < 0) partition = l.partition_numel();
      }
      for (const auto& [p, counts] : owned)
        for (int c : counts) ASSERT_EQ(c, 1) << "dp " << dp << " bucket " << bucket << " param " << params[p].name;
      for (const auto& b : l.buckets()) {
        EXPECT_EQ(b.numel % (dp * dtk::zero::kChunkAlign), 0);
        EXPECT_EQ(b.chunk * dp, b.numel);
      }
      EXPECT_EQ(l.partition_numel() * dp, l.flat_numel());
    }
  }
}

// Under pipeline stages the first stage's word embedding and the last stage's copy each fill a
// bucket alone, so every rank owns the same elements of both, whatever else the stage holds; the
// buckets around them are cut there.
TEST(ZeroLayout, ATiedWeightInABucketOfItsOwnIsShardedAlikeOnEveryStage) {
  auto params_of = [](bool first_stage) {
    std::vector<LayoutParam> p;
    if (first_stage)
      p = {{"emb.word", 5000, 0}, {"emb.pos", 640, 0}, {"l0.w", 4096, 1}, {"l0.b", 64, 1}};
    else
      p = {{"l1.w", 4096, 0}, {"l1.b", 64, 0}, {"final.ln", 64, 1}, {"head.word", 5000, 1}, {"orphan", 7, -1}};
    for (auto& lp : p) lp.own_bucket = lp.name.find(".word") != std::string::npos;
    return p;
  };
  for (int dp : {1, 2, 3, 4}) {
    const Layout first(params_of(true), dp, 1000000), last(params_of(false), dp, 1000000);
    auto tied_bucket = [](const Layout& l) {
      for (const auto& b : l.buckets())
        for (const auto& slot : b.slots)
          if (l.params()[slot.param].own_bucket) return b;
      return dtk::zero::Bucket{};
    };
    const dtk::zero::Bucket a = tied_bucket(first), b = tied_bucket(last);
    ASSERT_EQ(a.slots.size(), 1u) << "dp " << dp;
    ASSERT_EQ(b.slots.size(), 1u) << "dp " << dp;
    EXPECT_EQ(a.numel, b.numel);
    // In backward order: the first stage's layer, the embedding, its position embedding; the last
    // stage's final norm, the copy, the layer and what no module reads.
    EXPECT_EQ(first.buckets().size(), 3u) << "dp " << dp;
    EXPECT_EQ(last.buckets().size(), 3u) << "dp " << dp;
    for (int r = 0; r < dp; ++r) {
      auto tied_shard = [&](const Layout& l) {
        for (const auto& s : l.shards(r))
          if (l.params()[s.param].own_bucket) return std::pair{s.param_offset, s.numel};
        return std::pair<int64_t, int64_t>{0, 0};
      };
      EXPECT_EQ(tied_shard(first), tied_shard(last)) << "dp " << dp << " rank " << r;
    }
  }
}

TEST(ZeroLayout, BucketsFollowBackwardOrderAndNeverSplitAParameter) {
  std::vector<LayoutParam> params = gpt_like();
  for (auto& p : params) p.on_demand = false;
  const Layout l(params, 2, 4200);
  // Backward order: the output module's parameters first, the embedding's last, the orphan after.
  std::vector<std::string> order;
  for (const auto& b : l.buckets())
    for (const auto& s : b.slots) order.push_back(params[s.param].name);
  EXPECT_EQ(order, (std::vector<std::string>{"final.ln", "l1.w", "l1.b", "l0.w", "l0.b", "emb.word", "emb.pos",
                                             "orphan"}));
  for (const auto& b : l.buckets()) {
    int64_t used = 0;
    for (const auto& s : b.slots) {
      EXPECT_EQ(s.offset, used);
      used += s.numel;
    }
    EXPECT_TRUE(used <= 4200 || b.slots.size() == 1) << "a bucket exceeds the size only to hold one large parameter";
  }
}

TEST(ZeroLayout, Stage3BucketsHoldOneModulesOnDemandParameters) {
  const Layout l(gpt_like(), 4, 1000000);
  for (const auto& b : l.buckets()) {
    std::set<int32_t> modules;
    for (const auto& s : b.slots) {
      EXPECT_EQ(l.params()[s.param].on_demand, b.on_demand);
      modules.insert(l.params()[s.param].ready_module);
    }
    if (b.on_demand) {
      EXPECT_EQ(modules.size(), 1u);
    }
  }
  // On-demand buckets: module 2, 1, 0 (backward order); then one bucket of the small ones.
  ASSERT_EQ(l.buckets().size(), 4u);
  EXPECT_EQ(l.buckets()[0].ready_module, 2);
  EXPECT_EQ(l.buckets()[2].ready_module, 0);
  EXPECT_FALSE(l.buckets()[3].on_demand);
  EXPECT_EQ(l.buckets()[3].slots.size(), 4u);
}

// Expert parallelism: the experts' buckets are their own and split over the expert-data-parallel
// group, the dense ones over the whole DP group. Each DP rank d (expert-data-parallel rank
// d / (N / N_e)) holds its expert-parallel rank's experts; over any one expert-parallel rank's
// N_e ranks every expert element is owned once, and over the N ranks every dense element once.
TEST(ZeroLayout, ExpertsArePartitionedOverTheRanksHoldingThem) {
  std::vector<LayoutParam> params = gpt_like();
  params.insert(params.begin() + 4,
                {{"l0.experts.0.w", 3000, 1, false, true}, {"l0.experts.1.w", 1000, 1, false, true}});
  for (auto& p : params) p.on_demand = false;
  for (const auto& [dp, expert_dp] : std::vector<std::pair<int, int>>{{4, 2}, {4, 1}, {6, 3}, {2, 2}}) {
    const Layout l(params, dp, 2048, expert_dp);
    for (const auto& b : l.buckets()) {
      for (const auto& slot : b.slots)
        EXPECT_EQ(l.params()[slot.param].expert, b.expert) << "kinds never share a bucket";
      EXPECT_EQ(b.split, b.expert ? expert_dp : dp);
      EXPECT_EQ(b.numel % (b.split * dtk::zero::kChunkAlign), 0);
    }
    std::map<size_t, std::vector<int>> owned;
    for (size_t p = 0; p < params.size(); ++p) owned[p].assign(static_cast<size_t>(params[p].numel), 0);
    for (int d = 0; d < dp; ++d) {
      int64_t used = 0;
      for (const auto& s : l.shards(d, d / (dp / expert_dp))) {
        for (int64_t i = 0; i < s.numel; ++i) owned[s.param][static_cast<size_t>(s.param_offset + i)]++;
        EXPECT_GE(s.partition_offset, used) << "shards in partition order";
        used = s.partition_offset + s.numel;
      }
      EXPECT_LE(used, l.partition_numel());
      // shards(d) finds d's expert-data-parallel rank itself.
      const auto mine = l.shards(d, d / (dp / expert_dp)), found = l.shards(d);
      ASSERT_EQ(found.size(), mine.size());
      for (size_t k = 0; k < mine.size(); ++k)
        EXPECT_TRUE(found[k].param == mine[k].param && found[k].param_offset == mine[k].param_offset &&
                    found[k].partition_offset == mine[k].partition_offset && found[k].numel == mine[k].numel);
    }
    // dp / expert_dp expert-parallel ranks each own every (their own) expert element once.
    for (const auto& [p, counts] : owned)
      for (int c : counts)
        ASSERT_EQ(c, params[p].expert ? dp / expert_dp : 1)
            << "dp " << dp << " expert dp " << expert_dp << " " << params[p].name;
  }
  EXPECT_THROW(Layout(params, 4, 2048, 3), std::invalid_argument);
  EXPECT_THROW(Layout(params, 4, 2048, 2).shards(0, 2), std::invalid_argument);
}

TEST(ZeroLayout, RefusesBadSizes) {
  EXPECT_THROW(Layout(gpt_like(), 0, 10), std::invalid_argument);
  EXPECT_THROW(Layout(gpt_like(), 2, 0), std::invalid_argument);
  EXPECT_THROW(Layout(gpt_like(), 2, 10).shards(2), std::invalid_argument);
}

// ---------------------------------------------------------------------------------------------
// Re-partitioning state between layouts
// ---------------------------------------------------------------------------------------------

namespace {

using dtk::Param;
using dtk::TensorList;

// The optimizer tensors a rank would have under `l` (shards named after their parameters).
std::vector<Param> shard_params(const Layout& l, int rank) {
  std::vector<Param> out;
  for (const auto& s : l.shards(rank)) {
    Param p;
    p.name = l.params()[s.param].name;
    p.tensor = at::zeros({s.numel});
    p.info.shard_offset = s.param_offset;
    p.info.full_numel = l.params()[s.param].numel;
    out.push_back(p);
  }
  return out;
}

std::vector<std::string> names_of(const Layout& l) {
  std::vector<std::string> out;
  for (const auto& p : l.params()) out.push_back(p.name);
  return out;
}

// What a rank of `l` saves: per-parameter Adam-like state holding each element's global value
// (param index * 100000 + element), plus the optimizer's "step".
TensorList saved_state(const Layout& l, int rank) {
  TensorList out{{"step", at::scalar_tensor(int64_t{7})}};
  for (const auto& s : l.shards(rank)) {
    const double base = static_cast<double>(s.param) * 100000 + static_cast<double>(s.param_offset);
    out.emplace_back("g0." + l.params()[s.param].name + ".exp_avg", at::arange(s.numel, at::kDouble).add(base));
  }
  return out;
}

}  // namespace

TEST(ZeroStateAssembler, KeyNamesTheLongestParameter) {
  dtk::core::SliceMap names{{"layers.1.w", {}}, {"layers.11.w", {}}, {"w", {}}, {"a.b", {}}, {"a.b.c", {}}};
  EXPECT_EQ(dtk::core::param_of_key("g0.layers.1.w.exp_avg", names), "layers.1.w");
  EXPECT_EQ(dtk::core::param_of_key("g1.layers.11.w.exp_avg_sq", names), "layers.11.w");
  EXPECT_EQ(dtk::core::param_of_key("master.a.b.c", names), "a.b.c");
  EXPECT_EQ(dtk::core::param_of_key("master.a.bc", names), "");
  EXPECT_EQ(dtk::core::param_of_key("step", names), "");
}

TEST(ZeroStateAssembler, MovesStateBetweenDataParallelSizes) {
  std::vector<LayoutParam> params = gpt_like();
  for (auto& p : params) p.on_demand = false;
  const Layout from(params, 4, 3000), to(params, 3, 1000000);
  for (int r = 0; r < 3; ++r) {
    dtk::core::StateAssembler a(shard_params(to, r), names_of(to));
    for (int k = 0; k < 4; ++k)
      a.add(saved_state(from, k), {}, dtk::core::slices_of(shard_params(from, k)));
    const TensorList got = a.optimizer();
    const TensorList want = saved_state(to, r);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [key, value] : want) {
      const at::Tensor* t = dtk::find(got, key);
      ASSERT_NE(t, nullptr) << key;
      EXPECT_TRUE(at::equal(*t, value)) << key;
    }
  }
}

TEST(ZeroStateAssembler, ReplicatedStateToShardsAndBack) {
  std::vector<LayoutParam> params = gpt_like();
  for (auto& p : params) p.on_demand = false;
  // A replicated save (ddp): whole parameters, shaped as parameters, listed in no slice map.
  TensorList whole{{"step", at::scalar_tensor(int64_t{3})}};
  std::vector<Param> whole_params;
  for (size_t p = 0; p < params.size(); ++p) {
    at::Tensor v = at::arange(params[p].numel, at::kDouble).add(static_cast<double>(p) * 100000);
    whole.emplace_back("master." + params[p].name, v);
    Param wp;
    wp.name = params[p].name;
    wp.tensor = at::zeros({params[p].numel});
    whole_params.push_back(wp);
  }
  const Layout l(params, 2, 2000);
  std::vector<TensorList> shards;
  for (int r = 0; r < 2; ++r) {
    dtk::core::StateAssembler a(shard_params(l, r), names_of(l));
    a.add({}, whole, {});
    shards.push_back(a.strategy());
    EXPECT_EQ(dtk::find(shards.back(), "step")->item<int64_t>(), 3);
  }
  // And back to whole parameters from the two shard files.
  dtk::core::StateAssembler back(whole_params, names_of(l));
  for (int r = 0; r < 2; ++r) back.add({}, shards[static_cast<size_t>(r)], dtk::core::slices_of(shard_params(l, r)));
  const TensorList got = back.strategy();
  for (const auto& [key, value] : whole)
    EXPECT_TRUE(at::equal(*dtk::find(got, key), value)) << key;
}

TEST(ZeroStateAssembler, AMissingShardIsAnErrorNamingTheEntry) {
  std::vector<LayoutParam> params = gpt_like();
  for (auto& p : params) p.on_demand = false;
  const Layout from(params, 2, 1000000), to(params, 1, 1000000);
  dtk::core::StateAssembler a(shard_params(to, 0), names_of(to));
  a.add(saved_state(from, 0), {}, dtk::core::slices_of(shard_params(from, 0)));  // rank 1's file never read
  try {
    a.optimizer();
    FAIL() << "incomplete state accepted";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("elements this rank needs of"), std::string::npos) << msg;
    EXPECT_NE(msg.find("a data-parallel shard file is missing?"), std::string::npos) << msg;
  }
}
