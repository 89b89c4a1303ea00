/*
 * dtk/abi.h — the DTK plugin ABI. THE contract between the `dtk` host and its plugins.
 *
 * Pure C99. Everything a plugin and the host exchange is declared here; the C++ headers next to
 * this one (plugin.hpp, tensor.hpp, options.hpp) are optional conveniences built on top of it.
 *
 * ---------------------------------------------------------------------------------------------
 * 1. Entry point
 *    A plugin is a shared library exporting exactly ONE symbol:
 *        const dtk_plugin_entry* dtk_plugin_get_entry(void);   (DTK_PLUGIN_ENTRY_SYMBOL)
 *    It returns a pointer to a static, immutable entry struct describing the plugin. Plugins are
 *    built with -fvisibility=hidden and a linker version script so nothing else leaks out.
 *
 * 2. Growth rule (append-only)
 *    Every struct begins with `size_t struct_size`, set by whoever fills the struct to
 *    sizeof(that struct) as THEY compiled it. Structs and function tables only ever grow at the
 *    end. A reader uses a field only if the writer's struct_size covers it (DTK_HAS_FIELD).
 *    Field offsets of every shipped struct are asserted in tests/abi; reordering fails the build.
 *    An array of versioned structs (option specs, parameter groups) is walked with the stride of
 *    its elements' struct_size, which is the same for every element of one array.
 *
 * 3. Versions
 *    DTK_ABI_MAJOR changes only on an incompatible change; the host refuses another major.
 *    DTK_ABI_MINOR grows when fields or functions are appended; a plugin built for a minor <=
 *    the host's minor loads, a plugin built for a newer minor is refused ("plugin newer than
 *    host"). docs/abi-changelog.md has one entry per minor.
 *
 * 4. Errors
 *    No exception ever crosses the boundary. Every fallible function returns dtk_status*:
 *    NULL means success; non-NULL is a NEW status the receiver must release with
 *    dtk_status_release(). The creator of a status stores its own destroy function in it, so a
 *    status can be freed by whoever receives it. Plugins normally create statuses through
 *    dtk_host_services.make_status.
 *
 * 5. Ownership
 *    Next to every pointer parameter is one of:
 *      [borrowed]  valid for the duration of the call only; the callee copies what it keeps.
 *      [new]       a new reference/object the receiver owns and must release with the named
 *                  release function.
 *      [out]       written by the callee.
 *    Strings are NUL-terminated UTF-8. Strings in the entry struct, option specs and any struct
 *    returned by a plugin are borrowed for the plugin's lifetime (plugins are never unloaded).
 *
 * 6. Host services
 *    init() receives a dtk_host_services table: logging into the host's log, status creation,
 *    communication (process groups and collectives), seeds for the RNG streams, read access to
 *    the run configuration, and tensor-handle release.
 *
 * 7. Tensors, two tiers
 *    - Data tier (dataset plugins): dtk_buffer, a plain strided buffer described like DLPack
 *      (dtype code, shape, strides, data pointer, deleter). A dataset plugin needs no LibTorch;
 *      it can be written in C. Such a plugin leaves torch_version NULL.
 *    - Compute tier (model, step, optimizer, strategy plugins): dtk_tensor*, an opaque handle to
 *      a LibTorch tensor. Autograd needs one shared LibTorch, so a compute plugin records the
 *      LibTorch version it was built with (torch_version) and the host refuses a mismatch.
 *      C++ plugins convert handles with dtk/tensor.hpp.
 *
 * 8. Models cross as a vtable (dtk_model_api), never as a C++ module object.
 *
 * 9. Options
 *    Plugins declare their options (name, type, default, help) in the entry struct. The host
 *    validates user-supplied values (unknown key or ill-typed value is refused naming plugin and
 *    key) and passes every declared option, defaults filled in, as strings (dtk_option_values).
 *
 * 10. Lifetime
 *    Plugins are loaded RTLD_NOW|RTLD_LOCAL and never unloaded while the process lives.
 *    init() is called once after validation, deinit() once at orderly shutdown.
 * ---------------------------------------------------------------------------------------------
 */
#ifndef DTK_ABI_H_
#define DTK_ABI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DTK_ABI_MAJOR 1
#define DTK_ABI_MINOR 0

/* The one symbol a plugin exports. */
#define DTK_PLUGIN_ENTRY_SYMBOL "dtk_plugin_get_entry"

