// `--megatron_args`: published Megatron-LM and DeepSpeed-Domino pretraining command lines
// (fixtures/, their shell variables substituted) become DTK configs field by field; every flag
// DTK cannot run is named in one line; nothing is dropped silently; the docs' table is the
// mapper's own; and the shrunk Domino GPT-3 2.7B recipe trains at TP=2 in fp32 and bf16.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "../common/run_dtk.hpp"
#include "doc_table.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/core/config/megatron_args.hpp"
#include "dtk/core/device/cuda_support.hpp"
#include "dtk/core/train/batch_plan.hpp"
#include "dtk/core/train/sample_order.hpp"
#include "dtk/host/error.hpp"

namespace {

using dtk::core::config_value;
using dtk::core::MegatronMapping;

const std::string kFixtures = DTK_FIXTURES;

// The mapping of a command line's flags, as `--megatron_args '<flags>'` gives it.
MegatronMapping map_line(const std::string& flags) {
  return dtk::core::map_megatron_args(dtk::core::split_megatron_args(flags));
}

MegatronMapping map_file(const std::string& name) {
  return dtk::core::map_megatron_args(dtk::core::split_megatron_args("@" + kFixtures + "/" + name));
}

// The config a mapping gives on top of DTK's defaults and Megatron's (as `dtk train` without
// --config), refused flags left out so the rest can be checked.
dtk::config::RunConfig config_of(MegatronMapping m) {
  m.refused.clear();
  dtk::config::RunConfig cfg = dtk::core::default_config();
  for (const auto& d : dtk::core::megatron_defaults()) dtk::core::apply_override(cfg, d);
  dtk::core::apply_megatron_mapping(cfg, m);
  return cfg;
}

void expect_fields(const dtk::config::RunConfig& cfg, const std::map<std::string, std::string>& want) {
  for (const auto& [path, value] : want) EXPECT_EQ(config_value(cfg, path), value) << path;
}

// Fields the Domino GPT scripts share.
const std::map<std::string, std::string> kDominoCommon = {
    {"lr.lr", "0.00015"},
    {"lr.lr_decay_iters", "320000"},
    {"lr.lr_decay_style", "cosine"},
    {"lr.min_lr", "1e-05"},
    {"lr.weight_decay", "0.01"},
    {"lr.lr_warmup_fraction", "0.01"},
    {"train.clip_grad", "1"},
    {"train.params_dtype", "fp16"},
    {"distributed.tensor_model_parallel_size", "2"},
    {"dataset.name", "gpt_indexed"},
    {"dataset.data_path", "dataset/my-gpt2_text_document"},
    {"dataset.split", "949,50,1"},
    {"tokenizer.vocab_file", "dataset/gpt2-vocab.json"},
    {"tokenizer.merge_file", "dataset/gpt2-merges.txt"},
    {"logging.log_interval", "1"},
    // Left out by the scripts: Megatron's defaults, not DTK's.
    {"eval.eval_interval", "1000"},
};

// The "learning rate:" of every Megatron-style log line in `log`, as printed.
std::vector<std::string> printed_rates(const std::string& log) {
  std::vector<std::string> out;
  static const std::regex re("learning rate: ([0-9.E+-]+) \\|");
  for (std::sregex_iterator it(log.begin(), log.end(), re), e; it != e; ++it) out.push_back((*it)[1]);
  return out;
}

}  // namespace

TEST(MegatronArgs, DominoGpt3_2_7B) {
  const MegatronMapping m = map_file("domino_gpt3_2.7b.args");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_TRUE(m.ignored.empty());
  const auto cfg = config_of(m);
  expect_fields(cfg, kDominoCommon);
  expect_fields(cfg, {{"model.name", "gpt"},
                      {"model.num_layers", "12"},
                      {"model.hidden_size", "2560"},
                      {"model.num_attention_heads", "32"},
                      {"train.seq_length", "512"},
                      {"model.max_position_embeddings", "512"},
                      {"train.micro_batch_size", "64"},
                      {"train.global_batch_size", "64"},
                      {"train.train_iters", "10"},
                      {"train.seed", "3407"},
                      {"eval.eval_iters", "100"}});
}

TEST(MegatronArgs, DominoGpt3_6_7B) {
  const MegatronMapping m = map_file("domino_gpt3_6.7b.args");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  ASSERT_EQ(m.ignored.size(), 1u);
  EXPECT_EQ(m.ignored[0].rfind("--no-gradient-accumulation-fusion (the fused weight-gradient accumulation is a CUDA", 0),
            0u)
      << m.ignored[0];
  const auto cfg = config_of(m);
  expect_fields(cfg, kDominoCommon);
  expect_fields(cfg, {{"model.num_layers", "32"},
                      {"model.hidden_size", "4096"},
                      {"model.num_attention_heads", "32"},
                      {"train.seq_length", "2048"},
                      {"model.max_position_embeddings", "2048"},
                      {"train.micro_batch_size", "8"},
                      {"train.global_batch_size", "8"},
                      {"train.train_iters", "80"},
                      {"train.seed", "1234"}});  // not given: Megatron's (and DTK's) default
}

// The Llama flags select the llama model; Megatron's defaults apply where the llama plugin's
// (Llama's own) differ: this script keeps biases (no --disable-bias-linear), tied embeddings and
// dropout 0.1. --max-position-embeddings has nothing to set (rotary positions) and is named.
TEST(MegatronArgs, DominoLlama7B) {
  const MegatronMapping m = map_file("domino_llama_7b.args");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  ASSERT_EQ(m.ignored.size(), 1u);
  EXPECT_EQ(m.ignored[0].rfind("--max-position-embeddings 1024 (rotary positions have no table", 0), 0u) << m.ignored[0];
  const auto cfg = config_of(m);
  expect_fields(cfg, kDominoCommon);
  expect_fields(cfg, {{"model.name", "llama"},
                      {"model.num_layers", "32"},
                      {"model.hidden_size", "4096"},
                      {"model.num_attention_heads", "32"},
                      {"model.ffn_hidden_size", "11008"},
                      {"model.layernorm_epsilon", "1e-6"},
                      {"model.add_bias_linear", "true"},
                      {"model.untie_embeddings_and_output_weights", "false"},
                      {"model.hidden_dropout", "0.1"},
                      {"model.attention_dropout", "0.1"},
                      {"train.seq_length", "1024"},
                      {"train.micro_batch_size", "16"},
                      {"checkpoint.save_interval", "10000"},
                      {"eval.eval_interval", "1000"},
                      {"eval.eval_iters", "1"}});
  EXPECT_EQ(cfg.model().options().count("max_position_embeddings"), 0u);
}

// Llama 2 as Megatron-LM's examples write it: no biases, untied, grouped-query attention, no
// dropout, the flags' values over the defaults.
TEST(MegatronArgs, Llama2FlagsOverMegatronDefaults) {
  const MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(
      "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --position-embedding-type rope --normalization RMSNorm "
      "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights --group-query-attention "
      "--num-query-groups 2 --rotary-base 500000 --hidden-dropout 0 --attention-dropout 0"));
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"model.name", "llama"},
                               {"model.add_bias_linear", "false"},
                               {"model.untie_embeddings_and_output_weights", "true"},
                               {"model.num_query_groups", "2"},
                               {"model.rotary_base", "500000"},
                               {"model.hidden_dropout", "0"},
                               {"model.attention_dropout", "0"}});
}

// Megatron's --no-save-optim and --no-save-rng (a checkpoint of the weights alone).
TEST(MegatronArgs, NoSaveOptimAndRngMapToTheCheckpointSettings) {
  MegatronMapping m = map_line("--save ckpt/x --no-save-optim --no-save-rng");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(
      config_of(m),
      {{"checkpoint.save", "ckpt/x"}, {"checkpoint.no_save_optim", "true"}, {"checkpoint.no_save_rng", "true"}});
}

// Megatron-LM's and DeepSpeed-Domino's Llama command lines, shrunk (sizes tiny; the tokenizer
// flags, which another part maps, left out): docs/llama_mistral.md's launch lines for a converted
// Llama-2 and Llama-3.1 checkpoint (--use-checkpoint-args, partial architecture flags, the older
// rotary flags, Llama 3.1's rope scaling), Domino's pretrain_llama_13b.sh (--llama-model,
// --causal-lm) and the model flags of examples/llama/train_llama3_8b_h100_fp8.sh. Nothing DTK can
// run is refused; what it cannot build is, with the reason.
TEST(MegatronArgs, LlamaLaunchLinesOfMegatronAndDomino) {
  // Llama-2, inference or fine-tuning from a converted checkpoint (llama_mistral.md).
  MegatronMapping m = map_line(
      "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --seq-length 64 --max-position-embeddings 64 "
      "--load ckpt/llama2 --exit-on-missing-checkpoint --use-checkpoint-args --no-load-optim --no-load-rng "
      "--untie-embeddings-and-output-weights --use-rotary-position-embeddings --normalization RMSNorm "
      "--no-position-embedding --no-masked-softmax-fusion --attention-softmax-in-fp32 "
      "--tokenizer-type Llama2Tokenizer --tokenizer-model llama2/tokenizer.model");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  auto cfg = config_of(m);
  expect_fields(cfg, {{"model.name", "llama"},
                      {"tokenizer.type", "Llama2Tokenizer"},
                      {"tokenizer.model_file", "llama2/tokenizer.model"},
                      {"checkpoint.use_checkpoint_args", "true"},
                      {"checkpoint.load", "ckpt/llama2"},
                      {"checkpoint.no_load_optim", "true"},
                      {"checkpoint.no_load_rng", "true"},
                      {"model.untie_embeddings_and_output_weights", "true"},
                      {"train.seq_length", "64"}});
  auto ignored = [&](const std::string& flag) {
    return std::any_of(m.ignored.begin(), m.ignored.end(), [&](const std::string& i) { return i.rfind(flag, 0) == 0; });
  };
  for (const char* flag : {"--no-masked-softmax-fusion", "--attention-softmax-in-fp32", "--max-position-embeddings 64"})
    EXPECT_TRUE(ignored(flag)) << flag;
  // --exit-on-missing-checkpoint keeps the load strict; without it a --load folder that holds no
  // checkpoint yet starts the run from scratch, as Megatron's does.
  EXPECT_EQ(config_of(m).checkpoint().load_if_present(), false);
  EXPECT_EQ(config_of(map_line("--load ckpt/x --save ckpt/x")).checkpoint().load_if_present(), true);
  EXPECT_EQ(config_of(map_line("--save ckpt/x")).checkpoint().load_if_present(), false);

  // Llama-3.1 (llama_mistral.md; its "--group-query-attention 8" written as Megatron parses it).
  m = map_line(
      "--tensor-model-parallel-size 1 --seq-length 64 --max-position-embeddings 256 --load ckpt/llama31 "
      "--exit-on-missing-checkpoint --use-checkpoint-args --no-load-optim --no-load-rng "
      "--untie-embeddings-and-output-weights --normalization RMSNorm --position-embedding-type rope "
      "--no-masked-softmax-fusion --attention-softmax-in-fp32 --disable-bias-linear "
      "--transformer-impl transformer_engine --group-query-attention --num-query-groups 2 --attention-dropout 0.0 "
      "--hidden-dropout 0.0 --rotary-base 500000 --rotary-percent 1.0 --use-rope-scaling --ffn-hidden-size 192 "
      "--num-attention-heads 4 --swiglu --bf16 --no-rope-fusion "
      "--tokenizer-type HuggingFaceTokenizer --tokenizer-model llama31");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  cfg = config_of(m);
  expect_fields(cfg, {{"model.name", "llama"},
                      {"tokenizer.type", "HuggingFaceTokenizer"},
                      {"tokenizer.model_file", "llama31"},
                      {"model.rotary_base", "500000"},
                      {"model.rope_scaling", "llama3"},
                      {"model.rope_scaling_factor", "8"},  // Megatron's default
                      {"model.num_query_groups", "2"},
                      {"model.add_bias_linear", "false"},
                      {"train.params_dtype", "bf16"},
                      {"checkpoint.use_checkpoint_args", "true"}});
  EXPECT_TRUE(ignored("--transformer-impl")) << "--transformer-impl";
  // DTK has a rotary kernel: --no-rope-fusion leaves it out, as Megatron's flag does its own.
  EXPECT_FALSE(ignored("--no-rope-fusion")) << "--no-rope-fusion";
  expect_fields(cfg, {{"model.unfused_kernels", "rotary"}});
  // The fusion switches add up into the one option.
  expect_fields(config_of(map_line("--no-bias-gelu-fusion --no-rope-fusion --no-bias-swiglu-fusion --no-rope-fusion "
                                   "--no-bias-dropout-fusion")),
                {{"model.unfused_kernels", "bias_gelu,rotary,swiglu,bias_add"}});
  // The factor given; alone, it is ignored as Megatron ignores it.
  expect_fields(config_of(map_line("--position-embedding-type rope --normalization RMSNorm --swiglu --use-rope-scaling "
                                   "--rope-scaling-factor 32")),
                {{"model.rope_scaling", "llama3"}, {"model.rope_scaling_factor", "32"}});
  m = map_line("--position-embedding-type rope --normalization RMSNorm --swiglu --rope-scaling-factor 32");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_EQ(config_of(m).model().options().count("rope_scaling_factor"), 0u);

  // DeepSpeed-Domino's pretrain_llama_13b.sh.
  m = map_line(
      "--llama-model --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
      "--max-position-embeddings 64 --position-embedding-type rope --swiglu --ffn-hidden-size 192 "
      "--disable-bias-linear --normalization RMSNorm --layernorm-epsilon 1e-6 --micro-batch-size 8 "
      "--global-batch-size 8 --lr 0.00015 --train-iters 100 --lr-decay-iters 320000 --lr-decay-style cosine "
      "--min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 --clip-grad 1.0 "
      "--no-gradient-accumulation-fusion --fp16 --tensor-model-parallel-size 2 --seed 3407 --causal-lm");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"model.name", "llama"}, {"model.add_bias_linear", "false"}, {"train.seed", "3407"}});
  EXPECT_TRUE(ignored("--causal-lm")) << "--causal-lm";

  // examples/llama/train_llama3_8b_h100_fp8.sh's model flags, in the version that gave no
  // --normalization RMSNorm: all run but LayerNorm with SwiGLU, a model DTK does not build;
  // --apply-layernorm-1p is the models' zero-centred norm weights.
  m = map_line(
      "--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 4 "
      "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 64 --max-position-embeddings 64 "
      "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
      "--hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p "
      "--untie-embeddings-and-output-weights --disable-bias-linear --context-parallel-size 1 "
      "--cross-entropy-loss-fusion --manual-gc --use-distributed-optimizer");
  ASSERT_EQ(m.refused.size(), 1u) << (m.refused.empty() ? "" : m.refused.front());
  EXPECT_NE(m.refused[0].find("missing --normalization RMSNorm"), std::string::npos) << m.refused[0];
  // With RMSNorm (the script today) it is the llama model, its norms zero-centred.
  m = map_line(
      "--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 4 "
      "--group-query-attention --num-query-groups 2 --kv-channels 16 --position-embedding-type rope "
      "--normalization RMSNorm --rotary-base 1000000 --swiglu --context-parallel-size 1 --apply-layernorm-1p");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m),
                {{"model.name", "llama"}, {"model.rotary_base", "1000000"}, {"model.apply_layernorm_1p", "true"}});
  // The same script's data and checkpoint flags run: its NullTokenizer ignores --tiktoken-pattern, as
  // Megatron's does, and DTK's torch-format checkpoints are what Megatron loads under --ckpt-format
  // torch_dist (it detects the format); a format Megatron does not detect is refused.
  m = map_line(
      "--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --tiktoken-pattern v2 "
      "--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --ckpt-format torch_dist");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  for (const char* flag : {"--tiktoken-pattern (Megatron reads it only with --tokenizer-type TikTokenizer",
                           "--ckpt-format torch_dist (DTK writes Megatron's torch format"})
    EXPECT_TRUE(ignored(flag)) << flag;
  // Its fp8 flags (DTYPE=fp8): the format and the fp8 parameter gather refused, with the reason;
  // the amax settings, alone, Megatron ignores.
  m = map_line("--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather");
  ASSERT_EQ(m.refused.size(), 2u);
  EXPECT_EQ(m.refused[0].rfind("--fp8-format hybrid: DTK trains in fp32, bf16 or fp16", 0), 0u) << m.refused[0];
  EXPECT_EQ(m.refused[1].rfind("--fp8-param-gather: gathers fp8 parameters", 0), 0u) << m.refused[1];
  m = map_line("--fp8-amax-history-len 1024 --fp8-amax-compute-algo max");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_TRUE(ignored("--fp8-amax-history-len (Megatron reads it only with --fp8-format"));
  m = map_line("--ckpt-format torch_dcp");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0].rfind("--ckpt-format torch_dcp: DTK writes and reads Megatron's torch format", 0), 0u)
      << m.refused[0];
  // What DTK cannot build, named.
  m = map_line("--hidden-size 64 --num-attention-heads 4 --kv-channels 32 --no-position-embedding");
  ASSERT_EQ(m.refused.size(), 2u);
  EXPECT_EQ(m.refused[0].rfind("--no-position-embedding: needs rotary positions", 0), 0u) << m.refused[0];
  // Heads wider than hidden / heads are the llama model's (kv_channels), not the gpt model's.
  EXPECT_EQ(m.refused[1].rfind("--kv-channels 32: needs the llama model", 0), 0u) << m.refused[1];
  // Context parallelism: Megatron's flag and DeepSpeed-Ulysses' both split the sequence; DTK's
  // exchanges are a2a and all_gather: p2p's ring (Megatron's default) and a2a+p2p run as
  // all_gather, saying so in a note; Ulysses is a2a.
  const auto sets = [&](const std::string& a) { return std::find(m.sets.begin(), m.sets.end(), a) != m.sets.end(); };
  m = map_line("--context-parallel-size 2 --cp-comm-type p2p");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_TRUE(sets("distributed.context_parallel_size=2"));
  EXPECT_TRUE(sets("distributed.cp_comm_type=all_gather"));
  const auto noted = [&](const std::string& start) {
    return std::any_of(m.notes.begin(), m.notes.end(), [&](const std::string& n) { return n.rfind(start, 0) == 0; });
  };
  // (A note, not "no effect": the flag changed the exchange.)
  EXPECT_TRUE(m.ignored.empty()) << m.ignored.front();
  EXPECT_TRUE(noted("--cp-comm-type p2p runs as all_gather (distributed.cp_comm_type=all_gather): the same attention"));
  m = map_line("--context-parallel-size 2");  // Megatron's default p2p
  EXPECT_TRUE(m.refused.empty() && m.ignored.empty());
  EXPECT_TRUE(sets("distributed.cp_comm_type=all_gather"));
  EXPECT_TRUE(noted("--context-parallel-size 2 without --cp-comm-type: Megatron's default p2p runs as all_gather"));
  m = map_line("--ds-sequence-parallel-size 2 --cp-comm-type p2p");  // Ulysses' a2a replaced: said so
  EXPECT_TRUE(sets("distributed.cp_comm_type=all_gather"));
  EXPECT_TRUE(noted("--cp-comm-type p2p runs as all_gather"));
  m = map_line("--ds-sequence-parallel-size 4");
  EXPECT_TRUE(sets("distributed.context_parallel_size=4"));
  EXPECT_TRUE(sets("distributed.cp_comm_type=a2a"));
  m = map_line("--ds-sequence-parallel-size 4 --cp-comm-type a2a");
  EXPECT_TRUE(m.refused.empty() && m.ignored.empty());
  EXPECT_TRUE(sets("distributed.cp_comm_type=a2a"));
  m = map_line("--context-parallel-size 2 --cp-comm-type all_gather");
  EXPECT_TRUE(m.refused.empty() && m.ignored.empty());
  EXPECT_TRUE(sets("distributed.cp_comm_type=all_gather"));
  m = map_line("--context-parallel-size 2 --cp-comm-type all_gather a2a+p2p");
  EXPECT_TRUE(sets("distributed.cp_comm_type=all_gather"));
  EXPECT_TRUE(noted("--cp-comm-type all_gather a2a+p2p runs as all_gather"));
  m = map_line("--context-parallel-size 2 --cp-comm-type a2a p2p");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0].rfind("--cp-comm-type a2a p2p: DTK runs one exchange in every layer", 0), 0u) << m.refused[0];
  m = map_line("--cp-comm-type ring");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0], "--cp-comm-type ring: not one of p2p, all_gather, a2a, a2a+p2p");
  // A per-layer list names every layer of --num-layers (Megatron asserts it).
  m = map_line("--num-layers 2 --context-parallel-size 2 --cp-comm-type a2a a2a a2a");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0],
            "--cp-comm-type a2a a2a a2a: a per-layer list of 3 exchanges for --num-layers 2 (Megatron asserts one per "
            "layer)");
  m = map_line("--num-layers 2 --context-parallel-size 2 --cp-comm-type a2a a2a");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_TRUE(sets("distributed.cp_comm_type=a2a"));
  m = map_line("--num-layers 2 --cp-comm-type a2a a2a a2a");  // without the split too, as Megatron
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0].rfind("--cp-comm-type a2a a2a a2a: a per-layer list of 3 exchanges", 0), 0u) << m.refused[0];
  m = map_line("--num-layers 2 --context-parallel-size 2 --cp-comm-type a2a p2p all_gather");  // one reason given
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0].rfind("--cp-comm-type a2a p2p all_gather: DTK runs one exchange", 0), 0u) << m.refused[0];
  // The notes describe the exchange: one a --set changes afterwards is not said.
  m = map_line("--context-parallel-size 2 --cp-comm-type p2p");
  const auto p2p_note = std::find_if(m.notes.begin(), m.notes.end(),
                                     [](const std::string& n) { return n.rfind("--cp-comm-type p2p", 0) == 0; });
  ASSERT_NE(p2p_note, m.notes.end());
  ASSERT_EQ(m.note_field.count(*p2p_note), 1u);
  EXPECT_EQ(m.note_field.at(*p2p_note), "distributed.cp_comm_type");
  const std::string cp_flags = "config --megatron_args '--context-parallel-size 2 --cp-comm-type p2p'";
  EXPECT_NE(dtk_test::run_dtk(cp_flags).out.find("dtk: note: --megatron_args: --cp-comm-type p2p runs as all_gather"),
            std::string::npos);
  const dtk_test::Result overridden = dtk_test::run_dtk(cp_flags + " --set distributed.cp_comm_type=a2a");
  EXPECT_EQ(overridden.code, 0) << overridden.out;
  EXPECT_EQ(overridden.out.find("runs as all_gather"), std::string::npos) << overridden.out;
  // Megatron's and Megatron-DeepSpeed's names of the split, together: refused whatever the values
  // (one would silently override the other).
  for (const std::string both : {"--context-parallel-size 2 --ds-sequence-parallel-size 1",
                                 "--ds-sequence-parallel-size 2 --context-parallel-size 2"}) {
    m = map_line(both);
    ASSERT_EQ(m.refused.size(), 1u) << both;
    EXPECT_NE(m.refused[0].find(": give one (Megatron's and Megatron-DeepSpeed's names of the same split"),
              std::string::npos)
        << m.refused[0];
  }
}

