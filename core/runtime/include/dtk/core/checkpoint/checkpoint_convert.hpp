// dtk/core/checkpoint/checkpoint_convert.hpp — `dtk checkpoint convert SRC DST --tensor_model_parallel_size N
// --pipeline_model_parallel_size P`: a checkpoint re-partitioned for another tensor- and/or
// pipeline-parallel size, as Megatron's checkpoint tools do.
//
// The model plugin says how: the converter builds the model once per new tensor-parallel rank
// (nothing is trained or communicated; only shapes, the parameters' partition_dim and freshly
// seeded generator states are used). Every parameter is assembled whole from the old ranks
// (concatenated along its partition_dim, Megatron's column-, row- and vocab-parallel split) and cut
// for the new ranks; a partitioned dimension whose whole size differs between the layouts (the
// vocabulary padded to a multiple of make_vocab_size_divisible_by x TP) keeps the rows both have
// and zero-fills the rest: only padding rows differ. Optimizer and strategy entries of a parameter
// ("g0.<name>.exp_avg", "master.<name>") follow their parameter; the others ("step") are copied.
// The model's non-parameter state (the gpt model's dropout generators) comes from the new model:
// with dropout on, a converted run draws other masks than the unconverted one would have.
// Progress, schedule, loss scaler and host RNG are kept; the new checkpoint has its own
// SHA256SUMS and tracker.
//
// ZeRO-sharded optimizer state (optim_dp_rank_NNN.pt) is consolidated first: each old rank's
// data-parallel shards assembled into whole parameters' state (dtk/core/checkpoint/checkpoint_shards.hpp),
// so the new checkpoint has ddp's layout; ddp resumes it as is, and zero (any data-parallel size,
// any stage) shards it again on load. Converting to the same tensor-parallel size is thus how a
// ZeRO checkpoint is consolidated.
//
// Expert parallelism (Megatron's mp_rank_TT[_PPP]_EEE directories): each expert-parallel rank's
// files hold its own routed experts, under their names in the whole layer ("experts.<i>."), and
// the same dense parameters and buffers as every other expert-parallel rank. The whole model takes
// each expert from the rank that held it and the rest from expert-parallel rank 0; each new
// expert-parallel rank gets the experts its build holds. A ZeRO shard of data-parallel rank d lies
// in expert-parallel rank d % E's directory: each rank's shards are gathered from all of them.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtk/core/components/components.hpp"

namespace dtk::core {

// Builds the checkpoint's model for one rank of a tensor-, pipeline- and expert-parallel layout:
// stage `stage` of `split.stages` (pipeline ranks x model chunks), its layers as `split` gives them,
// the routed experts of expert-parallel rank `ep_rank` of `ep_size` (fp32 parameters on the CPU;
// the caller resolves the plugin and its options from the checkpoint's configuration).
using ModelAtLayout = std::function<std::unique_ptr<ModelInstance>(
    int tp_rank, int tp_size, int stage, const PipelineSplit& split, int ep_rank, int ep_size)>;

// The layout to convert to: a size 0 keeps the checkpoint's (the model chunks per rank: when the
// pipeline size stays, else 1); no `split` keeps the checkpoint's split of the layers when the
// pipeline size and the chunks stay, else the even one (its stages and chunks are the layout's).
struct ConvertTarget {
  int tp = 0, pp = 0, v = 0, ep = 0;
  std::optional<PipelineSplit> split;
};

struct ConvertReport {
  int64_t iteration = 0;
  int old_tp = 1, new_tp = 1, old_pp = 1, new_pp = 1, old_v = 1, new_v = 1, old_ep = 1, new_ep = 1;
  PipelineSplit old_split, new_split;
  int64_t model_tensors = 0, state_tensors = 0;
  int64_t consolidated_shards = 0;  // ZeRO data-parallel shards per rank that were merged (0: none)
  double megabytes = 0;
};

// Each parameter's tensor-parallel partition dimension, as the model plugin reports it
// (dtk_param_info.partition_dim; -1 = every rank holds all of it).
std::map<std::string, int> partition_dims(const std::vector<Param>& params);

// A tensor whole from every tensor-parallel rank's piece: concatenated along `dim` (Megatron's
// column-, row- and vocab-parallel split), or rank 0's when `dim` < 0. `who` starts the error that
// names a rank without it ("checkpoint convert", "export hf").
at::Tensor merge_partitions(const std::vector<std::map<std::string, at::Tensor>>& ranks, const std::string& name,
                            int dim, const std::string& who);

// `iter_dir`: the iteration to convert (every file verified against SHA256SUMS); `target`: the
// layout to convert to; `config_text(report)`: the configuration to record for the new layout
// (report.new_*); `save_dir`: must not hold a checkpoint yet.
//
// Pipeline stages (Megatron's mp_rank_TT_PPP): each stage's parameters are renamed to the whole
// model's (each stage numbers its layers from 0: "...layers.<i>..." of stage s is layer
// offset(s) + i, its split's, dtk/pipeline_split.hpp) and cut again for the new stages; the last
// stage's copy of a tied weight (dtk_param_info.shared on the first and the last stage) is the
// first stage's weight, with its optimizer state. Both layouts' splits must hold the layers.
//
// The interleaved schedule's checkpoints (virtual_pipeline_model_parallel_size v > 1) hold v
// chunks per pipeline rank under "model<k>." names; chunk k of rank r is stage k x pp + r of a
// pp x v stage pipeline, and is converted as that stage. `new_v` 0 keeps the checkpoint's v when
// the pipeline size stays, else 1.
// `verify`: each file read is checked against the checkpoint's SHA256SUMS (--noverify skips it).
ConvertReport convert_checkpoint(const std::string& iter_dir, const std::string& save_dir, const ConvertTarget& target,
                                 const std::function<std::string(const ConvertReport&)>& config_text,
                                 const ModelAtLayout& build, bool verify);

// The folder a command writes a new checkpoint or export into (convert, export hf, import hf):
// one that does not exist yet or is empty; a file or a folder holding something is refused,
// naming which (`command`: "checkpoint convert", ...).
void require_new_or_empty_folder(const std::string& dir, const std::string& command);

}  // namespace dtk::core
