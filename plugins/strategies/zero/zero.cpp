// zero — DeepSpeed's ZeRO (stages 1, 2, 3) with CPU offload as a DTK strategy plugin:
//   dtk train ... --strategy zero --set strategy.stage=2 [--set strategy.offload_optimizer=cpu]
// Options carry DeepSpeed's zero_optimization names (docs/user-guide.md maps a DeepSpeed config).
// The implementation is in zero_strategy.{hpp,cpp} (setup, gradients, step, state), gather.cpp
// (module hooks, stage 3 gathering) and layout.{hpp,cpp} (buckets and partitions).
#include "zero_strategy.hpp"

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_int("stage", "1",
                 "1: partition optimizer state and fp32 masters; 2: + gradients; 3: + parameters (DeepSpeed's "
                 "zero_optimization.stage)."),
    dtk::opt_int("reduce_bucket_size", "500000000",
                 "Elements per gradient bucket: the unit of every reduce-scatter and of the partition layout."),
    dtk::opt_int("allgather_bucket_size", "500000000",
                 "Elements of parameter all-gathers in flight at once after the optimizer step."),
    dtk::opt_bool("overlap_comm", "false",
                  "Leave reduce-scatters in flight while backward goes on (up to reduce_in_flight_size elements, "
                  "two buckets at least), instead of waiting on each; stage 1 then issues each bucket during the "
                  "last micro-batch's backward, as soon as its gradients are complete."),
    dtk::only_with("overlap_comm=true",
                   dtk::opt_int("reduce_in_flight_size", "500000000",
                                "Elements of reduce-scatters in flight at once during backward (each holds its "
                                "fp32 bucket until it completes; at least two buckets).")),
    dtk::only_with(
        "stage=1|2",
        dtk::opt_bool(
            "overlap_param_gather", "false",
            "Leave the updated parameters' all-gathers in flight after the optimizer step; the next "
            "forward waits for each module's buckets just before the module (Megatron's --overlap-param-gather).")),
    dtk::opt_bool("contiguous_gradients", "true",
                  "Copy gradients into contiguous buckets as they are produced (always on; false is refused)."),
    dtk::opt_bool("average_gradients", "true", "Average (not sum) gradients over data-parallel ranks."),
    dtk::only_with("stage=3", dtk::opt_int("stage3_prefetch_bucket_size", "50000000",
                                           "Elements of the next modules' parameters gathered ahead of use.")),
    dtk::only_with("stage=3", dtk::opt_int("stage3_max_live_parameters", "1000000000",
                                           "Prefetching stops when this many parameter elements are gathered.")),
    dtk::only_with("stage=3", dtk::opt_int("stage3_param_persistence_threshold", "100000",
                                           "Parameters of at most this many elements stay whole on every rank.")),
    dtk::opt_enum("offload_optimizer", "none", "none|cpu|nvme",
                  "cpu: fp32 masters, optimizer state and the gradient partition in pinned host memory; the optimizer "
                  "(use cpu_adam) steps there (ZeRO-Offload). nvme: the gradient partition in host memory, fp32 "
                  "masters and optimizer state in a swap file under nvme_path, streamed through a host buffer of "
                  "nvme_buffer_mb at each step (ZeRO-Infinity)."),
    dtk::only_with("offload_optimizer=nvme,offload_param=nvme",
                   dtk::opt_string("nvme_path", "",
                                   "The directory of the swap files (one per rank and "
                                   "kind; removed at exit).")),
    dtk::only_with("offload_optimizer=nvme",
                   dtk::opt_int("nvme_buffer_mb", "64",
                                "Host buffer (MiB, two halves: one is updated while the other is read or "
                                "written) through which the optimizer state streams.")),
    dtk::only_with(
        "stage=3",
        dtk::opt_enum("offload_param", "none", "none|cpu|nvme",
                      "cpu: this rank's parameter partition in host memory. nvme: in a swap file under "
                      "nvme_path, read into param_buffer_count host buffers before each module's all-gather (the next "
                      "modules' reads issued while the current one computes) and written back after the optimizer step "
                      "(ZeRO-Infinity; needs offload_optimizer=cpu or nvme).")),
    dtk::only_with(
        "offload_param=nvme",
        dtk::opt_int("param_buffer_count", "5",
                     "Host buffers of one bucket chunk each (reduce_bucket_size / data-parallel "
                     "size elements) through which the parameter partition is read and written: the parameters' host "
                     "memory (DeepSpeed's offload_param.buffer_count; at least 2).")),
    dtk::only_with(
        "stage=3",
        dtk::opt_bool(
            "zero_init", "true",
            "Build the model already partitioned (DeepSpeed's zero.Init): a model built with the SDK's "
            "ParamFactory creates placeholders and each rank keeps only its partition of every initial value, "
            "one parameter at a time (the same values as a whole build). false: the model is built whole on "
            "the device, then partitioned.")),
    dtk::only_with(
        "offload_optimizer=cpu",
        dtk::opt_bool(
            "delayed_param_update", "false",
            "From iteration 2 on, each optimizer step runs on a host thread during the "
            "next iteration's forward and backward, which compute on parameters one step older (ZeRO-Offload's "
            "delayed parameter update; losses differ from the undelayed run from iteration 3 on). The delayed step "
            "runs on state held in host memory, which nvme streams from disk.")),
};

}  // namespace

DTK_PLUGIN("zero", DTK_KIND_STRATEGY, "1.0.0",
           "DeepSpeed ZeRO stages 1-3: optimizer state, gradients and parameters partitioned over data "
           "parallel; CPU and NVMe offload",
           DTK_TORCH_VERSION, dtk::strategy_api<dtk::zero::ZeroStrategy>(), kOptions)