// A tiny llama trained through --megatron_args with Megatron's Llama flags (the older rotary
// flag, no position table, the fusion switches), on synthetic tokens of the GPT-2 vocabulary.
TEST(MegatronRecipe, LlamaFlagsTrain) {
  const dtk_test::Result r = dtk_test::run_dtk(
      std::string("train --threads 2 --dataset synthetic --megatron_args '--num-layers 2 --hidden-size 64 "
                  "--num-attention-heads 4 --ffn-hidden-size 192 --seq-length 32 --use-rotary-position-embeddings "
                  "--no-position-embedding --normalization RMSNorm --swiglu --disable-bias-linear "
                  "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 "
                  "--rotary-base 500000 --no-rope-fusion --no-masked-softmax-fusion --attention-softmax-in-fp32 "
                  "--transformer-impl local --use-mcore-models --kv-channels 16 --hidden-dropout 0 "
                  "--attention-dropout 0 --micro-batch-size 4 --global-batch-size 4 --train-iters 3 --lr 0.001 "
                  "--log-interval 1 --eval-iters 1 --eval-interval 3' --set tokenizer.vocab_file=") +
      DTK_VOCAB_DIR + "/encoder.json --set tokenizer.merge_file=" + DTK_VOCAB_DIR + "/vocab.bpe");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("model 'llama'"), std::string::npos) << r.out;
  EXPECT_EQ(dtk_test::printed_losses(r.out).size(), 3u) << r.out;
}

// Megatron's grouped-query attention: --group-query-attention turns it on with
// --num-query-groups groups (default 1, multi-query); the group count alone is ignored (and said
// so), on any model. --fp16 with --bf16 is refused, as Megatron asserts.
TEST(MegatronArgs, GroupedQueryAttentionAndPrecisionFollowMegatron) {
  const std::string llama = "--num-layers 2 --position-embedding-type rope --normalization RMSNorm --swiglu ";
  MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(llama + "--group-query-attention"));
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"model.num_query_groups", "1"}});
  m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(llama + "--num-query-groups 4"));
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  for (const auto& set : m.sets) EXPECT_EQ(set.find("num_query_groups"), std::string::npos) << set;  // multi-head
  ASSERT_EQ(m.ignored.size(), 1u);
  EXPECT_EQ(m.ignored[0].rfind("--num-query-groups 4 (Megatron reads it only with --group-query-attention", 0), 0u)
      << m.ignored[0];
  m = dtk::core::map_megatron_args(dtk::core::split_megatron_args("--num-layers 2 --num-query-groups 4"));
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_EQ(m.ignored.size(), 1u);
  m = dtk::core::map_megatron_args(dtk::core::split_megatron_args("--num-layers 2 --fp16 --bf16"));
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0], "--fp16 with --bf16: give one (Megatron asserts it)");
}

// Megatron's interleaved schedule: --num-layers-per-virtual-pipeline-stage X gives
// num_layers / pipeline size / X model chunks per rank (its virtual_pipeline_model_parallel_size);
// a split that does not work out is refused naming the flags.
TEST(MegatronArgs, VirtualPipelineStagesBecomeModelChunks) {
  MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(
      "--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2"));
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"distributed.pipeline_model_parallel_size", "2"},
                               {"distributed.virtual_pipeline_model_parallel_size", "2"}});
  m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(
      "--num-layers 8 --pipeline-model-parallel-size 4 --virtual-pipeline-model-parallel-size 2"));
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"distributed.virtual_pipeline_model_parallel_size", "2"}});
  for (const auto& [args, why] : std::vector<std::pair<std::string, std::string>>{
           {"--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
            "--num-layers-per-virtual-pipeline-stage 3: --num-layers 8 does not split into 2 pipeline stages of "
            "chunks of 3 layers"},
           {"--num-layers 8 --num-layers-per-virtual-pipeline-stage 2",
            "--num-layers-per-virtual-pipeline-stage 2: needs --pipeline-model-parallel-size 2 or more"},
           {"--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2",
            "--num-layers-per-virtual-pipeline-stage 2: needs --num-layers (the chunks per rank are num_layers / "
            "pipeline size / this)"}}) {
    m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(args));
    ASSERT_EQ(m.refused.size(), 1u) << args;
    EXPECT_EQ(m.refused[0], why);
  }
}

// Megatron's uneven pipeline split: the first/last rank's layers and the embedding/loss counted
// as layers map to distributed.*; the chunks per rank then come from
// --num-virtual-stages-per-pipeline-rank (Megatron asserts against the per-stage form), and the
// per-stage form counts the embedding and the loss; a layout string is refused.
TEST(MegatronArgs, AnUnevenPipelineSplitMaps) {
  MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(
      "--num-layers 8 --pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 1 "
      "--decoder-last-pipeline-num-layers 1 --num-virtual-stages-per-pipeline-rank 1"));
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"distributed.decoder_first_pipeline_num_layers", "1"},
                               {"distributed.decoder_last_pipeline_num_layers", "1"},
                               {"distributed.virtual_pipeline_model_parallel_size", "1"}});
  m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(
      "--num-layers 6 --pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split "
      "--account-for-loss-in-pipeline-split --num-layers-per-virtual-pipeline-stage 2"));
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"distributed.account_for_embedding_in_pipeline_split", "true"},
                               {"distributed.account_for_loss_in_pipeline_split", "true"},
                               {"distributed.virtual_pipeline_model_parallel_size", "2"}});
  for (const auto& [args, why] : std::vector<std::pair<std::string, std::string>>{
           {"--num-layers 8 --pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 "
            "--num-layers-per-virtual-pipeline-stage 2",
            "--num-layers-per-virtual-pipeline-stage 2 with --decoder-first-pipeline-num-layers 2: give the chunks per "
            "rank with --num-virtual-stages-per-pipeline-rank (Megatron asserts so)"},
           {"--num-layers 6 --pipeline-model-parallel-size 2 --account-for-loss-in-pipeline-split "
            "--num-layers-per-virtual-pipeline-stage 2",
            "--num-layers-per-virtual-pipeline-stage 2: --num-layers 6 (with the embedding/loss counted: 7) does not "
            "split into 2 pipeline stages of chunks of 2 layers"},
           {"--num-layers 8 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 2 "
            "--num-virtual-stages-per-pipeline-rank 2",
            "--num-layers-per-virtual-pipeline-stage 2 with --num-virtual-stages-per-pipeline-rank 2: give one "
            "(Megatron asserts no more than one of them)"},
           {"--pipeline-model-parallel-size 2 --decoder-last-pipeline-num-layers 0",
            "--decoder-last-pipeline-num-layers 0: not a positive number of layers (Megatron: must be larger than "
            "0)"}}) {
    m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(args));
    ASSERT_EQ(m.refused.size(), 1u) << args;
    EXPECT_EQ(m.refused[0], why);
  }
}

// --pipeline-model-parallel-layout (Megatron's layout string, parsed as parse_str_to_list does:
// commas dropped, "(...)*n" and "x*n" unrolled, empty stages kept) maps to the split of DTK's that
// puts the same decoder layers on every stage of the virtual pipeline (the stage order is Megatron's:
// chunk-major), and its chunks per rank; a layout no such split gives, MTP layers and Megatron's
// own refusals are refused, one line each.
TEST(MegatronArgs, ALayoutStringMapsToTheSplitThatGivesItsStages) {
  const auto fields = [](const std::string& args) {
    const MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(args));
    EXPECT_TRUE(m.refused.empty()) << args << ": " << m.refused.front();
    return config_of(m);
  };
  const auto unset = [](const dtk::config::RunConfig& c) {
    const auto& d = c.distributed();
    return d.decoder_first_pipeline_num_layers() == 0 && d.decoder_last_pipeline_num_layers() == 0 &&
           !d.account_for_embedding_in_pipeline_split() && !d.account_for_loss_in_pipeline_split();
  };
  // The even split (two ways to write it).
  EXPECT_TRUE(
      unset(fields("--num-layers 4 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ett|ttL")));
  EXPECT_TRUE(
      unset(fields("--num-layers 4 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
                   "'E(t)*2|t,t,L'")));
  expect_fields(fields("--num-layers 4 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tttL"),
                {{"distributed.decoder_first_pipeline_num_layers", "1"}});
  expect_fields(
      fields("--num-layers 6 --pipeline-model-parallel-size 4 --pipeline-model-parallel-layout "
             "'Et|(tt|)*2tL'"),
      {{"distributed.decoder_first_pipeline_num_layers", "1"}, {"distributed.decoder_last_pipeline_num_layers", "1"}});
  // Two chunks per rank: stages pp0c0, pp1c0, pp0c1, pp1c1 hold 1, 2, 2, 1: the embedding and
  // the loss counted (each rank's 3 layers are not even over its chunks with first/last).
  expect_fields(fields("--num-layers 6 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tt|tt|tL"),
                {{"distributed.virtual_pipeline_model_parallel_size", "2"},
                 {"distributed.account_for_embedding_in_pipeline_split", "true"},
                 {"distributed.account_for_loss_in_pipeline_split", "true"}});
  for (const auto& [args, why] : std::vector<std::pair<std::string, std::string>>{
           {"--num-layers 61 --pipeline-model-parallel-size 16 --pipeline-model-parallel-layout 'Et*3|(tt|)*29,m|L'",
            "--pipeline-model-parallel-layout Et*3|(tt|)*29,m|L: MTP layers (m): DTK has no multi-token prediction"},
           {"--num-layers 4 --pipeline-model-parallel-size 3 --pipeline-model-parallel-layout Ettt|t|L",
            "--pipeline-model-parallel-layout Ettt|t|L: its stages hold 3,1,0 decoder layers, which no split of DTK's "
            "gives (the first and last pipeline ranks' layers, the middle ranks even, the embedding and the loss "
            "counted as a layer; each rank's layers even over its chunks)"},
           {"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout tE|L",
            "--pipeline-model-parallel-layout tE|L: needs one embedding (E) first and one loss (L) last (Megatron "
            "asserts it)"},
           {"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout |EtL",
            "--pipeline-model-parallel-layout |EtL: DTK builds the embedding on the first stage and the loss on the "
            "last"},
           {"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|xL",
            "--pipeline-model-parallel-layout Et|xL: 'x' is not a layer (E embedding, t decoder layer, m MTP layer, L "
            "loss)"},
           {"--pipeline-model-parallel-size 3 --pipeline-model-parallel-layout Et|tL",
            "--pipeline-model-parallel-layout Et|tL: 2 stages do not divide into --pipeline-model-parallel-size 3 "
            "(Megatron asserts it)"},
           {"--num-layers 5 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Et|tL",
            "--pipeline-model-parallel-layout Et|tL: 2 decoder layers (t), --num-layers 5 (Megatron asserts they "
            "match)"},
           {"--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 1 "
            "--pipeline-model-parallel-layout Et|tL",
            "--pipeline-model-parallel-layout Et|tL: with --decoder-first/last-pipeline-num-layers or "
            "--account-for-embedding/loss-in-pipeline-split: give one (Megatron: the layout cannot be set with other "
            "pipeline layout arguments)"},
           {"--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
            "--pipeline-model-parallel-layout Et|tL",
            "--pipeline-model-parallel-layout Et|tL: with --num-virtual-stages-per-pipeline-rank 2: give one (Megatron "
            "asserts no more than one of them)"}}) {
    const MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(args));
    ASSERT_EQ(m.refused.size(), 1u) << args;
    EXPECT_EQ(m.refused[0], why);
  }
}

// Half a Llama is neither model; Llama-only flags on a GPT are named.
TEST(MegatronArgs, MixedArchitectureFlagsAreRefused) {
  MegatronMapping m = dtk::core::map_megatron_args(
      dtk::core::split_megatron_args("--num-layers 2 --position-embedding-type rope --swiglu"));
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_NE(m.refused[0].find("missing --normalization RMSNorm"), std::string::npos) << m.refused[0];
  m = dtk::core::map_megatron_args(
      dtk::core::split_megatron_args("--num-layers 2 --group-query-attention --num-query-groups 2"));
  ASSERT_EQ(m.refused.size(), 2u);
  EXPECT_EQ(m.refused[0].rfind("--group-query-attention: needs the llama model", 0), 0u) << m.refused[0];
  EXPECT_EQ(m.refused[1].rfind("--num-query-groups 2: needs the llama model", 0), 0u) << m.refused[1];
  m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(
      "--position-embedding-type rope --normalization RMSNorm --swiglu --openai-gelu"));
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0], "--openai-gelu: the llama model's MLP is SwiGLU, not GeLU");
  dtk::config::RunConfig c = dtk::core::default_config();
  try {
    dtk::core::apply_megatron_mapping(c, m);
    FAIL() << "refused flags must throw";
  } catch (const dtk::host::HostError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what, "--megatron_args: 1 flag(s) DTK cannot run: --openai-gelu: the llama model's MLP is SwiGLU, not GeLU");
  }
}

