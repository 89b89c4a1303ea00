// Megatron-LM / DeepSpeed-Domino flags -> DTK config (dtk/core/config/megatron_args.hpp).
#include "dtk/core/config/megatron_args.hpp"
#include "dtk/core/config/deepspeed_config.hpp"
#include "dtk/core/device/cuda_support.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>

#include <dtk/pipeline_split.hpp>
#include <dtk/recompute_modules.hpp>
#include <nlohmann/json.hpp>

#include "dtk/core/config/config.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

using host::HostError;

namespace {

// kSet: the flag's value goes to `target`. kSwitch: a flag without value; `target` holds the
// `path=value` assignments (';'-separated) it makes. kIgnore: accepted (its value consumed), no
// effect here, `note` says why. kRefuse: DTK cannot run it, `note` says why. kCustom: decided in
// custom() by value; `target` and `note` describe it for the docs.
enum class Kind { kSet, kSwitch, kIgnore, kRefuse, kCustom };

struct Rule {
  const char* flag;
  int nargs;  // values after the flag; -1: one or more (up to the next --flag)
  Kind kind;
  const char* target;
  const char* note;
};

// The fp8 settings Megatron reads only with --fp8-format.
constexpr const char* kOnlyWithFp8 = "Megatron reads it only with --fp8-format, which DTK refuses";
constexpr const char* kDtkFusion =
    "the layers run LibTorch ops instead of DTK's kernel on a GPU (no effect on the CPU); several such flags add up";
constexpr const char* kDtkAttention =
    "DTK picks its attention kernel: LibTorch's fused attention without attention dropout, DTK's with it on a GPU "
    "(model.unfused_kernels=attention leaves DTK's out)";
constexpr const char* kLlama = "the llama model (with --position-embedding-type rope --normalization RMSNorm --swiglu)";

// The order is the docs table's.
const Rule kRules[] = {
    // Model
    {"--num-layers", 1, Kind::kSet, "model.num_layers", ""},
    {"--hidden-size", 1, Kind::kSet, "model.hidden_size", ""},
    {"--num-attention-heads", 1, Kind::kSet, "model.num_attention_heads", ""},
    {"--ffn-hidden-size", 1, Kind::kSet, "model.ffn_hidden_size", ""},
    {"--seq-length", 1, Kind::kSet, "train.seq_length", ""},
    {"--max-position-embeddings", 1, Kind::kSet, "model.max_position_embeddings", ""},
    {"--make-vocab-size-divisible-by", 1, Kind::kSet, "model.make_vocab_size_divisible_by", ""},
    {"--init-method-std", 1, Kind::kSet, "model.init_method_std", ""},
    {"--hidden-dropout", 1, Kind::kSet, "model.hidden_dropout", ""},
    {"--attention-dropout", 1, Kind::kSet, "model.attention_dropout", ""},
    {"--layernorm-epsilon", 1, Kind::kSet, "model.layernorm_epsilon", ""},
    {"--norm-epsilon", 1, Kind::kSet, "model.layernorm_epsilon", "Megatron's newer name"},
    {"--openai-gelu", 0, Kind::kSwitch, "model.openai_gelu=true", ""},
    {"--untie-embeddings-and-output-weights", 0, Kind::kSwitch, "model.untie_embeddings_and_output_weights=true", ""},
    {"--position-embedding-type", 1, Kind::kCustom, "",
     "learned_absolute: the gpt model's learned positions; rope: the llama model, which needs --normalization RMSNorm "
     "and --swiglu with it (Megatron's own defaults where llama's differ: dropout 0.1, tied embeddings, biases; "
     "--max-position-embeddings ignored, rotary positions have no table)"},
    {"--normalization", 1, Kind::kCustom, "",
     "LayerNorm: the gpt model's; RMSNorm: the llama model (see rope); Megatron-DeepSpeed's layernorm, rmsnorm too"},
    {"--swiglu", 0, Kind::kCustom, "", "the llama model (see rope)"},
    {"--disable-bias-linear", 0, Kind::kCustom, "model.add_bias_linear=false", kLlama},
    {"--group-query-attention", 0, Kind::kCustom, "model.num_query_groups",
     "grouped-query attention (llama): --num-query-groups groups, Megatron's default 1 (multi-query)"},
    {"--num-query-groups", 1, Kind::kCustom, "model.num_query_groups",
     "with --group-query-attention (Megatron reads it only then, default 1); without it: ignored, multi-head "
     "attention"},
    {"--num-key-value-heads", 1, Kind::kCustom, "model.num_query_groups",
     "Megatron-DeepSpeed's grouped-query attention (llama); equal to --num-attention-heads: multi-head, as without it"},
    {"--rotary-position-embeddings-theta", 1, Kind::kSet, "model.rotary_base", "Megatron-DeepSpeed's --rotary-base"},
    {"--use-rotary-position-embeddings", 0, Kind::kCustom, "",
     "older Megatron's (and Megatron-DeepSpeed's) --position-embedding-type rope: the llama model (see rope)"},
    {"--no-position-embedding", 0, Kind::kCustom, "",
     "no learned position table: with rotary positions (rope), the llama model's own; without them refused (DTK "
     "has no model without positions)"},
    {"--llama-model", 0, Kind::kCustom, "",
     "DeepSpeed-Domino's switch for its Llama model: the llama model, with the rope, RMSNorm and SwiGLU flags its "
     "scripts give; with --data-path also dataset.order=megatron_legacy (Domino's megatron/data order and caches)"},
    {"--rotary-percent", 1, Kind::kSet, "model.rotary_percent", kLlama},
    {"--rotary-base", 1, Kind::kSet, "model.rotary_base", kLlama},
    {"--use-rope-scaling", 0, Kind::kCustom, "model.rope_scaling=llama3",
     "Llama 3.1's rotary frequency scaling (llama), by --rope-scaling-factor (Megatron's default 8)"},
    {"--rope-scaling-factor", 1, Kind::kCustom, "model.rope_scaling_factor",
     "with --use-rope-scaling (Megatron reads it only then); without it: ignored"},
    {"--no-rope-fusion", 0, Kind::kCustom, "model.unfused_kernels=rotary", kDtkFusion},
    {"--kv-channels", 1, Kind::kCustom, "model.kv_channels",
     "the head dimension: nothing to set when it is --hidden-size / --num-attention-heads; another value: the llama "
     "model's heads of that width (Qwen3's)"},
    {"--qk-layernorm", 0, Kind::kSwitch, "model.qk_layernorm=true",
     "the llama model's per-head query and key RMSNorm before rotary, Qwen3's"},
    {"--add-qkv-bias", 0, Kind::kSwitch, "model.add_qkv_bias=true",
     "the llama model's biases on the query/key/value projection alone, Qwen2's"},
    {"--window-size", 1, Kind::kCustom, "model.window_size",
     "sliding-window attention W,0 (gpt and llama): each token sees itself and the W tokens before it"},
    {"--window-attn-skip-freq", 1, Kind::kCustom, "model.window_attn_skip_freq",
     "with --window-size: every N-th layer (counting from 1), or the 0s of a 0/1 list per layer, keeps full "
     "attention"},
    // Mixture of experts
    {"--num-experts", -1, Kind::kCustom, "model.num_experts",
     "MoE layers in gpt and llama: Megatron-LM's (every layer, top-k routing, dropless unless "
     "--moe-expert-capacity-factor); with --deepspeed or Megatron-DeepSpeed's MoE flags below, DeepSpeed's "
     "(model.moe_gate=deepspeed, on every --expert-interval-th layer, top-k with capacity; a list of one "
     "count per MoE layer is DeepSpeed's pyramid MoE, model.moe_layer_num_experts)"},
    {"--moe-router-topk", 1, Kind::kSet, "model.moe_router_topk", ""},
    {"--moe-ffn-hidden-size", 1, Kind::kSet, "model.moe_ffn_hidden_size", ""},
    {"--moe-layer-freq", 1, Kind::kCustom, "model.moe_layer_freq",
     "an integer (every N-th layer from the first) or Megatron's Python list of 0/1 per layer, e.g. "
     "([0]*3+[1]*11)"},
    {"--moe-router-pre-softmax", 0, Kind::kSwitch, "model.moe_router_pre_softmax=true", ""},
    {"--moe-router-topk-scaling-factor", 1, Kind::kSet, "model.moe_router_topk_scaling_factor", ""},
    {"--moe-router-dtype", 1, Kind::kCustom, "model.moe_router_fp32",
     "fp32: the router's product and softmax in fp32; another value refused"},
    {"--moe-aux-loss-coeff", -1, Kind::kCustom, "model.moe_aux_loss_coeff",
     "per MoE layer, as Megatron; one per load-balancing type, in their order (a comma-separated list)"},
    {"--moe-z-loss-coeff", 1, Kind::kSet, "model.moe_z_loss_coeff", ""},
    {"--moe-router-load-balancing-type", -1, Kind::kCustom, "model.moe_router_load_balancing_type",
     "aux_loss (Megatron's default), seq_aux_loss and global_aux_loss, or a list of them (their losses added, a "
     "comma-separated list): weighed by --moe-aux-loss-coeff; none: no load-balancing loss (the coefficient "
     "ignored, as Megatron); sinkhorn (S-BASE, with --moe-aux-loss-coeff 0, Megatron's default, as it asserts) or "
     "quantile_balancing (the coefficient ignored, as Megatron) alone"},
    {"--moe-router-score-function", 1, Kind::kCustom, "model.moe_router_score_function",
     "softmax (Megatron's default), sigmoid or sqrtsoftplus"},
    {"--expert-tensor-parallel-size", 1, Kind::kIgnore, "",
     "DTK splits every expert over the tensor-parallel group as the dense MLP; another split is the same "
     "arithmetic"},
    {"--moe-layer-recompute", 0, Kind::kCustom, "model.recompute_modules",
     "selective recomputation with moe among the modules (core_attn and moe unless --recompute-modules names "
     "others), as Megatron-core sets it; with --recompute-granularity full refused, as Megatron"},
    {"--moe-per-layer-logging", 0, Kind::kIgnore, "",
     "DTK logs the MoE losses averaged over the layers (Megatron's default)"},
    {"--moe-shared-expert-intermediate-size", 1, Kind::kSet, "model.moe_shared_expert_intermediate_size",
     "a shared expert (the model's MLP of this inner size) on every token"},
    {"--moe-shared-expert-overlap", 0, Kind::kSwitch, "model.moe_shared_expert_overlap=true",
     "the shared expert's forward runs while the alltoall dispatcher's rows travel to the experts (Megatron's "
     "second CUDA stream); the same arithmetic; with the allgather dispatcher refused (Megatron raises); ignored "
     "without --moe-shared-expert-intermediate-size"},
    {"--moe-shared-expert-gate", 0, Kind::kSwitch, "model.moe_shared_expert_gate=true", ""},
    {"--moe-router-enable-expert-bias", 0, Kind::kSwitch, "model.moe_router_enable_expert_bias=true",
     "auxiliary-loss-free balancing (with sigmoid scores)"},
    {"--moe-router-bias-update-rate", 1, Kind::kSet, "model.moe_router_bias_update_rate", ""},
    {"--moe-router-quantile-balancing-ema", 1, Kind::kSet, "model.moe_router_quantile_balancing_ema",
     "quantile_balancing's bias: this times the old plus 1 - this times the iteration's estimate"},
    {"--moe-router-num-groups", 1, Kind::kSet, "model.moe_router_num_groups", "group-limited routing"},
    {"--moe-router-group-topk", 1, Kind::kSet, "model.moe_router_group_topk", "group-limited routing"},
    {"--moe-input-jitter-eps", 1, Kind::kSet, "model.moe_input_jitter_eps",
     "the router's input times Uniform(1 - eps, 1 + eps) noise, in training and evaluation as Megatron"},
    {"--moe-token-drop-policy", 1, Kind::kCustom, "model.moe_token_drop_policy",
     "probs or position; ignored without --moe-expert-capacity-factor, as Megatron"},
    {"--moe-pad-expert-input-to-capacity", 0, Kind::kSwitch, "model.moe_pad_expert_input_to_capacity=true",
     "the same outputs, static shapes; needs --moe-expert-capacity-factor"},
    {"--moe-grouped-gemm", 0, Kind::kIgnore, "",
     "how Megatron multiplies its experts; DTK runs one product per expert on its sorted rows"},
    {"--moe-token-dispatcher-type", 1, Kind::kCustom, "model.moe_token_dispatcher",
     "how tokens reach the experts of other expert-parallel ranks: allgather or alltoall (alltoall_seq, older "
     "Megatron's, is alltoall), the same results up to rounding; flex (DeepEP) refused; ignored without "
     "--num-experts"},
    {"--moe-permute-fusion", 0, Kind::kIgnore, "", "Megatron's fused permute kernel (Transformer Engine)"},
    {"--moe-router-fusion", 0, Kind::kIgnore, "", "Megatron's fused router kernel (Transformer Engine)"},
    {"--expert-model-parallel-size", 1, Kind::kSet, "distributed.expert_model_parallel_size",
     "the experts split over this many data-parallel ranks"},
    {"--moe-expert-capacity-factor", 1, Kind::kCustom, "model.moe_expert_capacity_factor",
     "token dropping; a negative factor: dropless (Megatron's None)"},
    {"--fp8-format", 1, Kind::kRefuse, "",
     "DTK trains in fp32, bf16 or fp16 (--bf16, --fp16): Transformer Engine's fp8 recipes are not in its layers"},
    {"--fp8-recipe", 1, Kind::kIgnore, "", kOnlyWithFp8},
    {"--fp8-margin", 1, Kind::kIgnore, "", kOnlyWithFp8},
    {"--fp8-amax-history-len", 1, Kind::kIgnore, "", kOnlyWithFp8},
    {"--fp8-amax-compute-algo", 1, Kind::kIgnore, "", kOnlyWithFp8},
    {"--fp8-param-gather", 0, Kind::kRefuse, "",
     "gathers fp8 parameters, which needs --fp8-format (Megatron asserts it): DTK trains in fp32, bf16 or fp16"},
    {"--apply-layernorm-1p", 0, Kind::kSwitch, "model.apply_layernorm_1p=true",
     "zero-centred norm weights: every LayerNorm or RMSNorm multiplies by 1 + w, w starting at 0"},
    {"--use-legacy-models", 0, Kind::kIgnore, "",
     "Megatron's choice between its two GPT implementations; DTK's models are its own"},
    {"--use-mcore-models", 0, Kind::kIgnore, "",
     "Megatron's choice between its two GPT implementations; DTK's models are its own"},
    {"--transformer-impl", 1, Kind::kIgnore, "",
     "Megatron's layer implementation (local or Transformer Engine); DTK's models are its own"},
    {"--attention-softmax-in-fp32", 0, Kind::kIgnore, "",
     "the precision of Megatron's unfused attention softmax under fp16/bf16; DTK's attention kernel decides its "
     "own"},
    {"--no-query-key-layer-scaling", 0, Kind::kIgnore, "",
     "DTK never scales the attention scores by the layer number (Megatron's fp16 overflow guard, the same "
     "function)"},
    {"--causal-lm", 0, Kind::kIgnore, "", "DTK's language-model step (causal_lm) is causal"},
    {"--attention-backend", 1, Kind::kIgnore, "", kDtkAttention},
    {"--use-flash-attn", 0, Kind::kIgnore, "", kDtkAttention},
    {"--use-flash-attn-v1", 0, Kind::kIgnore, "", kDtkAttention},
    {"--use-flash-attn-v2", 0, Kind::kIgnore, "", kDtkAttention},
    {"--use-flash-attn-triton", 0, Kind::kIgnore, "", kDtkAttention},
    {"--use-flash-attn-builder", 0, Kind::kIgnore, "", kDtkAttention},
    {"--recompute-granularity", 1, Kind::kCustom, "model.recompute_activations",
     "full: layers recomputed in backward (grouped by --recompute-method); selective: the --recompute-modules "
     "recomputed (core attention by default; gpt's not where its attention kernel keeps no probabilities)"},
    {"--recompute-method", 1, Kind::kCustom, "model.recompute_method",
     "uniform: groups of --recompute-num-layers layers, one checkpoint each; block: the first "
     "--recompute-num-layers layers of each stage"},
    {"--recompute-num-layers", 1, Kind::kCustom, "model.recompute_num_layers",
     "with --recompute-granularity full (refused with selective, ignored without a granularity, as Megatron)"},
    {"--recompute-modules", -1, Kind::kCustom, "model.recompute_modules",
     "with selective recomputation: core_attn (core attention), mlp (a dense layer's MLP) and moe (a "
     "mixture-of-experts layer's router and experts) map; moe_act, layernorm, shared_experts and the rest refused "
     "(--recompute-granularity full recomputes whole layers); ignored without selective, as Megatron ignores it"},
    {"--recompute-activations", 0, Kind::kCustom, "model.recompute_activations",
     "selective, whatever --recompute-granularity says (as Megatron sets it)"},
    {"--checkpoint-activations", 0, Kind::kCustom, "model.recompute_activations=full",
     "older Megatron's (Megatron-DeepSpeed's): full recomputation in uniform groups of --checkpoint-num-layers "
     "layers (default 1); with --recompute-granularity, --recompute-activations or --moe-layer-recompute refused"},
    {"--checkpoint-num-layers", 1, Kind::kCustom, "model.recompute_num_layers", "with --checkpoint-activations"},
    // Precision
    {"--fp16", 0, Kind::kSwitch, "train.params_dtype=fp16", ""},
    {"--bf16", 0, Kind::kSwitch, "train.params_dtype=bf16", ""},
    {"--loss-scale", 1, Kind::kSet, "train.loss_scale", ""},
    {"--initial-loss-scale", 1, Kind::kSet, "train.initial_loss_scale", ""},
    {"--min-loss-scale", 1, Kind::kSet, "train.min_loss_scale", ""},
    {"--loss-scale-window", 1, Kind::kSet, "train.loss_scale_window", ""},
    {"--hysteresis", 1, Kind::kSet, "train.hysteresis", ""},
    {"--accumulate-allreduce-grads-in-fp32", 0, Kind::kIgnore, "", "always on under bf16/fp16 (ddp, zero)"},
    {"--grad-reduce-in-bf16", 0, Kind::kIgnore, "",
     "DTK reduces gradients in fp32 (more precise, twice the bytes of bf16)"},
    {"--no-gradient-accumulation-fusion", 0, Kind::kIgnore, "",
     "the fused weight-gradient accumulation is a CUDA (APEX) kernel; DTK accumulates gradients in place either way"},
    {"--no-masked-softmax-fusion", 0, Kind::kIgnore, "",
     "Megatron's fused scale-mask-softmax kernel; DTK's attention kernels stay on (model.unfused_kernels=attention "
     "leaves DTK's out)"},
    {"--no-bias-gelu-fusion", 0, Kind::kCustom, "model.unfused_kernels=bias_gelu", kDtkFusion},
    {"--no-bias-swiglu-fusion", 0, Kind::kCustom, "model.unfused_kernels=swiglu", kDtkFusion},
    {"--no-bias-dropout-fusion", 0, Kind::kCustom, "model.unfused_kernels=bias_add", kDtkFusion},
    {"--no-persist-layer-norm", 0, Kind::kIgnore, "",
     "Apex's persistent LayerNorm kernel; DTK's LayerNorm is ATen's (its add + norm kernel: "
     "model.unfused_kernels=add_norm)"},
    {"--no-async-tensor-model-parallel-allreduce", 0, Kind::kIgnore, "",
     "Megatron's switch for overlapping the column-parallel layers' input-gradient all-reduce with their "
     "weight-gradient product; DTK has no such switch"},
    {"--empty-unused-memory-level", 1, Kind::kIgnore, "", "a CUDA caching-allocator setting"},
    {"--cross-entropy-loss-fusion", 0, Kind::kIgnore, "",
     "a CUDA kernel-fusion switch; DTK's own fused output layer and cross entropy is model.fused_lm_head (on)"},
    {"--cross-entropy-fusion-impl", 1, Kind::kIgnore, "",
     "which CUDA cross-entropy kernel Megatron fuses (native, te); DTK's own fused output layer and cross entropy is "
     "model.fused_lm_head (on)"},
    {"--manual-gc", 0, Kind::kIgnore, "", "Python's garbage collector: DTK has none"},
    {"--manual-gc-interval", 1, Kind::kIgnore, "", "Python's garbage collector: DTK has none"},
    {"--no-manual-gc-eval", 0, Kind::kIgnore, "", "Python's garbage collector: DTK has none"},
    {"--logging-level", 1, Kind::kIgnore, "", "Python's logging level; DTK logs through glog (GLOG_minloglevel)"},
    {"--use-cpu-initialization", 0, Kind::kIgnore, "",
     "DTK always initialises on the CPU, the same weights at any tensor-parallel size"},
    // Training
    {"--micro-batch-size", 1, Kind::kSet, "train.micro_batch_size", ""},
    {"--global-batch-size", 1, Kind::kSet, "train.global_batch_size", ""},
    {"--rampup-batch-size", 3, Kind::kCustom, "train.rampup_batch_size",
     "START INCREMENT SAMPLES, Megatron's ramp-up; needs --train-samples, as Megatron asserts"},
    {"--step-batch-size-schedule", -1, Kind::kCustom, "train.step_batch_size_schedule",
     "\"THRESHOLD:BATCH ...\" (thresholds in tokens, K/M/B/T), Megatron's step-wise global batch; needs "
     "--train-samples, and not with --global-batch-size (Megatron refuses both)"},
    {"--train-iters", 1, Kind::kSet, "train.train_iters", ""},
    {"--train-samples", 1, Kind::kCustom, "train.train_samples", "with train.train_iters=0"},
    {"--seed", 1, Kind::kSet, "train.seed", ""},
    {"--clip-grad", 1, Kind::kSet, "train.clip_grad", ""},
    {"--exit-interval", 1, Kind::kSet, "train.exit_interval", ""},
    {"--exit-duration-in-mins", 1, Kind::kSet, "train.exit_duration_in_mins", ""},
    {"--exit-signal-handler", 0, Kind::kSwitch, "train.exit_signal_handler=true", "DTK's default"},
    // Optimizer and learning rate
    {"--optimizer", 1, Kind::kCustom, "",
     "adam: the adamw plugin (Megatron's Adam decouples weight decay); sgd: the sgd plugin (torch.optim.SGD, as "
     "Megatron's)"},
    {"--sgd-momentum", 1, Kind::kCustom, "",
     "`optimizer.momentum` with --optimizer sgd; ignored otherwise, as Megatron"},
    {"--adam-beta1", 1, Kind::kSet, "optimizer.beta1", ""},
    {"--adam-beta2", 1, Kind::kSet, "optimizer.beta2", ""},
    {"--adam-eps", 1, Kind::kSet, "optimizer.eps", ""},
    {"--weight-decay", 1, Kind::kSet, "lr.weight_decay", ""},
    {"--start-weight-decay", 1, Kind::kSet, "lr.start_weight_decay", ""},
    {"--end-weight-decay", 1, Kind::kSet, "lr.end_weight_decay", ""},
    {"--weight-decay-incr-style", 1, Kind::kSet, "lr.weight_decay_incr_style", ""},
    {"--lr", 1, Kind::kSet, "lr.lr", ""},
    {"--min-lr", 1, Kind::kSet, "lr.min_lr", ""},
    {"--lr-decay-style", 1, Kind::kSet, "lr.lr_decay_style", ""},
    {"--lr-decay-iters", 1, Kind::kSet, "lr.lr_decay_iters", ""},
    {"--lr-warmup-iters", 1, Kind::kSet, "lr.lr_warmup_iters", ""},
    {"--lr-warmup-fraction", 1, Kind::kSet, "lr.lr_warmup_fraction", ""},
    {"--lr-warmup-init", 1, Kind::kSet, "lr.lr_warmup_init", ""},
    {"--lr-wsd-decay-style", 1, Kind::kSet, "lr.lr_wsd_decay_style", ""},
    {"--lr-wsd-decay-iters", 1, Kind::kSet, "lr.lr_wsd_decay_iters", ""},
    {"--lr-decay-samples", 1, Kind::kSet, "lr.lr_decay_samples", ""},
    {"--lr-warmup-samples", 1, Kind::kSet, "lr.lr_warmup_samples", ""},
    {"--override-opt_param-scheduler", 0, Kind::kSwitch, "checkpoint.override_opt_param_scheduler=true", ""},
    {"--use-checkpoint-opt_param-scheduler", 0, Kind::kSwitch, "checkpoint.use_checkpoint_opt_param_scheduler=true",
     ""},
    {"--use-distributed-optimizer", 0, Kind::kCustom, "strategy zero, strategy.stage=1",
     "Megatron's distributed optimizer shards optimizer state and fp32 masters over data parallel: ZeRO stage 1"},
    {"--overlap-grad-reduce", 0, Kind::kCustom, "strategy.overlap_grad_reduce=true",
     "ddp all-reduces its gradient buckets during the last backward (its default); with "
     "--use-distributed-optimizer: the zero strategy's strategy.overlap_comm=true (stage 1 then reduce-scatters each "
     "bucket during the last micro-batch's backward, as Megatron's distributed optimizer)"},
    {"--overlap-param-gather", 0, Kind::kCustom, "strategy.overlap_param_gather=true",
     "the zero strategy (stages 1/2) gathers the updated parameters during the next forward; needs "
     "--use-distributed-optimizer (Megatron asserts it)"},
    {"--ddp-bucket-size", 1, Kind::kCustom, "strategy.bucket_size_mb",
     "elements per gradient bucket: ddp's strategy.bucket_size_mb (x 4 bytes); with --use-distributed-optimizer "
     "the zero strategy's strategy.reduce_bucket_size; under --deepspeed no effect (the config's "
     "reduce_bucket_size)"},
    // Megatron-DeepSpeed
    {"--deepspeed", 0, Kind::kCustom, "",
     "Megatron-DeepSpeed's switch: the DeepSpeed config (--deepspeed_config, keys below) decides ZeRO, the "
     "precision, its loss scaling, clipping and the batch; the Megatron flags still decide the model, the optimizer "
     "and the schedule"},
    {"--deepspeed_config", 1, Kind::kCustom, "", "the DeepSpeed JSON config, read with --deepspeed"},
    {"--deepscale", 0, Kind::kCustom, "", "DeepSpeed's older name of --deepspeed"},
    {"--deepscale_config", 1, Kind::kCustom, "", "DeepSpeed's older name of --deepspeed_config"},
    {"--zero-stage", 1, Kind::kCustom, "",
     "Megatron-DeepSpeed's copy of the config's stage (it builds stage 3's model partitioned): must equal "
     "zero_optimization.stage"},
    {"--zero-reduce-scatter", 0, Kind::kIgnore, "",
     "declared by Megatron-DeepSpeed, which reads the DeepSpeed config's key instead"},
    {"--zero-contigious-gradients", 0, Kind::kIgnore, "",
     "declared by Megatron-DeepSpeed, which reads the DeepSpeed config's key instead"},
    {"--zero-reduce-bucket-size", 1, Kind::kIgnore, "",
     "declared by Megatron-DeepSpeed, which reads the DeepSpeed config's key instead"},
    {"--zero-allgather-bucket-size", 1, Kind::kIgnore, "",
     "declared by Megatron-DeepSpeed, which reads the DeepSpeed config's key instead"},
    {"--remote-device", 1, Kind::kIgnore, "",
     "where stage 3's partitioned build puts the partitions; DTK's puts them where offload_param keeps them"},
    {"--use-pin-memory", 0, Kind::kIgnore, "", "host memory is always pinned"},
    {"--cpu-optimizer", 0, Kind::kCustom, "optimizer cpu_adam",
     "DeepSpeedCPUAdam: the cpu_adam plugin (Adam only, as Megatron-DeepSpeed asserts); with "
     "zero_optimization.offload_optimizer"},
    {"--cpu-torch-adam", 0, Kind::kCustom, "",
     "with --cpu-optimizer: torch's AdamW on the host, the cpu_adam plugin's update; with an offload refused unless "
     "zero_force_ds_cpu_optimizer is false (DeepSpeed refuses it)"},
    {"--ds-fused-adam", 0, Kind::kIgnore, "", "DeepSpeed's fused Adam kernel: the same update"},
    {"--deepspeed-activation-checkpointing", 0, Kind::kIgnore, "",
     "DeepSpeed's checkpointing of the recomputed layers' inputs; DTK recomputes as the recompute flags say, the "
     "same results"},
    {"--partition-activations", 0, Kind::kIgnore, "", "where recomputed layers' inputs are kept; the same results"},
    {"--contigious-checkpointing", 0, Kind::kIgnore, "", "where recomputed layers' inputs are kept; the same results"},
    {"--checkpoint-in-cpu", 0, Kind::kIgnore, "", "where recomputed layers' inputs are kept; the same results"},
    {"--synchronize-each-layer", 0, Kind::kIgnore, "", "a device synchronisation per recomputed layer"},
    {"--profile-backward", 0, Kind::kIgnore, "", "DeepSpeed's timing of recomputed layers"},
    {"--no-pipeline-parallel", 0, Kind::kCustom, "",
     "Megatron-DeepSpeed's choice against DeepSpeed's pipeline engine: needed by zero_optimization.stage 2 and 3 "
     "(that engine refuses them); with --pipeline-model-parallel-size above 1 refused (Megatron-DeepSpeed asserts)"},
    {"--ds-sequence-parallel-size", 1, Kind::kSet, "distributed.context_parallel_size",
     "DeepSpeed-Ulysses, DTK's context parallelism: each sequence split over that many ranks, attention by "
     "all-to-all (distributed.cp_comm_type=a2a without --cp-comm-type); with --context-parallel-size refused"},
    {"--train-tokens", 1, Kind::kSet, "train.train_tokens", "the loop's second end: the iteration that reaches it"},
    {"--decoupled-lr", 1, Kind::kCustom, "lr.param_rules",
     "a rule for the word embeddings and the output layer (also the tied head's copy) with max_lr X: their "
     "schedule peaks there"},
    {"--decoupled-min-lr", 1, Kind::kCustom, "lr.param_rules",
     "that rule's min_lr (else --min-lr, which must not exceed --decoupled-lr); ignored without --decoupled-lr"},
    {"--calculate-per-token-loss", 0, Kind::kSwitch, "train.calculate_per_token_loss=true",
     "gradients and lm loss over the global batch's tokens, not the mean of each micro-batch's mean"},
    {"--lr-warmup-tokens", 1, Kind::kSet, "lr.lr_warmup_tokens", ""},
    {"--lr-decay-tokens", 1, Kind::kSet, "lr.lr_decay_tokens", ""},
    // Megatron-DeepSpeed's MoE (DeepSpeed's MoE layer; mapped together, see map_moe)
    {"--moe-expert-parallel-size", 1, Kind::kCustom, "distributed.expert_model_parallel_size",
     "the experts split over this many data-parallel ranks"},
    {"--topk", 1, Kind::kCustom, "model.moe_router_topk",
     "DeepSpeed's gate: top-1 (its default), top-2, or above 2 its topkgating (DeepSpeed 0.15 and later)"},
    {"--expert-interval", 1, Kind::kCustom, "model.moe_layer_freq",
     "layers N, 2N, ... (1-based) are MoE layers (default 2)"},
    {"--moe-train-capacity-factor", 1, Kind::kCustom, "model.moe_expert_capacity_factor",
     "DeepSpeed's gate's capacity factor in training (default 1.0)"},
    {"--moe-eval-capacity-factor", 1, Kind::kCustom, "model.moe_eval_capacity_factor",
     "DeepSpeed's gate's capacity factor in evaluation (default 1.0)"},
    {"--moe-min-capacity", 1, Kind::kCustom, "model.moe_min_capacity", "an expert's least capacity (default 4)"},
    {"--moe-loss-coeff", 1, Kind::kCustom, "model.moe_aux_loss_coeff",
     "DeepSpeed's l_aux of every MoE layer times this, added to the loss (default 0.1)"},
    {"--disable-moe-token-dropping", 0, Kind::kCustom, "model.moe_expert_capacity_factor",
     "DeepSpeed's gate dropless in training and evaluation (factor 0)"},
    {"--disable-moe-top2-2nd-expert-sampling", 0, Kind::kCustom, "model.moe_top2_2nd_expert_sampling",
     "top-2's second expert the second best, not Gumbel-sampled"},
    {"--mlp-type", 1, Kind::kCustom, "model.moe_residual",
     "standard, or residual: DeepSpeed's residual MoE (a dense MLP beside the experts, mixed per token)"},
    {"--create-moe-param-group", 0, Kind::kIgnore, "",
     "DeepSpeed's optimizer groups of the experts' parameters, at the same hyperparameters: the same update"},
    {"--enable-expert-tensor-parallelism", 0, Kind::kIgnore, "",
     "DTK splits every expert over the tensor-parallel group as the dense MLP; the same arithmetic"},
    {"--use-tutel", 0, Kind::kIgnore, "", "Tutel's dispatch kernels for top-1: the same arithmetic"},
    {"--universal-checkpoint", 0, Kind::kRefuse, "",
     "DeepSpeed's universal checkpoints are not read; DTK reads its own (Megatron's torch layout)"},
    // Parallelism
    {"--tensor-model-parallel-size", 1, Kind::kSet, "distributed.tensor_model_parallel_size", ""},
    {"--pipeline-model-parallel-size", 1, Kind::kSet, "distributed.pipeline_model_parallel_size",
     "1F1B schedule (docs/user-guide.md, pipeline parallelism)"},
    {"--num-layers-per-virtual-pipeline-stage", 1, Kind::kCustom, "distributed.virtual_pipeline_model_parallel_size",
     "the interleaved schedule: num_layers / pipeline size / this chunks per rank"},
    {"--virtual-pipeline-model-parallel-size", 1, Kind::kSet, "distributed.virtual_pipeline_model_parallel_size",
     "the interleaved schedule"},
    {"--num-virtual-stages-per-pipeline-rank", 1, Kind::kSet, "distributed.virtual_pipeline_model_parallel_size",
     "the interleaved schedule's chunks per rank (with an uneven split, Megatron's one way to ask for them)"},
    {"--decoder-first-pipeline-num-layers", 1, Kind::kCustom, "distributed.decoder_first_pipeline_num_layers",
     "the first pipeline rank's layers; the middle ranks share the rest evenly"},
    {"--decoder-last-pipeline-num-layers", 1, Kind::kCustom, "distributed.decoder_last_pipeline_num_layers",
     "the last pipeline rank's layers; the middle ranks share the rest evenly"},
    {"--account-for-embedding-in-pipeline-split", 0, Kind::kSwitch,
     "distributed.account_for_embedding_in_pipeline_split=true", "the embedding counts as a layer of the first stage"},
    {"--account-for-loss-in-pipeline-split", 0, Kind::kSwitch, "distributed.account_for_loss_in_pipeline_split=true",
     "the loss counts as a layer of the last stage"},
    {"--pipeline-model-parallel-layout", 1, Kind::kCustom,
     "distributed.decoder_first/last_pipeline_num_layers, account_for_embedding/loss_in_pipeline_split",
     "a layout whose stages hold the layers one of those splits gives (with the interleaved schedule's chunks "
     "from its stages); other layouts and MTP layers (m) refused"},
    {"--sequence-parallel", 0, Kind::kSwitch, "distributed.sequence_parallel=true", ""},
    {"--context-parallel-size", 1, Kind::kSet, "distributed.context_parallel_size",
     "each sequence split over that many ranks; without --cp-comm-type the exchange is all_gather (Megatron's default "
     "p2p), saying so; with --ds-sequence-parallel-size refused"},
    {"--cp-comm-type", -1, Kind::kCustom, "distributed.cp_comm_type",
     "a2a and all_gather as they are; p2p and a2a+p2p as all_gather, saying so (the same attention, other "
     "traffic); a per-layer list of both kinds, or not one per layer, refused; without the flag Megatron's default "
     "p2p: all_gather"},
    {"--distributed-backend", 1, Kind::kCustom, "distributed.backend",
     "gloo: accepted; nccl: also train.device=cuda (Megatron trains on GPUs), refused where this dtk cannot train on a "
     "GPU (docs/cuda.md)"},
    {"--distributed-timeout-minutes", 1, Kind::kCustom, "distributed.timeout_seconds", "minutes x 60"},
    {"--DDP-impl", 1, Kind::kIgnore, "", "DTK's ddp strategy is its one implementation"},
    {"--local-rank", 1, Kind::kIgnore, "", "each rank reads LOCAL_RANK from its launcher's environment"},
    // Data
    {"--data-path", -1, Kind::kCustom, "dataset gpt_indexed, dataset.data_path",
     "one prefix, a blend 'W1 PREFIX1 W2 PREFIX2 ...', or prefixes without weights (Megatron-core: a blend "
     "weighted by the datasets' sizes); without --split also dataset.split='969, 30, 1' "
     "(Megatron's default, part of its cache names); with --tokenizer-type also dataset.megatron_tokenizer "
     "(today's Megatron-core's description of the tokenizer, in its cache names)"},
    {"--train-data-path", -1, Kind::kCustom, "dataset gpt_indexed, dataset.train_data_path",
     "the train split's own prefix or blend, all its documents (Megatron's blend_per_split); as --data-path for "
     "the split and the tokenizer"},
    {"--valid-data-path", -1, Kind::kCustom, "dataset gpt_indexed, dataset.valid_data_path", "as --train-data-path"},
    {"--test-data-path", -1, Kind::kCustom, "dataset gpt_indexed, dataset.test_data_path", "as --train-data-path"},
    {"--data-args-path", 1, Kind::kCustom, "dataset gpt_indexed, dataset.data_path",
     "the file's whitespace-separated words, as --data-path (Megatron reads the file so)"},
    {"--per-split-data-args-path", 1, Kind::kCustom,
     "dataset gpt_indexed, dataset.train_data_path, valid_data_path, test_data_path",
     "a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...}, each a list of words or one string, as "
     "--train-data-path and its siblings"},
    {"--mock-data", 0, Kind::kCustom, "dataset synthetic", "random tokens"},
    {"--split", 1, Kind::kSet, "dataset.split", ""},
    {"--data-cache-path", 1, Kind::kSet, "dataset.cache_dir", ""},
    {"--vocab-file", 1, Kind::kSet, "tokenizer.vocab_file", "the vocabulary size is derived from it (and checked)"},
    {"--merge-file", 1, Kind::kSet, "tokenizer.merge_file", ""},
    {"--tokenizer-type", 1, Kind::kSet, "tokenizer.type",
     "GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer, "
     "TikTokenizer, NullTokenizer"},
    {"--tiktoken-pattern", 1, Kind::kCustom, "tokenizer.tiktoken_pattern",
     "TikTokenizer's regex, v1 or v2; ignored with the other tokenizers, as Megatron does"},
    {"--tiktoken-num-special-tokens", 1, Kind::kCustom, "tokenizer.tiktoken_num_special_tokens",
     "TikTokenizer's ids before the vocabulary's; ignored with the other tokenizers, as Megatron does"},
    {"--tokenizer-special-tokens", -1, Kind::kCustom, "tokenizer.special_tokens",
     "TikTokenizer's special tokens, in order (they must include <unk> <s> </s> <mask> <pad> <cls> <sep>; one "
     "holding whitespace is refused); ignored with NullTokenizer, as Megatron; refused with the other tokenizers "
     "(DTK does not add special tokens to them)"},
    {"--tokenizer-model", 1, Kind::kSet, "tokenizer.model_file",
     "a SentencePiece .model, a tokenizer.json, or TikTokenizer's vocabulary (.json)"},
    {"--vocab-size", 1, Kind::kSet, "tokenizer.null_vocab_size",
     "NullTokenizer's size (its EOD is one more); TikTokenizer's size, its special tokens included"},
    {"--data-impl", 1, Kind::kCustom, "dataset.order=megatron_legacy",
     "legacy Megatron's flag (megatron/data, as DeepSpeed-Domino ships it): with --data-path its sample order, "
     "split rounding, blend sizes and cache files; mmap: the .bin/.idx format DTK reads, others refused"},
    {"--num-workers", 1, Kind::kIgnore, "", "DTK prefetches batches on its own loader thread"},
    {"--dataloader-type", 1, Kind::kCustom, "train.dataloader_type",
     "single: Megatron's pretraining sampler (DTK's default); cyclic: its random sampler, a new permutation every "
     "epoch; external refused (DTK reads datasets through dataset plugins)"},
    {"--no-data-sharding", 0, Kind::kCustom, "train.data_sharding=false",
     "with --dataloader-type cyclic; ignored without it, as Megatron ignores it"},
    {"--eod-mask-loss", 0, Kind::kSwitch, "step.eod_mask_loss=true", ""},
    {"--reset-position-ids", 0, Kind::kSwitch, "step.reset_position_ids=true", ""},
    {"--reset-attention-mask", 0, Kind::kSwitch, "step.reset_attention_mask=true", ""},
    // Evaluation, logging, checkpoints
    {"--eval-interval", 1, Kind::kSet, "eval.eval_interval", ""},
    {"--eval-iters", 1, Kind::kSet, "eval.eval_iters", ""},
    {"--full-validation", 0, Kind::kSwitch, "eval.full_validation=true",
     "every evaluation reads its whole split; each sample counts once, where Megatron's cycling sampler counts "
     "some twice when the samples are not a multiple of the data-parallel size"},
    {"--skip-train", 0, Kind::kSwitch, "eval.skip_train=true",
     "the evaluations after training of the loaded model (checkpoint.load), validation from its first sample"},
    {"--multiple-validation-sets", 0, Kind::kCustom, "eval.validation_sets",
     "one set per prefix of --valid-data-path (its weights ignored, as Megatron ignores them), each "
     "{name: \"K\" options {valid_data_path: PREFIX}}, read whole; without --valid-data-path one set, the run's "
     "validation split; needs --full-validation, as Megatron does"},
    {"--validation-set-names", -1, Kind::kCustom, "eval.validation_sets (each set's name)",
     "one per set, with --multiple-validation-sets (\"validation-NAME loss at ...\")"},
    {"--log-interval", 1, Kind::kSet, "logging.log_interval", ""},
    {"--tensorboard-dir", 1, Kind::kSet, "logging.tensorboard_dir", ""},
    {"--tensorboard-log-interval", 1, Kind::kSet, "logging.tensorboard_log_interval", ""},
    {"--log-params-norm", 0, Kind::kSwitch, "logging.log_params_norm=true", ""},
    {"--log-num-zeros-in-grad", 0, Kind::kSwitch, "logging.log_num_zeros_in_grad=true", ""},
    {"--timing-log-level", 1, Kind::kSet, "logging.timing_log_level", ""},
    {"--profile", 0, Kind::kCustom, "logging.profile_steps",
     "iterations --profile-step-start + 1 to --profile-step-end (Megatron's defaults 10, 12: 11-12)"},
    {"--profile-step-start", 1, Kind::kCustom, "logging.profile_steps", "with --profile"},
    {"--profile-step-end", 1, Kind::kCustom, "logging.profile_steps", "with --profile"},
    {"--use-pytorch-profiler", 0, Kind::kIgnore, "", "DTK's profile is LibTorch's profiler (logging.profile_steps)"},
    {"--profile-ranks", -1, Kind::kIgnore, "", "every rank writes its trace; rank 0 prints the table"},
    {"--enable-cuda-graph", 0, Kind::kSwitch, "train.cuda_graphs=true",
     "each micro-batch's whole forward and backward is one graph (Megatron-core records per layer)"},
    {"--cuda-graph-impl", 1, Kind::kCustom, "train.cuda_graphs",
     "none: false; local, full_iteration: true (each micro-batch's whole forward and backward is one graph); "
     "transformer_engine refused"},
    {"--log-optimizer-states-to-tensorboard", 0, Kind::kIgnore, "", "DTK writes no optimizer-state statistics"},
    {"--log-timers-to-tensorboard", 0, Kind::kIgnore, "",
     "the timers (logging.timing_log_level) always reach TensorBoard when it is on"},
    {"--log-throughput", 0, Kind::kIgnore, "", "the log line always shows TFLOP/s, MFU and tokens per second"},
    {"--log-validation-ppl-to-tensorboard", 0, Kind::kIgnore, "", "always written when TensorBoard is on"},
    {"--log-memory-to-tensorboard", 0, Kind::kIgnore, "", "always written when TensorBoard is on"},
    {"--log-world-size-to-tensorboard", 0, Kind::kIgnore, "", "always written when TensorBoard is on"},
    {"--log-loss-scale-to-tensorboard", 0, Kind::kIgnore, "", "always written when TensorBoard is on"},
    {"--log-batch-size-to-tensorboard", 0, Kind::kIgnore, "", "always written when TensorBoard is on"},
    {"--tensorboard-queue-size", 1, Kind::kIgnore, "", "DTK's event writer has no queue to size"},
    {"--wandb-project", 1, Kind::kIgnore, "",
     "DTK logs to TensorBoard (logging.tensorboard_dir) and logging.metrics_jsonl, not to Weights & Biases"},
    {"--wandb-exp-name", 1, Kind::kIgnore, "", "DTK does not log to Weights & Biases"},
    {"--wandb-save-dir", 1, Kind::kIgnore, "", "DTK does not log to Weights & Biases"},
    {"--wandb-entity", 1, Kind::kIgnore, "", "DTK does not log to Weights & Biases"},
    {"--log-progress", 0, Kind::kSwitch, "logging.log_progress=true",
     "progress.txt in --save, in Megatron's format: job starts, saves with throughput, floating-point operations and "
     "tokens"},
    {"--no-mmap-bin-files", 0, Kind::kIgnore, "", "DTK always maps the .bin files (the tokens read are the same)"},
    {"--no-create-attention-mask-in-dataloader", 0, Kind::kIgnore, "",
     "DTK's loader makes no attention mask (the attention is causal in the layers)"},
    {"--ckpt-format", 1, Kind::kCustom, "",
     "torch: Megatron's torch checkpoints (mp_rank_XX/model_optim_rng.pt), what DTK writes and reads; torch_dist "
     "(Megatron's default): accepted, DTK writes the torch format, which Megatron loads under torch_dist too (it "
     "detects a checkpoint's format there); others refused"},
    {"--async-save", 0, Kind::kSwitch, "checkpoint.async_save=true",
     "interval saves are written by a background thread while training goes on, published once every rank's "
     "files are written (Megatron needs torch_dist and --use-persistent-ckpt-worker for it; DTK writes its torch "
     "format with or without them)"},
    {"--use-persistent-ckpt-worker", 0, Kind::kIgnore, "",
     "how Megatron runs its async writer (a persistent process); DTK's is a thread of each rank"},
    {"--async-strategy", 1, Kind::kIgnore, "", "which library writes Megatron's async checkpoints (nvrx, mcore)"},
    {"--async-ckpt-cpu-priority", 1, Kind::kIgnore, "",
     "the CPU priority of Megatron's async writer; DTK's writer thread runs at nice 19"},
    {"--async-ckpt-io-priority", 1, Kind::kIgnore, "",
     "the I/O priority of Megatron's async writer; DTK's writer thread is in the idle I/O class"},
    {"--async-ckpt-use-cpu-shm", 0, Kind::kIgnore, "",
     "where Megatron's async writer stages tensors (shared memory); DTK's thread reads its own copy"},
    {"--dist-ckpt-strictness", 1, Kind::kIgnore, "",
     "how torch_dist loads treat keys that do not match; DTK reads its torch-format checkpoints strictly (a "
     "missing or unexpected tensor is an error naming it)"},
    {"--ckpt-fully-parallel-save", 0, Kind::kIgnore, "",
     "a torch_dist speed switch; DTK writes Megatron's torch format, each rank its own file"},
    {"--no-ckpt-fully-parallel-save", 0, Kind::kIgnore, "",
     "a torch_dist speed switch; DTK writes Megatron's torch format, each rank its own file"},
    {"--ckpt-fully-parallel-load", 0, Kind::kIgnore, "",
     "a torch_dist speed switch; DTK reads Megatron's torch format, each rank its own file"},
    {"--ckpt-assume-constant-structure", 0, Kind::kIgnore, "",
     "a torch_dist caching switch; DTK writes Megatron's torch format"},
    {"--save", 1, Kind::kSet, "checkpoint.save", ""},
    {"--load", 1, Kind::kSet, "checkpoint.load", ""},
    {"--save-interval", 1, Kind::kSet, "checkpoint.save_interval", "without --save: accepted, no effect (as Megatron)"},
    {"--no-load-optim", 0, Kind::kSwitch, "checkpoint.no_load_optim=true", ""},
    {"--no-load-rng", 0, Kind::kSwitch, "checkpoint.no_load_rng=true", ""},
    {"--finetune", 0, Kind::kSwitch, "checkpoint.finetune=true", ""},
    {"--use-checkpoint-args", 0, Kind::kSwitch, "checkpoint.use_checkpoint_args=true",
     "the model plugin and options come from the checkpoint in --load; the architecture flags may then be partial"},
    {"--check-for-nan-in-loss-and-grad", 0, Kind::kSwitch, "train.skipped_steps_limit=1",
     "Megatron's default: a step with gradients that are not finite stops the run (unless loss scaling is "
     "dynamic)"},
    {"--no-check-for-nan-in-loss-and-grad", 0, Kind::kSwitch, "train.skipped_steps_limit=-1",
     "such steps are skipped and the run goes on"},
    {"--exit-on-missing-checkpoint", 0, Kind::kCustom, "",
     "a --load folder without a checkpoint is an error; without the flag the run starts from scratch "
     "(checkpoint.load_if_present=true), as Megatron's"},
    {"--no-save-optim", 0, Kind::kSwitch, "checkpoint.no_save_optim=true", ""},
    {"--no-save-rng", 0, Kind::kSwitch, "checkpoint.no_save_rng=true", ""},
};

// Flags compare with '_' read as '-' (scripts mix both; Megatron's own names mix them too).
std::string normalized(std::string flag) {
  std::replace(flag.begin(), flag.end(), '_', '-');
  return flag;
}

const Rule* find_rule(const std::string& flag) {
  const std::string want = normalized(flag);
  for (const Rule& r : kRules)
    if (normalized(r.flag) == want) return &r;
  return nullptr;
}

bool is_flag(const std::string& a) {
  return a.size() > 2 && a[0] == '-' && a[1] == '-' && !std::isdigit(static_cast<unsigned char>(a[2]));
}

std::string joined(const std::vector<std::string>& v, const std::string& sep = " ") {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

void add_assignments(MegatronMapping& m, const std::string& list) {
  std::stringstream ss(list);
  std::string one;
  while (std::getline(ss, one, ';'))
    if (!one.empty()) m.sets.push_back(one);
}

// A note about what a flag made of `field` (MegatronMapping::note_field).
void note_about(MegatronMapping& m, const std::string& field, const std::string& note) {
  m.notes.push_back(note);
  m.note_field[note] = field;
}

// One assignment the checks across flags make, credited to the flag behind it (as given, without
// its values) so that a later error about the field can name it.
void set_by(MegatronMapping& m, const std::string& assignment, const std::string& shown) {
  m.sets.push_back(assignment);
  m.flag_of[assignment.substr(0, assignment.find('='))] = shown.substr(0, shown.find(' '));
}

// Megatron-DeepSpeed's MoE flags (DeepSpeed's MoE layer), which Megatron-LM has not.
bool is_deepspeed_moe_flag(const std::string& f) {
  static const std::set<std::string> flags = {"--moe-expert-parallel-size",
                                              "--topk",
                                              "--expert-interval",
                                              "--moe-train-capacity-factor",
                                              "--moe-eval-capacity-factor",
                                              "--moe-min-capacity",
                                              "--moe-loss-coeff",
                                              "--disable-moe-token-dropping",
                                              "--disable-moe-top2-2nd-expert-sampling",
                                              "--mlp-type",
                                              "--create-moe-param-group",
                                              "--enable-expert-tensor-parallelism",
                                              "--use-tutel"};
  return flags.count(f) > 0;
}

// Megatron-LM's MoE flags (its MoE layer), which Megatron-DeepSpeed has not.
bool is_megatron_moe_flag(const std::string& f) {
  return (f.rfind("--moe-", 0) == 0 && !is_deepspeed_moe_flag(f)) || f == "--expert-model-parallel-size" ||
         f == "--expert-tensor-parallel-size";
}

// The flags whose effect depends on their value.
void custom(const Rule& r, const std::string& flag, const std::vector<std::string>& v, MegatronMapping& m) {
  const std::string f = normalized(r.flag);
  const std::string shown = flag + (v.empty() ? "" : " " + joined(v));
  auto refuse = [&](const std::string& why) { m.refused.push_back(shown + ": " + why); };
  if (f == "--position-embedding-type") {
    if (v[0] != "learned_absolute" && v[0] != "rope") return refuse("not one of learned_absolute, rope");
  } else if (f == "--normalization") {
    if (v[0] != "LayerNorm" && v[0] != "RMSNorm" && v[0] != "layernorm" && v[0] != "rmsnorm")
      return refuse("not one of LayerNorm, RMSNorm (Megatron-DeepSpeed: layernorm, rmsnorm)");
  } else if (f == "--disable-bias-linear") {
    m.sets.push_back("model.add_bias_linear=false");
  } else if (f == "--moe-layer-freq" || f == "--window-size" || f == "--window-attn-skip-freq") {
    // The model reads the integer, list or W,R (a bad one: its error).
    m.sets.push_back(std::string(r.target) + "=" + v[0]);
  } else if (f == "--decoder-first-pipeline-num-layers" || f == "--decoder-last-pipeline-num-layers") {
    char* end = nullptr;
    const long n = std::strtol(v[0].c_str(), &end, 10);
    if (v[0].empty() || *end || n <= 0 || n > (1L << 30))
      return refuse("not a positive number of layers (Megatron: must be larger than 0)");
    m.sets.push_back(std::string(r.target) + "=" + v[0]);
  } else if (f == "--moe-router-dtype") {
    if (v[0] != "fp32") return refuse("DTK's router runs in the model's dtype or in fp32 (--moe-router-dtype fp32)");
    m.sets.push_back("model.moe_router_fp32=true");
  } else if (f == "--moe-router-load-balancing-type") {
    for (const std::string& type : v) {
      const bool alone = type == "none" || type == "sinkhorn" || type == "quantile_balancing";
      if (type != "aux_loss" && type != "seq_aux_loss" && type != "global_aux_loss" && (!alone || v.size() > 1))
        return refuse(
            "DTK's router has Switch Transformer's load-balancing loss (aux_loss, seq_aux_loss, global_aux_loss or a "
            "list of them), or sinkhorn, quantile_balancing or none alone");
    }
    // none: mapped with the other flags (it overrides --moe-aux-loss-coeff wherever that comes)
    if (v[0] != "none") m.sets.push_back("model.moe_router_load_balancing_type=" + joined(v, ","));
  } else if (f == "--moe-aux-loss-coeff") {
    // One per type (the model checks the counts agree).
    m.sets.push_back(std::string(r.target) + "=" + joined(v, ","));
  } else if (f == "--moe-expert-capacity-factor") {
    char* end = nullptr;
    const double x = std::strtod(v[0].c_str(), &end);
    if (v[0].empty() || *end || !std::isfinite(x)) return refuse("not a number");
    // Megatron reads a negative factor as None (dropless); 0 would be a capacity of 0, every token dropped.
    if (x == 0) return refuse("a capacity of 0 drops every token; give a factor > 0 (or < 0: dropless)");
    if (x < 0) return m.ignored.push_back(shown + " (negative: dropless, Megatron's None)");
    m.sets.push_back("model.moe_expert_capacity_factor=" + v[0]);
  } else if (f == "--moe-token-dispatcher-type") {  // dropped where no --num-experts is given
    if (v[0] == "flex")
      return refuse("the flex dispatcher is DeepEP's or HybridEP's kernels; DTK has allgather and alltoall");
    // (Older Megatron-core's alltoall_seq: the alltoall dispatcher for sequence-split tokens; DTK's
    // routes whatever the split, so it is alltoall.)
    if (v[0] != "allgather" && v[0] != "alltoall" && v[0] != "alltoall_seq")
      return refuse("not one of allgather, alltoall, alltoall_seq, flex");
    m.sets.push_back("model.moe_token_dispatcher=" + std::string(v[0] == "allgather" ? "allgather" : "alltoall"));
  } else if (f == "--moe-token-drop-policy") {  // dropped with the other flags where no capacity is set
    if (v[0] != "probs" && v[0] != "position") return refuse("not one of probs, position");
    m.sets.push_back("model.moe_token_drop_policy=" + v[0]);
  } else if (f == "--moe-router-score-function") {
    if (v[0] != "softmax" && v[0] != "sigmoid" && v[0] != "sqrtsoftplus")
      return refuse("DTK's router scores with a softmax, a sigmoid or sqrtsoftplus");
    m.sets.push_back("model.moe_router_score_function=" + v[0]);
  } else if (f == "--cp-comm-type") {
    for (const std::string& type : v)
      if (type != "p2p" && type != "all_gather" && type != "a2a" && type != "a2a+p2p")
        return refuse("not one of p2p, all_gather, a2a, a2a+p2p");
    // p2p's ring passes the keys and values round the group, all_gather gathers them at once: the
    // same attention and the same freedom in the heads. a2a+p2p (a2a inside a node, p2p across)
    // asks the heads to divide by its a2a part only: all_gather, which asks nothing of them.
    const auto dtk_type = [](const std::string& t) { return std::string(t == "a2a" ? "a2a" : "all_gather"); };
    for (const std::string& type : v)
      if (dtk_type(type) != dtk_type(v[0]))
        return refuse(
            "DTK runs one exchange in every layer (a per-layer list must map to one: a2a to a2a; p2p, "
            "all_gather and a2a+p2p to all_gather)");
    set_by(m, "distributed.cp_comm_type=" + dtk_type(v[0]), shown);
    if (std::any_of(v.begin(), v.end(), [](const std::string& t) { return t == "p2p" || t == "a2a+p2p"; }))
      note_about(m, "distributed.cp_comm_type",
                 shown +
                     " runs as all_gather (distributed.cp_comm_type=all_gather): the same attention, the keys and "
                     "values gathered at once rather than passed round a ring");
  } else if (f == "--use-rope-scaling") {
    m.sets.push_back("model.rope_scaling=llama3");
  } else if (f == "--recompute-granularity") {  // mapped with the other recompute flags (map_recompute)
    if (v[0] != "full" && v[0] != "selective") refuse("not one of full, selective");
  } else if (f == "--recompute-method") {
    if (v[0] != "uniform" && v[0] != "block") refuse("not one of uniform, block");
  } else if (f == "--rampup-batch-size") {
    m.sets.push_back("train.rampup_batch_size=" + joined(v));
  } else if (f == "--cuda-graph-impl") {
    if (v[0] == "none") return void(m.sets.push_back("train.cuda_graphs=false"));
    if (v[0] == "local" || v[0] == "full_iteration") return void(m.sets.push_back("train.cuda_graphs=true"));
    refuse(v[0] == "transformer_engine" ? "Transformer Engine's graphs are not in DTK's layers; use local"
                                        : "not one of none, local, full_iteration, transformer_engine");
  } else if (f == "--step-batch-size-schedule") {  // one quoted value, or its entries as words
    m.sets.push_back("train.step_batch_size_schedule=" + joined(v));
  } else if (f == "--train-samples") {
    m.sets.push_back("train.train_samples=" + v[0]);
    m.sets.push_back("train.train_iters=0");
  } else if (f == "--optimizer") {
    if (v[0] == "adam") return void(m.optimizer = "adamw");
    if (v[0] == "sgd") return void(m.optimizer = "sgd");
    refuse("not one of adam, sgd");
  } else if (f == "--use-distributed-optimizer") {
    m.strategy = "zero";
    m.sets.push_back("strategy.stage=1");
  } else if (f == "--distributed-backend") {
    if (v[0] == "nccl") {
      std::string why;
      if (!cuda_training_available(&why)) return refuse(why + " (docs/cuda.md); use gloo");
      m.sets.push_back("distributed.backend=nccl");
      m.sets.push_back("train.device=cuda");
      return;
    }
    if (v[0] != "gloo") return refuse("not one of gloo, nccl");
    m.sets.push_back("distributed.backend=gloo");
  } else if (f == "--distributed-timeout-minutes") {
    char* end = nullptr;
    const long minutes = std::strtol(v[0].c_str(), &end, 10);
    if (v[0].empty() || *end || minutes <= 0) return refuse("not a positive number of minutes");
    m.sets.push_back("distributed.timeout_seconds=" + std::to_string(minutes * 60));
  } else if (f == "--tiktoken-pattern" || f == "--tiktoken-num-special-tokens" || f == "--tokenizer-special-tokens") {
    // mapped with --tokenizer-type (map_tiktoken)
  } else if (f == "--data-path") {
    m.dataset = "gpt_indexed";
    m.sets.push_back("dataset.data_path=" + joined(v));
  } else if (f == "--train-data-path" || f == "--valid-data-path" || f == "--test-data-path") {
    m.dataset = "gpt_indexed";
    m.sets.push_back("dataset." + f.substr(2, f.find('-', 2) - 2) + "_data_path=" + joined(v));
  } else if (f == "--data-args-path" || f == "--per-split-data-args-path") {
    std::ifstream in(v[0]);
    std::stringstream text;
    if (!in || !(text << in.rdbuf())) return refuse("cannot read the file");
    m.dataset = "gpt_indexed";
    if (f == "--data-args-path") {
      std::vector<std::string> words;
      for (std::string w; text >> w;) words.push_back(w);
      if (words.empty()) return refuse("the file holds no prefixes");
      return m.sets.push_back("dataset.data_path=" + joined(words));
    }
    nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
    if (j.is_discarded() || !j.is_object()) return refuse("not a JSON object {\"train\": ..., \"valid\": ..., \"test\": ...}");
    for (const char* split : {"train", "valid", "test"}) {
      if (!j.contains(split)) return refuse(std::string("has no \"") + split + "\" (Megatron reads all three)");
      const nlohmann::json& e = j[split];
      std::vector<std::string> words;
      if (e.is_string()) {
        std::stringstream ws(e.get<std::string>());
        for (std::string w; ws >> w;) words.push_back(w);
      } else if (e.is_array()) {
        for (const auto& w : e) {
          if (!w.is_string() && !w.is_number()) return refuse(std::string("\"") + split + "\" holds a JSON " + w.type_name());
          words.push_back(w.is_string() ? w.get<std::string>() : w.dump());
        }
      } else if (!e.is_null()) {
        return refuse(std::string("\"") + split + "\" is a JSON " + e.type_name() + ", not a list or a string");
      }
      if (!words.empty()) m.sets.push_back(std::string("dataset.") + split + "_data_path=" + joined(words));
    }
  } else if (f == "--ckpt-format") {
    if (v[0] == "torch_dist")
      m.ignored.push_back(shown +
                          " (DTK writes Megatron's torch format, mp_rank_XX/model_optim_rng.pt, which Megatron loads "
                          "under --ckpt-format torch_dist too: it detects a checkpoint's format there)");
    else if (v[0] != "torch")
      refuse("DTK writes and reads Megatron's torch format (mp_rank_XX/model_optim_rng.pt); use --ckpt-format torch");
  } else if (f == "--mock-data") {
    m.dataset = "synthetic";
    m.flag_of["dataset.name"] = flag;
  } else if (f == "--data-impl") {
    if (v[0] != "mmap") refuse("DTK reads Megatron's mmap .bin/.idx files only");
  } else if (f == "--multiple-validation-sets" || f == "--validation-set-names") {
    // mapped with --valid-data-path (map_validation_sets)
  } else if (f == "--num-experts" || is_deepspeed_moe_flag(f)) {
    // mapped together, in Megatron-LM's or Megatron-DeepSpeed's reading (map_moe)
  } else if (f == "--dataloader-type") {  // the last one given counts (map_dataloader)
    if (v[0] != "single" && v[0] != "cyclic" && v[0] != "external") refuse("not one of single, cyclic, external");
  }
}

// The model the architecture flags describe: Megatron's GPT (learned positions, LayerNorm, GeLU)
// is the gpt plugin; rotary positions + RMSNorm + SwiGLU is the llama plugin. A mix of the two is
// refused, since neither plugin builds it.
// With --use-checkpoint-args the checkpoint's model replaces the one the flags describe (Megatron's
// Llama launch lines for a converted checkpoint give only part of the architecture): any llama
// flag then stands for the llama model, and nothing is refused for being partial.
void choose_model(MegatronMapping& m, bool rope, bool rms_norm, bool swiglu, const std::vector<std::string>& llama_only,
                  const std::vector<std::string>& gpt_only, bool use_checkpoint_args) {
  if (!rope && !rms_norm && !swiglu) {
    if (use_checkpoint_args && !llama_only.empty()) return choose_model(m, true, true, true, {}, gpt_only, false);
    if (!use_checkpoint_args)
      for (const auto& flag : llama_only) m.refused.push_back(flag + ": needs " + kLlama);
    return;
  }
  if (!(rope && rms_norm && swiglu) && use_checkpoint_args) return choose_model(m, true, true, true, {}, gpt_only, false);
  if (!(rope && rms_norm && swiglu)) {
    std::vector<std::string> missing;
    if (!rope) missing.push_back("--position-embedding-type rope");
    if (!rms_norm) missing.push_back("--normalization RMSNorm");
    if (!swiglu) missing.push_back("--swiglu");
    m.refused.push_back("the architecture flags describe neither DTK's gpt model (learned positions, LayerNorm, GeLU) "
                        "nor its llama model (rotary positions, RMSNorm, SwiGLU): missing " + joined(missing, ", "));
    return;
  }
  m.model = "llama";
  // Megatron's defaults where the llama plugin's (Llama's) differ; the flags' own values follow.
  m.model_defaults = {"model.hidden_dropout=0.1", "model.attention_dropout=0.1",
                      "model.untie_embeddings_and_output_weights=false", "model.add_bias_linear=true"};
  for (const auto& flag : gpt_only) {
    if (flag.rfind("--max-position-embeddings", 0) == 0) {
      m.ignored.push_back(flag + " (rotary positions have no table: the llama model evaluates any position)");
      m.sets.erase(std::remove_if(m.sets.begin(), m.sets.end(),
                                  [](const std::string& a) { return a.rfind("model.max_position_embeddings=", 0) == 0; }),
                   m.sets.end());
    } else {
      m.refused.push_back(flag + ": the llama model's MLP is SwiGLU, not GeLU");
    }
  }
}

std::string read_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw HostError("--megatron_args @" + path + ": '" + path + "' is a directory, not a file of flags");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw HostError("--megatron_args @" + path + ": cannot read the file (" + std::strerror(errno) + ")");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  // Flags are text: a control byte (other than whitespace) means another kind of file, whose
  // bytes would otherwise come back in an error about a "flag".
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if ((c < 0x20 && !std::isspace(c)) || c == 0x7f) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "0x%02x", c);
      throw HostError("--megatron_args @" + path + ": '" + path + "' is not a text file of flags (byte " + byte +
                      " at offset " + std::to_string(i) + ")");
    }
  }
  return text;
}

}  // namespace

