// dtk/pipeline_split.hpp — which decoder layers each pipeline stage builds.
//
// Megatron-LM's get_num_layers_to_build and get_transformer_layer_offset, with its checks
// (TransformerConfig.__post_init__): an even split (num_layers / stages consecutive layers per
// stage), an uneven first or last pipeline rank (--decoder-first-pipeline-num-layers,
// --decoder-last-pipeline-num-layers; the middle ranks share the rest evenly), or the embedding
// and the loss counted as a layer of the first and last stage
// (--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split). Under the
// interleaved schedule each pipeline rank's layers are spread evenly over its model chunks, and
// the stages of the virtual pipeline take consecutive layers in their order (stage j is chunk
// j / ranks of pipeline rank j % ranks). The host and the models share this one definition: the
// models check the split and build its layers, the host prints each rank's layers, compares a
// checkpoint's split with the run's and renames the layers of each stage (dtk checkpoint convert).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtk {

struct PipelineSplit {
  int32_t stages = 1;  // stages of the (virtual) pipeline: pipeline ranks x chunks
  int32_t chunks = 1;  // model chunks of each pipeline rank (the interleaved schedule's)
  int64_t first_stage_layers = 0, last_stage_layers = 0;  // of the first / last rank; 0: the middle share
  bool embedding_in_split = false, loss_in_split = false;

  int32_t ranks() const { return chunks > 0 ? stages / chunks : stages; }
  bool uneven() const { return first_stage_layers != 0 || last_stage_layers != 0; }
  bool even() const { return !uneven() && !embedding_in_split && !loss_in_split; }
};

// The split a build context asks for: dtk::BuildContext (a context from a host before ABI 2.13,
// zero-filled by read_struct, asks for the even split), or a dtk_build_context whose struct_size
// covers dtk_build_context_STRUCT_SIZE_2_13 (the same field names).
template <class Context>
PipelineSplit pipeline_split(const Context& ctx) {
  PipelineSplit s;
  s.stages = ctx.pp_size > 1 ? ctx.pp_size : 1;
  s.chunks = ctx.pipeline_chunks > 1 ? ctx.pipeline_chunks : 1;
  s.first_stage_layers = ctx.first_stage_layers;
  s.last_stage_layers = ctx.last_stage_layers;
  s.embedding_in_split = ctx.embedding_in_split != 0;
  s.loss_in_split = ctx.loss_in_split != 0;
  return s;
}

// The inverse, the one writer of those fields (the host's run and `dtk checkpoint convert`/export
// build contexts from it): the chunks and the uneven ranks; pp_size and pp_rank stay the caller's.
template <class Context>
void put_pipeline_split(const PipelineSplit& s, Context& ctx) {
  ctx.pipeline_chunks = s.chunks;
  ctx.first_stage_layers = static_cast<int32_t>(s.first_stage_layers);
  ctx.last_stage_layers = static_cast<int32_t>(s.last_stage_layers);
  ctx.embedding_in_split = s.embedding_in_split ? 1 : 0;
  ctx.loss_in_split = s.loss_in_split ? 1 : 0;
}

struct StageLayers {
  int64_t offset = 0;  // the global index of the stage's first layer
  int64_t count = 0;
};