/* True when a struct written by another party (whose struct_size is in `s->struct_size`)
 * contains `field` of struct type `type`. */
#define DTK_HAS_FIELD(type, s, field) \
  ((s) != NULL && (s)->struct_size >= offsetof(type, field) + sizeof(((type*)0)->field))

#if defined(_WIN32)
#define DTK_EXPORT __declspec(dllexport)
#else
#define DTK_EXPORT __attribute__((visibility("default")))
#endif

/* ============================================================================================
 * Status (errors)
 * ========================================================================================== */

typedef enum dtk_status_code {
  DTK_OK = 0,
  DTK_ERR_UNKNOWN = 1,
  DTK_ERR_INVALID_ARGUMENT = 2, /* bad option value, bad shape, bad config */
  DTK_ERR_NOT_FOUND = 3,        /* missing file, missing tensor name */
  DTK_ERR_UNSUPPORTED = 4,      /* feature not implemented by this plugin */
  DTK_ERR_OUT_OF_RANGE = 5,     /* index past the end */
  DTK_ERR_INTERNAL = 6,         /* exception caught at the boundary, broken invariant */
  DTK_ERR_IO = 7,               /* read/write failure, corrupt file */
  DTK_ERR_COMM = 8,             /* collective failed or timed out */
  DTK_ERR_ABI = 9               /* version or struct-size incompatibility */
} dtk_status_code;

typedef struct dtk_status dtk_status;
struct dtk_status {
  size_t struct_size;
  int32_t code;                            /* a dtk_status_code */
  const char* message;                     /* UTF-8, owned by the status */
  void (*destroy)(dtk_status* self);       /* set by the creator; frees the status */
};

/* Getters, usable from C and C++. A NULL status is success. */
static inline int32_t dtk_status_get_code(const dtk_status* s) { return s ? s->code : DTK_OK; }
static inline const char* dtk_status_get_message(const dtk_status* s) {
  return (s && s->message) ? s->message : "";
}
static inline void dtk_status_release(dtk_status* s) {
  if (s && s->destroy) s->destroy(s);
}

/* ============================================================================================
 * Common enums and small structs
 * ========================================================================================== */

typedef enum dtk_plugin_kind {
  DTK_KIND_MODEL = 1,     /* model builder:        get_api returns const dtk_model_api*     */
  DTK_KIND_DATASET = 2,   /* dataset builder:      get_api returns const dtk_dataset_api*   */
  DTK_KIND_STEP = 3,      /* forward step + loss:  get_api returns const dtk_step_api*      */
  DTK_KIND_STRATEGY = 4,  /* parallel strategy:    get_api returns const dtk_strategy_api*  */
  DTK_KIND_OPTIMIZER = 5  /* optimizer:            get_api returns const dtk_optimizer_api* */
} dtk_plugin_kind;

/* Element types, shared by both tensor tiers. Values are fixed forever. */
typedef enum dtk_dtype {
  DTK_DTYPE_INVALID = 0,
  DTK_DTYPE_UINT8 = 1,
  DTK_DTYPE_INT8 = 2,
  DTK_DTYPE_INT16 = 3,
  DTK_DTYPE_INT32 = 4,
  DTK_DTYPE_INT64 = 5,
  DTK_DTYPE_UINT16 = 6,
  DTK_DTYPE_FLOAT16 = 7,
  DTK_DTYPE_BFLOAT16 = 8,
  DTK_DTYPE_FLOAT32 = 9,
  DTK_DTYPE_FLOAT64 = 10,
  DTK_DTYPE_BOOL = 11
} dtk_dtype;

typedef enum dtk_device_type { DTK_DEVICE_CPU = 0, DTK_DEVICE_CUDA = 1 } dtk_device_type;

typedef struct dtk_device {
  int32_t type;  /* dtk_device_type */
  int32_t index; /* -1 = current/default */
} dtk_device;

typedef enum dtk_log_level {
  DTK_LOG_DEBUG = 0, /* shown with --v=1 */
  DTK_LOG_INFO = 1,
  DTK_LOG_WARNING = 2,
  DTK_LOG_ERROR = 3
} dtk_log_level;

/* Data split a dataset serves. */
typedef enum dtk_split { DTK_SPLIT_TRAIN = 0, DTK_SPLIT_VALID = 1, DTK_SPLIT_TEST = 2 } dtk_split;

