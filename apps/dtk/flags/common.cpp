// dtk's own flags: read by train and config, some by other commands too (command_reads,
// main.cpp).
//
// Each command's flags are defined apart from the code that reads them, without LibTorch: bin/dtk
// (front.cpp) links them too, so that `dtk launch` checks its ranks' command line once, before it
// starts them, without loading LibTorch. command_reads (main.cpp) tells which commands read a flag
// by the name of the file that defines it.
#include <gflags/gflags.h>

DEFINE_string(config, "", "Run configuration in protobuf text format (see configs/).");
DEFINE_string(model, "", "Model plugin (overrides model.name).");
DEFINE_string(dataset, "", "Dataset plugin (overrides dataset.name).");
DEFINE_string(step, "", "Forward-step/loss plugin (overrides step.name).");
DEFINE_string(optimizer, "", "Optimizer plugin (overrides optimizer.name).");
DEFINE_string(strategy, "", "Parallel strategy plugin (overrides strategy.name).");
DEFINE_string(plugin_path, "", "Extra plugin files or directories, ':'-separated.");
DEFINE_int32(threads, 0, "Intra-op CPU threads for LibTorch (0 = all cores).");
DEFINE_string(data_path, "", "Shortcut for --set dataset.data_path=... (Megatron's --data_path).");
DEFINE_string(bench_out, "", "Write the performance summary as JSON to this file (--set logging.bench_out=...).");
DEFINE_string(megatron_args, "",
              "A Megatron-LM / DeepSpeed-Domino pretraining flag list (or @FILE) mapped onto the config; --set "
              "still wins. `dtk config --megatron_table` lists every flag.");
DEFINE_string(deepspeed_config, "",
              "DeepSpeed's JSON config (ds_config.json) as its engine reads it: ZeRO, precision, batch, clipping, "
              "its optimizer and scheduler; after --config, before the plugin flags and --set. `dtk config "
              "--deepspeed_table` lists every key.");
DEFINE_bool(use_checkpoint_args, false,
            "The model plugin and options of the checkpoint loaded (train's checkpoint.load, generate's --load, "
            "export's CHECKPOINT) replace this run's (--set checkpoint.use_checkpoint_args=true; Megatron's "
            "--use-checkpoint-args). Without it a difference that changes the model's function is refused.");
DEFINE_bool(verify, true,
            "checkpoint inspect, checkpoint convert, export, generate: check each checkpoint file against its "
            "SHA256SUMS (--noverify reads a damaged or hand-edited one).");
DEFINE_bool(megatron_table, false, "With `config`: print the Megatron flag table (Markdown) and exit.");
DEFINE_bool(deepspeed_table, false,
            "With `config`: print the table of DeepSpeed config keys (--deepspeed_config, and Megatron-DeepSpeed's "
            "inside --megatron_args) and exit.");
DEFINE_string(kind, "", "With `plugins describe`: the plugin kind when a name is used by several kinds.");
// --set may be given many times; it is collected before gflags parses the rest.
DEFINE_string(set, "", "key=value override of a config field or plugin option; repeatable.");