// "" when `num_layers` split this way, else why not (names the option; for one error line).
inline std::string pipeline_split_refusal(const PipelineSplit& s, int64_t num_layers) {
  using std::to_string;
  const int64_t ranks = s.ranks(), chunks = s.chunks;
  const std::string per_chunk = " is not divisible by the model chunks of a pipeline rank (" + to_string(chunks) +
                                ", virtual_pipeline_model_parallel_size)";
  if (s.stages < 1 || chunks < 1 || s.stages % chunks != 0)
    return "the pipeline's " + to_string(s.stages) + " stages are not pipeline ranks of " + to_string(chunks) +
           " model chunks each";
  if (s.first_stage_layers < 0 || s.last_stage_layers < 0)
    return "decoder_first_pipeline_num_layers and decoder_last_pipeline_num_layers must be >= 1 (0: unset), got " +
           to_string(s.first_stage_layers) + " and " + to_string(s.last_stage_layers);
  if (s.even()) {
    if (num_layers % s.stages == 0) return "";
    return "num_layers " + to_string(num_layers) + " is not divisible by the pipeline stages " + to_string(s.stages) +
           " (pipeline ranks x model chunks); an uneven split: distributed.decoder_first_pipeline_num_layers / "
           "decoder_last_pipeline_num_layers";
  }
  if (s.uneven() && (s.embedding_in_split || s.loss_in_split))
    return "decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers cannot go with "
           "account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split (Megatron-LM refuses "
           "them together too)";
  if (s.uneven()) {
    if (ranks == 1 && s.first_stage_layers && s.last_stage_layers)
      return "decoder_first_pipeline_num_layers and decoder_last_pipeline_num_layers both name the one pipeline "
             "rank of pipeline_model_parallel_size 1";
    int64_t middle_layers = num_layers, middle_ranks = ranks;
    for (const auto& [name, layers] : {std::pair<const char*, int64_t>{"first", s.first_stage_layers},
                                       std::pair<const char*, int64_t>{"last", s.last_stage_layers}}) {
      if (layers == 0) continue;
      if (layers % chunks != 0)
        return std::string("decoder_") + name + "_pipeline_num_layers " + to_string(layers) + per_chunk;
      middle_layers -= layers;
      --middle_ranks;
    }
    if (middle_layers < 0 || (middle_layers > 0) != (middle_ranks > 0))
      return "decoder_first_pipeline_num_layers " + to_string(s.first_stage_layers) +
             " and decoder_last_pipeline_num_layers " + to_string(s.last_stage_layers) + " leave " +
             to_string(middle_layers) + " of num_layers " + to_string(num_layers) + " for the " +
             to_string(middle_ranks) + " middle pipeline ranks";
    if (middle_ranks > 0 && middle_layers % middle_ranks != 0)
      return "the " + to_string(middle_layers) +
             " layers left for the middle pipeline ranks are not divisible by their " + to_string(middle_ranks);
    if (middle_ranks > 0 && (middle_layers / middle_ranks) % chunks != 0)
      return "the " + to_string(middle_layers / middle_ranks) + " layers of each middle pipeline rank" + per_chunk;
    return "";
  }
  const int64_t counted = num_layers + (s.embedding_in_split ? 1 : 0) + (s.loss_in_split ? 1 : 0);
  if (counted % ranks != 0)
    return "num_layers " + to_string(num_layers) + " with the embedding and loss counted as layers " +
           "(account_for_embedding/loss_in_pipeline_split) is " + to_string(counted) +
           ", not divisible by pipeline_model_parallel_size " + to_string(ranks);
  if ((counted / ranks) % chunks != 0)
    return "the " + to_string(counted / ranks) + " layers (the embedding and loss counted) of each pipeline rank" +
           per_chunk;
  return "";
}

// The layers of every stage of the (virtual) pipeline, in its order; for a split whose refusal
// is "".
inline std::vector<StageLayers> pipeline_stage_layers(const PipelineSplit& s, int64_t num_layers) {
  const int64_t ranks = s.ranks(), chunks = s.chunks;
  int64_t middle_layers = num_layers, middle_ranks = ranks;
  if (s.first_stage_layers) middle_layers -= s.first_stage_layers, --middle_ranks;
  if (s.last_stage_layers) middle_layers -= s.last_stage_layers, --middle_ranks;
  const int64_t counted = num_layers + (s.embedding_in_split ? 1 : 0) + (s.loss_in_split ? 1 : 0);
  std::vector<StageLayers> out(static_cast<size_t>(s.stages));
  int64_t offset = 0;
  for (int64_t j = 0; j < s.stages; ++j) {
    const int64_t rank = j % ranks;
    int64_t count = 0;
    if (s.uneven()) {
      int64_t rank_layers = middle_ranks > 0 ? middle_layers / middle_ranks : 0;
      if (rank == 0 && s.first_stage_layers) rank_layers = s.first_stage_layers;
      if (rank == ranks - 1 && s.last_stage_layers) rank_layers = s.last_stage_layers;
      count = rank_layers / chunks;
    } else {
      // The even split is this with nothing counted besides the layers.
      count = counted / s.stages;
      if (j == 0 && s.embedding_in_split) --count;
      if (j == s.stages - 1 && s.loss_in_split) --count;
    }
    out[static_cast<size_t>(j)] = StageLayers{offset, count};
    offset += count;
  }
  return out;
}

// For messages: "the even split of the layers", or "1 layer on the first pipeline rank", "the loss
// counted as a layer" and the like.
inline std::string describe_pipeline_split(const PipelineSplit& s) {
  if (s.even()) return "the even split of the layers";
  std::string out;
  auto add = [&](const std::string& part) { out += (out.empty() ? "" : ", ") + part; };
  auto layers = [](int64_t n) { return std::to_string(n) + (n == 1 ? " layer" : " layers"); };
  if (s.first_stage_layers) add(layers(s.first_stage_layers) + " on the first pipeline rank");
  if (s.last_stage_layers) add(layers(s.last_stage_layers) + " on the last pipeline rank");
  if (s.embedding_in_split) add("the embedding counted as a layer");
  if (s.loss_in_split) add("the loss counted as a layer");
  return out;
}

// The layers of stage `stage` (the build context's pp_rank).
inline StageLayers pipeline_layers(const PipelineSplit& s, int64_t num_layers, int32_t stage) {
  return pipeline_stage_layers(s, num_layers).at(static_cast<size_t>(stage < 0 ? 0 : stage));
}

}  // namespace dtk
