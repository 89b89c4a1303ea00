// `dtk checkpoint convert SRC DST [--tensor_model_parallel_size N] [--pipeline_model_parallel_size P]
// [--virtual_pipeline_model_parallel_size V] [--expert_model_parallel_size E] [--decoder_first_pipeline_num_layers F]
// [--decoder_last_pipeline_num_layers L] [--account_for_embedding_in_pipeline_split]
// [--account_for_loss_in_pipeline_split]`
// (checkpoint_convert.hpp) and
// `dtk checkpoint inspect DIR [--noverify] [--all_tensors]` — a checkpoint's iteration, progress,
// parallel layout, writers, tensors, files with their SHA-256 against SHA256SUMS, and whether it is
// complete (exit 0) or not (one error line, exit 1). DIR is a save directory (the tracker's
// iteration) or an iter_NNNNNNN directory. The catalog code is dtk/core/checkpoint/checkpoint_catalog.hpp.
#include "cmd_checkpoint.hpp"

#include <gflags/gflags.h>

#include <cstdio>
#include <iostream>

#include "cmd_export.hpp"
#include "dtk/core/checkpoint/checkpoint_catalog.hpp"
#include "dtk/core/checkpoint/checkpoint_convert.hpp"
#include "dtk/core/checkpoint/checkpoint_model.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/host/error_line.hpp"
#include "dtk/host/plugin_host.hpp"
#include "flags/flags.hpp"