/* ============================================================================================
 * Options (rule 9)
 * ========================================================================================== */

typedef enum dtk_option_type {
  DTK_OPT_BOOL = 1,   /* "true"/"false"/"1"/"0" */
  DTK_OPT_INT = 2,    /* decimal int64 */
  DTK_OPT_FLOAT = 3,  /* double */
  DTK_OPT_STRING = 4, /* any UTF-8 */
  DTK_OPT_ENUM = 5    /* one of `choices` */
} dtk_option_type;

typedef struct dtk_option_spec {
  size_t struct_size;
  const char* name;          /* snake_case key */
  int32_t type;              /* dtk_option_type */
  const char* default_value; /* textual default; NULL = required */
  const char* help;          /* one sentence */
  const char* choices;       /* DTK_OPT_ENUM only: '|'-separated allowed values, else NULL */
} dtk_option_spec;

typedef struct dtk_key_value {
  const char* key;
  const char* value;
} dtk_key_value;

/* Every option the plugin declared, validated, defaults filled in. [borrowed] for the call. */
typedef struct dtk_option_values {
  size_t struct_size;
  size_t count;
  const dtk_key_value* items;
} dtk_option_values;

/* ============================================================================================
 * Data tier: plain buffers (dataset plugins, no LibTorch needed)
 * ========================================================================================== */

typedef struct dtk_buffer dtk_buffer;
struct dtk_buffer {
  size_t struct_size;
  void* data;             /* first element */
  int32_t dtype;          /* dtk_dtype */
  int32_t ndim;
  const int64_t* shape;   /* ndim entries, owned by the buffer */
  const int64_t* strides; /* ndim entries in ELEMENTS, or NULL for C-contiguous */
  void* manager_ctx;      /* the producer's private state */
  /* Releases the buffer (and its memory or the reference it holds, e.g. on a memory map).
   * Called exactly once by the receiver. May be NULL when nothing needs freeing. */
  void (*deleter)(dtk_buffer* self);
};

/* A receiver for named buffers. The callee calls put() once per output.
 * put takes ownership of `buffer` [new] even when it returns an error. */
typedef struct dtk_buffer_sink {
  size_t struct_size;
  void* ctx;
  dtk_status* (*put)(void* ctx, const char* name /*[borrowed]*/, dtk_buffer* buffer /*[new]*/);
} dtk_buffer_sink;

/* ============================================================================================
 * Compute tier: opaque LibTorch tensor handles
 * ========================================================================================== */

/* An owning reference to one at::Tensor. Layout private to dtk/tensor.hpp (same LibTorch on
 * both sides, enforced by torch_version). Release with dtk_host_services.tensor_release. */
typedef struct dtk_tensor dtk_tensor;

typedef struct dtk_named_tensor {
  const char* name;   /* [borrowed] */
  dtk_tensor* tensor; /* [borrowed] */
} dtk_named_tensor;

/* A read-only list of named tensors, [borrowed] for the call. */
typedef struct dtk_tensor_map {
  size_t struct_size;
  size_t count;
  const dtk_named_tensor* items;
} dtk_tensor_map;

/* A receiver for named tensors. put takes ownership of `tensor` [new], even on error. */
typedef struct dtk_tensor_sink {
  size_t struct_size;
  void* ctx;
  dtk_status* (*put)(void* ctx, const char* name /*[borrowed]*/, dtk_tensor* tensor /*[new]*/);
} dtk_tensor_sink;

/* A receiver for scalar metrics (e.g. "lm loss"). */
typedef struct dtk_metric_sink {
  size_t struct_size;
  void* ctx;
  void (*put)(void* ctx, const char* name /*[borrowed]*/, double value);
} dtk_metric_sink;

/* How a parameter is laid out across tensor-parallel ranks and treated by optimizers.
 * Mirrors Megatron's parameter attributes (tensor_model_parallel, partition_dim, ...). */
typedef struct dtk_param_info {
  size_t struct_size;
  int32_t tensor_parallel;   /* 1 if this rank holds a shard of a TP-partitioned weight */
  int32_t partition_dim;     /* dimension split across TP ranks, -1 if replicated */
  int32_t partition_stride;  /* Megatron's partition stride (1 normally) */
  int32_t no_weight_decay;   /* biases and norm weights: 1 */
  int32_t shared;            /* 1 if the same tensor appears under another name (tied) */
  int32_t sequence_parallel; /* 1 for replicated params whose grads need a TP all-reduce */
} dtk_param_info;