TEST(MegatronArgs, MegatronGpt3_175B) {
  const MegatronMapping m = map_file("megatron_gpt3_175b.args");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0], "--rampup-batch-size 16 16 5859375: needs sample-based training, --train-samples instead of "
                          "--train-iters (Megatron asserts 'expected no batch-size rampup for iteration-based training')");
  ASSERT_EQ(m.ignored.size(), 1u);
  EXPECT_EQ(m.ignored[0].rfind("--attention-backend (DTK picks its attention kernel", 0), 0u) << m.ignored[0];
  const auto cfg = config_of(m);
  expect_fields(cfg, {{"model.num_layers", "96"},
                      {"model.hidden_size", "12288"},
                      {"model.num_attention_heads", "96"},
                      {"train.seq_length", "2048"},
                      {"model.max_position_embeddings", "2048"},
                      {"train.micro_batch_size", "1"},
                      {"train.global_batch_size", "1536"},
                      {"train.rampup_batch_size", "16 16 5859375"},
                      {"train.train_iters", "500000"},
                      {"lr.weight_decay", "0.1"},
                      {"optimizer.beta1", "0.9"},
                      {"optimizer.beta2", "0.95"},
                      {"model.init_method_std", "0.006"},
                      {"train.clip_grad", "1"},
                      {"train.params_dtype", "fp16"},
                      {"lr.lr", "6e-05"},
                      {"lr.lr_decay_style", "cosine"},
                      {"lr.min_lr", "6e-06"},
                      {"lr.lr_warmup_fraction", "0.001"},
                      {"lr.lr_decay_iters", "430000"},
                      {"distributed.tensor_model_parallel_size", "8"},
                      {"distributed.pipeline_model_parallel_size", "16"},
                      {"dataset.data_path", "data/gpt3_text_document"},
                      {"tokenizer.vocab_file", "data/gpt2-vocab.json"},
                      {"tokenizer.merge_file", "data/gpt2-merges.txt"},
                      {"dataset.split", "949,50,1"},
                      {"logging.log_interval", "100"},
                      {"checkpoint.save_interval", "10000"},
                      {"eval.eval_interval", "1000"},
                      {"checkpoint.save", "checkpoints/gpt3-175b"},
                      {"checkpoint.load", "checkpoints/gpt3-175b"},
                      {"eval.eval_iters", "10"},
                      {"logging.tensorboard_dir", "tensorboard/gpt3-175b"}});
}

// Sequence parallelism and Megatron's three recompute settings map without refusal.
TEST(MegatronArgs, SequenceParallelAndEveryRecomputeChoiceMap) {
  auto mapped = [](const std::string& args) {
    const MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(args));
    EXPECT_TRUE(m.refused.empty()) << m.refused.front();
    return config_of(m);
  };
  expect_fields(mapped("--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity full "
                       "--recompute-method block --recompute-num-layers 3"),
                {{"distributed.sequence_parallel", "true"},
                 {"model.recompute_activations", "full"},
                 {"model.recompute_method", "block"},
                 {"model.recompute_num_layers", "3"}});
  expect_fields(mapped("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2"),
                {{"model.recompute_method", "uniform"}, {"model.recompute_num_layers", "2"}});
  expect_fields(mapped("--recompute-granularity selective"), {{"model.recompute_activations", "selective"}});
  const MegatronMapping bad = dtk::core::map_megatron_args(dtk::core::split_megatron_args("--recompute-method layer"));
  ASSERT_EQ(bad.refused.size(), 1u);
  EXPECT_EQ(bad.refused[0], "--recompute-method layer: not one of uniform, block");
}

// As Megatron reads them: --recompute-activations is selective over any granularity; the method
// and the layer count shape full recomputation only (with selective, Megatron refuses either;
// without a granularity, either is ignored and listed).
TEST(MegatronArgs, RecomputeFlagsActAsMegatronReadsThem) {
  MegatronMapping m = map_line("--recompute-granularity full --recompute-activations");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"model.recompute_activations", "selective"}});
  m = map_line("--recompute-activations --recompute-method block");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_NE(m.refused[0].find("--recompute-method block: not with selective recomputation"), std::string::npos)
      << m.refused[0];
  m = map_line("--recompute-granularity selective --recompute-num-layers 2");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0],
            "--recompute-num-layers 2: not with selective recomputation (Megatron-core: recompute_num_layers must be "
            "None)");
  m = map_line("--recompute-method uniform --recompute-num-layers 4");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_EQ(config_of(m).model().options().count("recompute_activations"), 0u);
  EXPECT_EQ(config_of(m).model().options().count("recompute_method"), 0u);
  EXPECT_EQ(m.ignored.size(), 2u);
}

// Megatron's --profile over [--profile-step-start, --profile-step-end) of its finished-iteration
// count: DTK's 1-based iterations start + 1 to end.
TEST(MegatronArgs, ProfileFlagsMapToProfileSteps) {
  auto mapped = [](const std::string& args) {
    const MegatronMapping m = dtk::core::map_megatron_args(dtk::core::split_megatron_args(args));
    EXPECT_TRUE(m.refused.empty()) << m.refused.front();
    return config_of(m);
  };
  expect_fields(mapped("--profile"), {{"logging.profile_steps", "11-12"}});
  expect_fields(mapped("--profile --profile-step-start 3 --profile-step-end 5 --use-pytorch-profiler --profile-ranks 0 1"),
                {{"logging.profile_steps", "4-5"}});
  EXPECT_EQ(config_of(dtk::core::map_megatron_args(dtk::core::split_megatron_args("--profile-step-start 3")))
                .logging()
                .profile_steps(),
            "");
  const MegatronMapping bad =
      dtk::core::map_megatron_args(dtk::core::split_megatron_args("--profile --profile-step-start 5 --profile-step-end 5"));
  ASSERT_EQ(bad.refused.size(), 1u);
  EXPECT_EQ(bad.refused[0], "--profile-step-start 5 --profile-step-end 5: not a range of iterations (0 <= start < end)");
}

// The parser: continuations, comments, quotes, --flag=value, '_' for '-', and every kind of
// mistake listed rather than dropped.
TEST(MegatronArgs, ParsingAndMistakes) {
  using dtk::core::split_megatron_args;
  EXPECT_EQ(split_megatron_args("--a 1 \\\n  --b 'x y' # note\n--c=\"q\""),
            (std::vector<std::string>{"--a", "1", "--b", "x y", "--c=q"}));
  EXPECT_THROW(split_megatron_args("--data-path 'open"), dtk::host::HostError);
  EXPECT_THROW(split_megatron_args("@/no/such/file.args"), dtk::host::HostError);

  MegatronMapping m = dtk::core::map_megatron_args(
      split_megatron_args("--num_layers=3 --hidden-size 48 --data-path 0.3 a 0.7 b --no-such-flag 5 --lr "
                          "--seq-length 32 stray --distributed-backend nccl --bf16 --use-distributed-optimizer"));
  // nccl means a GPU run (train.device=cuda as well); where dtk cannot train on a GPU (CI's
  // machines) it is refused with the reason.
  std::string why;
  const bool gpu = dtk::core::cuda_training_available(&why);
  ASSERT_EQ(m.refused.size(), gpu ? 3u : 4u);
  EXPECT_EQ(m.refused[0], "--no-such-flag 5: not a Megatron pretraining flag DTK knows");
  EXPECT_EQ(m.refused[1], "--lr: takes 1 value(s)");
  EXPECT_EQ(m.refused[2], "stray: a value without a flag");
  if (!gpu) {
    EXPECT_EQ(m.refused[3], "--distributed-backend nccl: " + why + " (docs/cuda.md); use gloo");
  } else {
    EXPECT_NE(std::find(m.sets.begin(), m.sets.end(), "distributed.backend=nccl"), m.sets.end());
    EXPECT_NE(std::find(m.sets.begin(), m.sets.end(), "train.device=cuda"), m.sets.end());
  }
  const auto cfg = config_of(m);
  expect_fields(cfg, {{"model.num_layers", "3"},
                      {"model.hidden_size", "48"},
                      {"dataset.data_path", "0.3 a 0.7 b"},
                      {"train.seq_length", "32"},
                      {"train.params_dtype", "bf16"},
                      {"strategy.name", "zero"},
                      {"strategy.stage", "1"}});
  // A value a config field rejects names the flag's field.
  dtk::config::RunConfig c = dtk::core::default_config();
  try {
    dtk::core::apply_megatron_mapping(c, dtk::core::map_megatron_args({"--train-iters", "many"}));
    FAIL();
  } catch (const dtk::host::HostError& e) {
    EXPECT_EQ(std::string(e.what()),
              "--megatron_args: --train-iters: --set 'train.train_iters=many': 'many' is not a valid int64 for "
              "'train.train_iters'");
  }
  // A later error about a field names the flag that set it: whole field names only.
  const MegatronMapping wsd =
      dtk::core::map_megatron_args({"--lr-decay-style", "cosine", "--lr-wsd-decay-style", "linear", "--lr", "1e-3"});
  EXPECT_EQ(wsd.flag_of.at("lr.lr_wsd_decay_style"), "--lr-wsd-decay-style");
  EXPECT_EQ(
      dtk::core::megatron_flag_legend("lr.lr_wsd_decay_style does nothing without lr.lr_decay_style=WSD.", wsd.flag_of),
      " (--megatron_args: lr.lr_decay_style is --lr-decay-style, lr.lr_wsd_decay_style is --lr-wsd-decay-style)");
  EXPECT_EQ(dtk::core::megatron_flag_legend("lr.lr_warmup_iters and lr.lr_foo", wsd.flag_of), "");
  EXPECT_EQ(dtk::core::megatron_flag_legend("lr.lr must be finite.", wsd.flag_of), " (--megatron_args: lr.lr is --lr)");
  // Fields set by the checks across flags are credited to the flag behind them too.
  const MegatronMapping across = dtk::core::map_megatron_args(
      {"--group-query-attention", "--num-query-groups=4", "--overlap-grad-reduce", "--recompute-activations",
       "--no-bias-gelu-fusion", "--no-rope-fusion", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
       "--num-layers-per-virtual-pipeline-stage", "2", "--profile", "--use-rope-scaling"});
  const std::map<std::string, std::string> credited = {
      {"model.num_query_groups", "--num-query-groups"},
      {"strategy.overlap_grad_reduce", "--overlap-grad-reduce"},
      {"model.recompute_activations", "--recompute-activations"},
      {"model.unfused_kernels", "--no-bias-gelu-fusion/--no-rope-fusion"},
      {"distributed.virtual_pipeline_model_parallel_size", "--num-layers-per-virtual-pipeline-stage"},
      {"logging.profile_steps", "--profile"},
      {"model.rope_scaling_factor", "--use-rope-scaling"}};
  for (const auto& [field, flag] : credited) {
    ASSERT_TRUE(across.flag_of.count(field)) << field;
    EXPECT_EQ(across.flag_of.at(field), flag) << field;
  }
  // --optimizer sgd: the sgd plugin with --sgd-momentum; the Adam flags are Adam's only (and the
  // other way round), as Megatron reads them.
  const MegatronMapping sgd =
      dtk::core::map_megatron_args({"--optimizer", "sgd", "--sgd-momentum", "0.5", "--adam-beta2", "0.95"});
  EXPECT_TRUE(sgd.refused.empty()) << sgd.refused.front();
  EXPECT_EQ(sgd.optimizer, "sgd");
  expect_fields(config_of(sgd), {{"optimizer.name", "sgd"}, {"optimizer.momentum", "0.5"}});
  EXPECT_EQ(sgd.ignored.at(0), "--adam-beta2 0.95 (Megatron reads it only with --optimizer adam)");
  const MegatronMapping adam = dtk::core::map_megatron_args({"--sgd-momentum", "0.5"});
  EXPECT_EQ(adam.ignored.at(0), "--sgd-momentum 0.5 (Megatron reads it only with --optimizer sgd)");
  // Megatron stops at the first step whose gradients are not finite unless told not to check.
  EXPECT_EQ(config_of(adam).train().skipped_steps_limit(), 1);
  EXPECT_EQ(
      config_of(dtk::core::map_megatron_args({"--no-check-for-nan-in-loss-and-grad"})).train().skipped_steps_limit(),
      -1);
  // --mock-data: the split and cache folder of a data path do nothing (Megatron's llama3 example
  // passes them with it).
  const MegatronMapping mock =
      dtk::core::map_megatron_args({"--mock-data", "--split", "99,1,0", "--data-cache-path", "/tmp/cache"});
  EXPECT_TRUE(mock.refused.empty()) << mock.refused.front();
  EXPECT_EQ(mock.ignored, (std::vector<std::string>{"--split (--mock-data reads no files)",
                                                    "--data-cache-path (--mock-data reads no files)"}));
  EXPECT_EQ(config_of(mock).dataset().name(), "synthetic");
  EXPECT_EQ(config_of(mock).dataset().options().count("split"), 0u);
  // A plugin's message names its option without the slot.
  EXPECT_EQ(dtk::core::megatron_flag_legend(
                "model plugin 'llama': create: llama: num_attention_heads 12 is not divisible by num_query_groups 5",
                across.flag_of),
            " (--megatron_args: model.num_query_groups is --num-query-groups)");
  EXPECT_EQ(dtk::core::megatron_flag_legend("dataset plugin 'x': num_query_groups", across.flag_of), "");
  // What a user sees: dtk config's one error line, with the flags; a field a --set changed after
  // them is not credited to its flag.
  const std::string flags =
      "config --megatron_args '--lr-decay-style cosine --lr-wsd-decay-style linear --lr 1e-3 "
      "--train-iters 10'";
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(flags),
      "config: lr.lr_wsd_decay_style does nothing without lr.lr_decay_style=WSD (it is "
      "cosine): drop it, or set lr.lr_decay_style=WSD (--megatron_args: lr.lr_decay_style is "
      "--lr-decay-style, lr.lr_wsd_decay_style is --lr-wsd-decay-style)");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(flags + " --set lr.lr_wsd_decay_style=exponential"),
                                  "drop it, or set lr.lr_decay_style=WSD (--megatron_args: lr.lr_decay_style is "
                                  "--lr-decay-style)");
  // A run without the model's shape or data, as Megatron's validate_args refuses it (it trained
  // DTK's default GPT-2 on random tokens); a --set or --dataset stands in for the flag.
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk("train --threads 1 --megatron_args '--num-layers 2 --train-iters 2'", 60),
      "--megatron_args: no --hidden-size, --num-attention-heads, --data-path (or --mock-data for random tokens): "
      "Megatron requires them");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk("train --threads 1 --set model.hidden_size=64 --megatron_args '--num-layers 2 "
                        "--num-attention-heads 4 --mock-data --train-iters 0'",
                        60),
      "config: train.train_iters");
}

// Megatron's iteration- vs sample-based assertions, said by the mapper with the other flags.
// --overlap-grad-reduce: ddp's bucketed all-reduce during the backward (its default, set
// explicitly), or with the distributed optimizer ZeRO's overlapped reduce-scatter, in either order;
// --overlap-param-gather: ZeRO's gathers during the next forward (refused without the distributed
// optimizer, as Megatron asserts).
TEST(MegatronArgs, OverlapFlagsAreTheStrategysOverlap) {
  const MegatronMapping ddp = dtk::core::map_megatron_args({"--overlap-grad-reduce"});
  EXPECT_TRUE(ddp.refused.empty());
  EXPECT_TRUE(ddp.ignored.empty());
  expect_fields(config_of(ddp), {{"strategy.name", "ddp"}, {"strategy.overlap_grad_reduce", "true"}});
  for (const std::vector<std::string>& flags : {std::vector<std::string>{"--overlap-grad-reduce", "--use-distributed-optimizer"},
                                                std::vector<std::string>{"--use-distributed-optimizer", "--overlap-grad-reduce"}}) {
    const MegatronMapping zero = dtk::core::map_megatron_args(flags);
    EXPECT_TRUE(zero.refused.empty());
    expect_fields(config_of(zero),
                  {{"strategy.name", "zero"}, {"strategy.stage", "1"}, {"strategy.overlap_comm", "true"}});
    EXPECT_TRUE(zero.ignored.empty());
    EXPECT_TRUE(zero.notes.empty());
  }
  // --overlap-param-gather: the distributed optimizer's all-gather during the next forward.
  const MegatronMapping gather =
      dtk::core::map_megatron_args({"--overlap-param-gather", "--use-distributed-optimizer"});
  EXPECT_TRUE(gather.refused.empty());
  expect_fields(config_of(gather), {{"strategy.name", "zero"}, {"strategy.overlap_param_gather", "true"}});
  const MegatronMapping alone = dtk::core::map_megatron_args({"--overlap-param-gather"});
  ASSERT_EQ(alone.refused.size(), 1u);
  EXPECT_EQ(alone.refused[0].rfind("--overlap-param-gather: needs --use-distributed-optimizer", 0), 0u)
      << alone.refused[0];
}

TEST(MegatronArgs, IterationAndSampleBasedTrainingDoNotMix) {
  const MegatronMapping both = dtk::core::map_megatron_args({"--train-samples", "100", "--train-iters", "5"});
  ASSERT_EQ(both.refused.size(), 1u);
  EXPECT_EQ(both.refused[0].rfind("--train-iters with --train-samples: give one", 0), 0u) << both.refused[0];
  const MegatronMapping schedule = dtk::core::map_megatron_args(
      {"--train-samples", "100", "--lr-decay-iters", "20", "--rampup-batch-size", "8", "8", "40"});
  ASSERT_EQ(schedule.refused.size(), 1u);
  EXPECT_EQ(schedule.refused[0].rfind("--lr-decay-iters 20: with --train-samples the schedule is sample-based", 0), 0u)
      << schedule.refused[0];
  const MegatronMapping ramp = dtk::core::map_megatron_args(
      {"--train-samples", "100", "--global-batch-size", "16", "--rampup-batch-size", "8", "8", "40"});
  EXPECT_TRUE(ramp.refused.empty());
  expect_fields(config_of(ramp), {{"train.train_samples", "100"}, {"train.train_iters", "0"},
                                  {"train.rampup_batch_size", "8 8 40"}});
}

// --ddp-bucket-size counts elements of Megatron's DDP buffers: ddp's bucket in MB of fp32, the
// distributed optimizer's (ZeRO's) reduce bucket; the bf16 reduction and the legacy models are
// accepted with their reason.
TEST(MegatronArgs, DdpBucketSizeIsTheStrategysBucket) {
  const MegatronMapping ddp =
      dtk::core::map_megatron_args({"--ddp-bucket-size", "40000000", "--grad-reduce-in-bf16", "--use-legacy-models"});
  EXPECT_TRUE(ddp.refused.empty());
  EXPECT_EQ(ddp.ignored.size(), 2u);
  expect_fields(config_of(ddp), {{"strategy.bucket_size_mb", "152.587890625"}});
  const MegatronMapping zero =
      dtk::core::map_megatron_args({"--ddp-bucket-size", "1000000", "--use-distributed-optimizer"});
  EXPECT_EQ(zero.strategy, "zero");
  expect_fields(config_of(zero), {{"strategy.reduce_bucket_size", "1000000"}});
  const MegatronMapping bad = dtk::core::map_megatron_args({"--ddp-bucket-size", "0"});
  ASSERT_EQ(bad.refused.size(), 1u);
  EXPECT_EQ(bad.refused[0], "--ddp-bucket-size 0: not a positive number of elements");
}