std::vector<std::string> split_megatron_args(const std::string& text_or_file) {
  const std::string text = !text_or_file.empty() && text_or_file[0] == '@' ? read_file(text_or_file.substr(1))
                                                                           : text_or_file;
  std::vector<std::string> out;
  std::string cur;
  bool have = false;
  char quote = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quote) {
      if (c == quote)
        quote = 0;
      else
        cur += c;
      continue;
    }
    if (c == '\\' && i + 1 < text.size() && (text[i + 1] == '\n' || text[i + 1] == '\r')) {
      while (i + 1 < text.size() && (text[i + 1] == '\n' || text[i + 1] == '\r')) ++i;
      if (have) out.push_back(cur), cur.clear(), have = false;
      continue;
    }
    if (c == '#' && !have) {
      while (i + 1 < text.size() && text[i + 1] != '\n') ++i;
      continue;
    }
    if (c == '\'' || c == '"') {
      quote = c, have = true;
      continue;
    }
    if (std::isspace(static_cast<unsigned char>(c))) {
      if (have) out.push_back(cur), cur.clear(), have = false;
      continue;
    }
    cur += c, have = true;
  }
  if (quote) throw HostError(std::string("--megatron_args: unclosed ") + quote + " quote");
  if (have) out.push_back(cur);
  // An empty flag file would silently train Megatron's defaults, as `--megatron_args ''` would.
  if (out.empty() && !text_or_file.empty() && text_or_file[0] == '@')
    throw HostError("--megatron_args " + text_or_file + ": the file holds no flags (empty or only comments)");
  return out;
}

