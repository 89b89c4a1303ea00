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

// Every stage learns the elements its pipeline group sums of the tied weight: how many, and from
// which element of it on; the first and the last stage must agree on both (stages in between hold
// none and add zeros of that size).
int64_t agreed_tied_run(int64_t numel, int64_t offset, bool ends, const std::string& model_name,
                        const std::string& strategy_name, const std::string& name) {
  const auto d = [](int64_t v) { return static_cast<double>(v); };
  at::Tensor runs =
      at::tensor({d(numel), ends ? -d(numel) : -1e300, ends ? d(offset) : -1e300, ends ? -d(offset) : -1e300},
                 at::TensorOptions().dtype(at::kDouble));
  all_reduce(runs, DTK_GROUP_PIPELINE_PARALLEL, DTK_REDUCE_MAX).wait();
  const auto most = static_cast<int64_t>(runs[0].item<double>());
  const auto least = static_cast<int64_t>(-runs[1].item<double>());
  const auto last_offset = static_cast<int64_t>(runs[2].item<double>());
  const auto first_offset = static_cast<int64_t>(-runs[3].item<double>());
  if (most != least || first_offset != last_offset)
    throw HostError(
        "pipeline parallelism with tied embeddings: the first and the last pipeline stage hold different "
        "elements of the tied weight" +
        (name.empty() ? std::string() : " '" + name + "'") + " (" + std::to_string(least) + " from element " +
        std::to_string(first_offset) + " and " + std::to_string(most) + " from element " + std::to_string(last_offset) +
        ", model plugin '" + model_name + "', strategy plugin '" + strategy_name +
        "'), and their gradients are summed element by element: the strategy must shard both copies "
        "alike (zero does), or use --strategy ddp or model.untie_embeddings_and_output_weights=true");
  return most;
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
  if (agreed_tied_size(mine, ends, model_name) > 0)
    numel_ = agreed_tied_run(held, offset, ends, model_name, strategy_name, name);
}

void TiedGradients::sync(const OptimizerInstance& optimizer) const {
  sum_gradients_over_group(flagged_gradients(optimizer, &dtk_param_info::shared), DTK_GROUP_PIPELINE_PARALLEL, numel_);
}

}  // namespace dtk::core