// --calculate-per-token-loss: the loop's per-token loss (tests/training_loop proves its arithmetic).
TEST(MegatronArgs, CalculatePerTokenLossIsTheLoopsPerTokenLoss) {
  const MegatronMapping m = dtk::core::map_megatron_args({"--calculate-per-token-loss"});
  EXPECT_TRUE(m.refused.empty());
  expect_fields(config_of(m), {{"train.calculate_per_token_loss", "true"}});
}

TEST(MegatronArgs, FullValidationSkipTrainAndMultipleValidationSetsMap) {
  const MegatronMapping m = dtk::core::map_megatron_args({"--full-validation", "--skip-train"});
  EXPECT_TRUE(m.refused.empty());
  expect_fields(config_of(m), {{"eval.full_validation", "true"}, {"eval.skip_train", "true"}});
  // Each prefix of --valid-data-path is a set (weights not read), named as given or by position.
  const MegatronMapping named =
      dtk::core::map_megatron_args({"--full-validation", "--train-data-path", "t", "--valid-data-path", "0.3", "wiki",
                                    "0.7", "co\"de", "--multiple-validation-sets", "--validation-set-names", "w", "c"});
  ASSERT_TRUE(named.refused.empty()) << named.refused[0];
  const dtk::config::RunConfig cfg = config_of(named);
  EXPECT_EQ(cfg.dataset().options().at("valid_data_path"), "0.3 wiki 0.7 co\"de");  // kept, not asked for
  EXPECT_EQ(cfg.dataset().options().at("train_data_path"), "t");
  ASSERT_EQ(cfg.eval().validation_sets_size(), 2);
  EXPECT_EQ(cfg.eval().validation_sets(0).name(), "w");
  EXPECT_EQ(cfg.eval().validation_sets(0).options().at("valid_data_path"), "wiki");
  EXPECT_EQ(cfg.eval().validation_sets(1).name(), "c");
  EXPECT_EQ(cfg.eval().validation_sets(1).options().at("valid_data_path"), "co\"de");
  const dtk::config::RunConfig unnamed = config_of(dtk::core::map_megatron_args(
      {"--full-validation", "--valid-data-path", "a", "b", "c", "--multiple-validation-sets"}));
  ASSERT_EQ(unnamed.eval().validation_sets_size(), 3);
  EXPECT_EQ(unnamed.eval().validation_sets(2).name(), "2");
  EXPECT_EQ(unnamed.eval().validation_sets(2).options().at("valid_data_path"), "c");
  // Without per-split validation paths: one set, the run's own validation split (Megatron's list of one).
  const dtk::config::RunConfig one = config_of(dtk::core::map_megatron_args(
      {"--full-validation", "--data-path", "a", "--multiple-validation-sets", "--validation-set-names", "all"}));
  ASSERT_EQ(one.eval().validation_sets_size(), 1);
  EXPECT_EQ(one.eval().validation_sets(0).name(), "all");
  EXPECT_TRUE(one.eval().validation_sets(0).options().empty());
  // Refused as Megatron refuses them.
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--valid-data-path", "a", "b", "--multiple-validation-sets"},
       "--multiple-validation-sets: needs --full-validation"},
      {{"--full-validation", "--valid-data-path", "a", "b", "--multiple-validation-sets", "--validation-set-names",
        "x"},
       "--validation-set-names x: 1 names for 2 validation sets"},
      {{"--validation-set-names", "x"}, "--validation-set-names x: needs --multiple-validation-sets"},
  };
  for (const auto& [args, want] : refused) {
    const MegatronMapping r = dtk::core::map_megatron_args(args);
    ASSERT_EQ(r.refused.size(), 1u) << want;
    EXPECT_EQ(r.refused[0].rfind(want, 0), 0u) << r.refused[0];
  }
}

// --decoupled-lr / --decoupled-min-lr: one rule for the parameters Megatron-LM marks
// is_embedding_or_output_parameter, with their own peak and floor.
TEST(MegatronArgs, DecoupledLrIsARuleForTheEmbeddingAndOutputLayer) {
  const MegatronMapping m = dtk::core::map_megatron_args({"--decoupled-lr", "3e-4", "--decoupled-min-lr", "3e-5"});
  ASSERT_TRUE(m.refused.empty()) << m.refused[0];
  const dtk::config::RunConfig cfg = config_of(m);
  ASSERT_EQ(cfg.lr().param_rules_size(), 1);
  const auto& rule = cfg.lr().param_rules(0);
  EXPECT_EQ(rule.match(), R"((^|\.)(word_embeddings|word_embeddings_for_head|output_layer)\.weight$)");
  EXPECT_EQ(rule.max_lr(), 3e-4);
  EXPECT_EQ(rule.min_lr(), 3e-5);
  const std::regex re(rule.match());
  for (const char* name : {"language_model.embedding.word_embeddings.weight", "word_embeddings_for_head.weight",
                           "language_model.output_layer.weight"})
    EXPECT_TRUE(std::regex_search(name, re)) << name;
  for (const char* name : {"language_model.embedding.position_embeddings.weight",
                           "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"})
    EXPECT_FALSE(std::regex_search(name, re)) << name;
  const MegatronMapping alone = dtk::core::map_megatron_args({"--decoupled-min-lr", "1e-5"});
  EXPECT_TRUE(alone.refused.empty());
  EXPECT_TRUE(config_of(alone).lr().param_rules().empty());
  ASSERT_EQ(alone.ignored.size(), 1u);
  EXPECT_EQ(alone.ignored[0], "--decoupled-min-lr 1e-5 (without --decoupled-lr, as Megatron)");
  const MegatronMapping bad = dtk::core::map_megatron_args({"--decoupled-lr", "fast"});
  ASSERT_EQ(bad.refused.size(), 1u);
  EXPECT_EQ(bad.refused[0], "--decoupled-lr fast: not a learning rate >= 0");
}

// Megatron-LM's MoE flags as its Mixtral and MoE examples give them.
TEST(MegatronArgs, MixtureOfExpertsFlagsAreTheModelsMoeOptions) {
  const MegatronMapping m = dtk::core::map_megatron_args({"--num-experts",
                                                          "8",
                                                          "--moe-router-topk",
                                                          "2",
                                                          "--moe-ffn-hidden-size",
                                                          "512",
                                                          "--moe-layer-freq",
                                                          "2",
                                                          "--moe-router-pre-softmax",
                                                          "--moe-router-topk-scaling-factor",
                                                          "2.5",
                                                          "--moe-router-dtype",
                                                          "fp32",
                                                          "--moe-aux-loss-coeff",
                                                          "1e-2",
                                                          "--moe-z-loss-coeff",
                                                          "1e-3",
                                                          "--moe-router-load-balancing-type",
                                                          "aux_loss",
                                                          "--moe-grouped-gemm",
                                                          "--moe-token-dispatcher-type",
                                                          "alltoall",
                                                          "--expert-model-parallel-size",
                                                          "4",
                                                          "--moe-input-jitter-eps",
                                                          "0.01"});
  ASSERT_TRUE(m.refused.empty()) << m.refused[0];
  EXPECT_EQ(config_of(m).distributed().expert_model_parallel_size(), 4);
  const auto options = config_of(m).model().options();
  const std::pair<const char*, const char*> want[] = {{"num_experts", "8"},
                                                      {"moe_router_topk", "2"},
                                                      {"moe_ffn_hidden_size", "512"},
                                                      {"moe_layer_freq", "2"},
                                                      {"moe_router_pre_softmax", "true"},
                                                      {"moe_router_topk_scaling_factor", "2.5"},
                                                      {"moe_router_fp32", "true"},
                                                      {"moe_aux_loss_coeff", "1e-2"},
                                                      {"moe_z_loss_coeff", "1e-3"},
                                                      {"moe_input_jitter_eps", "0.01"},
                                                      {"moe_token_dispatcher", "alltoall"}};
  for (const auto& [key, value] : want) {
    ASSERT_EQ(options.count(key), 1u) << key;
    EXPECT_EQ(options.at(key), value) << key;
  }
  // The dispatcher: DeepEP's flex refused, a dense model's flag ignored, as Megatron never reads it.
  const MegatronMapping flex =
      dtk::core::map_megatron_args({"--num-experts", "8", "--moe-token-dispatcher-type", "flex"});
  ASSERT_EQ(flex.refused.size(), 1u);
  EXPECT_EQ(flex.refused[0],
            "--moe-token-dispatcher-type flex: the flex dispatcher is DeepEP's or HybridEP's kernels; DTK has "
            "allgather and alltoall");
  const MegatronMapping seq =
      dtk::core::map_megatron_args({"--num-experts", "8", "--moe-token-dispatcher-type", "alltoall_seq"});
  ASSERT_TRUE(seq.refused.empty()) << seq.refused[0];
  EXPECT_EQ(config_of(seq).model().options().at("moe_token_dispatcher"), "alltoall");
  const MegatronMapping dense = dtk::core::map_megatron_args({"--moe-token-dispatcher-type", "alltoall"});
  ASSERT_TRUE(dense.refused.empty()) << dense.refused[0];
  EXPECT_EQ(config_of(dense).model().options().count("moe_token_dispatcher"), 0u);
  EXPECT_NE(std::find(dense.ignored.begin(), dense.ignored.end(),
                      "--moe-token-dispatcher-type (without --num-experts the MLPs are dense)"),
            dense.ignored.end());
  // DeepSeek-V3's router and shared expert, as Megatron's DeepSeek scripts write them.
  const MegatronMapping deepseek = dtk::core::map_megatron_args({"--num-experts",
                                                                 "64",
                                                                 "--moe-router-topk",
                                                                 "6",
                                                                 "--moe-layer-freq",
                                                                 "([0]*1+[1]*15)",
                                                                 "--moe-router-score-function",
                                                                 "sigmoid",
                                                                 "--moe-router-num-groups",
                                                                 "8",
                                                                 "--moe-router-group-topk",
                                                                 "3",
                                                                 "--moe-router-load-balancing-type",
                                                                 "seq_aux_loss",
                                                                 "--moe-aux-loss-coeff",
                                                                 "1e-4",
                                                                 "--moe-shared-expert-intermediate-size",
                                                                 "2816",
                                                                 "--moe-shared-expert-gate",
                                                                 "--moe-shared-expert-overlap",
                                                                 "--moe-token-dispatcher-type",
                                                                 "alltoall",
                                                                 "--moe-router-pre-softmax",
                                                                 "--moe-token-drop-policy",
                                                                 "probs",
                                                                 "--moe-router-enable-expert-bias",
                                                                 "--moe-router-bias-update-rate",
                                                                 "1e-3"});
  ASSERT_TRUE(deepseek.refused.empty()) << deepseek.refused[0];
  const auto deepseek_options = config_of(deepseek).model().options();
  const std::pair<const char*, const char*> deepseek_want[] = {{"moe_layer_freq", "([0]*1+[1]*15)"},
                                                               {"moe_router_score_function", "sigmoid"},
                                                               {"moe_router_num_groups", "8"},
                                                               {"moe_router_group_topk", "3"},
                                                               {"moe_router_load_balancing_type", "seq_aux_loss"},
                                                               {"moe_aux_loss_coeff", "1e-4"},
                                                               {"moe_shared_expert_intermediate_size", "2816"},
                                                               {"moe_shared_expert_gate", "true"},
                                                               {"moe_router_enable_expert_bias", "true"},
                                                               {"moe_router_bias_update_rate", "1e-3"},
                                                               {"moe_token_dispatcher", "alltoall"},
                                                               {"moe_shared_expert_overlap", "true"}};
  for (const auto& [key, value] : deepseek_want) {
    ASSERT_EQ(deepseek_options.count(key), 1u) << key;
    EXPECT_EQ(deepseek_options.at(key), value) << key;
  }
  // Megatron's sigmoid router ignores --moe-router-pre-softmax (its DeepSeek recipes pass both).
  EXPECT_EQ(deepseek_options.count("moe_router_pre_softmax"), 0u);
  const auto ignored = [&](const std::string& flag) {
    return std::any_of(deepseek.ignored.begin(), deepseek.ignored.end(),
                       [&](const std::string& line) { return line.rfind(flag, 0) == 0; });
  };
  EXPECT_TRUE(ignored("--moe-router-pre-softmax"));
  EXPECT_TRUE(ignored("--moe-token-drop-policy"));
  const std::pair<std::vector<std::string>, const char*> refused[] = {
      {{"--moe-router-load-balancing-type", "sinkhorn", "aux_loss"},
       "--moe-router-load-balancing-type sinkhorn aux_loss: DTK's router has Switch Transformer's load-balancing "
       "loss"},
      {{"--moe-router-load-balancing-type", "aux_loss", "quantile_balancing"},
       "--moe-router-load-balancing-type aux_loss quantile_balancing: DTK's router has Switch Transformer's"},
      {{"--moe-router-load-balancing-type", "aux_loss", "none"},
       "--moe-router-load-balancing-type aux_loss none: DTK's router has Switch Transformer's load-balancing loss"},
      {{"--moe-router-score-function", "tanh"},
       "--moe-router-score-function tanh: DTK's router scores with a softmax, a sigmoid or sqrtsoftplus"},
      {{"--moe-expert-capacity-factor", "0"}, "--moe-expert-capacity-factor 0: a capacity of 0 drops every token"},
      {{"--moe-expert-capacity-factor", "x1"}, "--moe-expert-capacity-factor x1: not a number"},
      {{"--moe-token-drop-policy", "random"}, "--moe-token-drop-policy random: not one of probs, position"},
      {{"--moe-router-dtype", "fp64"}, "--moe-router-dtype fp64: DTK's router runs in the model's dtype or in fp32"},
      {{"--num-experts", "4", "--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"},
       "--moe-shared-expert-overlap: overlaps the shared expert with the alltoall dispatcher's exchange; give "
       "--moe-token-dispatcher-type alltoall"},
  };
  for (const auto& [args, line] : refused) {
    const MegatronMapping r = dtk::core::map_megatron_args(args);
    ASSERT_EQ(r.refused.size(), 1u) << args[0];
    EXPECT_NE(r.refused[0].find(line), std::string::npos) << r.refused[0];
  }
  // Without a shared expert Megatron's overlap does nothing.
  const MegatronMapping no_shared = dtk::core::map_megatron_args(
      {"--num-experts", "4", "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-overlap"});
  ASSERT_TRUE(no_shared.refused.empty()) << no_shared.refused[0];
  EXPECT_EQ(config_of(no_shared).model().options().count("moe_shared_expert_overlap"), 0u);
  EXPECT_NE(std::find(no_shared.ignored.begin(), no_shared.ignored.end(),
                      "--moe-shared-expert-overlap (without --moe-shared-expert-intermediate-size there is no shared "
                      "expert)"),
            no_shared.ignored.end());
  // Megatron's global-batch load-balancing loss maps as the other types.
  const MegatronMapping global = dtk::core::map_megatron_args(
      {"--num-experts", "4", "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "1e-3"});
  ASSERT_TRUE(global.refused.empty()) << global.refused[0];
  EXPECT_EQ(config_of(global).model().options().at("moe_router_load_balancing_type"), "global_aux_loss");
  EXPECT_EQ(config_of(global).model().options().at("moe_aux_loss_coeff"), "1e-3");
  // Megatron's lists, a coefficient per type: comma-separated lists.
  const MegatronMapping listed =
      dtk::core::map_megatron_args({"--num-experts", "4", "--moe-router-load-balancing-type", "seq_aux_loss",
                                    "global_aux_loss", "--moe-aux-loss-coeff", "1e-4", "1e-3"});
  ASSERT_TRUE(listed.refused.empty()) << listed.refused[0];
  EXPECT_EQ(config_of(listed).model().options().at("moe_router_load_balancing_type"), "seq_aux_loss,global_aux_loss");
  EXPECT_EQ(config_of(listed).model().options().at("moe_aux_loss_coeff"), "1e-4,1e-3");
  // Balancing by the choice (S-BASE's sinkhorn, quantile balancing with its bias's EMA).
  const MegatronMapping sinkhorn =
      dtk::core::map_megatron_args({"--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"});
  ASSERT_TRUE(sinkhorn.refused.empty()) << sinkhorn.refused[0];
  EXPECT_EQ(config_of(sinkhorn).model().options().at("moe_router_load_balancing_type"), "sinkhorn");
  // Megatron's quantile balancing ignores --moe-aux-loss-coeff (no loss), wherever it comes.
  const MegatronMapping quantile = dtk::core::map_megatron_args(
      {"--num-experts", "4", "--moe-aux-loss-coeff", "1e-2", "--moe-router-load-balancing-type", "quantile_balancing",
       "--moe-router-quantile-balancing-ema", "0.5"});
  ASSERT_TRUE(quantile.refused.empty()) << quantile.refused[0];
  EXPECT_EQ(config_of(quantile).model().options().at("moe_router_load_balancing_type"), "quantile_balancing");
  EXPECT_EQ(config_of(quantile).model().options().at("moe_router_quantile_balancing_ema"), "0.5");
  EXPECT_EQ(config_of(quantile).model().options().at("moe_aux_loss_coeff"), "0");
  // No load balancing: the coefficient is ignored wherever it comes, as Megatron ignores it.
  for (const auto& args : {std::vector<std::string>{"--num-experts", "4", "--moe-aux-loss-coeff", "0.01",
                                                    "--moe-router-load-balancing-type", "none"},
                           std::vector<std::string>{"--num-experts", "4", "--moe-router-load-balancing-type", "none",
                                                    "--moe-aux-loss-coeff", "0.01"}}) {
    const MegatronMapping none = dtk::core::map_megatron_args(args);
    ASSERT_TRUE(none.refused.empty()) << none.refused[0];
    EXPECT_EQ(config_of(none).model().options().at("moe_aux_loss_coeff"), "0");
  }
  // Token dropping (Switch Transformer / Mixtral recipes): the capacity factor, the policy it reads
  // wherever it came, padding; a negative factor is Megatron's None (dropless).
  for (const auto& args :
       {std::vector<std::string>{"--num-experts", "8", "--moe-token-drop-policy", "position",
                                 "--moe-expert-capacity-factor", "1.25", "--moe-pad-expert-input-to-capacity"},
        std::vector<std::string>{"--num-experts", "8", "--moe-expert-capacity-factor", "1.25",
                                 "--moe-pad-expert-input-to-capacity", "--moe-token-drop-policy", "position"}}) {
    const MegatronMapping dropping = dtk::core::map_megatron_args(args);
    ASSERT_TRUE(dropping.refused.empty()) << dropping.refused[0];
    const auto options = config_of(dropping).model().options();
    EXPECT_EQ(options.at("moe_expert_capacity_factor"), "1.25");
    EXPECT_EQ(options.at("moe_token_drop_policy"), "position");
    EXPECT_EQ(options.at("moe_pad_expert_input_to_capacity"), "true");
  }
  const MegatronMapping dropless =
      dtk::core::map_megatron_args({"--num-experts", "8", "--moe-expert-capacity-factor", "-1"});
  ASSERT_TRUE(dropless.refused.empty()) << dropless.refused[0];
  EXPECT_EQ(config_of(dropless).model().options().count("moe_expert_capacity_factor"), 0u);
  ASSERT_EQ(dropless.ignored.size(), 1u);
  EXPECT_EQ(dropless.ignored[0], "--moe-expert-capacity-factor -1 (negative: dropless, Megatron's None)");
  // sqrtsoftplus scores, which (as sigmoid's) do not read --moe-router-pre-softmax.
  const MegatronMapping sqrt_softplus = dtk::core::map_megatron_args(
      {"--num-experts", "8", "--moe-router-pre-softmax", "--moe-router-score-function", "sqrtsoftplus"});
  ASSERT_TRUE(sqrt_softplus.refused.empty()) << sqrt_softplus.refused[0];
  const auto sqrt_options = config_of(sqrt_softplus).model().options();
  EXPECT_EQ(sqrt_options.at("moe_router_score_function"), "sqrtsoftplus");
  EXPECT_EQ(sqrt_options.count("moe_router_pre_softmax"), 0u);
}

// docs/user-guide.md holds the table the mapper prints (`dtk config --megatron_table`).
TEST(MegatronArgs, DocsTableIsTheMappersTable) {
  const auto table = dtk_test::doc_table("megatron", "megatron_table");
  ASSERT_TRUE(table) << "docs/user-guide.md lacks the table's markers";
  EXPECT_EQ(*table, dtk::core::megatron_flag_table()) << "regenerate with tools/gen_megatron_table.sh";
}

namespace {

// A small indexed dataset made with `dtk preprocess` from the committed Shakespeare excerpt, one
// document per line, the excerpt four times over (so the recipe's 0.1% test split holds more than
// one sample).
std::string make_dataset(const std::string& dir) {
  std::ofstream out(dir + "/excerpt.jsonl");
  for (int copy = 0; copy < 4; ++copy) {
    std::ifstream in(std::string(DTK_SOURCE_DIR) + "/tests/data/fixtures/shakespeare_excerpt.txt");
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      std::string esc;
      for (char c : line) esc += c == '"' ? "\\\"" : c == '\\' ? "\\\\" : std::string(1, c);
      out << "{\"text\": \"" << esc << "\"}\n";
    }
  }
  out.close();
  const dtk_test::Result r = dtk_test::run_dtk("preprocess --input " + dir + "/excerpt.jsonl --output_prefix " + dir +
                    "/excerpt --vocab_file " + DTK_VOCAB_DIR + "/encoder.json --merge_file " + DTK_VOCAB_DIR +
                    "/vocab.bpe --append_eod");
  EXPECT_EQ(r.code, 0) << r.out;
  return dir + "/excerpt_text_document";
}

std::vector<double> losses(const std::string& log) {
  std::vector<double> out;
  std::regex re("iteration +[0-9]+/ +[0-9]+ \\|.* lm loss: ([0-9.E+-]+) \\|");
  for (std::sregex_iterator it(log.begin(), log.end(), re), e; it != e; ++it) out.push_back(std::stod((*it)[1]));
  return out;
}

}  // namespace

// The shrunk Domino 2.7B recipe, as its flag list, at TP=2 in fp32 and bf16: it trains (10
// iterations, the loss going down), says which flag it ignored, derives the vocabulary from the
// tokenizer files; --fp16 itself is refused on the CPU at start with the reason.
TEST(MegatronRecipe, ShrunkDomino2_7BTrainsAtTensorParallel2) {
  const std::string dir = std::string(DTK_TEST_TMP) + "/recipe-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string data = make_dataset(dir);
  const std::string recipe = std::string("launch --nproc_per_node 2 train --threads 1 --megatron_args @") +
                             kFixtures + "/domino_gpt3_2.7b_shrunk.args --set dataset.data_path=" + data +
                             " --set tokenizer.vocab_file=" + DTK_VOCAB_DIR +
                             "/encoder.json --set tokenizer.merge_file=" + DTK_VOCAB_DIR + "/vocab.bpe" +
                             // Megatron's default of 100 evaluation iterations per set took 20 s of
                             // the fp32 run's 28 and over 4 minutes in bf16 on a CPU without native
                             // bf16 (a Zen 3 VM): 4 still evaluate both sets.
                             " --set eval.eval_iters=4"
                             // DeepSpeed-Domino ships legacy Megatron's megatron/data: its order
                             // (none of the script's flags names it).
                             " --set dataset.order=megatron_legacy";
  for (const std::string dtype : {"fp32", "bf16"}) {
    const dtk_test::Result r = dtk_test::run_dtk(recipe + " --set train.params_dtype=" + dtype + " --set lr.lr=0.003");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("dtk: note: --megatron_args: 1 flag(s) accepted with no effect here: "
                         "--no-gradient-accumulation-fusion ("),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("padded vocab 50432"), std::string::npos) << r.out;  // 50257 from encoder.json, TP 2
    const auto l = losses(r.out);
    ASSERT_EQ(l.size(), 10u) << r.out;
    EXPECT_LT(l.back(), l.front()) << dtype << "\n" << r.out;
    EXPECT_NE(r.out.find("validation loss at iteration 10 on test set"), std::string::npos) << r.out;
  }
  const dtk_test::Result fp16 = dtk_test::run_dtk(recipe);
  EXPECT_EQ(fp16.code, 1) << fp16.out;
  EXPECT_NE(fp16.out.find("config: train.params_dtype=fp16 needs train.device=cuda"), std::string::npos) << fp16.out;
  // A model vocabulary that contradicts the tokenizer is refused at start.
  const dtk_test::Result vocab = dtk_test::run_dtk(recipe + " --set train.params_dtype=fp32 --set model.vocab_size=1000");
  EXPECT_EQ(vocab.code, 1) << vocab.out;
  EXPECT_NE(vocab.out.find("config: model.vocab_size 1000 differs from the tokenizer's 50257 tokens"),
            std::string::npos)
      << vocab.out;
  std::filesystem::remove_all(dir);
}