namespace {

// What the flags seen so far say beyond their own assignments: the checks across flags (training
// by iterations or samples, the model family, grouped-query attention, virtual stages) need them.
struct SeenFlags {
  std::string rampup;  // the --rampup-batch-size flag as given
  std::string step_schedule;  // the --step-batch-size-schedule flag as given
  bool iteration_based = false, sample_based = false;
  std::vector<std::string> iteration_schedule;  // --lr-decay-iters / --lr-warmup-iters as given
  std::vector<std::string> sample_schedule;     // --lr-decay-samples / --lr-warmup-samples as given
  std::string no_train_tokens;                  // --train-tokens 0 (or less) as given
  std::vector<std::string> llama_only;          // flags only the llama model takes, as given
  std::vector<std::string> gpt_only;            // flags only the gpt model takes, as given
  bool rope = false, rms_norm = false, swiglu = false;
  bool group_query_attention = false, fp16 = false, bf16 = false;
  std::string num_layers = "", pipeline_size = "1", per_virtual_stage, per_virtual_shown;
  std::string uneven_shown;                                // --decoder-first/last-pipeline-num-layers as given
  std::string virtual_stages_shown;                        // --num-virtual-stages-per-pipeline-rank as given
  std::string virtual_size_shown;                          // --virtual-pipeline-model-parallel-size as given
  std::string layout, layout_shown;                        // --pipeline-model-parallel-layout: value, as given
  bool embedding_in_split = false, loss_in_split = false;  // --account-for-embedding/loss-in-pipeline-split
  std::string query_groups, query_groups_shown;  // --num-query-groups: its value, and as given
  bool use_checkpoint_args = false, rope_scaling = false;
  std::string rope_factor, rope_factor_shown;   // --rope-scaling-factor: its value, and as given
  std::string kv_channels, kv_channels_shown;   // --kv-channels: its value, and as given
  std::string recompute_granularity;            // --recompute-granularity: full | selective
  bool recompute_activations = false;           // --recompute-activations (selective, over the granularity)
  std::string recompute_method, recompute_method_shown;  // --recompute-method: its value, and as given
  std::string recompute_layers, recompute_layers_shown;  // --recompute-num-layers: its value, and as given
  std::vector<std::string> recompute_modules;            // --recompute-modules
  std::string recompute_modules_shown;                   // --recompute-modules as given
  bool moe_layer_recompute = false;                      // --moe-layer-recompute: selective, modules + moe
  std::string hidden_size, attention_heads;     // --hidden-size, --num-attention-heads
  std::string no_position_shown;                // --no-position-embedding as given
  bool legacy_data = false, split_given = false;  // --data-impl / --llama-model; --split
  std::string legacy_data_shown;                  // the first of --data-impl / --llama-model as given
  std::set<std::string> data_path_forms, split_path_forms;  // a path and its file form (Megatron: one)
  std::string tokenizer_type, vocab_file, merge_file, tokenizer_model, vocab_size;
  // TikTokenizer's flags: their values (Megatron's defaults) and as given.
  std::string tiktoken_pattern, tiktoken_pattern_shown, tiktoken_num_special = "1000", tiktoken_num_special_shown;
  std::vector<std::string> special_tokens;  // --tokenizer-special-tokens
  std::string special_tokens_shown;
  bool overlap_grad_reduce = false;             // --overlap-grad-reduce (its strategy decides the option)
  std::string decoupled_lr, decoupled_min_lr;   // --decoupled-lr, --decoupled-min-lr as given
  bool profile = false;                         // --profile, over [--profile-step-start, --profile-step-end)
  bool full_validation = false;                 // --full-validation
  std::string multiple_sets_shown;              // --multiple-validation-sets as given
  std::vector<std::string> set_names;           // --validation-set-names' values
  std::string set_names_shown;
  std::string profile_start = "10", profile_end = "12";
  std::string overlap_param_gather_shown;       // --overlap-param-gather as given
  std::vector<std::string> unfused_kernels;     // DTK's kernels the --no-*-fusion flags leave out
  std::vector<std::string> unfusing_flags;      // those flags as given
  std::string sgd_momentum, sgd_momentum_shown;                 // --sgd-momentum: its value, and as given
  std::vector<std::string> adam_shown;                          // --adam-beta1/2, --adam-eps as given
  bool load_given = false, exit_on_missing_checkpoint = false;  // --load; --exit-on-missing-checkpoint
  std::string no_load_balancing_shown;  // --moe-router-load-balancing-type none or quantile_balancing as given
  bool gate_scores = false;                                     // --moe-router-score-function sigmoid or sqrtsoftplus
  bool nan_check_given = false;                                 // --(no-)check-for-nan-in-loss-and-grad
  std::string key_value_heads, key_value_heads_shown;           // --num-key-value-heads (Megatron-DeepSpeed)
  bool checkpoint_activations = false;                          // --checkpoint-activations
  std::string checkpoint_layers, checkpoint_layers_shown;       // --checkpoint-num-layers: its value, as given
  // Megatron-DeepSpeed: --deepspeed and its config, and the Megatron flags the config overrules.
  std::string deepspeed_shown, ds_config, ds_config_shown, zero_stage, zero_stage_shown, cpu_optimizer_shown;
  std::vector<std::string> loss_scale_shown;  // --loss-scale, --initial-loss-scale, ...
  std::string clip_grad, clip_grad_shown, micro_batch, micro_batch_shown, global_batch, global_batch_shown;
  std::string distributed_optimizer_shown;  // --use-distributed-optimizer as given
  std::string ddp_bucket, ddp_bucket_shown;  // --ddp-bucket-size: its value, and as given
  std::string no_pipeline_shown, cpu_torch_adam_shown;  // --no-pipeline-parallel, --cpu-torch-adam as given
  std::string dataloader_type, dataloader_type_shown;   // the last --dataloader-type: its value, as given
  std::string no_data_sharding_shown;                   // --no-data-sharding as given
  int ds_config_flags = 0;                              // --deepspeed_config / --deepscale_config given
  std::vector<std::string> num_experts;                 // --num-experts' values
  std::string num_experts_shown;                        // --num-experts as given
  // Megatron-DeepSpeed's MoE flags given: flag -> (values, as given); Megatron-LM's, as given.
  std::map<std::string, std::pair<std::vector<std::string>, std::string>> deepspeed_moe;
  std::vector<std::string> deepspeed_moe_shown, megatron_moe_shown;  // each family's, in the order given
  std::string context_parallel_shown;  // --context-parallel-size or --ds-sequence-parallel-size above 1, as given
  bool ulysses = false;                // ... it was DeepSpeed-Ulysses' flag
  std::string megatron_cp_shown, ulysses_shown;  // each of the two flags as given, any value
  std::vector<std::string> cp_comm_types;        // --cp-comm-type's values
  std::string cp_comm_type_shown;                // ... as given
};

// Records what flag `f` (normalized; `shown` as given, with its values) says for the checks
// across flags.
void note_flag(SeenFlags& s, const std::string& f, const std::string& shown, const std::vector<std::string>& values) {
  if ((f == "--data-impl" || f == "--llama-model") && !s.legacy_data) s.legacy_data = true, s.legacy_data_shown = shown;
  if (f == "--split") s.split_given = true;
  if (f == "--num-experts") s.num_experts = values, s.num_experts_shown = shown;
  if (is_deepspeed_moe_flag(f)) s.deepspeed_moe[f] = {values, shown}, s.deepspeed_moe_shown.push_back(shown);
  if (is_megatron_moe_flag(f)) s.megatron_moe_shown.push_back(shown);
  if (f == "--load") s.load_given = true;
  if ((f == "--context-parallel-size" || f == "--ds-sequence-parallel-size") && values[0] != "0" && values[0] != "1")
    s.context_parallel_shown = shown, s.ulysses = f == "--ds-sequence-parallel-size";
  if (f == "--context-parallel-size") s.megatron_cp_shown = shown;
  if (f == "--ds-sequence-parallel-size") s.ulysses_shown = shown;
  if (f == "--cp-comm-type") s.cp_comm_types = values, s.cp_comm_type_shown = shown;
  if (f == "--num-key-value-heads") s.key_value_heads = values[0], s.key_value_heads_shown = shown;
  if (f == "--checkpoint-activations") s.checkpoint_activations = true;
  if (f == "--checkpoint-num-layers") s.checkpoint_layers = values[0], s.checkpoint_layers_shown = shown;
  if (f == "--deepspeed" || f == "--deepscale") s.deepspeed_shown = shown;
  if (f == "--deepspeed-config" || f == "--deepscale-config")
    s.ds_config = values[0], s.ds_config_shown = shown, ++s.ds_config_flags;
  if (f == "--no-pipeline-parallel") s.no_pipeline_shown = shown;
  if (f == "--cpu-torch-adam") s.cpu_torch_adam_shown = shown;
  if (f == "--dataloader-type") s.dataloader_type = values[0], s.dataloader_type_shown = shown;
  if (f == "--no-data-sharding") s.no_data_sharding_shown = shown;
  if (f == "--zero-stage") s.zero_stage = values[0], s.zero_stage_shown = shown;
  if (f == "--cpu-optimizer") s.cpu_optimizer_shown = shown;
  if (f == "--loss-scale" || f == "--initial-loss-scale" || f == "--min-loss-scale" || f == "--loss-scale-window" ||
      f == "--hysteresis")
    s.loss_scale_shown.push_back(shown);
  if (f == "--clip-grad") s.clip_grad = values[0], s.clip_grad_shown = shown;
  if (f == "--micro-batch-size") s.micro_batch = values[0], s.micro_batch_shown = shown;
  if (f == "--global-batch-size") s.global_batch = values[0], s.global_batch_shown = shown;
  if (f == "--use-distributed-optimizer") s.distributed_optimizer_shown = shown;
  if (f == "--ddp-bucket-size") s.ddp_bucket = values[0], s.ddp_bucket_shown = shown;
  if (f == "--sgd-momentum") s.sgd_momentum = values[0], s.sgd_momentum_shown = shown;
  if (f == "--adam-beta1" || f == "--adam-beta2" || f == "--adam-eps") s.adam_shown.push_back(shown);
  if (f == "--check-for-nan-in-loss-and-grad" || f == "--no-check-for-nan-in-loss-and-grad") s.nan_check_given = true;
  if (f == "--exit-on-missing-checkpoint") s.exit_on_missing_checkpoint = true;
  if (f == "--data-path" || f == "--data-args-path") s.data_path_forms.insert(f);
  if (f == "--train-data-path" || f == "--valid-data-path" || f == "--test-data-path") s.split_path_forms.insert("--*-data-path");
  if (f == "--per-split-data-args-path") s.split_path_forms.insert(f);
  if (f == "--tokenizer-type") s.tokenizer_type = values[0];
  if (f == "--vocab-file") s.vocab_file = values[0];
  if (f == "--merge-file") s.merge_file = values[0];
  if (f == "--tokenizer-model") s.tokenizer_model = values[0];
  if (f == "--vocab-size") s.vocab_size = values[0];
  if (f == "--tiktoken-pattern") s.tiktoken_pattern = values[0], s.tiktoken_pattern_shown = shown;
  if (f == "--tiktoken-num-special-tokens") s.tiktoken_num_special = values[0], s.tiktoken_num_special_shown = shown;
  if (f == "--tokenizer-special-tokens") s.special_tokens = values, s.special_tokens_shown = shown;
  if (f == "--rampup-batch-size") s.rampup = shown;
  if (f == "--step-batch-size-schedule") s.step_schedule = shown;
  if (f == "--train-iters") s.iteration_based = true;
  if (f == "--train-samples") s.sample_based = true;
  if (f == "--lr-decay-iters" || f == "--lr-warmup-iters") s.iteration_schedule.push_back(shown);
  // Megatron asserts lr_decay_samples None and lr_warmup_samples 0 (its default) for iterations.
  if ((f == "--lr-decay-samples" || f == "--lr-warmup-samples") && values[0] != "0") s.sample_schedule.push_back(shown);
  // Megatron-DeepSpeed's loop trains while consumed tokens < --train-tokens: 0 (or less) trains nothing.
  if (f == "--train-tokens" && std::strtoll(values[0].c_str(), nullptr, 10) <= 0) s.no_train_tokens = shown;
  if ((f == "--position-embedding-type" && values[0] == "rope") || f == "--use-rotary-position-embeddings")
    s.rope = true;
  if (f == "--no-position-embedding") s.no_position_shown = shown;
  if (f == "--use-checkpoint-args") s.use_checkpoint_args = true;
  if (f == "--overlap-grad-reduce") s.overlap_grad_reduce = true;
  if (f == "--profile") s.profile = true;
  if (f == "--full-validation") s.full_validation = true;
  if (f == "--multiple-validation-sets") s.multiple_sets_shown = shown;
  if (f == "--validation-set-names") s.set_names = values, s.set_names_shown = shown;
  if (f == "--decoupled-lr") s.decoupled_lr = values[0];
  if (f == "--decoupled-min-lr") s.decoupled_min_lr = values[0];
  if (f == "--profile-step-start") s.profile_start = values[0];
  if (f == "--profile-step-end") s.profile_end = values[0];
  if (f == "--overlap-param-gather") s.overlap_param_gather_shown = shown;
  const char* kernel = f == "--no-rope-fusion"           ? "rotary"
                       : f == "--no-bias-gelu-fusion"    ? "bias_gelu"
                       : f == "--no-bias-swiglu-fusion"  ? "swiglu"
                       : f == "--no-bias-dropout-fusion" ? "bias_add"
                                                         : nullptr;
  if (kernel && std::find(s.unfused_kernels.begin(), s.unfused_kernels.end(), kernel) == s.unfused_kernels.end())
    s.unfused_kernels.push_back(kernel), s.unfusing_flags.push_back(shown);
  if (f == "--use-rope-scaling") s.rope_scaling = true;
  if (f == "--rope-scaling-factor") s.rope_factor = values[0], s.rope_factor_shown = shown;
  if (f == "--kv-channels") s.kv_channels = values[0], s.kv_channels_shown = shown;
  if (f == "--moe-router-load-balancing-type")
    s.no_load_balancing_shown = values[0] == "none" || values[0] == "quantile_balancing" ? shown : "";
  if (f == "--moe-router-score-function") s.gate_scores = values[0] != "softmax";
  if (f == "--recompute-granularity") s.recompute_granularity = values[0];
  if (f == "--recompute-activations") s.recompute_activations = true;
  if (f == "--recompute-method" && (values[0] == "uniform" || values[0] == "block"))
    s.recompute_method = values[0], s.recompute_method_shown = shown;
  if (f == "--recompute-num-layers") s.recompute_layers = values[0], s.recompute_layers_shown = shown;
  if (f == "--recompute-modules") s.recompute_modules = values, s.recompute_modules_shown = shown;
  if (f == "--moe-layer-recompute") s.moe_layer_recompute = true;
  if (f == "--hidden-size") s.hidden_size = values[0];
  if (f == "--num-attention-heads") s.attention_heads = values[0];
  if (f == "--normalization" && (values[0] == "RMSNorm" || values[0] == "rmsnorm")) s.rms_norm = true;
  if (f == "--swiglu") s.swiglu = true;
  if (f == "--group-query-attention") s.group_query_attention = true;
  if (f == "--num-query-groups") s.query_groups = values[0], s.query_groups_shown = shown;
  if (f == "--num-layers") s.num_layers = values[0];
  if (f == "--pipeline-model-parallel-size") s.pipeline_size = values[0];
  if (f == "--num-layers-per-virtual-pipeline-stage") s.per_virtual_stage = values[0], s.per_virtual_shown = shown;
  if (f == "--decoder-first-pipeline-num-layers" || f == "--decoder-last-pipeline-num-layers") s.uneven_shown = shown;
  if (f == "--num-virtual-stages-per-pipeline-rank") s.virtual_stages_shown = shown;
  if (f == "--virtual-pipeline-model-parallel-size") s.virtual_size_shown = shown;
  if (f == "--pipeline-model-parallel-layout") s.layout = values[0], s.layout_shown = shown;
  if (f == "--account-for-embedding-in-pipeline-split") s.embedding_in_split = true;
  if (f == "--account-for-loss-in-pipeline-split") s.loss_in_split = true;
  if (f == "--fp16") s.fp16 = true;
  if (f == "--bf16") s.bf16 = true;
  if (f == "--disable-bias-linear" || f == "--group-query-attention" || f == "--rotary-percent" ||
      f == "--rotary-base" || f == "--use-rope-scaling" || f == "--llama-model" ||
      f == "--rotary-position-embeddings-theta" || f == "--qk-layernorm" || f == "--add-qkv-bias")
    s.llama_only.push_back(shown);
  if (f == "--openai-gelu" || f == "--max-position-embeddings") s.gpt_only.push_back(shown);
}

// One known flag with the right number of values, by its rule's kind.
void apply_rule(const Rule& r, const std::string& flag, const std::string& shown,
                const std::vector<std::string>& values, MegatronMapping& m) {
  switch (r.kind) {
    case Kind::kSet:
      m.sets.push_back(std::string(r.target) + "=" + values[0]);
      break;
    case Kind::kSwitch:
      add_assignments(m, r.target);
      break;
    case Kind::kIgnore:
      m.ignored.push_back(flag + " (" + r.note + ")");
      break;
    case Kind::kRefuse:
      m.refused.push_back(shown + ": " + r.note);
      break;
    case Kind::kCustom:
      custom(r, flag, values, m);
      break;
  }
}

// Megatron builds grouped-query attention only with --group-query-attention, with
// --num-query-groups groups (default 1: multi-query); the group count alone changes nothing.
void map_query_groups(SeenFlags& s, MegatronMapping& m) {
  if (s.group_query_attention && !s.query_groups.empty()) s.llama_only.push_back(s.query_groups_shown);
  if (s.group_query_attention)
    set_by(m, "model.num_query_groups=" + (s.query_groups.empty() ? std::string("1") : s.query_groups),
           s.query_groups.empty() ? "--group-query-attention" : s.query_groups_shown);
  else if (!s.query_groups.empty())
    m.ignored.push_back(s.query_groups_shown +
                        " (Megatron reads it only with --group-query-attention: multi-head "
                        "attention as written)");
}

// Megatron profiles from the step taken when its count of finished iterations is
// --profile-step-start to the one before it reaches --profile-step-end: DTK's iterations (1-based)
// start + 1 to end. Without --profile the step flags change nothing.
void map_profile(const SeenFlags& s, MegatronMapping& m) {
  if (!s.profile) return;
  char* end = nullptr;
  const long first = std::strtol(s.profile_start.c_str(), &end, 10) + 1;
  const bool bad_start = s.profile_start.empty() || *end;
  const long last = std::strtol(s.profile_end.c_str(), &end, 10);
  if (bad_start || s.profile_end.empty() || *end || first < 1 || last < first)
    return m.refused.push_back("--profile-step-start " + s.profile_start + " --profile-step-end " + s.profile_end +
                               ": not a range of iterations (0 <= start < end)");
  set_by(m, "logging.profile_steps=" + std::to_string(first) + "-" + std::to_string(last), "--profile");
}

// Megatron-LM's decoupled learning rate: the parameters it marks is_embedding_or_output_parameter
// (the word embeddings, and the output layer, which is the tied head's copy under tied
// embeddings) get max_lr --decoupled-lr and min_lr --decoupled-min-lr (else --min-lr).
void map_decoupled_lr(const SeenFlags& s, MegatronMapping& m) {
  const auto rate = [&](const std::string& flag, const std::string& v) {
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    const bool ok = !v.empty() && !*end && std::isfinite(x) && x >= 0;
    if (!ok) m.refused.push_back(flag + " " + v + ": not a learning rate >= 0");
    return ok;
  };
  if (s.decoupled_lr.empty()) {
    if (!s.decoupled_min_lr.empty())
      m.ignored.push_back("--decoupled-min-lr " + s.decoupled_min_lr + " (without --decoupled-lr, as Megatron)");
    return;
  }
  if (!rate("--decoupled-lr", s.decoupled_lr) ||
      (!s.decoupled_min_lr.empty() && !rate("--decoupled-min-lr", s.decoupled_min_lr)))
    return;
  set_by(
      m,
      R"(lr.param_rules=match: "(^|\\.)(word_embeddings|word_embeddings_for_head|output_layer)\\.weight$" max_lr: )" +
          s.decoupled_lr + (s.decoupled_min_lr.empty() ? "" : " min_lr: " + s.decoupled_min_lr),
      "--decoupled-lr");
}

// A whole positive number, or 0.
long positive_number(const std::string& v) {
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  return v.empty() || *end || n <= 0 ? 0L : n;
}

// Megatron-DeepSpeed's grouped-query attention: --num-key-value-heads groups (the head count, its
// default, is multi-head attention as without the flag).
void map_key_value_heads(SeenFlags& s, MegatronMapping& m) {
  if (s.key_value_heads_shown.empty()) return;
  if (positive_number(s.key_value_heads) == 0)
    return m.refused.push_back(s.key_value_heads_shown + ": not a positive number of key-value heads");
  if (s.group_query_attention || !s.query_groups_shown.empty())
    return m.refused.push_back(s.key_value_heads_shown +
                               " with --group-query-attention/--num-query-groups: give one (Megatron-DeepSpeed's and "
                               "Megatron's names of the same groups)");
  if (s.key_value_heads == s.attention_heads) return;
  s.llama_only.push_back(s.key_value_heads_shown);
  set_by(m, "model.num_query_groups=" + s.key_value_heads, s.key_value_heads_shown);
}

// Whether a flag set `field` ("model.x").
bool has_sets(const MegatronMapping& m, const std::string& field) {
  return std::any_of(m.sets.begin(), m.sets.end(),
                     [&](const std::string& set) { return set.rfind(field + "=", 0) == 0; });
}

// Context parallelism's two names and its exchange. Megatron's --context-parallel-size and
// Megatron-DeepSpeed's --ds-sequence-parallel-size (DeepSpeed-Ulysses) set the same split: given
// together they are refused, not one silently overriding the other. Megatron's default
// --cp-comm-type is p2p (its ring passes the keys and values round the group): DTK's all_gather,
// as the flag given, said at start; Ulysses exchanges heads (a2a). A per-layer list must name
// every layer of --num-layers, as Megatron asserts (DTK checks it where --num-layers is given).
void map_context_parallel(const SeenFlags& s, MegatronMapping& m) {
  if (!s.megatron_cp_shown.empty() && !s.ulysses_shown.empty())
    return m.refused.push_back(s.megatron_cp_shown + " with " + s.ulysses_shown +
                               ": give one (Megatron's and Megatron-DeepSpeed's names of the same split of each "
                               "sequence; Megatron-DeepSpeed's exchanges heads, --cp-comm-type a2a)");
  const long layers = positive_number(s.num_layers);
  const bool refused_already = std::any_of(m.refused.begin(), m.refused.end(), [&](const std::string& r) {
    return r.rfind(s.cp_comm_type_shown + ":", 0) == 0;
  });
  if (s.cp_comm_types.size() > 1 && layers > 0 && static_cast<long>(s.cp_comm_types.size()) != layers &&
      !refused_already)
    return m.refused.push_back(s.cp_comm_type_shown + ": a per-layer list of " +
                               std::to_string(s.cp_comm_types.size()) + " exchanges for --num-layers " + s.num_layers +
                               " (Megatron asserts one per layer)");
  if (s.context_parallel_shown.empty() || has_sets(m, "distributed.cp_comm_type")) return;
  set_by(m, std::string("distributed.cp_comm_type=") + (s.ulysses ? "a2a" : "all_gather"), s.context_parallel_shown);
  if (!s.ulysses)
    note_about(m, "distributed.cp_comm_type",
               s.context_parallel_shown +
                   " without --cp-comm-type: Megatron's default p2p runs as all_gather "
                   "(distributed.cp_comm_type=all_gather): the same attention, the keys and values gathered at "
                   "once rather than passed round a ring");
}

// Drops the assignments to `field` (and their credit); a name ending in '.' drops its group's.
void drop_sets(MegatronMapping& m, const std::string& field) {
  const bool group = field.back() == '.';
  const auto of_field = [&](const std::string& set) { return set.rfind(group ? field : field + "=", 0) == 0; };
  m.sets.erase(std::remove_if(m.sets.begin(), m.sets.end(), of_field), m.sets.end());
  for (auto it = m.flag_of.begin(); it != m.flag_of.end();)
    it = (group ? it->first.rfind(field, 0) == 0 : it->first == field) ? m.flag_of.erase(it) : std::next(it);
}

// Megatron's --ddp-bucket-size (elements) is the bucket of its DDP buffers, which its distributed
// optimizer shares: ddp's bucket in MB of fp32, or ZeRO's reduce bucket.
void map_ddp_bucket(const SeenFlags& s, MegatronMapping& m) {
  if (s.ddp_bucket_shown.empty()) return;
  const long elements = positive_number(s.ddp_bucket);
  if (elements == 0) return m.refused.push_back(s.ddp_bucket_shown + ": not a positive number of elements");
  if (!s.deepspeed_shown.empty())
    return m.ignored.push_back(s.ddp_bucket_shown + " (under --deepspeed: zero_optimization.reduce_bucket_size)");
  if (m.strategy == "zero") return set_by(m, "strategy.reduce_bucket_size=" + s.ddp_bucket, s.ddp_bucket_shown);
  set_by(m, "strategy.bucket_size_mb=" + number_text(static_cast<double>(elements) * 4.0 / (1 << 20)),
         s.ddp_bucket_shown);
}

// Megatron-DeepSpeed with --deepspeed: DeepSpeed's config decides ZeRO, the precision and its loss
// scaling, clipping and the batch, while Megatron's loop builds the model, the optimizer and the
// schedule and hands them to DeepSpeed (deepspeed.initialize(optimizer=..., lr_scheduler=...)), so
// the config's own optimizer and scheduler do nothing. Megatron flags the config overrules are said
// to have no effect; a setting both give with two values is refused, as one side would train
// another run than the other expects. (--cpu-optimizer, Megatron-DeepSpeed's choice of the host's
// Adam, is the cpu_adam plugin with or without --deepspeed.)
void map_deepspeed(SeenFlags& s, MegatronMapping& m) {
  if (!s.cpu_optimizer_shown.empty()) {
    if (m.optimizer == "sgd")
      m.refused.push_back(s.cpu_optimizer_shown +
                          " with --optimizer sgd: CPU offloading is for Adam (Megatron-DeepSpeed asserts it)");
    else
      m.optimizer = "cpu_adam";
  } else if (!s.cpu_torch_adam_shown.empty()) {
    m.ignored.push_back(s.cpu_torch_adam_shown + " (Megatron-DeepSpeed reads it only with --cpu-optimizer)");
  }
  if (!s.no_pipeline_shown.empty() && positive_number(s.pipeline_size) > 1)
    m.refused.push_back(s.no_pipeline_shown + " with --pipeline-model-parallel-size " + s.pipeline_size +
                        ": give one (Megatron-DeepSpeed asserts it)");
  if (s.deepspeed_shown.empty()) {
    if (!s.ds_config_shown.empty())
      m.ignored.push_back(s.ds_config_shown + " (without --deepspeed Megatron-DeepSpeed does not read it)");
    if (!s.zero_stage_shown.empty())
      m.ignored.push_back(s.zero_stage_shown + " (without --deepspeed there is no ZeRO)");
    return;
  }
  if (s.ds_config_shown.empty())
    return m.refused.push_back(s.deepspeed_shown +
                               ": needs --deepspeed_config FILE (DeepSpeed reads its settings from it)");
  if (s.ds_config_flags > 1)
    return m.refused.push_back(
        "--deepspeed_config given twice (or with --deepscale_config): give one (DeepSpeed "
        "asserts it)");
  DeepSpeedConfig ds;
  try {
    ds = read_deepspeed_config(s.ds_config);
  } catch (const HostError& e) {
    return m.refused.push_back(s.ds_config_shown + ": " + e.what());
  }
  m.refused.insert(m.refused.end(), ds.refused.begin(), ds.refused.end());
  m.ignored.insert(m.ignored.end(), ds.ignored.begin(), ds.ignored.end());
  for (const auto& section : ds.client_sections)
    m.notes.push_back(s.ds_config + ": \"" + section +
                      "\" has no effect: Megatron-DeepSpeed passes DeepSpeed its own " +
                      (section == "optimizer" ? "optimizer (--optimizer, --adam-*, --lr, --weight-decay)"
                                              : "schedule (--lr-decay-style, --lr-warmup-*, --lr-decay-iters)") +
                      ", which DeepSpeed uses instead");
  // Megatron's distributed optimizer and its overlaps are not built under DeepSpeed.
  if (!s.distributed_optimizer_shown.empty())
    m.ignored.push_back(s.distributed_optimizer_shown +
                        " (under --deepspeed the config's zero_optimization decides: Megatron-DeepSpeed hands "
                        "DeepSpeed the bare optimizer)");
  if (s.overlap_grad_reduce)
    m.ignored.push_back("--overlap-grad-reduce (under --deepspeed: zero_optimization.overlap_comm)");
  if (!s.overlap_param_gather_shown.empty())
    m.ignored.push_back(s.overlap_param_gather_shown + " (under --deepspeed DeepSpeed gathers the parameters)");
  s.overlap_grad_reduce = false, s.overlap_param_gather_shown.clear();
  drop_sets(m, "strategy.");
  m.strategy = ds.stage == 0 ? "ddp" : "zero";
  // Without --no-pipeline-parallel Megatron-DeepSpeed trains through DeepSpeed's pipeline engine.
  if (ds.stage >= 2 && s.no_pipeline_shown.empty())
    m.refused.push_back(s.ds_config + ": zero_optimization.stage " + std::to_string(ds.stage) +
                        " without --no-pipeline-parallel: Megatron-DeepSpeed then trains through DeepSpeed's "
                        "pipeline engine, which refuses ZeRO-2 and ZeRO-3; add --no-pipeline-parallel");
  // Megatron-DeepSpeed reads its --zero-stage only as "stage 3 or not" (the partitioned build).
  if (!s.zero_stage.empty() && (std::strtol(s.zero_stage.c_str(), nullptr, 10) == 3) != (ds.stage == 3))
    m.refused.push_back(s.zero_stage_shown + ": " + s.ds_config + " says zero_optimization.stage " +
                        std::to_string(ds.stage) +
                        " (Megatron-DeepSpeed would build the model for one stage and "
                        "DeepSpeed train another); give the same stage");
  const std::string flag_precision = s.fp16 ? "fp16" : s.bf16 ? "bf16" : "";
  if (!flag_precision.empty() && flag_precision != ds.precision)
    m.refused.push_back("--" + flag_precision + ": " + s.ds_config + " trains " + ds.precision +
                        " (fp16.enabled, bf16.enabled); give the same precision to both");
  for (const auto& shown : s.loss_scale_shown)
    m.ignored.push_back(shown + " (under --deepspeed the config's fp16 section scales the loss)");
  for (const char* field : {"train.loss_scale", "train.initial_loss_scale", "train.min_loss_scale",
                            "train.loss_scale_window", "train.hysteresis"})
    drop_sets(m, field);
  // DeepSpeed clips by its config alone.
  if (!s.clip_grad_shown.empty() && std::strtod(s.clip_grad.c_str(), nullptr) != ds.gradient_clipping)
    m.notes.push_back(s.clip_grad_shown + " has no effect under --deepspeed: DeepSpeed clips by " + s.ds_config +
                      "'s gradient_clipping (" + number_text(ds.gradient_clipping) +
                      (ds.gradient_clipping_given ? "" : ", DeepSpeed's default when absent") + ")");
  drop_sets(m, "train.clip_grad");
  const auto differ = [](const std::string& flag_value, const std::optional<long long>& ds_value) {
    return ds_value && !flag_value.empty() && std::strtoll(flag_value.c_str(), nullptr, 10) != *ds_value;
  };
  if (differ(s.micro_batch, ds.micro_batch))
    m.refused.push_back(s.micro_batch_shown + ": " + s.ds_config + "'s train_micro_batch_size_per_gpu is " +
                        std::to_string(*ds.micro_batch) +
                        " (Megatron's loop would feed one size and DeepSpeed count another); give the same");
  if (differ(s.global_batch, ds.train_batch))
    m.refused.push_back(s.global_batch_shown + ": " + s.ds_config + "'s train_batch_size is " +
                        std::to_string(*ds.train_batch) +
                        " (Megatron's loop would step at one batch and DeepSpeed at another); give the same");
  // DeepSpeed tests its ZeRO with its own optimizers (Adam and the like), not torch's SGD.
  if (m.optimizer == "sgd" && ds.stage >= 1 && !ds.allow_untested_optimizer)
    m.refused.push_back("--optimizer sgd with " + s.ds_config + "'s zero_optimization.stage " +
                        std::to_string(ds.stage) +
                        ": DeepSpeed refuses an optimizer its ZeRO was not tested with (zero_allow_untested_optimizer: "
                        "true allows it)");
  // ZeRO-Offload steps with DeepSpeed's CPU Adam: DeepSpeed refuses another client optimizer (torch's
  // AdamW included) unless zero_force_ds_cpu_optimizer is false.
  const bool torch_adam = !s.cpu_torch_adam_shown.empty() && !s.cpu_optimizer_shown.empty();
  if (ds.offload_optimizer != "none" && (m.optimizer != "cpu_adam" || torch_adam)) {
    const std::string offload = s.ds_config + ": " + ds.offload_optimizer_key + " " + ds.offload_optimizer;
    if (m.optimizer == "sgd")
      m.refused.push_back(offload + " with --optimizer sgd: the offloaded step is Adam's (cpu_adam)");
    else if (ds.force_ds_cpu_optimizer)
      m.refused.push_back(offload + (torch_adam ? " with --cpu-torch-adam" : " without --cpu-optimizer") +
                          ": DeepSpeed refuses ZeRO-Offload with an optimizer other than its CPU Adam "
                          "(zero_force_ds_cpu_optimizer: false allows it)" +
                          (torch_adam ? "" : "; add --cpu-optimizer"));
    else
      m.optimizer = "cpu_adam";
  }
  // The config first, so that a Megatron flag given as well (--timing-log-level) wins.
  m.sets.insert(m.sets.begin(), ds.sets.begin(), ds.sets.end());
  for (const auto& [field, key] : ds.key_of) m.flag_of.insert({field, key});
}

// Megatron-DeepSpeed's get_num_experts_per_layer: layer L (1-based) of `layers` is MoE layer j when
// L = (j + 1) N (N the interval), with `counts[j]` experts (or the one count), and dense where that
// is at most one. Returns one count per layer, 0 for a dense one.
std::vector<long> experts_per_layer(const std::vector<long>& counts, long layers, long interval) {
  std::vector<long> per_layer;
  for (long layer = 1; layer <= layers; ++layer) {
    const long n = layer % interval ? 0 : counts[counts.size() == 1 ? 0 : static_cast<size_t>(layer / interval - 1)];
    per_layer.push_back(n > 1 ? n : 0);
  }
  return per_layer;
}

// Megatron-DeepSpeed's MoE flags given that do nothing, each said with `why` (those its rule
// ignores are said already).
void note_unused_deepspeed_moe(const SeenFlags& s, const std::string& why, MegatronMapping& m) {
  for (const auto& [flag, given] : s.deepspeed_moe)
    if (find_rule(flag)->kind != Kind::kIgnore) m.ignored.push_back(given.second + " (" + why + ")");
}

// Megatron-DeepSpeed's MoE: DeepSpeed's gate on every --expert-interval-th layer with its defaults
// (top-1, capacity factors 1.0, least capacity 4, loss coefficient 0.1).
void map_deepspeed_moe(const SeenFlags& s, const std::vector<long>& counts, MegatronMapping& m) {
  const auto given = [&](const char* flag) { return s.deepspeed_moe.count(flag) > 0; };
  const auto value = [&](const char* flag, const char* fallback) {
    return given(flag) ? s.deepspeed_moe.at(flag).first[0] : std::string(fallback);
  };
  const auto credit = [&](const char* flag) {
    return given(flag) ? s.deepspeed_moe.at(flag).second : s.num_experts_shown;
  };
  const std::string interval_text = value("--expert-interval", "2");
  const long interval = positive_number(interval_text), layers = positive_number(s.num_layers);
  if (interval == 0) return m.refused.push_back(credit("--expert-interval") + ": not a positive number of layers");
  if (layers == 0)
    return m.refused.push_back(s.num_experts_shown +
                               ": DeepSpeed's MoE layers are every --expert-interval-th layer: give --num-layers");
  if (s.num_experts.size() > 1 && static_cast<long>(s.num_experts.size()) != layers / interval)
    return m.refused.push_back(s.num_experts_shown + ": " + std::to_string(s.num_experts.size()) + " counts for " +
                               std::to_string(layers / interval) +
                               " MoE layers (Megatron-DeepSpeed asserts one count, or one per MoE layer)");
  const std::string mlp_type = value("--mlp-type", "standard");
  if (mlp_type != "standard" && mlp_type != "residual")
    return m.refused.push_back(credit("--mlp-type") + ": not one of standard, residual");
  if (layers < interval) {  // no layer number is a multiple of the interval: Megatron-DeepSpeed's are dense
    m.ignored.push_back(s.num_experts_shown + " (no layer of " + std::to_string(layers) + " is a multiple of " +
                        "--expert-interval " + std::to_string(interval) + ": Megatron-DeepSpeed builds dense MLPs)");
    return note_unused_deepspeed_moe(s, "no MoE layer", m);
  }
  // The MoE layers (1-based) and their counts: a pyramid where they differ (DeepSpeed's PR-MoE).
  const std::vector<long> per_layer = experts_per_layer(counts, layers, interval);
  std::string pattern, moe_layers, layer_counts;
  long largest = 0, every_slot = 1;
  for (long layer = 1; layer <= layers; ++layer) {
    const long n = per_layer[static_cast<size_t>(layer - 1)];
    pattern += std::string(pattern.empty() ? "[" : ",") + (n ? "1" : "0");
    if (layer % interval == 0 && n == 0) every_slot = 0;
    if (n == 0) continue;
    moe_layers += (moe_layers.empty() ? "" : ", ") + std::to_string(layer);
    layer_counts += (layer_counts.empty() ? "" : ",") + std::to_string(n);
    largest = std::max(largest, n);
  }
  const bool pyramid = std::any_of(per_layer.begin(), per_layer.end(), [&](long n) { return n && n != largest; });
  set_by(m, "model.num_experts=" + std::to_string(largest), s.num_experts_shown);
  if (pyramid) set_by(m, "model.moe_layer_num_experts=" + layer_counts, s.num_experts_shown);
  set_by(m, "model.moe_gate=deepspeed", s.num_experts_shown);
  set_by(m, std::string("model.moe_residual=") + (mlp_type == "residual" ? "true" : "false"), credit("--mlp-type"));
  set_by(m, "model.moe_layer_freq=" + (interval == 1 && every_slot ? std::string("1") : pattern + "]"),
         credit("--expert-interval"));
  const std::string topk = value("--topk", "1");
  set_by(m, "model.moe_router_topk=" + topk, credit("--topk"));
  set_by(m, "model.moe_aux_loss_coeff=" + value("--moe-loss-coeff", "0.1"), credit("--moe-loss-coeff"));
  if (given("--moe-expert-parallel-size"))
    set_by(m, "distributed.expert_model_parallel_size=" + value("--moe-expert-parallel-size", ""),
           credit("--moe-expert-parallel-size"));
  const char* capacity_flags[] = {"--moe-train-capacity-factor", "--moe-eval-capacity-factor", "--moe-min-capacity"};
  if (given("--disable-moe-token-dropping")) {
    set_by(m, "model.moe_expert_capacity_factor=0", credit("--disable-moe-token-dropping"));
    if (positive_number(topk) > 2)  // (its locations are only made when it drops)
      m.notes.push_back(credit("--disable-moe-token-dropping") + " with --topk " + topk +
                        ": DeepSpeed's topkgating fails without dropping; DTK keeps every choice of each token");
    for (const char* flag : capacity_flags)
      if (given(flag)) m.ignored.push_back(credit(flag) + " (--disable-moe-token-dropping: no capacity)");
  } else {
    for (const char* flag : {"--moe-train-capacity-factor", "--moe-eval-capacity-factor"}) {
      char* end = nullptr;
      const std::string v = value(flag, "1.0");
      const double factor = std::strtod(v.c_str(), &end);
      if (v.empty() || *end || !(factor > 0.0) || !std::isfinite(factor))
        return m.refused.push_back(credit(flag) +
                                   ": not a factor > 0 (at 0 DeepSpeed's capacity is --moe-min-capacity alone, which "
                                   "DTK's factors cannot say: its factor 0 is dropless, its evaluation factor 0 "
                                   "the training one)");
    }
    set_by(m, "model.moe_expert_capacity_factor=" + value("--moe-train-capacity-factor", "1.0"),
           credit("--moe-train-capacity-factor"));
    set_by(m, "model.moe_eval_capacity_factor=" + value("--moe-eval-capacity-factor", "1.0"),
           credit("--moe-eval-capacity-factor"));
    set_by(m, "model.moe_min_capacity=" + value("--moe-min-capacity", "4"), credit("--moe-min-capacity"));
  }
  if (given("--disable-moe-top2-2nd-expert-sampling")) {
    if (topk == "2")
      set_by(m, "model.moe_top2_2nd_expert_sampling=false", credit("--disable-moe-top2-2nd-expert-sampling"));
    else
      m.ignored.push_back(credit("--disable-moe-top2-2nd-expert-sampling") + " (top-" + topk +
                          " samples no second expert)");
  }
  // Which reading --num-experts had, said at start (Megatron-LM's differs in every default).
  const bool dropless = given("--disable-moe-token-dropping");
  m.notes.push_back(
      s.num_experts_shown + " is Megatron-DeepSpeed's (" +
      (s.deepspeed_shown.empty() ? s.deepspeed_moe_shown[0] : s.deepspeed_shown) +
      "): DeepSpeed's gate (model.moe_gate=deepspeed) on " +
      (!every_slot ? "layers " + moe_layers + " (1-based)"
       : interval == 1
           ? std::string("every layer")
           : "layers " + std::to_string(interval) + ", " + std::to_string(2 * interval) + ", ... (1-based)") +
      (pyramid ? " with " + layer_counts + " experts (a pyramid)" : std::string()) + ", top-" + topk + ", " +
      (dropless
           ? std::string("dropless")
           : "capacity factor " + value("--moe-train-capacity-factor", "1.0") + " (evaluation " +
                 value("--moe-eval-capacity-factor", "1.0") + "), least capacity " + value("--moe-min-capacity", "4")) +
      ", loss coefficient " + value("--moe-loss-coeff", "0.1"));
}

// --num-experts in Megatron-LM's reading (one count: its MoE layer) or, with --deepspeed or any of
// Megatron-DeepSpeed's MoE flags, in Megatron-DeepSpeed's (DeepSpeed's MoE layer, whose flags
// Megatron-LM has not, and the reverse: a mix of the two families is refused, as each one's
// argparse refuses the other's flags).
void map_moe(const SeenFlags& s, MegatronMapping& m) {
  const bool deepspeed = !s.deepspeed_shown.empty() || !s.deepspeed_moe.empty();
  if (!s.deepspeed_moe.empty() && !s.megatron_moe_shown.empty())
    return m.refused.push_back(s.megatron_moe_shown[0] + " with " + s.deepspeed_moe_shown[0] +
                               ": Megatron-LM's and Megatron-DeepSpeed's MoE flags; give one family");
  if (s.num_experts.empty())
    return note_unused_deepspeed_moe(s, "Megatron-DeepSpeed reads it only with --num-experts", m);
  if (!deepspeed) {  // (Megatron-LM's count the model checks)
    if (s.num_experts.size() > 1)
      return m.refused.push_back(s.num_experts_shown +
                                 ": Megatron-LM's --num-experts is one count (a list per MoE layer is "
                                 "Megatron-DeepSpeed's, with --deepspeed)");
    return set_by(m, "model.num_experts=" + s.num_experts[0], s.num_experts_shown);
  }
  std::vector<long> counts;  // (a list: DeepSpeed's pyramid MoE, one count per MoE layer)
  for (const std::string& v : s.num_experts) {
    counts.push_back(v == "0" ? 0 : positive_number(v));
    // (In a list 0 is no count: Megatron-DeepSpeed builds a layer of 1 dense, and one of 0 too, whose
    // forward then fails, taking it for an MoE layer.)
    if (counts.back() == 0 && (v != "0" || s.num_experts.size() > 1))
      return m.refused.push_back(s.num_experts_shown + ": " + (s.num_experts.size() > 1 ? "'" + v + "' is " : "") +
                                 "not a number of experts");
  }
  if (!s.megatron_moe_shown.empty())  // (with --deepspeed: a mix with its MoE flags is refused above)
    return m.refused.push_back(s.megatron_moe_shown[0] + ": Megatron-LM's MoE flag; with " + s.deepspeed_shown +
                               " --num-experts is DeepSpeed's MoE (its flags: --topk, --expert-interval, "
                               "--moe-expert-parallel-size, --moe-train-capacity-factor, --moe-loss-coeff, ...)");
  if (*std::max_element(counts.begin(), counts.end()) <= 1)
    return note_unused_deepspeed_moe(s, "at most one expert: Megatron-DeepSpeed builds dense MLPs", m);
  map_deepspeed_moe(s, counts, m);
}

// Megatron-core's recompute_modules: what selective recomputation recomputes (core_attn when not
// given; --moe-layer-recompute adds moe). DTK's layers recompute core_attn, mlp and moe; Megatron
// reads the list only under selective granularity.
void map_recompute_modules(const SeenFlags& s, bool selective, MegatronMapping& m) {
  if (s.recompute_modules_shown.empty() && !s.moe_layer_recompute) return;
  if (!selective)
    return m.ignored.push_back(s.recompute_modules_shown.substr(0, s.recompute_modules_shown.find(' ')) +
                               " (Megatron reads it only with --recompute-granularity selective)");
  std::vector<std::string> modules =
      s.recompute_modules_shown.empty() ? std::vector<std::string>{"core_attn"} : s.recompute_modules;
  if (s.moe_layer_recompute && std::find(modules.begin(), modules.end(), "moe") == modules.end())
    modules.push_back("moe");
  std::vector<std::string> unknown, other, kept;
  for (const std::string& module : modules) {
    const int32_t bit = dtk::recompute_module_bit(module);
    if (bit < 0)
      unknown.push_back(module);
    else if (bit == 0)
      other.push_back(module);
    else if (std::find(kept.begin(), kept.end(), module) == kept.end())
      kept.push_back(module);
  }
  const std::string shown = s.recompute_modules_shown.empty() ? "--moe-layer-recompute" : s.recompute_modules_shown;
  if (!unknown.empty())
    m.refused.push_back(shown + ": " + joined(unknown, ", ") + " not among Megatron's modules (" +
                        dtk::recompute_module_list(false) + ")");
  else if (!other.empty())
    m.refused.push_back(shown + ": DTK's layers recompute " + dtk::recompute_module_list(true) + "; not " +
                        joined(other, ", ") + " (--recompute-granularity full recomputes whole layers)");
  else
    set_by(m, "model.recompute_modules=" + joined(kept, ","), shown);
}

// Megatron recomputes as --recompute-granularity says (selective with --recompute-activations,
// whatever the granularity); --recompute-method and --recompute-num-layers shape full
// recomputation only. With selective it refuses either (an assertion on the method, Megatron-core's
// ValueError on the layer count); without a granularity it reads neither.
void map_recompute(const SeenFlags& s, MegatronMapping& m) {
  // Older Megatron's (Megatron-DeepSpeed's) --checkpoint-activations: full, uniform groups of
  // --checkpoint-num-layers layers.
  if (s.checkpoint_activations &&
      (!s.recompute_granularity.empty() || s.recompute_activations || s.moe_layer_recompute))
    m.refused.push_back(
        "--checkpoint-activations with --recompute-granularity/--recompute-activations/--moe-layer-recompute: give "
        "one (older and newer Megatron's names of recomputation)");
  else if (s.checkpoint_activations) {
    set_by(m, "model.recompute_activations=full", "--checkpoint-activations");
    set_by(m, "model.recompute_method=uniform", "--checkpoint-activations");
    set_by(m, "model.recompute_num_layers=" + (s.checkpoint_layers.empty() ? std::string("1") : s.checkpoint_layers),
           s.checkpoint_layers.empty() ? "--checkpoint-activations" : s.checkpoint_layers_shown);
  } else if (!s.checkpoint_layers_shown.empty()) {
    m.ignored.push_back(s.checkpoint_layers_shown + " (Megatron reads it only with --checkpoint-activations)");
  }
  // Megatron-core's --moe-layer-recompute (deprecated): selective granularity with moe among the
  // modules; with full granularity a ValueError.
  if (s.moe_layer_recompute && !s.recompute_activations && s.recompute_granularity == "full")
    return m.refused.push_back(
        "--moe-layer-recompute with --recompute-granularity full: Megatron refuses it (give one; the MoE layer is "
        "recompute module moe)");
  const std::string granularity =
      s.recompute_activations || s.moe_layer_recompute ? "selective" : s.recompute_granularity;
  const bool selective = granularity == "selective";
  const char* granularity_flag = s.recompute_activations           ? "--recompute-activations"
                                 : s.recompute_granularity.empty() ? "--moe-layer-recompute"
                                                                   : "--recompute-granularity";
  if (selective) set_by(m, "model.recompute_activations=selective", granularity_flag);
  map_recompute_modules(s, selective, m);
  if (granularity == "full") {
    set_by(m, "model.recompute_activations=full", granularity_flag);
    if (!s.recompute_method.empty())
      set_by(m, "model.recompute_method=" + s.recompute_method, s.recompute_method_shown);
    if (!s.recompute_layers.empty())
      set_by(m, "model.recompute_num_layers=" + s.recompute_layers, s.recompute_layers_shown);
    return;
  }
  const std::pair<const std::string*, const char*> shaping[] = {
      {&s.recompute_method_shown,
       "Megatron asserts: recompute method is not supported for selective recomputing granularity"},
      {&s.recompute_layers_shown, "Megatron-core: recompute_num_layers must be None"}};
  // Megatron checks them before --moe-layer-recompute makes the granularity selective: alone, that
  // flag leaves them unchecked and unread.
  const bool checked = selective && (s.recompute_activations || !s.recompute_granularity.empty());
  for (const auto& [shown, megatron_says] : shaping) {
    if (shown->empty()) continue;
    if (checked)
      m.refused.push_back(*shown + ": not with selective recomputation (" + megatron_says + ")");
    else
      m.ignored.push_back(*shown + " (Megatron reads it only with --recompute-granularity full)");
  }
}

// The last --dataloader-type given is Megatron's (argparse); its random sampler reads
// --no-data-sharding, its pretraining sampler never does.
void map_dataloader(const SeenFlags& s, MegatronMapping& m) {
  const bool cyclic = s.dataloader_type == "cyclic";
  if (cyclic) set_by(m, "train.dataloader_type=cyclic", s.dataloader_type_shown);
  if (s.dataloader_type == "external")
    m.refused.push_back(s.dataloader_type_shown +
                        ": DTK reads data through dataset plugins (write one: docs/plugin-guide.md)");
  if (s.no_data_sharding_shown.empty()) return;
  if (cyclic)
    set_by(m, "train.data_sharding=false", s.no_data_sharding_shown);
  else
    m.ignored.push_back(s.no_data_sharding_shown + " (Megatron reads it only with --dataloader-type cyclic)");
}

// Megatron reads --sgd-momentum with SGD only, and the --adam-* flags with Adam only.
void map_optimizer_options(const SeenFlags& s, MegatronMapping& m) {
  const bool sgd = m.optimizer == "sgd";
  if (sgd && !s.sgd_momentum.empty()) set_by(m, "optimizer.momentum=" + s.sgd_momentum, s.sgd_momentum_shown);
  if (!sgd && !s.sgd_momentum_shown.empty())
    m.ignored.push_back(s.sgd_momentum_shown + " (Megatron reads it only with --optimizer sgd)");
  if (!sgd) return;
  for (const auto& shown : s.adam_shown) m.ignored.push_back(shown + " (Megatron reads it only with --optimizer adam)");
  for (const char* field : {"optimizer.beta1", "optimizer.beta2", "optimizer.eps"}) drop_sets(m, field);
}

// Megatron applies Llama 3.1's frequency scaling only with --use-rope-scaling, by
// --rope-scaling-factor (default 8.0); the factor alone changes nothing.
void map_rope_scaling(const SeenFlags& s, MegatronMapping& m) {
  if (s.rope_scaling)
    set_by(m, "model.rope_scaling_factor=" + (s.rope_factor.empty() ? std::string("8") : s.rope_factor),
           s.rope_factor.empty() ? "--use-rope-scaling" : s.rope_factor_shown);
  else if (!s.rope_factor_shown.empty())
    m.ignored.push_back(s.rope_factor_shown + " (Megatron reads it only with --use-rope-scaling: no scaling as written)");
}

// --kv-channels: hidden / heads sets nothing (the models derive it); another width is the llama
// model's kv_channels. --no-position-embedding: a model without a learned table must have rotary
// positions.
void check_heads_and_positions(SeenFlags& s, MegatronMapping& m) {
  if (!s.kv_channels_shown.empty()) {
    const long kv = positive_number(s.kv_channels), hidden = positive_number(s.hidden_size),
               heads = positive_number(s.attention_heads);
    if (kv == 0)
      m.refused.push_back(s.kv_channels_shown + ": not a positive number");
    else if (hidden == 0 || heads == 0) {
      if (s.use_checkpoint_args)
        m.ignored.push_back(s.kv_channels_shown + " (the checkpoint's model decides: --use-checkpoint-args)");
      else {  // the heads' own width: the llama model's kv_channels
        set_by(m, "model.kv_channels=" + s.kv_channels, s.kv_channels_shown);
        s.llama_only.push_back(s.kv_channels_shown);
      }
    } else if (hidden % heads != 0 || hidden / heads != kv) {
      set_by(m, "model.kv_channels=" + s.kv_channels, s.kv_channels_shown);
      s.llama_only.push_back(s.kv_channels_shown);
    }
  }
  if (!s.no_position_shown.empty() && !s.rope && !s.use_checkpoint_args)
    m.refused.push_back(s.no_position_shown +
                        ": needs rotary positions (--position-embedding-type rope or "
                        "--use-rotary-position-embeddings): DTK has no model without positions");
}

// Megatron's virtual_pipeline_model_parallel_size = num_layers (the embedding and the loss counted
// when they are) / pipeline size / this.
void map_virtual_stages(const SeenFlags& s, MegatronMapping& m) {
  if (s.per_virtual_shown.empty()) return;
  if (!s.virtual_stages_shown.empty()) {
    m.refused.push_back(s.per_virtual_shown + " with " + s.virtual_stages_shown +
                        ": give one (Megatron asserts no more than one of them)");
    return;
  }
  if (!s.uneven_shown.empty()) {
    m.refused.push_back(s.per_virtual_shown + " with " + s.uneven_shown +
                        ": give the chunks per rank with --num-virtual-stages-per-pipeline-rank (Megatron asserts so)");
    return;
  }
  auto positive = [](const std::string& v) {
    char* end = nullptr;
    const long n = std::strtol(v.c_str(), &end, 10);
    return v.empty() || *end || n <= 0 ? 0L : n;
  };
  const long counted = (s.embedding_in_split ? 1 : 0) + (s.loss_in_split ? 1 : 0);
  const long layers = positive(s.num_layers) > 0 ? positive(s.num_layers) + counted : 0;
  const long stages = positive(s.pipeline_size), per = positive(s.per_virtual_stage);
  if (per == 0)
    m.refused.push_back(s.per_virtual_shown + ": not a positive number of layers");
  else if (layers == 0)
    m.refused.push_back(s.per_virtual_shown +
                        ": needs --num-layers (the chunks per rank are num_layers / pipeline size / this)");
  else if (stages < 2)
    m.refused.push_back(s.per_virtual_shown + ": needs --pipeline-model-parallel-size 2 or more");
  else if (layers % stages != 0 || (layers / stages) % per != 0)
    m.refused.push_back(s.per_virtual_shown + ": --num-layers " + s.num_layers +
                        (counted ? " (with the embedding/loss counted: " + std::to_string(layers) + ")" : "") +
                        " does not split into " + s.pipeline_size + " pipeline stages of chunks of " +
                        s.per_virtual_stage + " layers");
  else if (layers / stages / per > 1)
    set_by(m, "distributed.virtual_pipeline_model_parallel_size=" + std::to_string(layers / stages / per),
           s.per_virtual_shown);
}

// Megatron's PipelineParallelLayerLayout.parse_str_to_list: commas dropped, "(...)*n" and then
// "x*n" unrolled (each pattern once over the string, left to right, as re.sub does), stages split
// at '|' (empty ones kept).
std::vector<std::string> layout_stages(std::string text) {
  text.erase(std::remove(text.begin(), text.end(), ','), text.end());
  for (const char* pattern : {R"(\(([^)]+)\)\*(\d+))", R"((.)\*(\d+))"}) {
    const std::regex re(pattern);
    std::string out;
    auto last = text.cbegin();
    for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) {
      out.append(last, (*it)[0].first);
      const long n = std::strtol((*it)[2].str().c_str(), nullptr, 10);
      for (long k = 0; k < n && out.size() < (1u << 20); ++k) out += (*it)[1].str();
      last = (*it)[0].second;
    }
    out.append(last, text.cend());
    text = out;
  }
  std::vector<std::string> stages(1);
  for (const char c : text) {
    if (c == '|')
      stages.emplace_back();
    else
      stages.back() += c;
  }
  return stages;
}

