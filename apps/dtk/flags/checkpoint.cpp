// The flags of `dtk checkpoint` (inspect, convert).
//
// Each command's flags are defined apart from the code that reads them, without LibTorch: bin/dtk
// (front.cpp) links them too, so that `dtk launch` checks its ranks' command line once, before it
// starts them, without loading LibTorch. command_reads (main.cpp) tells which commands read a flag
// by the name of the file that defines it.
#include <gflags/gflags.h>

DEFINE_bool(all_tensors, false, "checkpoint inspect: list the optimizer's and strategy's tensors too.");
DEFINE_int32(tensor_model_parallel_size, 0,
             "checkpoint convert: the tensor-parallel size to convert to (0: the checkpoint's).");
DEFINE_int32(pipeline_model_parallel_size, 0,
             "checkpoint convert: the pipeline-parallel size to convert to (0: the checkpoint's).");
DEFINE_int32(virtual_pipeline_model_parallel_size, 0,
             "checkpoint convert: model chunks per pipeline rank to convert to, the interleaved schedule's (0: the "
             "checkpoint's when the pipeline size stays, else 1).");
DEFINE_int32(expert_model_parallel_size, 0,
             "checkpoint convert: the expert-parallel size to convert to (0: the checkpoint's): each expert-parallel "
             "rank's directory holds its share of the routed experts.");
DEFINE_int32(decoder_first_pipeline_num_layers, 0,
             "checkpoint convert: the layers of the first pipeline rank in the new layout (0: the middle ranks' "
             "share). Any of the four split flags sets the new split; none keeps the checkpoint's when the pipeline "
             "size and chunks stay, else the even split.");
DEFINE_int32(
    decoder_last_pipeline_num_layers, 0,
    "checkpoint convert: the layers of the last pipeline rank in the new layout (0: the middle ranks' share).");
DEFINE_bool(account_for_embedding_in_pipeline_split, false,
            "checkpoint convert: the new layout counts the embedding as a layer of the first stage.");
DEFINE_bool(account_for_loss_in_pipeline_split, false,
            "checkpoint convert: the new layout counts the loss as a layer of the last stage.");