// Megatron-LM's own example scripts for Llama 3 8B (zero-centred RMSNorm weights, sample-based
// schedule, distributed optimizer) and Mixtral 8x7B (expert parallelism with the distributed
// optimizer: the zero strategy with the experts partitioned over the ranks holding them) map whole;
// shrunk by --set to a few layers of width 64, each trains on two processes (Mixtral at expert-
// parallel size 2 without stages), saves and evaluates.
TEST(MegatronRecipe, LlamaAndMixtralExampleScriptsMapAndTrain) {
  const MegatronMapping llama = map_file("megatron_llama3_8b.args");
  EXPECT_TRUE(llama.refused.empty()) << llama.refused.front();
  expect_fields(config_of(llama), {{"model.name", "llama"},
                                   {"model.apply_layernorm_1p", "true"},
                                   {"model.num_query_groups", "8"},
                                   {"strategy.name", "zero"},
                                   {"train.train_samples", "1953125000"},
                                   {"train.calculate_per_token_loss", "true"}});
  const MegatronMapping mixtral = map_file("megatron_mixtral_8x7b.args");
  EXPECT_TRUE(mixtral.refused.empty()) << mixtral.refused.front();
  expect_fields(config_of(mixtral), {{"model.name", "llama"},
                                     {"model.num_experts", "8"},
                                     {"distributed.expert_model_parallel_size", "8"},
                                     {"distributed.pipeline_model_parallel_size", "4"},
                                     {"strategy.name", "zero"}});
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, "recipe-megatron-examples");
  const std::string shrunk =
      " --threads 1 --set model.num_layers=2 --set model.hidden_size=64 --set model.num_attention_heads=4 "
      "--set model.num_query_groups=2 --set train.seq_length=32 --set train.global_batch_size=4 "
      "--set tokenizer.null_vocab_size=255 --set eval.eval_iters=1 --set logging.profile_dir=" +
      dir + "/profile --set logging.tensorboard_dir=" + dir + "/tb ";
  const std::pair<std::string, std::string> runs[] = {
      {"--megatron_args @" + kFixtures + "/megatron_llama3_8b.args" + shrunk +
           "--set model.ffn_hidden_size=192 --set train.train_samples=32 --set lr.lr_decay_samples=28 "
           "--set lr.lr_warmup_samples=4 --set checkpoint.save=" +
           dir + "/llama --set checkpoint.load=" + dir + "/llama",
       "llama3"},
      {"--megatron_args @" + kFixtures + "/megatron_mixtral_8x7b.args" + shrunk +
           "--set model.ffn_hidden_size=128 --set model.num_experts=4 --set train.train_iters=8 "
           "--set lr.lr_decay_iters=8 --set lr.lr_warmup_iters=1 --set distributed.pipeline_model_parallel_size=1 "
           "--set distributed.expert_model_parallel_size=2 --set checkpoint.save=" +
           dir +
           "/mixtral "
           "--set checkpoint.load=" +
           dir + "/mixtral",
       "mixtral"},
  };
  for (const auto& [args, what] : runs) {
    const dtk_test::Result r = dtk_test::run_dtk("launch --nproc_per_node 2 train " + args, 600);
    ASSERT_EQ(r.code, 0) << what << "\n" << r.out;
    EXPECT_NE(r.out.find("iteration        8/       8"), std::string::npos) << what << "\n" << r.out;
    EXPECT_NE(r.out.find("saved checkpoint at iteration 8"), std::string::npos) << what << "\n" << r.out;
    EXPECT_NE(r.out.find("validation loss at iteration 8 on test set"), std::string::npos) << what << "\n" << r.out;
  }
  EXPECT_TRUE(std::filesystem::is_regular_file(dir + "/mixtral/iter_0000008/mp_rank_00_001/optim_dp_rank_001.pt"));
}

// Qwen's layers: Megatron-LM's own Qwen3-0.6B model flags (--qk-layernorm, --kv-channels 128 over
// hidden 1024 / 16 heads) map to the llama model's qk_layernorm and kv_channels; --add-qkv-bias
// (Qwen2) to add_qkv_bias; a --kv-channels that is hidden / heads sets nothing; the gpt model has
// none of the three: refused naming the llama model. The mapped Qwen3 shape, shrunk, trains.
TEST(MegatronArgs, QwenLayerFlagsMapToTheLlamaModel) {
  const MegatronMapping qwen3 = map_file("megatron_qwen3_0.6b.args");
  EXPECT_TRUE(qwen3.refused.empty()) << qwen3.refused.front();
  expect_fields(config_of(qwen3), {{"model.name", "llama"},
                                   {"model.qk_layernorm", "true"},
                                   {"model.kv_channels", "128"},
                                   {"model.num_query_groups", "8"},
                                   {"model.add_bias_linear", "false"},
                                   {"model.rotary_base", "1000000"}});
  MegatronMapping m = map_line(
      "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --add-qkv-bias --disable-bias-linear "
      "--position-embedding-type rope --normalization RMSNorm --swiglu");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"model.name", "llama"}, {"model.add_qkv_bias", "true"}});
  for (const std::string& set : m.sets) EXPECT_EQ(set.rfind("model.kv_channels", 0), std::string::npos) << set;
  m = map_line("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --qk-layernorm --add-qkv-bias");
  ASSERT_EQ(m.refused.size(), 2u);
  EXPECT_EQ(m.refused[0].rfind("--qk-layernorm: needs the llama model", 0), 0u) << m.refused[0];
  EXPECT_EQ(m.refused[1].rfind("--add-qkv-bias: needs the llama model", 0), 0u) << m.refused[1];

  const dtk_test::Result r = dtk_test::run_dtk(
      "train --dataset synthetic --threads 1 --megatron_args @" + kFixtures +
      "/megatron_qwen3_0.6b.args --set tokenizer.type=GPT2BPETokenizer --set tokenizer.model_file= "
      "--set tokenizer.vocab_file=" +
      DTK_VOCAB_DIR + "/encoder.json --set tokenizer.merge_file=" + DTK_VOCAB_DIR +
      "/vocab.bpe --set train.params_dtype=fp32 --set model.num_layers=2 --set model.hidden_size=64 "
      "--set model.num_attention_heads=4 --set model.num_query_groups=2 --set model.kv_channels=32 "
      "--set model.ffn_hidden_size=128 --set model.make_vocab_size_divisible_by=128 --set train.seq_length=32 "
      "--set train.global_batch_size=2 --set train.train_iters=2 --set lr.lr=1e-4 --set eval.eval_iters=1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("model 'llama': 2 layers, hidden 64, heads 4 of 32 channels, seq 32"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("iteration        2/       2"), std::string::npos) << r.out;
}

// Megatron's sliding-window flags, as gpt-oss's script passes them (--window-size 127,0
// --window-attn-skip-freq 2), map to both models' window options, which read Megatron's tuple as
// written; a llama and a gpt train with them, and a window that sees later tokens is the model's
// one-line refusal.
TEST(MegatronArgs, SlidingWindowFlagsMapToBothModels) {
  const MegatronMapping m =
      map_line("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --window-size 127,0 --window-attn-skip-freq 2");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"model.window_size", "127,0"}, {"model.window_attn_skip_freq", "2"}});
  const std::string base =
      "train --threads 1 --dataset synthetic --megatron_args '--num-layers 2 --hidden-size 64 "
      "--num-attention-heads 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 2 --train-iters 2 --lr 0.001 "
      "--eval-iters 1 --eval-interval 2 --log-interval 1 --window-attn-skip-freq [1,0] ";
  const std::string vocab = std::string(" --set tokenizer.vocab_file=") + DTK_VOCAB_DIR +
                            "/encoder.json --set tokenizer.merge_file=" + DTK_VOCAB_DIR + "/vocab.bpe";
  for (const char* model : {"", "--position-embedding-type rope --normalization RMSNorm --swiglu "}) {
    const dtk_test::Result r = dtk_test::run_dtk(base + model + "--window-size 7,0'" + vocab);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(dtk_test::printed_losses(r.out).size(), 2u) << r.out;
  }
  dtk_test::expect_one_line_error(dtk_test::run_dtk(base + "--window-size 7,3'" + vocab),
                                  "option 'window_size': '7,3' would let each token see the 3 tokens after it");
}

// --recompute-modules: the sub-layers selective recomputation reruns (core_attn when not given);
// DTK's layers rerun core_attn, mlp and moe. --moe-layer-recompute (Megatron-core's deprecated
// flag) is selective with moe added; with full granularity Megatron refuses it.
TEST(MegatronArgs, RecomputeModulesMapToDtksModules) {
  MegatronMapping m = map_line("--num-layers 2 --recompute-granularity selective --recompute-modules core_attn");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_TRUE(m.ignored.empty()) << m.ignored.front();
  expect_fields(config_of(m), {{"model.recompute_activations", "selective"}, {"model.recompute_modules", "core_attn"}});
  m = map_line("--num-layers 2 --recompute-granularity selective --recompute-modules mlp core_attn mlp");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m),
                {{"model.recompute_activations", "selective"}, {"model.recompute_modules", "mlp,core_attn"}});
  m = map_line("--num-layers 2 --recompute-modules core_attn");
  ASSERT_EQ(m.ignored.size(), 1u);
  EXPECT_EQ(m.ignored[0], "--recompute-modules (Megatron reads it only with --recompute-granularity selective)");
  m = map_line("--num-layers 2 --recompute-activations --recompute-modules core_attn mlp layernorm");
  ASSERT_FALSE(m.refused.empty());
  EXPECT_EQ(m.refused[0],
            "--recompute-modules core_attn mlp layernorm: DTK's layers recompute core_attn, mlp and moe; not layernorm "
            "(--recompute-granularity full recomputes whole layers)");
  m = map_line("--num-layers 2 --recompute-granularity selective --recompute-modules attn");
  ASSERT_FALSE(m.refused.empty());
  EXPECT_EQ(m.refused[0].rfind("--recompute-modules attn: attn not among Megatron's modules (core_attn, ", 0), 0u)
      << m.refused[0];
  // --moe-layer-recompute: selective, core_attn (the default list) and moe.
  m = map_line("--num-layers 2 --moe-layer-recompute");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_TRUE(m.ignored.empty()) << m.ignored.front();
  expect_fields(config_of(m),
                {{"model.recompute_activations", "selective"}, {"model.recompute_modules", "core_attn,moe"}});
  m = map_line("--num-layers 2 --recompute-granularity selective --recompute-modules mlp --moe-layer-recompute");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"model.recompute_modules", "mlp,moe"}});
  m = map_line("--num-layers 2 --recompute-granularity full --moe-layer-recompute");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0].rfind("--moe-layer-recompute with --recompute-granularity full: Megatron refuses it", 0), 0u)
      << m.refused[0];
  // Older Megatron's --checkpoint-activations (full) and --moe-layer-recompute (selective): give one.
  m = map_line("--num-layers 2 --checkpoint-activations --moe-layer-recompute");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0].rfind("--checkpoint-activations with --recompute-granularity/--recompute-activations/"
                               "--moe-layer-recompute: give one",
                               0),
            0u)
      << m.refused[0];
  // Megatron checks --recompute-method and --recompute-num-layers before --moe-layer-recompute makes
  // the granularity selective: alone, it leaves them unread, not refused.
  m = map_line("--num-layers 2 --moe-layer-recompute --recompute-method uniform --recompute-num-layers 1");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  ASSERT_EQ(m.ignored.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(m.ignored[i].rfind(i == 0 ? "--recompute-method" : "--recompute-num-layers", 0), 0u) << m.ignored[i];
    EXPECT_NE(m.ignored[i].find("(Megatron reads it only with --recompute-granularity full)"), std::string::npos);
  }
  expect_fields(config_of(m),
                {{"model.recompute_activations", "selective"}, {"model.recompute_modules", "core_attn,moe"}});
  m = map_line("--num-layers 2 --recompute-activations --moe-layer-recompute --recompute-num-layers 1");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0].rfind("--recompute-num-layers 1: not with selective recomputation", 0), 0u) << m.refused[0];
}