// The split DTK builds whose stages hold `counts` decoder layers (the even one first, then the
// fewest settings), if any.
std::optional<dtk::PipelineSplit> split_giving(const std::vector<int64_t>& counts, int32_t chunks) {
  int64_t layers = 0;
  for (const int64_t c : counts) layers += c;
  std::optional<dtk::PipelineSplit> best;
  int best_settings = 5;
  for (int counted = 0; counted < 4; ++counted)
    for (int64_t last = 0; last <= layers; ++last)  // at a tie the first rank's count is named
      for (int64_t first = 0; first <= layers; ++first) {
        dtk::PipelineSplit s;
        s.stages = static_cast<int32_t>(counts.size()), s.chunks = chunks;
        s.first_stage_layers = first, s.last_stage_layers = last;
        s.embedding_in_split = counted & 1, s.loss_in_split = counted & 2;
        const int settings = (first > 0) + (last > 0) + (counted & 1) + ((counted & 2) >> 1);
        if (settings >= best_settings || !dtk::pipeline_split_refusal(s, layers).empty()) continue;
        const auto stages = dtk::pipeline_stage_layers(s, layers);
        bool same = true;
        for (size_t i = 0; i < counts.size() && same; ++i) same = stages[i].count == counts[i];
        if (same) best = s, best_settings = settings;
      }
  return best;
}

