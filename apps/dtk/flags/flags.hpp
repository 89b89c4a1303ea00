// apps/dtk/flags/flags.hpp — every flag of dtk, declared; defined in flags/*.cpp, one file per
// command (or group of commands) that reads them.
#pragma once

#include <gflags/gflags.h>

// flags/common.cpp
DECLARE_string(config);
DECLARE_string(model);
DECLARE_string(dataset);
DECLARE_string(step);
DECLARE_string(optimizer);
DECLARE_string(strategy);
DECLARE_string(plugin_path);
DECLARE_int32(threads);
DECLARE_string(data_path);
DECLARE_string(bench_out);
DECLARE_string(megatron_args);
DECLARE_string(deepspeed_config);
DECLARE_bool(use_checkpoint_args);
DECLARE_bool(verify);
DECLARE_bool(megatron_table);
DECLARE_bool(deepspeed_table);
DECLARE_string(kind);
DECLARE_string(set);

// flags/generate.cpp
DECLARE_string(load);
DECLARE_string(prompt);
DECLARE_string(prompts_file);
DECLARE_int32(max_new_tokens);
DECLARE_double(temperature);
DECLARE_int32(top_k);
DECLARE_double(top_p);
DECLARE_uint64(seed);
DECLARE_int32(batch_size);

// flags/preprocess.cpp
DECLARE_string(input);
DECLARE_string(output_prefix);
DECLARE_string(json_keys);
DECLARE_bool(append_eod);
DECLARE_int32(workers);
DECLARE_bool(decode);
DECLARE_bool(skip_bad_lines);
DECLARE_double(log_interval_mb);

// flags/checkpoint.cpp
DECLARE_bool(all_tensors);
DECLARE_int32(tensor_model_parallel_size);
DECLARE_int32(expert_model_parallel_size);
DECLARE_int32(pipeline_model_parallel_size);
DECLARE_int32(virtual_pipeline_model_parallel_size);
DECLARE_int32(decoder_first_pipeline_num_layers);
DECLARE_int32(decoder_last_pipeline_num_layers);
DECLARE_bool(account_for_embedding_in_pipeline_split);
DECLARE_bool(account_for_loss_in_pipeline_split);

// flags/tokenizer.cpp
DECLARE_string(tokenizer_type);
DECLARE_string(tokenizer_model);
DECLARE_string(vocab_file);
DECLARE_string(merge_file);
DECLARE_int64(vocab_size);
DECLARE_string(tiktoken_pattern);
DECLARE_int64(tiktoken_num_special_tokens);
DECLARE_string(tokenizer_special_tokens);