// --dataloader-type cyclic is Megatron's random sampler; --no-data-sharding reaches it only with
// cyclic (Megatron's pretraining sampler never reads it); external is refused.
TEST(MegatronArgs, CyclicDataloaderAndDataShardingMap) {
  MegatronMapping m = map_line("--num-layers 2 --dataloader-type cyclic --no-data-sharding");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_TRUE(m.ignored.empty()) << m.ignored.front();
  expect_fields(config_of(m), {{"train.dataloader_type", "cyclic"}, {"train.data_sharding", "false"}});
  m = map_line("--num-layers 2 --no-data-sharding --dataloader-type single");
  ASSERT_EQ(m.ignored.size(), 1u);
  EXPECT_EQ(m.ignored[0], "--no-data-sharding (Megatron reads it only with --dataloader-type cyclic)");
  EXPECT_FALSE(config_of(m).train().has_data_sharding());
  // The last --dataloader-type given counts, as in argparse.
  m = map_line("--num-layers 2 --dataloader-type cyclic --no-data-sharding --dataloader-type single");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_EQ(config_of(m).train().dataloader_type(), "");
  EXPECT_EQ(m.ignored.size(), 1u);
  m = map_line("--num-layers 2 --dataloader-type external --dataloader-type cyclic");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"train.dataloader_type", "cyclic"}});
  m = map_line("--num-layers 2 --dataloader-type external");
  ASSERT_FALSE(m.refused.empty());
  EXPECT_EQ(m.refused[0],
            "--dataloader-type external: DTK reads data through dataset plugins (write one: docs/plugin-guide.md)");
}

// Megatron-core's add_extra_token_to_sequence=False and drop_last_partial_validation_sequence=False
// under tensor parallelism: the samples' loss mask (padding) reaches every tensor-parallel rank
// with the tokens, so TP 2 trains and evaluates exactly as TP 1 (with the vocabulary padded alike:
// divisible by 256 at TP 1 is what 128 x 2 gives at TP 2).
TEST(MegatronRecipe, SamplesWithPaddingTrainAlikeAtTensorParallel2) {
  const std::string dir = std::string(DTK_TEST_TMP) + "/padding-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string data = make_dataset(dir);
  const std::string run = std::string("train --config ") + DTK_SOURCE_DIR +
                          "/configs/gpt-tiny.pbtxt --dataset gpt_indexed --threads 1 --data_path " + data +
                          " --vocab_file " + DTK_VOCAB_DIR + "/encoder.json --merge_file " + DTK_VOCAB_DIR +
                          "/vocab.bpe --set model.hidden_dropout=0 --set model.attention_dropout=0 "
                          "--set train.train_iters=4 --set lr.lr_warmup_iters=1 --set logging.log_interval=1 "
                          "--set eval.eval_interval=2 --set eval.eval_iters=2 --set dataset.add_extra_token=false "
                          "--set dataset.drop_last_partial_validation=false --set dataset.cache_dir=" + dir + "/cache";
  const dtk_test::Result tp1 =
      dtk_test::run_dtk("launch --nproc_per_node 1 " + run + " --set model.make_vocab_size_divisible_by=256");
  const dtk_test::Result tp2 =
      dtk_test::run_dtk("launch --nproc_per_node 2 " + run + " --set distributed.tensor_model_parallel_size=2");
  ASSERT_EQ(tp1.code, 0) << tp1.out;
  ASSERT_EQ(tp2.code, 0) << tp2.out;
  auto printed = [](const std::string& log) {  // every training and validation loss, as printed
    std::vector<std::string> out;
    std::regex re("lm loss( value)?: ([0-9.E+-]+)");
    for (std::sregex_iterator it(log.begin(), log.end(), re), e; it != e; ++it) out.push_back((*it)[2]);
    return out;
  };
  // 4 iterations, evaluations after 2 and 4, the final validation and test.
  EXPECT_EQ(printed(tp1.out).size(), 4u + 2u + 1u + 1u) << tp1.out;
  EXPECT_EQ(printed(tp1.out), printed(tp2.out)) << tp1.out << "\n" << tp2.out;
  std::filesystem::remove_all(dir);
}

// A run sized in samples asks the train split for train.train_samples itself, as Megatron's
// train_val_test_num_samples does (its dataset cache is named after them): 100 samples are 6
// global batches of 16 (96 read), and the cache's description says 100.
TEST(MegatronRecipe, TrainSamplesAreWhatTheTrainSplitIsAskedFor) {
  const std::string dir = std::string(DTK_TEST_TMP) + "/train-samples-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string data = make_dataset(dir);
  const dtk_test::Result r = dtk_test::run_dtk(
      std::string("train --config ") + DTK_SOURCE_DIR + "/configs/gpt-tiny.pbtxt --dataset gpt_indexed --threads 1 " +
      "--data_path " + data + " --vocab_file " + DTK_VOCAB_DIR + "/encoder.json --merge_file " + DTK_VOCAB_DIR +
      "/vocab.bpe --set train.train_iters=0 --set train.train_samples=100 --set train.global_batch_size=16 "
      "--set lr.lr_warmup_iters=0 --set eval.eval_iters=0 --set logging.log_interval=1 --set dataset.cache_dir=" +
      dir + "/cache");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(losses(r.out).size(), 6u) << r.out;
  std::string description;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/cache")) {
    const std::string name = e.path().filename().string();
    if (name.size() > 33 && name.substr(name.size() - 33) == "-GPTDataset-train-description.txt") {
      std::ifstream in(e.path());
      description.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
  }
  EXPECT_NE(description.find("\"num_samples\": 100,"), std::string::npos) << description;
  std::filesystem::remove_all(dir);
}

namespace {

// A byte-level BPE vocabulary of 257 tokens (the 256 byte tokens of GPT-2's bytes_to_unicode and
// <|endoftext|>) without merges: a valid tokenizer far smaller than GPT-2's.
void write_tiny_tokenizer(const std::string& vocab, const std::string& merges) {
  std::vector<int> bs;
  for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
  for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
  for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
  std::vector<int> cs = bs;
  for (int b = 0, n = 0; b < 256; ++b)
    if (std::find(bs.begin(), bs.end(), b) == bs.end()) bs.push_back(b), cs.push_back(256 + n++);
  auto utf8 = [](int c) {
    std::string s;
    if (c < 0x80) {
      if (c == '"' || c == '\\') s += '\\';
      s += static_cast<char>(c);
    } else {
      s += static_cast<char>(0xC0 | (c >> 6));
      s += static_cast<char>(0x80 | (c & 0x3F));
    }
    return s;
  };
  std::ofstream v(vocab);
  v << "{";
  for (size_t i = 0; i < cs.size(); ++i) v << "\"" << utf8(cs[i]) << "\": " << i << ", ";
  v << "\"<|endoftext|>\": 256}";
  std::ofstream(merges) << "#version: 0.2\n";
}

}  // namespace

// The tokenizer files at training time: the model's vocabulary comes from them, and data whose
// token ids the tokenizer cannot have produced is refused at start: by the dataset's declared
// vocabulary, or else by the ids of the first batches.
TEST(TokenizerFiles, VocabularyDerivedAndDataCheckedAtStart) {
  const std::string dir = std::string(DTK_TEST_TMP) + "/tokenizer-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string data = make_dataset(dir);  // GPT-2 ids
  write_tiny_tokenizer(dir + "/tiny.json", dir + "/tiny.bpe");
  const std::string train = std::string("train --threads 1 --dataset gpt_indexed --set dataset.data_path=") +
                            data + " --set train.train_iters=2 --set train.seq_length=32 --set model.num_layers=1 " +
                            "--set model.hidden_size=32 --set model.num_attention_heads=2 --set eval.eval_iters=1 ";
  const dtk_test::Result gpt2 = dtk_test::run_dtk(train + "--set tokenizer.vocab_file=" + DTK_VOCAB_DIR + "/encoder.json " +
                             "--set tokenizer.merge_file=" + DTK_VOCAB_DIR + "/vocab.bpe");
  EXPECT_EQ(gpt2.code, 0) << gpt2.out;
  EXPECT_NE(gpt2.out.find("padded vocab 50304"), std::string::npos) << gpt2.out;
  const std::string tiny = "--set tokenizer.vocab_file=" + dir + "/tiny.json --set tokenizer.merge_file=" + dir + "/tiny.bpe";
  const dtk_test::Result declared = dtk_test::run_dtk(train + tiny + " --set dataset.vocab_size=50257");
  EXPECT_EQ(declared.code, 1) << declared.out;
  EXPECT_NE(declared.out.find("dtk: error: config: dataset.vocab_size 50257 is larger than the tokenizer's 257 tokens"),
            std::string::npos)
      << declared.out;
  const dtk_test::Result ids = dtk_test::run_dtk(train + tiny);
  EXPECT_EQ(ids.code, 1) << ids.out;
  EXPECT_TRUE(std::regex_search(ids.out, std::regex("dtk: error: dataset plugin 'gpt_indexed': token id [0-9]+ in 'text' "
                                                    "of a training batch of iteration 1 is not below the tokenizer's "
                                                    "vocabulary \\(.*tiny.json\\) of 257 tokens\n")))
      << ids.out;
  const dtk_test::Result half = dtk_test::run_dtk(train + "--set tokenizer.vocab_file=" + dir + "/tiny.json");
  EXPECT_EQ(half.code, 1) << half.out;
  EXPECT_NE(half.out.find("dtk: error: tokenizer: --tokenizer-type GPT2BPETokenizer needs --vocab-file (encoder.json) "
                          "and --merge-file (vocab.bpe)"),
            std::string::npos)
      << half.out;
  std::filesystem::remove_all(dir);
}

// Megatron's RampupBatchsizeNumMicroBatches and update_train_iters, transcribed on their own:
// the global batch of each iteration of a sample-based run.
std::vector<int64_t> megatron_rampup_batches(int64_t start, int64_t incr, int64_t ramp, int64_t gbs, int64_t samples) {
  const double per_increment = static_cast<double>(ramp) / static_cast<double>((gbs - start) / incr);
  auto current = [&](int64_t consumed) {
    return consumed > ramp ? gbs : start + static_cast<int64_t>(static_cast<double>(consumed) / per_increment) * incr;
  };
  std::vector<int64_t> out;
  int64_t consumed = 0;
  while (consumed <= ramp) out.push_back(current(consumed)), consumed += out.back();
  for (int64_t k = (samples - consumed) / gbs; k > 0; --k) out.push_back(gbs);
  return out;
}

// Every iteration's global batch, samples consumed before it and micro-batches against `want`
// (micro_batch_size 4, data parallel 2), and DP rank 1's rows m*8 + 4 + j of each iteration's
// samples from any resume point.
void expect_iteration_batches(const dtk::core::BatchPlan& plan, const std::vector<int64_t>& want,
                              const std::string& what) {
  ASSERT_EQ(plan.train_iters(), static_cast<int64_t>(want.size())) << what;
  const dtk::core::SampleOrder rank1(dtk::core::SamplerChoice{}, plan.train_samples(), 4, /*dp_rank=*/1, 2);
  int64_t consumed = 0, micro = 0;
  for (int64_t i = 1; i <= plan.train_iters(); ++i) {
    ASSERT_EQ(plan.global_batch_of(i), want[i - 1]) << what << ", iteration " << i;
    ASSERT_EQ(plan.consumed_before(i), consumed);
    ASSERT_EQ(plan.micro_batches_of(i), want[i - 1] / 8);
    for (int64_t m = 0; m < plan.micro_batches_of(i); ++m)
      for (int64_t first : {int64_t{1}, std::min<int64_t>(i, 3)})
        ASSERT_EQ(rank1.index(plan.consumed_before(first), micro + m - plan.micro_batches_before(first), 2),
                  consumed + m * 8 + 4 + 2);
    consumed += want[i - 1], micro += plan.micro_batches_of(i);
  }
  EXPECT_EQ(plan.train_samples(), consumed) << what;
}

TEST(RampupBatchSize, BatchPlanFollowsMegatronsCalculator) {
  dtk::core::Topology topo;
  topo.dp_size = 2, topo.dp_rank = 1, topo.world_size = 2, topo.world_rank = 1;
  for (const auto& [start, incr, ramp, gbs, samples] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>{
           {8, 8, 100, 64, 1000}, {16, 16, 5000, 256, 20000}, {8, 24, 30, 56, 300}}) {
    dtk::config::RunConfig cfg = dtk::core::default_config();
    cfg.mutable_train()->set_micro_batch_size(4);
    cfg.mutable_train()->set_global_batch_size(gbs);
    cfg.mutable_train()->set_train_iters(0);
    cfg.mutable_train()->set_train_samples(samples);
    cfg.mutable_train()->set_rampup_batch_size(std::to_string(start) + " " + std::to_string(incr) + " " +
                                               std::to_string(ramp));
    dtk::core::validate_config(cfg);
    const dtk::core::BatchPlan plan(cfg, topo);
    expect_iteration_batches(plan, megatron_rampup_batches(start, incr, ramp, gbs, samples),
                             cfg.train().rampup_batch_size());
  }
}

// End to end: the log shows each iteration's batch and the samples consumed; the first iterations
// equal a run with the start batch; the learning-rate warm-up counts samples; data parallel 2
// equals one process; a resume in the middle of the ramp-up equals the uninterrupted run.
TEST(RampupBatchSize, TrainsAsMegatronAndResumesExactly) {
  const std::string dir = std::string(DTK_TEST_TMP) + "/rampup-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  const std::string base = std::string(" train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.hidden_dropout=0 "
                           "--set model.attention_dropout=0 --set logging.log_interval=1 --set eval.eval_iters=1 "
                           "--set train.micro_batch_size=4 --set lr.lr_decay_style=constant --set lr.lr_warmup_iters=0";
  const std::string ramp = base + " --set train.train_iters=0 --set train.train_samples=88 "
                                  "--set train.global_batch_size=16 '--set=train.rampup_batch_size=8 8 16'";
  const dtk_test::Result one = dtk_test::run_dtk(ramp);
  ASSERT_EQ(one.code, 0) << one.out;
  // One increment of 8 over 16 samples: consumed 0 and 8 give 8, consumed 16 gives 16; then 16s.
  std::vector<std::string> batches, consumed;
  std::regex re("consumed samples: +([0-9]+) \\|.* global batch size: +([0-9]+) \\|");
  for (std::sregex_iterator it(one.out.begin(), one.out.end(), re), e; it != e; ++it)
    consumed.push_back((*it)[1]), batches.push_back((*it)[2]);
  // Three ramp-up iterations (32 samples), then (88 - 32) / 16 = 3 more: 6 in all.
  EXPECT_EQ(batches, (std::vector<std::string>{"8", "8", "16", "16", "16", "16"})) << one.out;
  EXPECT_EQ(consumed, (std::vector<std::string>{"8", "16", "32", "48", "64", "80"})) << one.out;
  EXPECT_NE(one.out.find("ramping up from 8 (8 8 16)"), std::string::npos) << one.out;

  const dtk_test::Result start = dtk_test::run_dtk(base + " --set train.train_iters=2 --set train.global_batch_size=8");
  ASSERT_EQ(start.code, 0) << start.out;
  const auto a = losses(one.out), b = losses(start.out);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 2u);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(a[i], b[i], 1e-6 * std::abs(b[i])) << "iteration " << i + 1;

  // Warm-up over lr_warmup_iters x global batch = 32 samples: after iteration 1 (8 samples) the
  // rate is lr x 8/32.
  const dtk_test::Result warm = dtk_test::run_dtk(ramp + " --set lr.lr_warmup_iters=2 --set lr.lr=1e-3");
  ASSERT_EQ(warm.code, 0) << warm.out;
  EXPECT_NE(warm.out.find("consumed samples:            8 |"), std::string::npos) << warm.out;
  EXPECT_NE(warm.out.find("learning rate: 2.500000E-04 |"), std::string::npos) << warm.out;

  const dtk_test::Result dp2 = dtk_test::run_dtk(" launch --nproc_per_node 2" + ramp);
  ASSERT_EQ(dp2.code, 0) << dp2.out;
  const auto c = losses(dp2.out);
  ASSERT_EQ(c.size(), 6u) << dp2.out;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(c[i], a[i], 1e-5 * std::abs(a[i])) << "DP2 iteration " << i + 1;

  const dtk_test::Result first = dtk_test::run_dtk(ramp + " --set checkpoint.save=" + dir +
                              " --set checkpoint.save_interval=2 --set train.exit_interval=2");
  ASSERT_EQ(first.code, 0) << first.out;
  const dtk_test::Result rest = dtk_test::run_dtk(ramp + " --set checkpoint.load=" + dir);
  ASSERT_EQ(rest.code, 0) << rest.out;
  const auto d = losses(rest.out);
  ASSERT_EQ(d.size(), 4u) << rest.out;
  for (size_t i = 0; i < d.size(); ++i)
    EXPECT_EQ(d[i], a[i + 2]) << "resumed iteration " << i + 3;
  std::filesystem::remove_all(dir);
}