// --pipeline-model-parallel-layout: Megatron's checks (arguments.py, TransformerConfig and
// validate_layer_layout), then the split of DTK's that puts the same decoder layers on every
// stage of the (virtual) pipeline. DTK builds the embedding on the first stage and the loss on the
// last, and has no MTP layers.
void map_pipeline_layout(const SeenFlags& s, MegatronMapping& m) {
  if (s.layout_shown.empty()) return;
  const std::string& shown = s.layout_shown;
  auto refuse = [&](const std::string& why) { m.refused.push_back(shown + ": " + why); };
  for (const std::string& other : {s.per_virtual_shown, s.virtual_stages_shown})
    if (!other.empty()) return refuse("with " + other + ": give one (Megatron asserts no more than one of them)");
  if (!s.uneven_shown.empty() || s.embedding_in_split || s.loss_in_split)
    return refuse(
        "with --decoder-first/last-pipeline-num-layers or --account-for-embedding/loss-in-pipeline-split: give "
        "one (Megatron: the layout cannot be set with other pipeline layout arguments)");
  const std::vector<std::string> stages = layout_stages(s.layout);
  const long pipeline = std::max(1L, std::strtol(s.pipeline_size.c_str(), nullptr, 10));
  std::string flat;
  std::vector<int64_t> counts;
  for (const std::string& stage : stages) {
    for (const char c : stage)
      if (c != 'E' && c != 'L' && c != 't' && c != 'm')
        return refuse(std::string("'") + c + "' is not a layer (E embedding, t decoder layer, m MTP layer, L loss)");
    flat += stage;
    counts.push_back(static_cast<int64_t>(std::count(stage.begin(), stage.end(), 't')));
  }
  if (stages.size() % static_cast<size_t>(pipeline) != 0)
    return refuse(std::to_string(stages.size()) + " stages do not divide into --pipeline-model-parallel-size " +
                  std::to_string(pipeline) + " (Megatron asserts it)");
  if (flat.find('m') != std::string::npos) return refuse("MTP layers (m): DTK has no multi-token prediction");
  if (std::count(flat.begin(), flat.end(), 'E') != 1 || flat.front() != 'E' ||
      std::count(flat.begin(), flat.end(), 'L') != 1 || flat.back() != 'L')
    return refuse("needs one embedding (E) first and one loss (L) last (Megatron asserts it)");
  const long layers = std::count(flat.begin(), flat.end(), 't');
  if (!s.num_layers.empty() && std::strtol(s.num_layers.c_str(), nullptr, 10) != layers)
    return refuse(std::to_string(layers) + " decoder layers (t), --num-layers " + s.num_layers +
                  " (Megatron asserts they match)");
  if (stages.front().find('E') == std::string::npos || stages.back().find('L') == std::string::npos)
    return refuse("DTK builds the embedding on the first stage and the loss on the last");
  const long chunks = static_cast<long>(stages.size()) / pipeline;
  if (!s.virtual_size_shown.empty() && chunks > 1) {
    m.refused.push_back(s.virtual_size_shown + " with " + shown + ": the layout's " + std::to_string(chunks) +
                        " chunks per rank decide it (give one)");
    return;
  }
  const auto split = split_giving(counts, static_cast<int32_t>(chunks));
  if (!split) {
    std::string list;
    for (const int64_t c : counts) list += (list.empty() ? "" : ",") + std::to_string(c);
    return refuse("its stages hold " + list +
                  " decoder layers, which no split of DTK's gives (the first and last pipeline ranks' layers, the "
                  "middle ranks even, the embedding and the loss counted as a layer; each rank's layers even over its "
                  "chunks)");
  }
  if (chunks > 1) set_by(m, "distributed.virtual_pipeline_model_parallel_size=" + std::to_string(chunks), shown);
  if (split->first_stage_layers > 0)
    set_by(m, "distributed.decoder_first_pipeline_num_layers=" + std::to_string(split->first_stage_layers), shown);
  if (split->last_stage_layers > 0)
    set_by(m, "distributed.decoder_last_pipeline_num_layers=" + std::to_string(split->last_stage_layers), shown);
  if (split->embedding_in_split) set_by(m, "distributed.account_for_embedding_in_pipeline_split=true", shown);
  if (split->loss_in_split) set_by(m, "distributed.account_for_loss_in_pipeline_split=true", shown);
}