namespace {

// The split of the layers the command line asks for: none when no split flag was given.
std::optional<dtk::PipelineSplit> asked_split() {
  bool given = false;
  for (const char* flag : {"decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                           "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"})
    given = given || !gflags::GetCommandLineFlagInfoOrDie(flag).is_default;
  if (!given) return std::nullopt;
  if (FLAGS_decoder_first_pipeline_num_layers < 0 || FLAGS_decoder_last_pipeline_num_layers < 0)
    throw dtk::host::HostError(
        "checkpoint convert: --decoder_first_pipeline_num_layers and --decoder_last_pipeline_num_layers must be >= 1 "
        "(0: the middle ranks' share)");
  dtk::PipelineSplit split;
  split.first_stage_layers = FLAGS_decoder_first_pipeline_num_layers;
  split.last_stage_layers = FLAGS_decoder_last_pipeline_num_layers;
  split.embedding_in_split = FLAGS_account_for_embedding_in_pipeline_split;
  split.loss_in_split = FLAGS_account_for_loss_in_pipeline_split;
  return split;
}

// The --set flags a resume from the converted checkpoint needs for its split of the layers.
std::string split_settings(const dtk::core::ConvertReport& report) {
  const dtk::PipelineSplit& s = report.new_split;
  if (s.even() && report.old_split.even()) return "";
  return " --set distributed.decoder_first_pipeline_num_layers=" + std::to_string(s.first_stage_layers) +
         " --set distributed.decoder_last_pipeline_num_layers=" + std::to_string(s.last_stage_layers) +
         " --set distributed.account_for_embedding_in_pipeline_split=" + (s.embedding_in_split ? "true" : "false") +
         " --set distributed.account_for_loss_in_pipeline_split=" + (s.loss_in_split ? "true" : "false");
}

int run_convert(const std::vector<std::string>& args, dtk::host::PluginHost& plugins) {
  using dtk::host::HostError;
  dtk::core::ConvertTarget target;
  target.tp = FLAGS_tensor_model_parallel_size, target.pp = FLAGS_pipeline_model_parallel_size;
  target.v = FLAGS_virtual_pipeline_model_parallel_size;
  target.ep = FLAGS_expert_model_parallel_size;
  target.split = asked_split();
  const int asked = target.tp + target.pp + target.v + target.ep + (target.split ? 1 : 0);
  if (args.size() != 3 || target.tp < 0 || target.pp < 0 || target.v < 0 || target.ep < 0 || asked == 0)
    throw HostError(
        "usage: dtk checkpoint convert SRC DST --tensor_model_parallel_size N, --pipeline_model_parallel_size P, "
        "--virtual_pipeline_model_parallel_size V, --expert_model_parallel_size E (N, P, V, E >= 1) and/or the "
        "split of the layers "
        "(--decoder_first_pipeline_num_layers F, --decoder_last_pipeline_num_layers L, "
        "--account_for_embedding_in_pipeline_split, --account_for_loss_in_pipeline_split)");
  int64_t iteration = 0;
  const std::string iter_dir = dtk::core::resolve_iteration_dir(args[1], &iteration, FLAGS_verify);
  dtk::config::RunConfig cfg;
  if (!dtk::core::read_recorded_config(iter_dir, &cfg, plugins, dtk::core::offline_checksum_check(FLAGS_verify)))
    throw HostError("checkpoint convert: the configuration recorded in " + iter_dir + " does not parse");
  std::vector<std::unique_ptr<dtk::host::OptionValues>> options;  // alive as long as the models
  const auto report = dtk::core::convert_checkpoint(
      iter_dir, args[2], target,
      [&](const dtk::core::ConvertReport& r) {  // the configuration the new checkpoint records: its layout's
        dtk::config::RunConfig recorded = cfg;
        auto& d = *recorded.mutable_distributed();
        d.set_tensor_model_parallel_size(r.new_tp);
        d.set_pipeline_model_parallel_size(r.new_pp);
        d.set_virtual_pipeline_model_parallel_size(r.new_v);
        d.set_expert_model_parallel_size(r.new_ep);
        d.set_decoder_first_pipeline_num_layers(static_cast<int32_t>(r.new_split.first_stage_layers));
        d.set_decoder_last_pipeline_num_layers(static_cast<int32_t>(r.new_split.last_stage_layers));
        d.set_account_for_embedding_in_pipeline_split(r.new_split.embedding_in_split);
        d.set_account_for_loss_in_pipeline_split(r.new_split.loss_in_split);
        return dtk::core::to_text(recorded);
      },
      [&](int tp_rank, int tp_size, int stage, const dtk::PipelineSplit& split, int ep_rank, int ep_size) {
        BuiltModel b = build_model(plugins, cfg, tp_rank, tp_size, stage, split, ep_rank, ep_size);
        options.push_back(std::move(b.options));
        return std::move(b.model);
      },
      FLAGS_verify);
  const bool staged = report.old_pp > 1 || report.new_pp > 1;
  const bool interleaved = report.old_v > 1 || report.new_v > 1;
  const bool experts = report.old_ep > 1 || report.new_ep > 1;
  char layout[200];
  if (interleaved)
    std::snprintf(layout, sizeof layout,
                  "tensor-parallel size %d, pipeline-parallel size %d, model chunks per rank %d to %d, %d, %d",
                  report.old_tp, report.old_pp, report.old_v, report.new_tp, report.new_pp, report.new_v);
  else if (staged)
    std::snprintf(layout, sizeof layout, "tensor-parallel size %d, pipeline-parallel size %d to %d, %d", report.old_tp,
                  report.old_pp, report.new_tp, report.new_pp);
  else
    std::snprintf(layout, sizeof layout, "tensor-parallel size %d to %d", report.old_tp, report.new_tp);
  std::string from_to = layout;
  if (experts)
    from_to += ", expert-parallel size " + std::to_string(report.old_ep) + " to " + std::to_string(report.new_ep);
  const std::string resume =
      "--set checkpoint.load=" + args[2] +
      " --set distributed.tensor_model_parallel_size=" + std::to_string(report.new_tp) +
      (staged ? " --set distributed.pipeline_model_parallel_size=" + std::to_string(report.new_pp) : std::string()) +
      (interleaved ? " --set distributed.virtual_pipeline_model_parallel_size=" + std::to_string(report.new_v)
                   : std::string()) +
      (experts ? " --set distributed.expert_model_parallel_size=" + std::to_string(report.new_ep) : std::string()) +
      split_settings(report);
  std::printf(
      "converted iteration %lld of %s from %s into %s: %d file(s), %.1f MB; %lld model and %lld "
      "optimizer/strategy tensors %s; resume with %s\n",
      static_cast<long long>(report.iteration), args[1].c_str(), from_to.c_str(), args[2].c_str(),
      report.new_tp * report.new_pp * report.new_ep, report.megabytes, static_cast<long long>(report.model_tensors),
      static_cast<long long>(report.state_tensors), staged ? "in the last stage's files" : "per rank", resume.c_str());
  if (report.consolidated_shards > 0)
    std::printf("the ZeRO optimizer state (%lld data-parallel shards per rank) is consolidated into whole "
                "parameters' state: ddp resumes it as is, zero shards it again at any data-parallel size\n",
                static_cast<long long>(report.consolidated_shards));
  return 0;
}

}  // namespace

int run_checkpoint(const std::vector<std::string>& args, const std::function<dtk::host::PluginHost&()>& plugins) {
  if (!args.empty() && args[0] == "convert") return run_convert(args, plugins());
  if (args.empty() || args[0] != "inspect")
    throw dtk::host::HostError(
        "usage: dtk checkpoint inspect DIR [--noverify] [--all_tensors] | dtk checkpoint convert SRC DST "
        "--tensor_model_parallel_size N, --pipeline_model_parallel_size P, --expert_model_parallel_size E and/or "
        "--virtual_pipeline_model_parallel_size V");
  if (args.size() != 2)
    throw dtk::host::HostError("usage: dtk checkpoint inspect DIR (one directory: a save directory or an iter_NNNNNNN one)");
  dtk::core::InspectOptions options;
  options.verify = FLAGS_verify;
  options.all_tensors = FLAGS_all_tensors;
  const std::string problem = dtk::core::inspect_checkpoint(args[1], options, std::cout);
  std::cout.flush();
  if (problem.empty()) return 0;
  std::fprintf(stderr, "dtk: error: checkpoint inspect: %s\n", dtk::host::error_line(problem).c_str());
  return 1;
}