/* Visitor over named parameters. `tensor` is [borrowed] for the call: the visitor may keep
 * the underlying tensor by taking its own reference (dtk::borrow(...) in C++). */
typedef struct dtk_param_visitor {
  size_t struct_size;
  void* ctx;
  dtk_status* (*visit)(void* ctx, const char* name, dtk_tensor* tensor, const dtk_param_info* info);
} dtk_param_visitor;

/* ============================================================================================
 * Communication services (process groups and collectives)
 * ========================================================================================== */

/* The process groups of a run. Megatron's layout: world = DP x TP x PP ranks. */
typedef enum dtk_group {
  DTK_GROUP_WORLD = 0,
  DTK_GROUP_DATA_PARALLEL = 1,
  DTK_GROUP_TENSOR_PARALLEL = 2,
  DTK_GROUP_PIPELINE_PARALLEL = 3,
  DTK_GROUP_MODEL_PARALLEL = 4 /* TP x PP ranks sharing a data-parallel replica */
} dtk_group;

typedef enum dtk_reduce_op {
  DTK_REDUCE_SUM = 0,
  DTK_REDUCE_AVG = 1,
  DTK_REDUCE_MAX = 2,
  DTK_REDUCE_MIN = 3
} dtk_reduce_op;

/* An in-flight asynchronous collective. [new] from the collective; finish with wait(), then
 * release with release(). */
typedef struct dtk_comm_work dtk_comm_work;

typedef struct dtk_comm_services {
  size_t struct_size;
  void* ctx;
  int32_t (*rank)(void* ctx, int32_t group);
  int32_t (*size)(void* ctx, int32_t group);
  /* Global rank of `group_rank` in `group` as seen from the calling rank. */
  int32_t (*global_rank)(void* ctx, int32_t group, int32_t group_rank);
  /* Collectives. Tensors are [borrowed]; in-place where noted. With async != 0 the call
   * returns immediately and *work receives a [new] handle; with async == 0 *work is untouched
   * (may be NULL) and the call returns when the result is ready. */
  dtk_status* (*all_reduce)(void* ctx, int32_t group, dtk_tensor* inout, int32_t op, int32_t async,
                            dtk_comm_work** work);
  dtk_status* (*broadcast)(void* ctx, int32_t group, dtk_tensor* inout, int32_t src_group_rank,
                           int32_t async, dtk_comm_work** work);
  /* output has size(group) x input's first dimension, concatenated along dim 0 in rank order. */
  dtk_status* (*all_gather)(void* ctx, int32_t group, dtk_tensor* output, dtk_tensor* input,
                            int32_t async, dtk_comm_work** work);
  /* input has size(group) x output's first dimension; rank r receives reduced chunk r. */
  dtk_status* (*reduce_scatter)(void* ctx, int32_t group, dtk_tensor* output, dtk_tensor* input,
                                int32_t op, int32_t async, dtk_comm_work** work);
  dtk_status* (*barrier)(void* ctx, int32_t group);
  /* Waits for an async collective; timeout_ms <= 0 uses the run's collective timeout. */
  dtk_status* (*wait)(void* ctx, dtk_comm_work* work, int64_t timeout_ms);
  void (*work_release)(void* ctx, dtk_comm_work* work);
} dtk_comm_services;

/* ============================================================================================
 * Host services (rule 6), passed to init() and valid for the process lifetime
 * ========================================================================================== */

typedef enum dtk_rng_stream {
  DTK_RNG_DEFAULT = 0,         /* identical on all TP ranks of a replica (Megatron: seed+100*pp) */
  DTK_RNG_TENSOR_PARALLEL = 1, /* differs per TP rank (Megatron: seed+2718+tp_rank) */
  DTK_RNG_DATA = 2             /* the data seed, identical on all ranks */
} dtk_rng_stream;