// Megatron's validate_args, said here with the other flags rather than later.
void check_training_kind(const SeenFlags& s, MegatronMapping& m) {
  if (s.iteration_based && s.sample_based)
    m.refused.push_back(
        "--train-iters with --train-samples: give one (Megatron asserts 'expected iteration-based "
        "training' / 'expected sample-based training')");
  if (s.sample_based)
    for (const auto& flag : s.iteration_schedule)
      m.refused.push_back(flag +
                          ": with --train-samples the schedule is sample-based (Megatron asserts it); drop it, "
                          "or use --lr-warmup-fraction");
  if (s.iteration_based)
    for (const auto& flag : s.sample_schedule)
      m.refused.push_back(flag +
                          ": with --train-iters the schedule is iteration-based (Megatron asserts it); use "
                          "--lr-decay-iters / --lr-warmup-iters");
  if (!s.no_train_tokens.empty())
    m.refused.push_back(s.no_train_tokens +
                        ": Megatron-DeepSpeed trains no iteration with it; leave the flag out for no token limit");
  if (!s.rampup.empty() && s.iteration_based)
    m.refused.push_back(s.rampup +
                        ": needs sample-based training, --train-samples instead of --train-iters (Megatron "
                        "asserts 'expected no batch-size rampup for iteration-based training')");
  if (!s.step_schedule.empty() && !s.global_batch_shown.empty())
    m.refused.push_back(s.global_batch_shown +
                        ": not with --step-batch-size-schedule (Megatron refuses both: "
                        "'Cannot specify both --step-batch-size-schedule and --global-batch-size')");
  if (!s.step_schedule.empty() && s.iteration_based)
    m.refused.push_back(s.step_schedule +
                        ": needs sample-based training, --train-samples instead of --train-iters (with iterations "
                        "Megatron sizes the data and the learning-rate schedule by --micro-batch-size x "
                        "data-parallel size samples an iteration, not by the schedule's batches)");
  if (!s.step_schedule.empty() && !s.rampup.empty())
    m.refused.push_back(s.rampup + ": not with --step-batch-size-schedule (Megatron's schedule replaces the ramp-up)");
}

}  // namespace

