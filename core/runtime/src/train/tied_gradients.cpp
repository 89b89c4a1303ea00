#include "dtk/core/train/tied_gradients.hpp"

#include "dtk/core/train/sequence_parallel_gradients.hpp"

#include <ATen/ATen.h>

#include "dtk/core/comm/comm.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace {

// Every stage learns the tied size; the first and the last must agree on it.
int64_t agreed_tied_size(int64_t mine, bool ends, const std::string& model_name) {
  at::Tensor sizes = at::tensor({static_cast<double>(mine), ends ? -static_cast<double>(mine) : -1e300},
                                at::TensorOptions().dtype(at::kDouble));
  all_reduce(sizes, DTK_GROUP_PIPELINE_PARALLEL, DTK_REDUCE_MAX).wait();
  const auto most = static_cast<int64_t>(sizes[0].item<double>());
  const auto least = static_cast<int64_t>(-sizes[1].item<double>());
  if (most != least)
    throw HostError("model plugin '" + model_name +
                    "': the tied weights (dtk_param_info.shared) of the first and the last pipeline stage differ in "
                    "size (" +
                    std::to_string(least) + " and " + std::to_string(most) + " elements)");
  return most;
}

// The run of the tied weight that each end of this rank's pipeline group holds: the first stage
// writes its (elements, first element) into slots 0-1, the last into 2-3, the others nothing
// (-1e300 under the max). Offsets and sizes are far below 2^53: exact in doubles.
struct TiedRuns {
  int64_t first_numel = 0, first_offset = 0, last_numel = 0, last_offset = 0;
};
TiedRuns tied_runs_of_the_ends(int64_t numel, int64_t offset, const Topology& topo) {
  const double none = -1e300;
  const bool first = topo.pp_rank == 0, last = topo.pp_rank == topo.pp_size - 1;
  at::Tensor runs = at::tensor({first ? static_cast<double>(numel) : none, first ? static_cast<double>(offset) : none,
                                last ? static_cast<double>(numel) : none, last ? static_cast<double>(offset) : none},
                               at::TensorOptions().dtype(at::kDouble));
  all_reduce(runs, DTK_GROUP_PIPELINE_PARALLEL, DTK_REDUCE_MAX).wait();
  const auto at = [&](int64_t i) { return static_cast<int64_t>(runs[i].item<double>()); };
  return TiedRuns{at(0), at(1), at(2), at(3)};
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
  if (agreed_tied_size(mine, ends, model_name) == 0) return;
  // Rank d of the first and of the last stage must hold the same elements: decided by every rank
  // together, so that no group goes on to the next collective while another stops here.
  const TiedRuns runs = tied_runs_of_the_ends(held, offset, topo);
  std::string differ;
  if (runs.first_numel != runs.last_numel || (runs.first_numel > 0 && runs.first_offset != runs.last_offset))
    differ = "pipeline parallelism with tied embeddings: on data-parallel rank " + std::to_string(topo.dp_rank) +
             " strategy plugin '" + strategy_name + "' holds " + std::to_string(runs.first_numel) +
             " elements of the tied weight" + (name.empty() ? "" : " '" + name + "'") + " from element " +
             std::to_string(runs.first_offset) + " on the first stage and " + std::to_string(runs.last_numel) +
             " from element " + std::to_string(runs.last_offset) +
             " on the last, whose gradients are summed element by element: it must shard both copies alike (zero "
             "does), or use --strategy ddp or model.untie_embeddings_and_output_weights=true";
  agree(differ, topo, "pipeline: checking the tied weights");
  numel_ = runs.first_numel;
}

void TiedGradients::sync(const OptimizerInstance& optimizer) const {
  sum_gradients_over_group(flagged_gradients(optimizer, &dtk_param_info::shared), DTK_GROUP_PIPELINE_PARALLEL, numel_);
}

}  // namespace dtk::core