typedef struct dtk_host_services {
  size_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  const char* host_version;  /* "0.1.0" */
  const char* torch_version; /* LibTorch the host runs, e.g. "1.13.0" */
  void* ctx;

  /* Logging into the host's log. `plugin` may be NULL (the host knows the caller). */
  void (*log)(void* ctx, int32_t level, const char* plugin, const char* file, int32_t line,
              const char* message);
  /* A [new] status with a copy of `message`. Never returns NULL. */
  dtk_status* (*make_status)(int32_t code, const char* message);

  /* Communication: always present; a single-process run has groups of size 1. */
  const dtk_comm_services* comm;

  /* Seed of an RNG stream for this rank (see dtk_rng_stream). */
  uint64_t (*rng_seed)(void* ctx, int32_t stream);

  /* Read access to the run configuration by dotted path, e.g. "train.micro_batch_size".
   * Writes a [borrowed] (until the next call) textual value into *value. */
  dtk_status* (*config_get)(void* ctx, const char* key, const char** value);

  /* Releases a [new] tensor handle (compute tier). */
  void (*tensor_release)(dtk_tensor* tensor);
} dtk_host_services;

/* ============================================================================================
 * Build context: what the pipeline tells a plugin when it creates an object
 * ========================================================================================== */

typedef struct dtk_build_context {
  size_t struct_size;
  const dtk_option_values* options; /* [borrowed] the plugin's validated options */
  dtk_device device;                /* where compute objects live */
  int32_t params_dtype;             /* dtk_dtype of parameters: FLOAT32, BFLOAT16 or FLOAT16 */
  int32_t tp_rank, tp_size;         /* tensor parallel */
  int32_t pp_rank, pp_size;         /* pipeline parallel */
  int32_t dp_rank, dp_size;         /* data parallel */
  int32_t pre_process;              /* this stage holds the embedding */
  int32_t post_process;             /* this stage holds the output layer and loss */
  int64_t seq_length;
  int64_t micro_batch_size;
  uint64_t seed;
} dtk_build_context;

/* ============================================================================================
 * Kind 1: model builder
 * ========================================================================================== */

typedef struct dtk_model dtk_model; /* opaque, plugin-owned */

/* Shape facts the host uses for parameter counts, FLOPs and logging. */
typedef struct dtk_model_info {
  size_t struct_size;
  int64_t num_layers;
  int64_t hidden_size;
  int64_t num_attention_heads;
  int64_t ffn_hidden_size;
  int64_t seq_length;
  int64_t vocab_size;        /* padded, full (all TP ranks) */
  int32_t recompute;         /* 0 none, 1 full activation recomputation */
  int32_t tied_embeddings;   /* 1 if the output layer reuses the word embedding */
} dtk_model_info;

typedef struct dtk_model_api {
  size_t struct_size;
  /* Builds the part of the model this rank owns (ctx->tp_rank, pre/post_process). */
  dtk_status* (*create)(const dtk_build_context* ctx, dtk_model** out /*[new] destroy()*/);
  void (*destroy)(dtk_model* model);
  /* Forward. Inputs by name (GPT: "tokens", "position_ids", "attention_mask", optional
   * "labels"). Outputs by name into `out` (GPT: "logits", or "loss" per token when labels
   * were given, computed with the vocab-parallel cross entropy). */
  dtk_status* (*forward)(dtk_model* model, const dtk_tensor_map* inputs, const dtk_tensor_sink* out);
  /* Every trainable parameter, in a stable order; tied parameters appear once with shared=1
   * on the owning stage. */
  dtk_status* (*visit_parameters)(dtk_model* model, const dtk_param_visitor* visitor);
  dtk_status* (*visit_buffers)(dtk_model* model, const dtk_param_visitor* visitor);
  dtk_status* (*set_training)(dtk_model* model, int32_t training);
  /* Moves/casts parameters and buffers in place. dtype DTK_DTYPE_INVALID keeps each dtype. */
  dtk_status* (*to)(dtk_model* model, dtk_device device, int32_t dtype);
  /* Checkpoint state: the tensors this rank owns (e.g. the embedding only where it lives). */
  dtk_status* (*state_save)(dtk_model* model, const dtk_tensor_sink* out);
  /* Loads state by name; copies values in place. strict != 0: a missing or unexpected name or
   * a shape mismatch is an error naming the tensor. */
  dtk_status* (*state_load)(dtk_model* model, const dtk_tensor_map* state, int32_t strict);
  dtk_status* (*get_info)(dtk_model* model, dtk_model_info* info /*[out], caller sets size*/);
} dtk_model_api;