// Megatron's --lr-decay-samples / --lr-warmup-samples: with a ramp-up the schedule takes them as
// samples (the warm-up over 32 samples equals lr_warmup_iters 2 x global batch 16); without one
// they are whole global batches (equal to the iteration lengths; a partial batch refused); with
// iteration-based training refused, by the mapper and by the config.
TEST(RampupBatchSize, ScheduleLengthsInSamples) {
  const std::string base = std::string(" train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.hidden_dropout=0 "
                           "--set model.attention_dropout=0 --set logging.log_interval=1 --set eval.eval_iters=0 "
                           "--set train.micro_batch_size=4 --set lr.lr=1e-3 --set lr.lr_warmup_iters=0 "
                           "--set train.train_iters=0 --set train.global_batch_size=16";
  const std::string ramp = base + " --set train.train_samples=88 '--set=train.rampup_batch_size=8 8 16'";
  const dtk_test::Result warm = dtk_test::run_dtk(ramp + " --set lr.lr_warmup_samples=32");
  ASSERT_EQ(warm.code, 0) << warm.out;
  EXPECT_NE(warm.out.find("learning rate: 2.500000E-04 |"), std::string::npos) << warm.out;

  const std::string plain = base + " --set train.train_samples=96 --set lr.lr_decay_style=cosine";
  const dtk_test::Result samples = dtk_test::run_dtk(plain + " --set lr.lr_warmup_samples=32 --set lr.lr_decay_samples=80");
  const dtk_test::Result iters = dtk_test::run_dtk(plain + " --set lr.lr_warmup_iters=2 --set lr.lr_decay_iters=5");
  ASSERT_EQ(samples.code, 0) << samples.out;
  ASSERT_EQ(iters.code, 0) << iters.out;
  EXPECT_EQ(printed_rates(samples.out).size(), 6u) << samples.out;
  EXPECT_EQ(printed_rates(samples.out), printed_rates(iters.out));

  dtk_test::expect_one_line_error(dtk_test::run_dtk(plain + " --set lr.lr_warmup_samples=24"),
                                  "config: lr.lr_warmup_samples (24) is not a whole number of global batches of 16");
  dtk_test::expect_one_line_error(
      dtk_test::run_dtk(std::string(" train --config ") + DTK_SOURCE_DIR + "/configs/gpt-tiny.pbtxt --dataset synthetic "
                        "--set lr.lr_decay_samples=100"),
      "config: lr.lr_decay_samples and lr.lr_warmup_samples are for sample-based training");
  const MegatronMapping m = dtk::core::map_megatron_args(
      dtk::core::split_megatron_args("--train-iters 10 --lr-decay-samples 100 --lr-warmup-samples 0"));
  ASSERT_EQ(m.refused.size(), 1u);  // --lr-warmup-samples 0 is Megatron's default, fine with iterations
  EXPECT_EQ(m.refused[0].rfind("--lr-decay-samples 100: with --train-iters the schedule is iteration-based", 0), 0u)
      << m.refused[0];
}

// Megatron-DeepSpeed's token counts through --megatron_args: --lr-warmup-tokens and
// --lr-decay-tokens give the rates its scheduler gives (expected values: Megatron-DeepSpeed's own
// optimizer_param_scheduler.py driven by its loop, 64 tokens per iteration, the rate logged after
// each step); --train-tokens 560 ends the run after iteration 9 (576 tokens) of 12, with the final
// validation there; a run stopped at iteration 4 and resumed gives the same losses and rates.
TEST(MegatronArgs, TokenCountedScheduleAndEnd) {
  const std::string dir = dtk_test::fresh_dir(::testing::TempDir(), "token_schedule_ckpt");
  const std::string run =
      std::string(
          "train --threads 1 --dataset synthetic --megatron_args '--num-layers 2 --hidden-size 64 "
          "--num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --hidden-dropout 0 "
          "--attention-dropout 0 --micro-batch-size 2 --global-batch-size 4 --train-iters 12 --lr 1e-3 "
          "--min-lr 1e-5 --lr-decay-style cosine --lr-warmup-tokens 128 --lr-decay-tokens 512 "
          "--train-tokens 560 --log-interval 1 --eval-iters 1 --eval-interval 100' "
          "--set tokenizer.vocab_file=") +
      DTK_VOCAB_DIR + "/encoder.json --set tokenizer.merge_file=" + DTK_VOCAB_DIR + "/vocab.bpe";
  const dtk_test::Result whole = dtk_test::run_dtk(run);
  ASSERT_EQ(whole.code, 0) << whole.out;
  const std::vector<std::string> want = {"0.000000E+00", "5.000000E-04", "1.000000E-03", "9.336826E-04", "7.525000E-04",
                                         "5.050000E-04", "2.575000E-04", "7.631743E-05", "1.000000E-05"};
  EXPECT_EQ(printed_rates(whole.out), want) << whole.out;
  EXPECT_NE(whole.out.find("train.train_tokens 560 ends it after iteration 9 (576 tokens)"), std::string::npos)
      << whole.out;
  EXPECT_NE(whole.out.find("iteration 9 on validation set"), std::string::npos) << whole.out;
  const auto losses = dtk_test::printed_losses(whole.out);
  ASSERT_EQ(losses.size(), 9u) << whole.out;

  const dtk_test::Result first =
      dtk_test::run_dtk(run + " --set checkpoint.save=" + dir + " --set train.exit_interval=4");
  ASSERT_EQ(first.code, 0) << first.out;
  EXPECT_NE(first.out.find("stopped after iteration 4 of 9 (train.train_tokens 560)"), std::string::npos) << first.out;
  const dtk_test::Result inspect = dtk_test::run_dtk("checkpoint inspect " + dir);
  EXPECT_NE(inspect.out.find("counted in tokens: warm-up 128, decay 512; 192 tokens at the last step"),
            std::string::npos)
      << inspect.out;
  const dtk_test::Result rest = dtk_test::run_dtk(run + " --set checkpoint.load=" + dir);
  ASSERT_EQ(rest.code, 0) << rest.out;
  const auto resumed = dtk_test::printed_losses(rest.out);
  ASSERT_EQ(resumed.size(), 5u) << rest.out;
  for (const auto& [it, loss] : resumed) EXPECT_EQ(loss, losses.at(it)) << "resumed iteration " << it;
  EXPECT_EQ(printed_rates(rest.out), std::vector<std::string>(want.begin() + 4, want.end())) << rest.out;
  std::filesystem::remove_all(dir);

  // One warm-up length; the token counts with a schedule that counts only steps.
  dtk_test::expect_one_line_error(dtk_test::run_dtk(run + " --set lr.lr_warmup_iters=2"),
                                  "config: lr.lr_warmup_tokens replaces the step warm-up");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(run + " --set lr.lr_decay_style=WSD --set lr.lr_wsd_decay_iters=2"),
                                  "config: lr.lr_warmup_tokens and lr.lr_decay_tokens are Megatron-DeepSpeed's");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(run + " --set lr.lr_warmup_tokens=600"),
                                  "config: lr.lr_warmup_tokens (600) must be smaller than lr.lr_decay_tokens (512)");
  dtk_test::expect_one_line_error(dtk_test::run_dtk(run + " --set train.train_tokens=-1"),
                                  "config: train.train_tokens must be >= 0");
}

// Per-split data paths and --data-path prefixes without weights reach gpt_indexed as Megatron
// reads them (Megatron-core: a blend weighted by the datasets' sizes; each split its own paths).
TEST(MegatronArgs, PerSplitAndUnweightedDataPaths) {
  auto has = [](const dtk::core::MegatronMapping& m, const std::string& set) {
    return std::find(m.sets.begin(), m.sets.end(), set) != m.sets.end();
  };
  auto per = dtk::core::map_megatron_args(dtk::core::split_megatron_args(
      "--train-data-path 0.4 d/a 0.6 d/b --valid-data-path d/b --test-data-path d/a d/b"));
  EXPECT_TRUE(per.refused.empty());
  EXPECT_EQ(per.dataset, "gpt_indexed");
  EXPECT_TRUE(has(per, "dataset.train_data_path=0.4 d/a 0.6 d/b"));
  EXPECT_TRUE(has(per, "dataset.valid_data_path=d/b"));
  EXPECT_TRUE(has(per, "dataset.test_data_path=d/a d/b"));
  auto sizes = dtk::core::map_megatron_args(dtk::core::split_megatron_args("--data-path d/a d/b"));
  EXPECT_TRUE(sizes.refused.empty());
  EXPECT_TRUE(has(sizes, "dataset.data_path=d/a d/b"));
  // The same lists from files, as Megatron reads --data-args-path and --per-split-data-args-path.
  const std::string dir = std::string(DTK_TEST_TMP) + "/megatron-data-args";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/blend.txt") << "0.3 d/a\n  0.7 d/b\n";
  std::ofstream(dir + "/splits.json") << R"({"train": ["0.4", "d/a", 0.6, "d/b"], "valid": "d/b", "test": null})";
  auto file = dtk::core::map_megatron_args(dtk::core::split_megatron_args("--data-args-path " + dir + "/blend.txt"));
  EXPECT_TRUE(file.refused.empty());
  EXPECT_TRUE(has(file, "dataset.data_path=0.3 d/a 0.7 d/b"));
  auto json = dtk::core::map_megatron_args(
      dtk::core::split_megatron_args("--per-split-data-args-path " + dir + "/splits.json"));
  EXPECT_TRUE(json.refused.empty());
  EXPECT_EQ(json.dataset, "gpt_indexed");
  EXPECT_TRUE(has(json, "dataset.train_data_path=0.4 d/a 0.6 d/b"));
  EXPECT_TRUE(has(json, "dataset.valid_data_path=d/b"));
  std::ofstream(dir + "/bad.json") << R"({"train": "d/a"})";
  auto bad = dtk::core::map_megatron_args(dtk::core::split_megatron_args("--per-split-data-args-path " + dir + "/bad.json"));
  ASSERT_EQ(bad.refused.size(), 1u);
  EXPECT_NE(bad.refused[0].find("has no \"valid\""), std::string::npos) << bad.refused[0];
  // A path and its file form together: refused, as Megatron asserts.
  auto both = dtk::core::map_megatron_args(
      dtk::core::split_megatron_args("--data-path d/a --data-args-path " + dir + "/blend.txt"));
  ASSERT_EQ(both.refused.size(), 1u);
  EXPECT_NE(both.refused[0].find("--data-path and --data-args-path: give one of them"), std::string::npos)
      << both.refused[0];
  auto splits = dtk::core::map_megatron_args(dtk::core::split_megatron_args(
      "--per-split-data-args-path " + dir + "/splits.json --valid-data-path d/b"));
  ASSERT_EQ(splits.refused.size(), 1u);
  EXPECT_NE(splits.refused[0].find("give one form of the split paths"), std::string::npos) << splits.refused[0];
}

// Megatron's TikTokenizer (its Nemotron recipes): the tiktoken flags go to the tokenizer with that
// type, are ignored beside another (as Megatron ignores them), and name the index caches as
// Megatron-core's description does (keyword arguments in build_tokenizer's order, str()'d).
TEST(MegatronArgs, TikTokenizerFlagsGoWithItsType) {
  const std::string tok = "--tokenizer-type TikTokenizer --tokenizer-model v/multiMix.vocab.json ";
  MegatronMapping m = map_line(tok +
                               "--tiktoken-pattern v1 --tiktoken_num_special_tokens=100 --vocab-size 50000 "
                               "--tokenizer-special-tokens <unk> <s> </s> <mask> <pad> <cls> <sep> <eot>");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m), {{"tokenizer.type", "TikTokenizer"},
                               {"tokenizer.model_file", "v/multiMix.vocab.json"},
                               {"tokenizer.tiktoken_pattern", "v1"},
                               {"tokenizer.tiktoken_num_special_tokens", "100"},
                               {"tokenizer.null_vocab_size", "50000"},
                               {"tokenizer.special_tokens", "<unk> <s> </s> <mask> <pad> <cls> <sep> <eot>"}});
  auto has = [](const MegatronMapping& mm, const std::string& set) {
    return std::find(mm.sets.begin(), mm.sets.end(), set) != mm.sets.end();
  };
  const std::string description =
      "dataset.megatron_tokenizer={\"class\": \"megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText\", "
      "\"tokenizer_path\": \"v/multiMix.vocab.json\", \"chat_template\": \"None\", ";
  EXPECT_TRUE(
      has(map_line("--data-path x " + tok + "--tiktoken-pattern v2"),
          description + "\"pattern\": \"v2\", \"num_special_tokens\": \"1000\", \"special_tokens\": \"None\"}"));
  EXPECT_TRUE(has(map_line("--data-path x " + tok +
                           "--vocab-size 131072 --tokenizer-special-tokens <unk> <s> </s> <mask> "
                           "<pad> <cls> <sep> \"it's\""),
                  description + "\"vocab_size\": \"131072\", \"num_special_tokens\": \"1000\", \"special_tokens\": "
                                "\"['<unk>', '<s>', '</s>', '<mask>', '<pad>', '<cls>', '<sep>', \\\"it's\\\"]\"}"));
  // Beside another tokenizer: the two tiktoken flags ignored, the special tokens refused.
  m = map_line(
      "--tokenizer-type HuggingFaceTokenizer --tokenizer-model t --tiktoken-pattern v2 "
      "--tiktoken-num-special-tokens 10 --tokenizer-special-tokens <s>");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0],
            "--tokenizer-special-tokens <s>: DTK reads special tokens for --tokenizer-type TikTokenizer only");
  EXPECT_EQ(m.ignored,
            (std::vector<std::string>{
                "--tiktoken-pattern (Megatron reads it only with --tokenizer-type TikTokenizer)",
                "--tiktoken-num-special-tokens (Megatron reads it only with --tokenizer-type TikTokenizer)"}));
  for (const auto& s : m.sets) EXPECT_EQ(s.find("tiktoken"), std::string::npos) << s;
  // NullTokenizer takes no special tokens in Megatron either: ignored there. A token holding
  // whitespace cannot go through DTK's space-separated list, and 0 special ids Megatron asserts.
  m = map_line("--tokenizer-type NullTokenizer --vocab-size 100 --tokenizer-special-tokens <s>");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  EXPECT_EQ(
      m.ignored,
      (std::vector<std::string>{"--tokenizer-special-tokens (NullTokenizer takes no special tokens, as in Megatron)"}));
  m = map_line(
      tok +
      "--tokenizer-special-tokens <unk> <s> </s> <mask> <pad> <cls> <sep> '<|a b|>' --tiktoken-num-special-tokens 0");
  ASSERT_EQ(m.refused.size(), 2u);
  EXPECT_EQ(m.refused[0].rfind("--tiktoken-num-special-tokens 0: not a positive number", 0), 0u) << m.refused[0];
  EXPECT_NE(m.refused[1].find("the special token '<|a b|>' holds whitespace"), std::string::npos) << m.refused[1];
}

// The dataset's Megatron from the flags: legacy megatron/data when a flag only it takes is given
// (--data-impl, Domino's --llama-model), Megatron-core otherwise; Megatron's default split and
// Megatron-core's GPT2BPETokenizer description go with --data-path (both name its caches).
TEST(MegatronArgs, DataOrderFromTheFlags) {
  auto has = [](const dtk::core::MegatronMapping& m, const std::string& set) {
    return std::find(m.sets.begin(), m.sets.end(), set) != m.sets.end();
  };
  const std::string tok = "--tokenizer-type GPT2BPETokenizer --vocab-file v/gpt2-vocab.json --merge-file m.txt";
  auto core = dtk::core::map_megatron_args(dtk::core::split_megatron_args("--data-path d/x_text_document " + tok));
  EXPECT_TRUE(core.refused.empty());
  EXPECT_TRUE(has(core, "dataset.split=969, 30, 1"));
  EXPECT_FALSE(has(core, "dataset.order=megatron_legacy"));
  EXPECT_TRUE(has(core,
                  "dataset.megatron_tokenizer={\"class\": \"megatron.core.tokenizers.text.text_tokenizer."
                  "MegatronTokenizerText\", \"tokenizer_path\": \"GPT2BPETokenizer\", \"additional_special_tokens\": "
                  "\"[]\", \"vocab_file\": \"v/gpt2-vocab.json\", \"merges_file\": \"m.txt\", \"use_fast\": \"True\", "
                  "\"trust_remote_code\": \"False\", \"include_special_tokens\": \"True\", \"use_gigatoken\": \"False\"}"));
  auto legacy = dtk::core::map_megatron_args(
      dtk::core::split_megatron_args("--data-path d/x_text_document --split 949,50,1 --data-impl mmap " + tok));
  EXPECT_TRUE(legacy.refused.empty());
  EXPECT_TRUE(has(legacy, "dataset.order=megatron_legacy"));
  EXPECT_TRUE(has(legacy, "dataset.split=949,50,1"));
  EXPECT_FALSE(has(legacy, "dataset.split=969, 30, 1"));
  for (const auto& s : legacy.sets) EXPECT_EQ(s.find("dataset.megatron_tokenizer"), std::string::npos) << s;
  auto mock = dtk::core::map_megatron_args(dtk::core::split_megatron_args("--mock-data --data-impl mmap"));
  for (const auto& s : mock.sets) EXPECT_EQ(s.find("dataset.order"), std::string::npos) << s;
  auto llama = dtk::core::map_megatron_args(dtk::core::split_megatron_args(
      "--data-path x --tokenizer-type Llama2Tokenizer --tokenizer-model llama2/tokenizer.model"));
  EXPECT_TRUE(has(llama,
                  "dataset.megatron_tokenizer={\"class\": \"megatron.core.tokenizers.text.text_tokenizer."
                  "MegatronTokenizerText\", \"tokenizer_path\": \"llama2/tokenizer.model\", \"chat_template\": "
                  "\"None\", \"ignore_extra_whitespaces\": \"True\", \"legacy\": \"False\", \"special_tokens\": "
                  "\"None\"}"));
  auto null = dtk::core::map_megatron_args(
      dtk::core::split_megatron_args("--data-path x --tokenizer-type NullTokenizer --vocab-size 1000"));
  EXPECT_TRUE(has(null,
                  "dataset.megatron_tokenizer={\"class\": \"megatron.core.tokenizers.text.text_tokenizer."
                  "MegatronTokenizerText\", \"tokenizer_path\": null, \"vocab_size\": \"1000\", \"pad_id\": \"-1\"}"));
  auto lazy = dtk::core::map_megatron_args(dtk::core::split_megatron_args("--data-path x --data-impl lazy"));
  ASSERT_EQ(lazy.refused.size(), 1u);
  EXPECT_EQ(lazy.refused[0], "--data-impl lazy: DTK reads Megatron's mmap .bin/.idx files only");
}

// ---- Megatron's --step-batch-size-schedule -----------------------------------------------------