// The dataset's Megatron: legacy megatron/data when a flag only it takes is given, else
// Megatron-core (the option's default). Megatron's default split and, for Megatron-core, its
// tokenizer's description (today's Megatron-LM, megatron/core/tokenizers: GPT2BPETokenizer, the
// SentencePiece three, HuggingFaceTokenizer, TikTokenizer, NullTokenizer) go with --data-path: both are part of
// the descriptions Megatron names its index caches by.
// Megatron asserts that a data path and its file form are not both given.
static void check_data_path_forms(const SeenFlags& s, MegatronMapping& m) {
  if (s.data_path_forms.size() > 1) m.refused.push_back("--data-path and --data-args-path: give one of them");
  if (s.split_path_forms.size() > 1)
    m.refused.push_back(
        "--per-split-data-args-path and --train/valid/test-data-path: give one form of the split paths");
}

// A name or a prefix as a text-format string ("..." with \ and " escaped), for an
// eval.validation_sets entry.
static std::string text_format_string(const std::string& v) {
  std::string out = "\"";
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out + "\"";
}

// Megatron's --multiple-validation-sets: each prefix of the per-split validation path is a set of
// its own (a blend's weights are not read), read whole, named by --validation-set-names or by its
// position. Without a per-split validation path Megatron's builder gives the one validation split
// it builds as a list of one: one set, the run's dataset as it is. The run's own validation split
// is then not asked for (its path stays, so that a run given only --valid-data-path has one).
static void map_validation_sets(const SeenFlags& s, MegatronMapping& m) {
  if (s.multiple_sets_shown.empty()) {
    if (!s.set_names_shown.empty())
      m.refused.push_back(s.set_names_shown + ": needs --multiple-validation-sets (Megatron asserts it)");
    return;
  }
  if (!s.full_validation)
    return m.refused.push_back(s.multiple_sets_shown +
                               ": needs --full-validation (Megatron: \"--multiple-validation-sets currently requires "
                               "--full-validation\")");
  std::string path;
  for (const std::string& set : m.sets)
    if (set.rfind("dataset.valid_data_path=", 0) == 0) path = set.substr(24);
  std::vector<std::string> words;
  std::stringstream ws(path);
  for (std::string w; ws >> w;) words.push_back(w);
  // Megatron's get_blend_from_list: an even count whose odd words are numbers is "W1 P1 W2 P2 ...".
  bool weighted = words.size() > 1 && words.size() % 2 == 0;
  for (size_t k = 0; weighted && k < words.size(); k += 2) {
    char* end = nullptr;
    std::strtod(words[k].c_str(), &end);
    weighted = end != words[k].c_str() && *end == '\0';
  }
  std::vector<std::string> prefixes;
  for (size_t k = weighted ? 1 : 0; k < words.size(); k += weighted ? 2 : 1) prefixes.push_back(words[k]);
  const size_t count = std::max<size_t>(1, prefixes.size());
  if (!s.set_names.empty() && s.set_names.size() != count)
    return m.refused.push_back(s.set_names_shown + ": " + std::to_string(s.set_names.size()) + " names for " +
                               std::to_string(count) +
                               " validation sets (Megatron: \"Number of --validation-set-names must match the number "
                               "of validation datasets\")");
  for (size_t k = 0; k < count; ++k) {
    const std::string name = s.set_names.empty() ? std::to_string(k) : s.set_names[k];
    const std::string options =
        prefixes.empty() ? "" : " options { key: \"valid_data_path\" value: " + text_format_string(prefixes[k]) + " }";
    set_by(m, "eval.validation_sets=name: " + text_format_string(name) + options, s.multiple_sets_shown);
  }
}