/* A model together with its vtable, so another plugin (a step, a strategy) can call it. */
typedef struct dtk_model_ref {
  size_t struct_size;
  const dtk_model_api* api;
  dtk_model* model; /* [borrowed] */
} dtk_model_ref;

/* ============================================================================================
 * Kind 2: dataset builder (data tier)
 * ========================================================================================== */

typedef struct dtk_dataset dtk_dataset; /* opaque, plugin-owned */

typedef struct dtk_dataset_context {
  size_t struct_size;
  const dtk_option_values* options; /* [borrowed] */
  int64_t seq_length;               /* tokens per sample = seq_length + 1 for LM */
  int64_t num_samples[3];           /* samples requested per dtk_split (0 = split unused) */
  uint64_t seed;
  int32_t rank;                     /* global rank and world size: one rank builds caches, */
  int32_t world_size;               /* the others wait for them */
  const char* cache_dir;            /* [borrowed] where index caches may go; NULL = next to data */
} dtk_dataset_context;

typedef struct dtk_dataset_api {
  size_t struct_size;
  dtk_status* (*create)(const dtk_dataset_context* ctx, dtk_dataset** out /*[new] destroy()*/);
  void (*destroy)(dtk_dataset* dataset);
  /* Number of samples available in a split (>= requested; 0 if the split is empty). */
  dtk_status* (*num_samples)(dtk_dataset* dataset, int32_t split, int64_t* out);
  /* Sample `index` of `split`: puts named buffers into `out` (GPT: "text", int64 or the file's
   * integer dtype, shape [seq_length + 1]). Must be thread-safe: the host prefetches from a
   * background thread. */
  dtk_status* (*get_sample)(dtk_dataset* dataset, int32_t split, int64_t index,
                            const dtk_buffer_sink* out);
  /* Vocabulary size of the data (0 if unknown) so the host can check it against the model. */
  dtk_status* (*vocab_size)(dtk_dataset* dataset, int64_t* out);
} dtk_dataset_api;

/* ============================================================================================
 * Kind 3: forward step + loss
 * ========================================================================================== */

typedef struct dtk_step dtk_step; /* opaque, plugin-owned */

typedef struct dtk_step_api {
  size_t struct_size;
  dtk_status* (*create)(const dtk_build_context* ctx, dtk_step** out /*[new] destroy()*/);
  void (*destroy)(dtk_step* step);
  /* One micro-batch: turns the raw batch (e.g. "text" [b, s+1] int64) into model inputs,
   * runs the model, computes the loss.
   *   *loss    [new] scalar tensor to call backward on (the mean over valid tokens)
   *   metrics  reported values, already averaged over the data-parallel group
   *            (GPT: "lm loss")
   * `batch` may be empty on ranks that receive their inputs by broadcast (TP rank > 0). */
  dtk_status* (*forward_step)(dtk_step* step, const dtk_model_ref* model,
                              const dtk_tensor_map* batch, dtk_tensor** loss,
                              const dtk_metric_sink* metrics);
} dtk_step_api;

/* ============================================================================================
 * Kind 5: optimizer (declared before the strategy, which drives it)
 * ========================================================================================== */

typedef struct dtk_optimizer dtk_optimizer; /* opaque, plugin-owned */

/* One parameter group. Tensors are [borrowed]: the optimizer keeps its own references. Their
 * .grad() holds the gradient at step time. Under ZeRO these are flat fp32 shards. */
typedef struct dtk_param_group {
  size_t struct_size;
  size_t count;
  dtk_tensor* const* params;
  const char* const* names; /* may be NULL */
  double weight_decay;
  double lr_scale;          /* effective lr = step lr * lr_scale */
} dtk_param_group;

typedef struct dtk_optimizer_step_args {
  size_t struct_size;
  double lr;
  int64_t iteration;   /* 1-based optimizer step number */
  double grad_scale;   /* gradients are multiplied by 1/grad_scale before use (loss scaling) */
} dtk_optimizer_step_args;

typedef struct dtk_optimizer_api {
  size_t struct_size;
  dtk_status* (*create)(const dtk_build_context* ctx, const dtk_param_group* groups,
                        size_t num_groups, dtk_optimizer** out /*[new] destroy()*/);
  void (*destroy)(dtk_optimizer* optimizer);
  dtk_status* (*step)(dtk_optimizer* optimizer, const dtk_optimizer_step_args* args);
  /* Optimizer state for checkpoints (e.g. "g0.p3.exp_avg", "step"). */
  dtk_status* (*state_save)(dtk_optimizer* optimizer, const dtk_tensor_sink* out);
  dtk_status* (*state_load)(dtk_optimizer* optimizer, const dtk_tensor_map* state);
} dtk_optimizer_api;

