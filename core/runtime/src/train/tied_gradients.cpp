#include "dtk/core/train/tied_gradients.hpp"

#include "dtk/core/train/sequence_parallel_gradients.hpp"

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace {

// What each end of this rank's pipeline group has of the tied weight: the model's elements, and
// the run of them its optimizer steps (elements, first element). One all-reduce: the first stage
// writes its values into slots 0-2, the last into 3-5, the others nothing (-1e300 under the max).
// Sizes and offsets are far below 2^53: exact in doubles.
struct TiedView {
  int64_t model_numel = 0, held = 0, offset = 0;
};
std::pair<TiedView, TiedView> views_of_the_ends(const TiedView& mine, const Topology& topo) {
  std::vector<double> slots(6, -1e300);
  const auto put = [&](size_t base) {
    slots[base] = static_cast<double>(mine.model_numel);
    slots[base + 1] = static_cast<double>(mine.held);
    slots[base + 2] = static_cast<double>(mine.offset);
  };
  if (topo.pp_rank == 0) put(0);
  if (topo.pp_rank == topo.pp_size - 1) put(3);
  at::Tensor ends = at::tensor(slots, at::TensorOptions().dtype(at::kDouble));
  all_reduce(ends, DTK_GROUP_PIPELINE_PARALLEL, DTK_REDUCE_MAX).wait();
  const auto at = [&](int64_t i) { return static_cast<int64_t>(ends[i].item<double>()); };
  return {TiedView{at(0), at(1), at(2)}, TiedView{at(3), at(4), at(5)}};
}

}  // namespace

TiedGradients::TiedGradients(const ModelInstance& model, const OptimizerInstance& optimizer, const Topology& topo,
                             const std::string& model_name, const std::string& strategy_name) {
  if (topo.pp_size <= 1) return;
  int64_t mine = 0;  // elements of the model's tied weights
  std::string name;
  int tied = 0;
  for (const Param& p : model.parameters())
    if (p.info.shared) mine += p.tensor.numel(), name = p.name, ++tied;
  // The first stage's tied weight and the last stage's copy are summed element by element: one
  // on each, none in between (what the shipped models list; convert assumes it too).
  const bool ends = topo.pp_rank == 0 || topo.pp_rank == topo.pp_size - 1;
  std::string layout;
  if (tied > 1 || (tied > 0 && !ends))
    layout = "model plugin '" + model_name + "': pipeline stage " + std::to_string(topo.pp_rank) + " lists " +
             std::to_string(tied) +
             " tied weights (dtk_param_info.shared); with pipeline stages the first and the last stage list one each "
             "(the word embedding and its copy), the stages between none";
  agree(layout, topo, "pipeline: checking the tied weights");
  // What this rank's optimizer steps of the tied weight: all of it (ddp, or data-parallel size 1)
  // or one contiguous shard (zero under pipeline stages gives it a bucket of its own, so that rank
  // d of the first and of the last stage hold the same elements). The pieces' gradients are what
  // the pipeline group sums.
  int64_t held = 0, offset = 0;
  int pieces = 0;
  for (const Param& p : optimizer.params())
    if (p.info.shared) held += p.tensor.numel(), offset = p.info.full_numel == 0 ? 0 : p.info.shard_offset, ++pieces;
  // Decided by every rank together: a data-parallel rank may hold all of a shard list or none.
  if (world_max(pieces > 1 ? 1 : 0, topo, "pipeline: checking the tied weights") != 0)
    throw HostError("pipeline parallelism with tied embeddings: strategy plugin '" + strategy_name +
                    "' holds the tied weight" + (name.empty() ? "" : " '" + name + "'") +
                    " in several pieces on one rank, and the first and last stage sum one run of it; use "
                    "--strategy ddp or model.untie_embeddings_and_output_weights=true");
  const auto [first, last] = views_of_the_ends(TiedView{mine, held, offset}, topo);
  if (first.model_numel != last.model_numel)
    throw HostError("model plugin '" + model_name +
                    "': the tied weights (dtk_param_info.shared) of the first and the last pipeline stage differ in "
                    "size (" +
                    std::to_string(first.model_numel) + " and " + std::to_string(last.model_numel) + " elements)");
  if (first.model_numel == 0) return;
  // Rank d of the first and of the last stage must hold the same elements: decided by every rank
  // together, so that no group goes on to the next collective while another stops here.
  std::string differ;
  if (first.held != last.held || (first.held > 0 && first.offset != last.offset))
    differ = "pipeline parallelism with tied embeddings: on data-parallel rank " + std::to_string(topo.dp_rank) +
             " strategy plugin '" + strategy_name + "' holds " + std::to_string(first.held) +
             " elements of the tied weight" + (name.empty() ? "" : " '" + name + "'") + " from element " +
             std::to_string(first.offset) + " on the first stage and " + std::to_string(last.held) + " from element " +
             std::to_string(last.offset) +
             " on the last, whose gradients are summed element by element: it must shard both copies alike (zero "
             "does), or use --strategy ddp or model.untie_embeddings_and_output_weights=true";
  agree(differ, topo, "pipeline: checking the tied weights");
  numel_ = first.held;
}

void TiedGradients::sync(const OptimizerInstance& optimizer) const {
  sum_gradients_over_group(flagged_gradients(optimizer, &dtk_param_info::shared), DTK_GROUP_PIPELINE_PARALLEL, numel_);
}

}  // namespace dtk::core
