// dtk/pipeline_split.hpp against a transcription of Megatron-LM's own formulas
// (megatron/core/transformer/transformer_block.py get_num_layers_to_build and
// transformer_layer.py get_transformer_layer_offset, with TransformerConfig's checks), written here
// rank by rank and chunk by chunk, as Megatron computes them, rather than as prefix sums: every
// split of 1 to 24 layers over 2 to 6 pipeline ranks and 1 to 4 chunks that Megatron accepts
// gives each stage Megatron's first layer and count, and every split it rejects is refused.
#include <gtest/gtest.h>
#include <dtk/pipeline_split.hpp>

#include <optional>
#include <string>

namespace {

struct Megatron {
  int64_t num_layers, pp, vp;  // vp: 1 = no virtual pipeline (Megatron's None)
  std::optional<int64_t> first, last;
  bool embedding = false, loss = false;

  bool vpp() const { return vp > 1; }

  // TransformerConfig.__post_init__ and get_num_layers_to_build's asserts: true when accepted.
  bool accepts() const {
    if ((first || last) && (embedding || loss)) return false;
    if (first || last) {
      int64_t layers = num_layers, stages = pp;
      for (const auto& x : {first, last}) {
        if (!x) continue;
        if (*x <= 0) return false;
        if (vpp() && *x % vp != 0) return false;
        layers -= *x;
        --stages;
      }
      if ((layers != 0) != (stages != 0)) return false;
      if (stages && layers % stages != 0) return false;
      if (stages && vpp() && (layers / stages) % vp != 0) return false;
      // (Megatron lets a first/last count above the layers through when the rest divides, and
      // fails later on a negative count; DTK refuses it here.)
      return stages >= 0 && layers >= 0;
    }
    const int64_t counted = num_layers + embedding + loss;
    if (counted % pp != 0) return false;
    if (vpp() && (counted / pp) % vp != 0) return false;
    // (get_num_layers_to_build's first and last virtual stages build one fewer: at least 0, as
    // each stage's share is at least one here.)
    return true;
  }

  int64_t num_layers_to_build(int64_t pp_rank, int64_t vp_stage) const {
    const bool is_first = pp_rank == 0, is_last = pp_rank == pp - 1;
    int64_t per_rank;
    if (first || last) {
      int64_t layers = num_layers, stages = pp;
      if (first) layers -= *first, --stages;
      if (last) layers -= *last, --stages;
      per_rank = stages > 0 ? layers / stages : 0;
      if (is_first && first) per_rank = *first;
      if (is_last && last) per_rank = *last;
    } else {
      per_rank = (num_layers + embedding + loss) / pp;
    }
    int64_t build = vpp() && pp > 1 ? per_rank / vp : per_rank;
    if (embedding && vp_stage == 0 && is_first) build -= 1;
    if (loss && vp_stage == vp - 1 && is_last) build -= 1;
    return build;
  }

  int64_t offset(int64_t pp_rank, int64_t vp_stage) const {
    if (pp <= 1) return 0;
    if (first || last) {
      const int64_t middle_stages = pp - (first ? 1 : 0) - (last ? 1 : 0);
      const int64_t f = first.value_or(0), l = last.value_or(0);
      const int64_t middle_layers = num_layers - f - l;
      const int64_t middle_rank = first ? pp_rank - 1 : pp_rank;
      if (vpp()) {
        const int64_t first_chunk = f / vp, last_chunk = l / vp, middle_chunk = middle_layers / vp;
        const int64_t total = first_chunk + middle_chunk + last_chunk;
        if (pp_rank == 0) return vp_stage * total;
        // (With no middle rank Megatron divides by 0 here, for the last rank of a first-and-last
        // split: DTK's offset is then first / vp, which the count of the stages before it says.)
        return vp_stage * total + first_chunk + middle_rank * (middle_stages ? middle_chunk / middle_stages : 0);
      }
      const int64_t per_rank = middle_stages > 0 ? middle_layers / middle_stages : 0;
      return pp_rank == 0 ? 0 : middle_rank * per_rank + f;
    }
    const int64_t counted = num_layers + embedding + loss, per_rank = counted / pp;
    int64_t offset;
    if (vpp()) {
      const int64_t per_virtual = per_rank / vp, total = counted / vp;
      offset = vp_stage * total + pp_rank * per_virtual;
    } else {
      offset = pp_rank * per_rank;
    }
    if (embedding && !(vp_stage == 0 && pp_rank == 0)) offset -= 1;
    return offset;
  }
};

TEST(PipelineSplit, EqualsMegatronsOffsetsAndCountsAndRefusesWhatItRejects) {
  int accepted = 0, rejected = 0, uneven = 0;
  for (int64_t layers = 1; layers <= 24; ++layers)
    for (int64_t pp = 2; pp <= 6; ++pp)  // (one rank: Megatron skips the split altogether)
      for (int64_t vp = 1; vp <= 4; ++vp)
        for (int64_t f = 0; f <= 7; ++f)
          for (int64_t l = 0; l <= 7; ++l)
            for (int e = 0; e <= 1; ++e)
              for (int s = 0; s <= 1; ++s) {
                Megatron m{layers,
                           pp,
                           vp,
                           f ? std::optional<int64_t>(f) : std::nullopt,
                           l ? std::optional<int64_t>(l) : std::nullopt,
                           e == 1,
                           s == 1};
                dtk::PipelineSplit split;
                split.stages = static_cast<int32_t>(pp * vp), split.chunks = static_cast<int32_t>(vp);
                split.first_stage_layers = f, split.last_stage_layers = l;
                split.embedding_in_split = e == 1, split.loss_in_split = s == 1;
                const std::string refusal = dtk::pipeline_split_refusal(split, layers);
                const std::string what = "layers " + std::to_string(layers) + ", pp " + std::to_string(pp) + ", vp " +
                                         std::to_string(vp) + ", first " + std::to_string(f) + ", last " +
                                         std::to_string(l) + ", embedding " + std::to_string(e) + ", loss " +
                                         std::to_string(s);
                const bool fits = m.accepts();
                ASSERT_EQ(refusal.empty(), fits) << what << ": " << refusal;
                if (!fits) {
                  ++rejected;
                  continue;
                }
                ++accepted;
                uneven += split.even() ? 0 : 1;
                const auto stages = dtk::pipeline_stage_layers(split, layers);
                int64_t total = 0;
                for (int64_t rank = 0; rank < pp; ++rank)
                  for (int64_t chunk = 0; chunk < vp; ++chunk) {
                    const dtk::StageLayers& got = stages.at(static_cast<size_t>(chunk * pp + rank));
                    ASSERT_EQ(got.offset, m.offset(rank, chunk)) << what << ", rank " << rank << ", chunk " << chunk;
                    ASSERT_EQ(got.count, m.num_layers_to_build(rank, chunk))
                        << what << ", rank " << rank << ", chunk " << chunk;
                    total += got.count;
                  }
                ASSERT_EQ(total, layers) << what;
              }
  // Guards: the grid holds many splits of each kind.
  EXPECT_GT(accepted, 2000);
  EXPECT_GT(uneven, 1000);
  EXPECT_GT(rejected, 10000);
}

}  // namespace
