// `dtk checkpoint convert SRC DST [--tensor_model_parallel_size N] [--pipeline_model_parallel_size P]
// [--virtual_pipeline_model_parallel_size V]`
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

DECLARE_bool(verify);
DEFINE_bool(all_tensors, false, "checkpoint inspect: list the optimizer's and strategy's tensors too.");
DEFINE_int32(tensor_model_parallel_size, 0,
             "checkpoint convert: the tensor-parallel size to convert to (0: the checkpoint's).");
DEFINE_int32(pipeline_model_parallel_size, 0,
             "checkpoint convert: the pipeline-parallel size to convert to (0: the checkpoint's).");
DEFINE_int32(virtual_pipeline_model_parallel_size, 0,
             "checkpoint convert: model chunks per pipeline rank to convert to, the interleaved schedule's (0: the "
             "checkpoint's when the pipeline size stays, else 1).");

namespace {

int run_convert(const std::vector<std::string>& args, dtk::host::PluginHost& plugins) {
  using dtk::host::HostError;
  const int asked = FLAGS_tensor_model_parallel_size + FLAGS_pipeline_model_parallel_size +
                    FLAGS_virtual_pipeline_model_parallel_size;
  if (args.size() != 3 || FLAGS_tensor_model_parallel_size < 0 || FLAGS_pipeline_model_parallel_size < 0 ||
      FLAGS_virtual_pipeline_model_parallel_size < 0 || asked == 0)
    throw HostError(
        "usage: dtk checkpoint convert SRC DST --tensor_model_parallel_size N, --pipeline_model_parallel_size P and/or "
        "--virtual_pipeline_model_parallel_size V (N, P, V >= 1)");
  int64_t iteration = 0;
  const std::string iter_dir = dtk::core::resolve_iteration_dir(args[1], &iteration, FLAGS_verify);
  dtk::config::RunConfig cfg;
  if (!dtk::core::read_recorded_config(iter_dir, &cfg, plugins, dtk::core::offline_checksum_check(FLAGS_verify)))
    throw HostError("checkpoint convert: the configuration recorded in " + iter_dir + " does not parse");
  std::vector<std::unique_ptr<dtk::host::OptionValues>> options;  // alive as long as the models
  const auto report = dtk::core::convert_checkpoint(
      iter_dir, args[2], FLAGS_tensor_model_parallel_size, FLAGS_pipeline_model_parallel_size,
      FLAGS_virtual_pipeline_model_parallel_size,
      [&](int tp, int pp, int v) {  // the configuration the new checkpoint records: its layout's
        dtk::config::RunConfig target = cfg;
        target.mutable_distributed()->set_tensor_model_parallel_size(tp);
        target.mutable_distributed()->set_pipeline_model_parallel_size(pp);
        target.mutable_distributed()->set_virtual_pipeline_model_parallel_size(v);
        return dtk::core::to_text(target);
      },
      [&](int tp_rank, int tp_size, int pp_rank, int pp_size) {
        BuiltModel b = build_model(plugins, cfg, tp_rank, tp_size, pp_rank, pp_size);
        options.push_back(std::move(b.options));
        return std::move(b.model);
      },
      FLAGS_verify);
  const bool staged = report.old_pp > 1 || report.new_pp > 1;
  const bool interleaved = report.old_v > 1 || report.new_v > 1;
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
  const std::string resume =
      "--set checkpoint.load=" + args[2] +
      " --set distributed.tensor_model_parallel_size=" + std::to_string(report.new_tp) +
      (staged ? " --set distributed.pipeline_model_parallel_size=" + std::to_string(report.new_pp) : std::string()) +
      (interleaved ? " --set distributed.virtual_pipeline_model_parallel_size=" + std::to_string(report.new_v)
                   : std::string());
  std::printf("converted iteration %lld of %s from %s into %s: %d file(s), %.1f MB; %lld model and %lld "
              "optimizer/strategy tensors %s; resume with %s\n",
              static_cast<long long>(report.iteration), args[1].c_str(), layout, args[2].c_str(),
              report.new_tp * report.new_pp, report.megabytes, static_cast<long long>(report.model_tensors),
              static_cast<long long>(report.state_tensors), staged ? "in the last stage's files" : "per rank",
              resume.c_str());
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
        "--tensor_model_parallel_size N, --pipeline_model_parallel_size P and/or "
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