namespace {

// Megatron-LM's StepBatchsizeNumMicroBatchesCalculator and update_train_iters, transcribed: each
// iteration's batch is the last entry whose threshold (tokens // seq_length) the consumed samples
// reach; iterations run while consumed < train_samples.
std::vector<int64_t> megatron_step_batches(const std::vector<std::pair<int64_t, int64_t>>& tokens_and_batch,
                                           int64_t seq_length, int64_t train_samples) {
  std::vector<int64_t> out;
  for (int64_t consumed = 0; consumed < train_samples;) {
    int64_t batch = tokens_and_batch.front().second;
    for (const auto& [tokens, bs] : tokens_and_batch) {
      if (consumed >= tokens / seq_length)
        batch = bs;
      else
        break;
    }
    out.push_back(batch);
    consumed += batch;
  }
  return out;
}

dtk::config::RunConfig step_config(const std::string& schedule, int64_t seq_length, int64_t train_samples) {
  dtk::config::RunConfig cfg = dtk::core::default_config();
  cfg.mutable_train()->set_micro_batch_size(4);
  cfg.mutable_train()->set_global_batch_size(0);
  cfg.mutable_train()->set_seq_length(seq_length);
  cfg.mutable_train()->set_train_iters(0);
  cfg.mutable_train()->set_train_samples(train_samples);
  cfg.mutable_train()->set_step_batch_size_schedule(schedule);
  return cfg;
}

}  // namespace

TEST(StepBatchSizeSchedule, BatchPlanFollowsMegatronsCalculator) {
  dtk::core::Topology topo;
  topo.dp_size = 2, topo.dp_rank = 1, topo.world_size = 2, topo.world_rank = 1;
  struct Case {
    std::string schedule;
    std::vector<std::pair<int64_t, int64_t>> parsed;  // tokens, batch, sorted
    int64_t seq_length, train_samples;
  };
  for (const Case& c : std::vector<Case>{
           {"0:8 64:16 200:32", {{0, 8}, {64, 16}, {200, 32}}, 4, 300},  // thresholds 0, 16, 50 samples
           {"0:16", {{0, 16}}, 4, 100},                                  // one entry: 7 iterations, 112 samples
           {"0:8 1K:16", {{0, 8}, {1000, 16}}, 4, 40},                   // the run ends before the last step
           {"0:8, 100:32", {{0, 8}, {100, 32}}, 2, 120},                 // commas
           {"0:8 1.005K:16", {{0, 8}, {1004, 16}}, 4, 400},     // int(1.005 * 1000.0) = 1004: truncated as Megatron
           {"-0.5:8.9 1e2:16.2", {{0, 8}, {100, 16}}, 4, 200},  // int() truncates toward zero; e notation
           {"0:8 1K:12", {{0, 8}, {1000, 12}}, 4, 40},          // a last batch the run never reaches need not divide
           {"0.5K:24 0:8 1.2k:40", {{0, 8}, {500, 24}, {1200, 40}}, 10, 500},     // unsorted, fractions, k
           {"0:8 2.4B:16", {{0, 8}, {2'400'000'000, 16}}, 1'000'000'000, 64}}) {  // 2.4B // 1e9 = 2 samples
    dtk::config::RunConfig cfg = step_config(c.schedule, c.seq_length, c.train_samples);
    dtk::core::validate_config(cfg);
    const dtk::core::BatchPlan plan(cfg, topo);
    expect_iteration_batches(plan, megatron_step_batches(c.parsed, c.seq_length, c.train_samples), c.schedule);
    EXPECT_TRUE(plan.steps_batch());
    EXPECT_EQ(plan.global_batch_size(), 8) << "validation's batch: micro-batch x data-parallel size";
  }
  const dtk::core::BatchPlan plan(step_config("0:8 64:16 200:32", 4, 300), topo);
  EXPECT_EQ(plan.describe_batch_steps(), "8 from iteration 1, 16 from iteration 3, 32 from iteration 6");
}

TEST(StepBatchSizeSchedule, BadSchedulesAreOneLine) {
  const auto refused = [](const dtk::config::RunConfig& cfg, const std::string& want) {
    try {
      dtk::core::validate_config(cfg);
      dtk::core::Topology topo;
      dtk::core::BatchPlan plan(cfg, topo);
      ADD_FAILURE() << "accepted: " << cfg.train().step_batch_size_schedule();
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what() << "\nwanted: " << want;
    }
  };
  refused(step_config("0:8 16", 4, 100), "train.step_batch_size_schedule entry '16' is not THRESHOLD:BATCH");
  refused(step_config("4:8 100:16", 4, 100),
          "the first threshold must be 0, got '4:8' (sample 1 at 4 tokens a sample)");
  refused(step_config("0:8 2:16", 4, 100), "'0:8' and '2:16' fall on the same sample (0; thresholds are tokens");
  refused(step_config("0:0", 4, 100), "entry '0:0': the batch must be positive");
  refused(step_config("0:8 x:16", 4, 100), "entry 'x:16': 'x' is not a number");
  refused(step_config("0:8 -4:16", 4, 100), "entry '-4:16': a threshold or batch must be >= 0");  // -0.5 is 0
  refused(step_config("0:32 100:8", 2, 120),
          "entry '100:8': global batch 8 (from iteration 3) is smaller than the 32 before it (Megatron asserts");
  refused(step_config("0:8 0x10:16", 4, 100), "entry '0x10:16': '0x10' is not a number");
  auto warmup_iters = step_config("0:8", 4, 100);
  warmup_iters.mutable_lr()->set_lr_warmup_iters(10);
  refused(warmup_iters,
          "config: lr.lr_warmup_iters 10 counts iterations, which have no one batch under "
          "train.step_batch_size_schedule: give lr.lr_warmup_samples or lr.lr_warmup_fraction");
  auto bench = step_config("0:8", 4, 100);
  bench.mutable_logging()->set_bench_out("bench.json");
  refused(bench,
          "config: logging.bench_out measures iterations of one size; train.step_batch_size_schedule "
          "changes their global batch");
  refused(step_config("0:8 40:10", 4, 100),
          "entry '40:10': global batch 10 (from iteration 3) is not divisible by micro_batch_size x "
          "data-parallel size = 4");
  auto with_gbs = step_config("0:8", 4, 100);
  with_gbs.mutable_train()->set_global_batch_size(8);
  refused(with_gbs, "train.step_batch_size_schedule and train.global_batch_size cannot both be set");
  auto with_iters = step_config("0:8", 4, 0);
  with_iters.mutable_train()->set_train_iters(10);
  refused(with_iters, "train.step_batch_size_schedule needs sample-based training (train.train_samples");
  auto with_ramp = step_config("0:8", 4, 100);
  with_ramp.mutable_train()->set_rampup_batch_size("4 4 20");
  refused(with_ramp, "train.step_batch_size_schedule and train.rampup_batch_size cannot both be set");
}

// Megatron's calculator checks the batch it reaches, so a run resumed on more data-parallel ranks
// trains past an early batch they do not divide. A run that may resume (checkpoint.load,
// train.consumed_samples) is checked from where it resumes; any other from iteration 1.
TEST(StepBatchSizeSchedule, AResumeChecksTheBatchesFromWhereItResumes) {
  dtk::core::Topology topo;  // one rank: micro-batches of 4, so 6 does not divide and 8 does
  dtk::config::RunConfig cfg = step_config("0:6 40:8", 4, 100);  // 6, 6, then 8 (from sample 10)
  dtk::core::validate_config(cfg);
  const std::string refused = "config: train.step_batch_size_schedule entry '0:6': global batch 6 (from iteration ";
  try {
    dtk::core::BatchPlan plan(cfg, topo);
    ADD_FAILURE() << "a run from iteration 1 accepted a batch of 6";
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()), refused + "1) is not divisible by micro_batch_size x data-parallel size = 4");
  }
  cfg.mutable_checkpoint()->set_load("some-checkpoint");
  const dtk::core::BatchPlan plan(cfg, topo);
  EXPECT_EQ(plan.describe_batch_steps(), "6 from iteration 1, 8 from iteration 3");
  for (const int64_t first : {1, 2}) {
    try {
      plan.check_batches_from(first);
      ADD_FAILURE() << "a run from iteration " << first << " accepted a batch of 6";
    } catch (const std::exception& e) {
      EXPECT_EQ(std::string(e.what()),
                refused + std::to_string(first) + ") is not divisible by micro_batch_size x data-parallel size = 4");
    }
  }
  EXPECT_NO_THROW(plan.check_batches_from(3));
  EXPECT_NO_THROW(plan.check_batches_from(plan.train_iters()));
  cfg.mutable_checkpoint()->clear_load();
  cfg.mutable_train()->set_consumed_samples(12);
  EXPECT_NO_THROW(dtk::core::BatchPlan(cfg, topo).check_batches_from(3));
}

TEST(StepBatchSizeSchedule, MegatronFlagMapsAndItsConflictsAreRefused) {
  MegatronMapping m = map_line("--train-samples 1000 --step-batch-size-schedule '0:16 2.4B:320 4.8B:624'");
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  expect_fields(config_of(m),
                {{"train.step_batch_size_schedule", "0:16 2.4B:320 4.8B:624"}, {"train.train_samples", "1000"}});
  // Unquoted in a flag file: its entries as words.
  EXPECT_EQ(config_of(map_line("--train-samples 1000 --step-batch-size-schedule 0:16 2.4B:320"))
                .train()
                .step_batch_size_schedule(),
            "0:16 2.4B:320");
  // Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh as it is now: Megatron itself stops
  // on its --global-batch-size, and its --train-iters would size the data by micro-batches.
  m = map_file("megatron_gpt3_175b_step.args");
  ASSERT_EQ(m.refused.size(), 2u);
  EXPECT_EQ(
      m.refused[0].rfind("--global-batch-size 1536: not with --step-batch-size-schedule (Megatron refuses both", 0), 0u)
      << m.refused[0];
  EXPECT_EQ(m.refused[1].rfind("--step-batch-size-schedule 0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536: needs "
                               "sample-based training",
                               0),
            0u)
      << m.refused[1];
  m = map_line("--train-samples 100 --rampup-batch-size 4 4 20 --step-batch-size-schedule 0:8");
  ASSERT_EQ(m.refused.size(), 1u);
  EXPECT_EQ(m.refused[0],
            "--rampup-batch-size 4 4 20: not with --step-batch-size-schedule (Megatron's schedule "
            "replaces the ramp-up)");
}

// End to end: a schedule that gives the batches of a ramp-up (8, 8, then 16: "0:8 1K:16" at 64
// tokens a sample puts the step at sample 15) trains the same losses and learning rates as the
// ramp-up; data parallel 2 equals one process; a resume after the first step equals the
// uninterrupted run; the start line shows where the batch changes.
TEST(StepBatchSizeSchedule, TrainsTheRampUpItEqualsAndResumesExactly) {
  const std::string dir = std::string(DTK_TEST_TMP) + "/step-schedule-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  const std::string base = std::string(" train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 --set model.hidden_dropout=0 "
                           "--set model.attention_dropout=0 --set logging.log_interval=1 --set eval.eval_iters=1 "
                           "--set train.micro_batch_size=4 --set lr.lr_decay_style=cosine --set lr.lr=1e-3 "
                           "--set lr.lr_warmup_iters=0 --set lr.lr_warmup_samples=32 --set lr.lr_decay_samples=96 "
                           "--set train.train_iters=0 --set train.train_samples=96";
  const dtk_test::Result ramp =
      dtk_test::run_dtk(base + " --set train.global_batch_size=16 '--set=train.rampup_batch_size=8 8 16'");
  const std::string step = base + " --set train.global_batch_size=0 '--set=train.step_batch_size_schedule=0:8 1K:16'";
  const dtk_test::Result one = dtk_test::run_dtk(step);
  ASSERT_EQ(ramp.code, 0) << ramp.out;
  ASSERT_EQ(one.code, 0) << one.out;
  EXPECT_NE(one.out.find("training: 7 iterations, global batch 8 from iteration 1, 16 from iteration 3 "
                         "(train.step_batch_size_schedule), micro-batches of 4, validation batch 4, seq 64"),
            std::string::npos)
      << one.out;
  std::vector<std::string> batches;
  std::regex re("global batch size: +([0-9]+) \\|");
  for (std::sregex_iterator it(one.out.begin(), one.out.end(), re), e; it != e; ++it) batches.push_back((*it)[1]);
  EXPECT_EQ(batches, (std::vector<std::string>{"8", "8", "16", "16", "16", "16", "16"})) << one.out;
  const auto a = losses(ramp.out), b = losses(one.out);
  ASSERT_EQ(a.size(), 7u) << ramp.out;
  ASSERT_EQ(b.size(), 7u) << one.out;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(b[i], a[i]) << "iteration " << i + 1;
  EXPECT_EQ(printed_rates(one.out), printed_rates(ramp.out));

  const dtk_test::Result dp2 = dtk_test::run_dtk(" launch --nproc_per_node 2" + step);
  ASSERT_EQ(dp2.code, 0) << dp2.out;
  const auto c = losses(dp2.out);
  ASSERT_EQ(c.size(), 7u) << dp2.out;
  for (size_t i = 0; i < b.size(); ++i) EXPECT_NEAR(c[i], b[i], 1e-5 * std::abs(b[i])) << "DP2 iteration " << i + 1;

  // As Megatron, a checkpoint before the first iteration of another micro-batch count (and the
  // final one): the first run of the two below stops there.
  const dtk_test::Result saves = dtk_test::run_dtk(step + " --set checkpoint.save=" + dir + "-all");
  ASSERT_EQ(saves.code, 0) << saves.out;
  EXPECT_NE(saves.out.find(" saved checkpoint at iteration 2 to "), std::string::npos) << saves.out;
  EXPECT_NE(saves.out.find(" saved checkpoint at iteration 7 to "), std::string::npos) << saves.out;
  EXPECT_EQ(saves.out.find(" saved checkpoint at iteration 3 to "), std::string::npos) << saves.out;
  std::filesystem::remove_all(dir + "-all");
  const dtk_test::Result first =
      dtk_test::run_dtk(step + " --set checkpoint.save=" + dir + " --set train.exit_interval=2");
  ASSERT_EQ(first.code, 0) << first.out;
  const dtk_test::Result rest = dtk_test::run_dtk(step + " --set checkpoint.load=" + dir);
  ASSERT_EQ(rest.code, 0) << rest.out;
  const auto d = losses(rest.out);
  ASSERT_EQ(d.size(), 5u) << rest.out;
  for (size_t i = 0; i < d.size(); ++i) EXPECT_EQ(d[i], b[i + 2]) << "resumed iteration " << i + 3;
  // Four data-parallel ranks (16 samples a step) do not divide the first iterations' 8, and do
  // divide the rest: resumed after those, they train the same losses; from the start, refused.
  const dtk_test::Result dp4 = dtk_test::run_dtk(" launch --nproc_per_node 4" + step + " --set checkpoint.load=" + dir);
  ASSERT_EQ(dp4.code, 0) << dp4.out;
  const auto e = losses(dp4.out);
  ASSERT_EQ(e.size(), 5u) << dp4.out;
  for (size_t i = 0; i < e.size(); ++i)
    EXPECT_NEAR(e[i], b[i + 2], 1e-5 * std::abs(b[i + 2])) << "resumed on DP 4, iteration " << i + 3;
  const dtk_test::Result fresh_dp4 = dtk_test::run_dtk(" launch --nproc_per_node 4" + step);
  EXPECT_NE(fresh_dp4.code, 0) << fresh_dp4.out;
  EXPECT_NE(fresh_dp4.out.find("config: train.step_batch_size_schedule entry '0:8': global batch 8 (from iteration "
                               "1) is not divisible by micro_batch_size x data-parallel size = 16"),
            std::string::npos)
      << fresh_dp4.out;
  std::filesystem::remove_all(dir);
}

// Companions of flags DTK maps or ignores, which current Megatron-LM launch lines pass with them
// (--wandb-entity with --wandb-project, --manual-gc-interval with --manual-gc, torch_dist's speed
// switches with --ckpt-format torch_dist): accepted, each named as ignored with its reason.
// --async-save and --log-progress map (checkpoint.async_save, logging.log_progress); --cuda-graph-impl (which replaced
// --enable-cuda-graph) maps to train.cuda_graphs.
TEST(MegatronArgs, CompanionFlagsOfCurrentLaunchLinesAreAccepted) {
  const std::vector<std::string> flags = {"--wandb-entity team",
                                          "--manual-gc-interval 100",
                                          "--no-manual-gc-eval",
                                          "--logging-level 20",
                                          "--dist-ckpt-strictness log_all",
                                          "--ckpt-fully-parallel-save",
                                          "--no-ckpt-fully-parallel-save",
                                          "--ckpt-fully-parallel-load",
                                          "--ckpt-assume-constant-structure",
                                          "--use-persistent-ckpt-worker",
                                          "--async-strategy mcore",
                                          "--async-ckpt-cpu-priority 10",
                                          "--async-ckpt-io-priority 3",
                                          "--async-ckpt-use-cpu-shm",
                                          "--cross-entropy-fusion-impl te"};
  std::string line;
  for (const auto& f : flags) line += f + " ";
  const MegatronMapping m = map_line(line);
  EXPECT_TRUE(m.refused.empty()) << m.refused.front();
  ASSERT_EQ(m.ignored.size(), flags.size());
  for (size_t i = 0; i < flags.size(); ++i)
    EXPECT_EQ(m.ignored[i].rfind(flags[i].substr(0, flags[i].find(' ')) + " (", 0), 0u) << m.ignored[i];

  // --async-save (Megatron's with torch_dist) maps: DTK writes its torch format in the background.
  EXPECT_TRUE(config_of(map_line("--async-save --ckpt-format torch_dist")).checkpoint().async_save());
  EXPECT_FALSE(config_of(map_line("--ckpt-format torch_dist")).checkpoint().async_save());
  EXPECT_TRUE(config_of(map_line("--log-progress")).logging().log_progress());

  EXPECT_EQ(config_of(map_line("--cuda-graph-impl none")).train().cuda_graphs(), false);
  EXPECT_EQ(config_of(map_line("--cuda-graph-impl local")).train().cuda_graphs(), true);
  EXPECT_EQ(config_of(map_line("--cuda-graph-impl full_iteration")).train().cuda_graphs(), true);
  const MegatronMapping te = map_line("--cuda-graph-impl transformer_engine");
  ASSERT_EQ(te.refused.size(), 1u);
  EXPECT_EQ(te.refused[0],
            "--cuda-graph-impl transformer_engine: Transformer Engine's graphs are not in DTK's "
            "layers; use local");
}