typedef struct dtk_optimizer_ref {
  size_t struct_size;
  const dtk_optimizer_api* api;
  dtk_optimizer* optimizer; /* [borrowed] */
} dtk_optimizer_ref;

/* ============================================================================================
 * Kind 4: parallel strategy (gradient sync, sharding, offload)
 * ========================================================================================== */

typedef struct dtk_strategy dtk_strategy; /* opaque, plugin-owned */

/* The pipeline's per-iteration contract with a strategy:
 *   setup(model)                      once: wrap the model (DDP buckets, ZeRO partitions)
 *   optimizer_groups(groups)          once: the groups the optimizer is created over
 *   for each micro-batch: before_backward(last) ... backward ...
 *   reduce_gradients()                all-reduce / reduce-scatter gradients
 *   clip_and_norm(max_norm, &norm)    global grad norm across DP/TP, clipped if max_norm > 0
 *   optimizer_step(optimizer, args)   steps the optimizer and makes params current everywhere
 *   zero_grad()
 * Checkpoints: state_save/state_load carry sharded optimizer state and master weights. */
typedef struct dtk_strategy_api {
  size_t struct_size;
  dtk_status* (*create)(const dtk_build_context* ctx, dtk_strategy** out /*[new] destroy()*/);
  void (*destroy)(dtk_strategy* strategy);
  dtk_status* (*setup)(dtk_strategy* strategy, const dtk_model_ref* model);
  /* Fills `visitor` with the tensors the optimizer should own, one call per tensor; the
   * info's no_weight_decay splits them into groups. */
  dtk_status* (*optimizer_params)(dtk_strategy* strategy, const dtk_param_visitor* visitor);
  /* Called before each micro-batch's backward; is_last != 0 on the last micro-batch of a
   * step, so gradient reduction may overlap the last backward. */
  dtk_status* (*before_backward)(dtk_strategy* strategy, int32_t is_last);
  dtk_status* (*reduce_gradients)(dtk_strategy* strategy);
  /* Global L2 norm of the gradients (over all DP/TP ranks); clips to max_norm if > 0.
   * *norm receives the norm before clipping (NaN/Inf when gradients overflowed). */
  dtk_status* (*clip_and_norm)(dtk_strategy* strategy, double max_norm, double* norm);
  dtk_status* (*optimizer_step)(dtk_strategy* strategy, const dtk_optimizer_ref* optimizer,
                                const dtk_optimizer_step_args* args);
  dtk_status* (*zero_grad)(dtk_strategy* strategy);
  dtk_status* (*state_save)(dtk_strategy* strategy, const dtk_tensor_sink* out);
  dtk_status* (*state_load)(dtk_strategy* strategy, const dtk_tensor_map* state);
} dtk_strategy_api;

/* ============================================================================================
 * The entry struct (rule 1)
 * ========================================================================================== */

typedef struct dtk_plugin_entry {
  size_t struct_size;
  uint32_t abi_major;        /* DTK_ABI_MAJOR the plugin was built with */
  uint32_t abi_minor;        /* DTK_ABI_MINOR the plugin was built with */
  const char* torch_version; /* LibTorch version built against; NULL for data-tier plugins */
  const char* name;          /* unique per kind, [a-z0-9_]+ */
  int32_t kind;              /* dtk_plugin_kind */
  const char* version;       /* the plugin's own version, e.g. "1.0.0" */
  const char* description;   /* one line */
  /* Called once after the host validated the entry. `host` is [borrowed] for the process
   * lifetime. A non-NULL status refuses the plugin with its message. */
  dtk_status* (*init)(const dtk_host_services* host);
  void (*deinit)(void);
  /* The kind's function table (see dtk_plugin_kind). Static; never NULL after init. */
  const void* (*get_api)(void);
  const dtk_option_spec* options; /* num_options entries, static */
  size_t num_options;
} dtk_plugin_entry;

typedef const dtk_plugin_entry* (*dtk_plugin_entry_fn)(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DTK_ABI_H_ */