// Python's str() of a list of strings: ['<unk>', '<s>'] (a string holding ' and no " is quoted
// with ", as repr does; \n \r \t and other control characters escaped as repr escapes them).
static std::string python_list(const std::vector<std::string>& items) {
  std::string out = "[";
  for (const std::string& item : items) {
    const bool double_quoted = item.find('\'') != std::string::npos && item.find('"') == std::string::npos;
    const char quote = double_quoted ? '"' : '\'';
    if (out.size() > 1) out += ", ";
    out += quote;
    for (char c : item) {
      const auto u = static_cast<unsigned char>(c);
      if (c == '\\' || c == quote) {
        out += '\\', out += c;
      } else if (c == '\n' || c == '\r' || c == '\t') {
        out += c == '\n' ? "\\n" : (c == '\r' ? "\\r" : "\\t");
      } else if (u < 0x20 || u == 0x7f) {
        const char* hex = "0123456789abcdef";
        out += "\\x", out += hex[u >> 4], out += hex[u & 15];
      } else {
        out += c;
      }
    }
    out += quote;
  }
  return out + "]";
}

// Megatron reads --tiktoken-pattern and --tiktoken-num-special-tokens only for TikTokenizer (its
// Llama 3 example gives the pattern beside NullTokenizer); --tokenizer-special-tokens it also hands
// to the Hugging Face and SentencePiece tokenizers, which DTK builds without them.
static void map_tiktoken(const SeenFlags& s, MegatronMapping& m) {
  const bool tiktoken = s.tokenizer_type == "TikTokenizer";
  const auto ignore = [&](const std::string& shown) {
    m.ignored.push_back(shown.substr(0, shown.find(' ')) +
                        " (Megatron reads it only with --tokenizer-type TikTokenizer)");
  };
  if (!s.tiktoken_pattern_shown.empty()) {
    if (tiktoken)
      set_by(m, "tokenizer.tiktoken_pattern=" + s.tiktoken_pattern, s.tiktoken_pattern_shown);
    else
      ignore(s.tiktoken_pattern_shown);
  }
  if (!s.tiktoken_num_special_shown.empty()) {
    char* end = nullptr;
    const long long n = std::strtoll(s.tiktoken_num_special.c_str(), &end, 10);
    if (!tiktoken)
      ignore(s.tiktoken_num_special_shown);
    else if (s.tiktoken_num_special.empty() || *end || n <= 0)
      m.refused.push_back(s.tiktoken_num_special_shown +
                          ": not a positive number (the seven required special tokens need ids; Megatron asserts it)");
    else
      set_by(m, "tokenizer.tiktoken_num_special_tokens=" + s.tiktoken_num_special, s.tiktoken_num_special_shown);
  }
  if (s.special_tokens_shown.empty()) return;
  // NullTokenizer takes no special tokens in Megatron either; the others would add them.
  if (s.tokenizer_type == "NullTokenizer")
    return m.ignored.push_back(s.special_tokens_shown.substr(0, s.special_tokens_shown.find(' ')) +
                               " (NullTokenizer takes no special tokens, as in Megatron)");
  if (!tiktoken)
    return m.refused.push_back(s.special_tokens_shown +
                               ": DTK reads special tokens for --tokenizer-type TikTokenizer only");
  for (const std::string& t : s.special_tokens)
    if (t.find_first_of(" \t\n\r") != std::string::npos)
      return m.refused.push_back(s.special_tokens_shown + ": the special token '" + t +
                                 "' holds whitespace (DTK's tokenizer.special_tokens is a space-separated list)");
  set_by(m, "tokenizer.special_tokens=" + joined(s.special_tokens), s.special_tokens_shown);
}

static void map_data_order(const SeenFlags& s, MegatronMapping& m) {
  if (m.dataset != "gpt_indexed") return;
  if (s.legacy_data) set_by(m, "dataset.order=megatron_legacy", s.legacy_data_shown);
  if (!s.split_given) m.sets.push_back("dataset.split=969, 30, 1");
  if (s.legacy_data) return;  // legacy descriptions hold no tokenizer
  auto q = [](const std::string& v) {
    std::string out = "\"";
    for (char c : v) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out + "\"";
  };
  // MegatronTokenizerText.unique_identifiers: class, tokenizer_path, then build_tokenizer's
  // keyword arguments in its order, str()'d (Megatron's defaults for the flags DTK does not take).
  std::string args;
  std::string path;
  const std::string& t = s.tokenizer_type;
  if (t == "GPT2BPETokenizer" && !s.vocab_file.empty() && !s.merge_file.empty()) {
    path = q(t);
    args = ", \"additional_special_tokens\": \"[]\", \"vocab_file\": " + q(s.vocab_file) + ", \"merges_file\": " +
           q(s.merge_file) +
           ", \"use_fast\": \"True\", \"trust_remote_code\": \"False\", \"include_special_tokens\": \"True\", "
           "\"use_gigatoken\": \"False\"";
  } else if ((t == "SentencePieceTokenizer" || t == "GPTSentencePieceTokenizer" || t == "Llama2Tokenizer") &&
             !s.tokenizer_model.empty()) {
    path = q(s.tokenizer_model);
    args = ", \"chat_template\": \"None\", \"ignore_extra_whitespaces\": \"True\", \"legacy\": \"False\", "
           "\"special_tokens\": \"None\"";
  } else if (t == "HuggingFaceTokenizer" && !s.tokenizer_model.empty()) {
    path = q(s.tokenizer_model);
    args = ", \"chat_template\": \"None\", \"vocab_file\": " + (s.vocab_file.empty() ? "\"None\"" : q(s.vocab_file)) +
           ", \"merges_file\": " + (s.merge_file.empty() ? "\"None\"" : q(s.merge_file)) +
           ", \"additional_special_tokens\": \"[]\", \"use_fast\": \"True\", \"trust_remote_code\": \"False\", "
           "\"include_special_tokens\": \"True\", \"use_gigatoken\": \"False\"";
  } else if (t == "TikTokenizer" && !s.tokenizer_model.empty()) {
    path = q(s.tokenizer_model);
    args = ", \"chat_template\": \"None\"";
    if (!s.tiktoken_pattern.empty()) args += ", \"pattern\": " + q(s.tiktoken_pattern);
    if (!s.vocab_size.empty()) args += ", \"vocab_size\": " + q(s.vocab_size);
    args += ", \"num_special_tokens\": " + q(s.tiktoken_num_special) +
            ", \"special_tokens\": " + (s.special_tokens.empty() ? "\"None\"" : q(python_list(s.special_tokens)));
  } else if (t == "NullTokenizer") {
    path = "null";
    if (!s.vocab_size.empty()) args = ", \"vocab_size\": " + q(s.vocab_size);
    args += ", \"pad_id\": \"-1\"";
  } else {
    return;
  }
  set_by(
      m,
      "dataset.megatron_tokenizer={\"class\": \"megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText\", "
      "\"tokenizer_path\": " +
          path + args + "}",
      "--tokenizer-type");
}

MegatronMapping map_megatron_args(const std::vector<std::string>& args) {
  MegatronMapping m;
  SeenFlags s;
  for (size_t i = 0; i < args.size();) {
    std::string flag = args[i++];
    std::vector<std::string> values;
    if (const size_t eq = flag.find('='); is_flag(flag) && eq != std::string::npos) {
      values.push_back(flag.substr(eq + 1));
      flag = flag.substr(0, eq);
    }
    if (!is_flag(flag)) {
      m.refused.push_back(flag + ": a value without a flag");
      continue;
    }
    const Rule* r = find_rule(flag);
    // Values: what the rule takes (an unknown flag takes what follows it up to the next flag).
    const int nargs = r ? r->nargs : -2;
    while (i < args.size() && !is_flag(args[i]) &&
           (nargs < 0 || static_cast<int>(values.size()) < nargs))
      values.push_back(args[i++]);
    const std::string shown = flag + (values.empty() ? "" : " " + joined(values));
    if (!r) {
      m.refused.push_back(shown + ": not a Megatron pretraining flag DTK knows");
      continue;
    }
    if ((r->nargs >= 0 && static_cast<int>(values.size()) != r->nargs) || (r->nargs < 0 && values.empty())) {
      m.refused.push_back(shown + ": takes " +
                          (r->nargs < 0 ? std::string("one or more values") : std::to_string(r->nargs) + " value(s)"));
      continue;
    }
    const size_t sets_before = m.sets.size();
    apply_rule(*r, flag, shown, values, m);
    for (size_t k = sets_before; k < m.sets.size(); ++k) m.flag_of[m.sets[k].substr(0, m.sets[k].find('='))] = flag;
    note_flag(s, normalized(r->flag), shown, values);
  }
  // Megatron's --lr-decay-style takes its own styles only (argparse's choices).
  for (const auto& set : m.sets)
    if (set.rfind("lr.lr_decay_style=", 0) == 0 && is_deepspeed_style(set.substr(18)))
      m.refused.push_back("--lr-decay-style " + set.substr(18) +
                          ": not one of Megatron's (constant, linear, cosine, inverse-square-root, WSD); DeepSpeed's "
                          "schedulers come from its config's \"scheduler\" (dtk train --deepspeed_config)");
  map_deepspeed(s, m);
  map_ddp_bucket(s, m);
  map_query_groups(s, m);
  map_key_value_heads(s, m);
  map_virtual_stages(s, m);
  map_pipeline_layout(s, m);
  // The overlap is each strategy's option: ddp's buckets, or ZeRO's reduce-scatter (whichever flag
  // came first).
  if (s.overlap_grad_reduce)
    set_by(m, m.strategy == "zero" ? "strategy.overlap_comm=true" : "strategy.overlap_grad_reduce=true",
           "--overlap-grad-reduce");
  if (!s.overlap_param_gather_shown.empty()) {
    if (m.strategy == "zero")
      set_by(m, "strategy.overlap_param_gather=true", s.overlap_param_gather_shown);
    else
      m.refused.push_back(s.overlap_param_gather_shown +
                          ": needs --use-distributed-optimizer (Megatron asserts it; DTK's ddp splits its "
                          "all-reduce across the step with strategy.overlap_param_gather=true)");
  }
  if (s.fp16 && s.bf16) m.refused.push_back("--fp16 with --bf16: give one (Megatron asserts it)");
  map_recompute(s, m);
  map_rope_scaling(s, m);
  map_moe(s, m);
  // No load-balancing loss (none, or quantile balancing's bias): Megatron ignores --moe-aux-loss-coeff
  // then, wherever it came (its sinkhorn asserts it is 0: the model refuses another).
  if (!s.no_load_balancing_shown.empty()) {
    drop_sets(m, "model.moe_aux_loss_coeff");
    set_by(m, "model.moe_aux_loss_coeff=0", s.no_load_balancing_shown);
  }
  // Dense MLPs dispatch no token: a script's --moe-token-dispatcher-type without --num-experts.
  if (has_sets(m, "model.moe_token_dispatcher") && s.num_experts.empty()) {
    drop_sets(m, "model.moe_token_dispatcher");
    m.ignored.push_back("--moe-token-dispatcher-type (without --num-experts the MLPs are dense)");
  }
  // Megatron's --moe-shared-expert-overlap does nothing without a shared expert, and raises with
  // another dispatcher than alltoall.
  if (has_sets(m, "model.moe_shared_expert_overlap")) {
    const bool all_to_all =
        std::find(m.sets.begin(), m.sets.end(), "model.moe_token_dispatcher=alltoall") != m.sets.end();
    if (s.num_experts.empty() || !has_sets(m, "model.moe_shared_expert_intermediate_size")) {
      drop_sets(m, "model.moe_shared_expert_overlap");
      m.ignored.push_back(s.num_experts.empty()
                              ? "--moe-shared-expert-overlap (without --num-experts the MLPs are dense)"
                              : "--moe-shared-expert-overlap (without "
                                "--moe-shared-expert-intermediate-size there is no shared expert)");
    } else if (!all_to_all) {
      m.refused.push_back(
          "--moe-shared-expert-overlap: overlaps the shared expert with the alltoall dispatcher's exchange; give "
          "--moe-token-dispatcher-type alltoall (Megatron raises \"moe_shared_expert_overlap only works with "
          "alltoall token dispatcher\")");
    }
  }
  // Megatron reads --moe-token-drop-policy only with a capacity factor (wherever that came).
  if (has_sets(m, "model.moe_token_drop_policy") && !has_sets(m, "model.moe_expert_capacity_factor")) {
    drop_sets(m, "model.moe_token_drop_policy");
    m.ignored.push_back("--moe-token-drop-policy (without --moe-expert-capacity-factor Megatron drops no token)");
  }
  // Megatron's sigmoid and sqrtsoftplus routers do not read --moe-router-pre-softmax (its DeepSeek
  // recipes pass both); DTK's model refuses the pair, so the mapper leaves the flag out.
  if (s.gate_scores && has_sets(m, "model.moe_router_pre_softmax")) {
    drop_sets(m, "model.moe_router_pre_softmax");
    m.ignored.push_back("--moe-router-pre-softmax (Megatron's sigmoid and sqrtsoftplus scores do not read it)");
  }
  // Megatron starts from scratch when --load holds no checkpoint yet (its scripts pass --save X
  // --load X from the first run on), unless --exit-on-missing-checkpoint.
  if (s.load_given && !s.exit_on_missing_checkpoint) set_by(m, "checkpoint.load_if_present=true", "--load");
  map_optimizer_options(s, m);
  // --mock-data reads no files: the split and the cache folder of a data path do nothing.
  if (m.dataset == "synthetic") {
    for (const std::string field : {"dataset.split", "dataset.cache_dir"}) {
      if (!has_sets(m, field)) continue;  // (a flag given twice: each set)
      m.ignored.push_back(m.flag_of[field] + " (--mock-data reads no files)");
      drop_sets(m, field);
    }
  }
  // Megatron checks every loss and gradient for NaN by default and stops at the first.
  if (!s.nan_check_given) m.sets.push_back("train.skipped_steps_limit=1");
  map_profile(s, m);
  map_decoupled_lr(s, m);
  map_context_parallel(s, m);
  // One option for every --no-*-fusion flag given (each names one of DTK's kernels).
  if (!s.unfused_kernels.empty())
    set_by(m, "model.unfused_kernels=" + joined(s.unfused_kernels, ","), joined(s.unfusing_flags, "/"));
  check_heads_and_positions(s, m);
  choose_model(m, s.rope, s.rms_norm, s.swiglu, s.llama_only, s.gpt_only, s.use_checkpoint_args);
  check_training_kind(s, m);
  check_data_path_forms(s, m);
  map_validation_sets(s, m);
  map_tiktoken(s, m);
  map_data_order(s, m);
  map_dataloader(s, m);
  return m;
}

const std::vector<std::string>& megatron_defaults() {
  // Megatron's arguments.py defaults where DTK's differ (the rest agree: dropout 0.1, init std
  // 0.02, Adam 0.9/0.999/1e-8, weight decay 0.01, clip 1.0, seed 1234, split 969,30,1).
  static const std::vector<std::string> d = {"lr.lr_decay_style=linear", "lr.min_lr=0", "logging.log_interval=100",
                                             "eval.eval_interval=1000", "eval.eval_iters=100"};
  return d;
}

void apply_megatron_mapping(config::RunConfig& cfg, const MegatronMapping& m) {
  if (!m.refused.empty())
    throw HostError(m.source + ": " + std::to_string(m.refused.size()) +
                    (m.source == "--megatron_args" ? " flag(s)" : " key(s)") +
                    " DTK cannot run: " + joined(m.refused, "; "));
  // True when the slot switched plugins (its old options dropped).
  auto choose = [](config::PluginChoice* slot, const std::string& name) {
    if (name.empty() || name == slot->name()) return false;
    slot->set_name(name);
    slot->clear_options();
    return true;
  };
  if (choose(cfg.mutable_model(), m.model))
    for (const auto& s : m.model_defaults) apply_override(cfg, s);
  choose(cfg.mutable_dataset(), m.dataset);
  choose(cfg.mutable_optimizer(), m.optimizer);
  choose(cfg.mutable_strategy(), m.strategy);
  for (const auto& s : m.sets) {
    try {
      apply_override(cfg, s);
    } catch (const HostError& e) {
      // Named by what the user typed: the flag (or the file's key) behind the field.
      const auto by = m.flag_of.find(s.substr(0, s.find('=')));
      throw HostError(m.source + ": " + (by == m.flag_of.end() ? "" : by->second + ": ") + std::string(e.what()));
    }
  }
}

std::string megatron_flag_legend(const std::string& message, const std::map<std::string, std::string>& flag_of,
                                 const std::string& source) {
  // A field counts where the message names it whole: not "lr.lr" inside "lr.lr_decay_style".
  const auto names = [&](const std::string& field) {
    const auto part_of_name = [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
    };
    for (size_t at = message.find(field); at != std::string::npos; at = message.find(field, at + 1)) {
      const size_t end = at + field.size();
      // A period after it ends a sentence unless a name goes on ("lr.lr" then "_decay").
      const bool name_goes_on = end < message.size() && part_of_name(message[end]) &&
                                (message[end] != '.' || (end + 1 < message.size() && part_of_name(message[end + 1]) &&
                                                         message[end + 1] != '.'));
      if ((at == 0 || !part_of_name(message[at - 1])) && !name_goes_on) return true;
    }
    return false;
  };
  // A plugin names its options without the slot: "model plugin 'llama': ... num_query_groups 5".
  const auto plugin_names = [&](const std::string& field) {
    const size_t dot = field.find('.');
    return dot != std::string::npos && message.find(field.substr(0, dot) + " plugin '") != std::string::npos &&
           names(field.substr(dot + 1));
  };
  std::string legend;
  for (const auto& [field, flag] : flag_of)
    if (names(field) || plugin_names(field)) legend += (legend.empty() ? "" : ", ") + field + " is " + flag;
  return legend.empty() ? "" : " (" + source + ": " + legend + ")";
}

std::string megatron_flag_table() {
  std::string out = "| Megatron / Domino flag | DTK |\n|---|---|\n";
  for (const Rule& r : kRules) {
    std::string dtk;
    switch (r.kind) {
      case Kind::kSet:
        dtk = std::string("`") + r.target + "`";
        break;
      case Kind::kSwitch:
        dtk = std::string("`") + r.target + "`";
        break;
      case Kind::kIgnore:
        dtk = "ignored: ";
        break;
      case Kind::kRefuse:
        dtk = "refused: ";
        break;
      case Kind::kCustom:
        dtk = *r.target ? std::string("`") + r.target + "`; " : "";
        break;
    }
    const std::string note = r.note;
    if (!note.empty()) dtk += (r.kind == Kind::kSet || r.kind == Kind::kSwitch ? " (" + note + ")" : note);
    const std::string args = r.nargs == 0 ? "" : r.nargs < 0 ? " X..." : r.nargs == 3 ? " A B C" : " X";
    out += std::string("| `") + r.flag + args + "` | " + dtk + " |\n";
  }
  return out;
}

}  // namespace dtk::core
