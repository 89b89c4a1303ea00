/*
 * dtk/abi.h — the DTK plugin ABI. THE contract between the `dtk` host and its plugins.
 *
 * Pure C99. Everything a plugin and the host exchange is declared here; the C++ headers next to
 * this one (plugin.hpp, dataset.hpp, tensor.hpp, model.hpp, step.hpp, optimizer.hpp,
 * strategy.hpp) are optional conveniences built on top of it.
 *
 * ---------------------------------------------------------------------------------------------
 * 1. Entry point
 *    A plugin is a shared library exporting exactly ONE symbol:
 *        const dtk_plugin_entry* dtk_plugin_get_entry(void);   (DTK_PLUGIN_ENTRY_SYMBOL)
 *    It returns a pointer to a static, immutable entry struct describing the plugin. Plugins are
 *    built with -fvisibility=hidden and a linker version script so nothing else leaks out.
 *
 * 2. Growth rule (append-only) and struct sizes
 *    Every growable struct begins with `size_t struct_size`. Whoever fills a struct sets
 *    struct_size to <type>_STRUCT_SIZE (the size up to and including its last field at the
 *    writer's minor; NOT sizeof, whose trailing padding could seem to cover a field appended
 *    later). Structs and function tables only ever grow at the end. A reader:
 *      - refuses a struct smaller than the minor it requires, <type>_STRUCT_SIZE_2_0 for every
 *        field that shipped in 2.0 (DTK_STRUCT_COVERS);
 *      - reads a field appended after 2.0 only if DTK_HAS_FIELD(type, s, field) is true.
 *    DTK_DEFINE_STRUCT_SIZE below gives every struct one constant per minor; the constant of a
 *    released minor never changes. tests/abi asserts every shipped field offset, so a reorder
 *    fails the build, and keeps a frozen copy of each released header (tests/abi/v2_0).
 *    An array of versioned structs (option specs, parameter groups) is walked with the stride of
 *    its elements' struct_size, which is the same for every element of one array.
 *
 *    Frozen value types. Three small structs are passed by value or in arrays of fixed stride
 *    and have NO struct_size: dtk_device, dtk_key_value and dtk_named_tensor. They never grow;
 *    a need for another field is met by a new type (e.g. dtk_named_tensor2) used by new
 *    functions, never by changing these.
 *
 * 3. Versions
 *    DTK_ABI_MAJOR changes only on an incompatible change; the host refuses another major with
 *    one line naming the plugin file, its ABI and the host's. DTK_ABI_MINOR grows when fields or
 *    functions are appended; a plugin built for a minor <= the host's minor loads, a plugin
 *    built for a newer minor is refused ("plugin newer than host"). docs/abi-changelog.md has
 *    one entry per version.
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
 * 6. Threads (CLAP style: every function pointer carries one tag of its own, in the comment on
 *    its line or directly above it; a group comment does not count. tests/abi/thread_tags_test.cpp
 *    checks it.)
 *      [main-thread]    called only from the training thread, the thread that runs the
 *                       pipeline (and, inside backward(), LibTorch's autograd thread for the
 *                       device, which the training thread waits on).
 *      [loader-thread]  called from the host's data-loader thread (prefetch), concurrently
 *                       with [main-thread] calls on other objects. Must be thread-safe against
 *                       [main-thread] calls on the same object.
 *      [any-thread]     may be called from any thread, one call at a time per object.
 *      [thread-safe]    may be called from any thread, concurrently.
 *    Host services are tagged the same way: a plugin may call a [thread-safe] service from a
 *    thread of its own. A sink's or visitor's function is called on the thread of the call that
 *    was given it, and is tagged with that call's tag.
 *
 * 7. Calls that grow take an args struct
 *    A call whose inputs may grow (forward, forward_step, collectives, optimizer create/step,
 *    strategy hooks, dataset get_sample, model to) takes one `const <name>_args*` whose first
 *    field is struct_size. A later minor appends fields (a stream, a timeout, a tag) without a
 *    new function: the callee reads them only when DTK_HAS_FIELD says the caller set them.
 *    Results come back through [out] fields of the args struct or a sink.
 *
 * 8. Extensions
 *    Optional capabilities added between minors are looked up by id: the entry's and the host
 *    services' get_extension("dtk.ext.<name>.v<N>") returns a pointer to a static table
 *    (struct_size first) or NULL when not provided. An extension id is never reused for
 *    another layout; an incompatible change is a new id (".v2"). See docs/abi.md.
 *
 * 9. Host services
 *    init() receives a dtk_host_services table: logging into the host's log, status creation,
 *    communication (process groups and collectives), seeds for the RNG streams, device
 *    services (streams, events, pinned memory), tensor-handle release and extensions.
 *
 * 10. Tensors, two tiers
 *    - Data tier (dataset plugins): dtk_buffer, a plain strided buffer described like DLPack
 *      (dtype code, shape, strides, data pointer, deleter). A dataset plugin needs no LibTorch;
 *      it can be written in C. Such a plugin leaves torch_version NULL.
 *    - Compute tier (model, step, optimizer, strategy plugins): dtk_tensor*, an opaque handle to
 *      a LibTorch tensor. Autograd needs one shared LibTorch, so a compute plugin records the
 *      LibTorch version it was built with (torch_version) and the host refuses a mismatch.
 *      C++ plugins convert handles with dtk/tensor.hpp.
 *
 * 11. Models cross as a vtable (dtk_model_api), never as a C++ module object.
 *
 * 12. Options
 *    Plugins declare their options (name, type, default, help, and since 2.7 the settings they
 *    act with) in the entry struct. The host validates user-supplied values (unknown key,
 *    ill-typed value, or a value for an option its settings leave idle is refused naming plugin
 *    and key) and passes every declared option, defaults filled in, as strings
 *    (dtk_option_values).
 *
 * 13. Lifetime
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

#define DTK_ABI_MAJOR 2
#define DTK_ABI_MINOR 21

/* The one symbol a plugin exports. */
#define DTK_PLUGIN_ENTRY_SYMBOL "dtk_plugin_get_entry"

/* ============================================================================================
 * Struct sizes (rule 2)
 * ========================================================================================== */

/* Bytes of `type` up to and including `last_field`: the struct's size at the minor whose last
 * field that was. Trailing padding is excluded on purpose. */
#define DTK_STRUCT_SIZE(type, last_field) (offsetof(type, last_field) + sizeof(((type*)0)->last_field))

/* Compile-time assertion usable at file scope in C99, C11 and C++. */
#if defined(__cplusplus)
#define DTK_STATIC_ASSERT(cond, name) static_assert(cond, #name)
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define DTK_STATIC_ASSERT(cond, name) _Static_assert(cond, #name)
#else
#define DTK_STATIC_ASSERT(cond, name) typedef char name[(cond) ? 1 : -1]
#endif

/* DTK_DEFINE_STRUCT_SIZE(type, 2_0, last_field) defines the constant type_STRUCT_SIZE_2_0,
 * the struct's size at ABI 2.0 (frozen forever once 2.0 shipped), and asserts that the struct
 * starts with struct_size. A minor that appends fields adds a line for itself (2_1, ...). */
#define DTK_DEFINE_STRUCT_SIZE(type, minor, last_field)                    \
  enum { type##_STRUCT_SIZE_##minor = DTK_STRUCT_SIZE(type, last_field) }; \
  DTK_STATIC_ASSERT(offsetof(type, struct_size) == 0, type##_struct_size_first_##minor)

/* DTK_DEFINE_STRUCT_TRAITS(type, last_field) defines type_STRUCT_SIZE, the size at the minor
 * this header declares: the value a writer stores in struct_size. It moves with each minor
 * that appends to the struct. */
#define DTK_DEFINE_STRUCT_TRAITS(type, last_field) enum { type##_STRUCT_SIZE = DTK_STRUCT_SIZE(type, last_field) }

/* True when a struct written by another party covers every field of `type` at `minor`, e.g.
 * DTK_STRUCT_COVERS(dtk_model_api, api, 2_0). */
#define DTK_STRUCT_COVERS(type, s, minor) ((s) != NULL && (s)->struct_size >= (size_t)type##_STRUCT_SIZE_##minor)

/* True when a struct written by another party (whose size is in `s->struct_size`) contains
 * `field` of `type`. Use it before reading any field appended after 2.0. */
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
  int32_t code;                      /* a dtk_status_code */
  const char* message;               /* UTF-8, owned by the status */
  void (*destroy)(dtk_status* self); /* [any-thread] set by the creator; frees the status */
};
DTK_DEFINE_STRUCT_SIZE(dtk_status, 2_0, destroy);
DTK_DEFINE_STRUCT_TRAITS(dtk_status, destroy);

/* Getters, usable from C and C++. A NULL status is success. */
static inline int32_t dtk_status_get_code(const dtk_status* s) { return s ? s->code : DTK_OK; }
static inline const char* dtk_status_get_message(const dtk_status* s) { return (s && s->message) ? s->message : ""; }
static inline void dtk_status_release(dtk_status* s) {
  if (s && s->destroy) s->destroy(s);
}

/* ============================================================================================
 * Common enums and frozen value types
 * ========================================================================================== */

typedef enum dtk_plugin_kind {
  DTK_KIND_MODEL = 1,    /* model builder:        get_api returns const dtk_model_api*     */
  DTK_KIND_DATASET = 2,  /* dataset builder:      get_api returns const dtk_dataset_api*   */
  DTK_KIND_STEP = 3,     /* forward step + loss:  get_api returns const dtk_step_api*      */
  DTK_KIND_STRATEGY = 4, /* parallel strategy:    get_api returns const dtk_strategy_api*  */
  DTK_KIND_OPTIMIZER = 5 /* optimizer:            get_api returns const dtk_optimizer_api* */
} dtk_plugin_kind;

/* Element types, shared by both tensor tiers. Values are fixed forever. */
typedef enum dtk_dtype {
  DTK_DTYPE_INVALID = 0,
  DTK_DTYPE_UINT8 = 1,
  DTK_DTYPE_INT8 = 2,
  DTK_DTYPE_INT16 = 3,
  DTK_DTYPE_INT32 = 4,
  DTK_DTYPE_INT64 = 5,
  DTK_DTYPE_UINT16 = 6, /* data tier only: LibTorch 1.13 has no uint16 */
  DTK_DTYPE_FLOAT16 = 7,
  DTK_DTYPE_BFLOAT16 = 8,
  DTK_DTYPE_FLOAT32 = 9,
  DTK_DTYPE_FLOAT64 = 10,
  DTK_DTYPE_BOOL = 11
} dtk_dtype;

typedef enum dtk_device_type { DTK_DEVICE_CPU = 0, DTK_DEVICE_CUDA = 1 } dtk_device_type;

/* Frozen value type (rule 2): passed by value, never grows. */
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
 * Options (rule 12)
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
  /* ABI 2.7. NULL, or the settings without which the option does nothing:
   * "setting=value[|value...][,setting=value...]", each setting another option of the same
   * plugin; the option acts while any one of them holds one of its listed values (e.g.
   * "stage=3", "offload_optimizer=nvme,offload_param=nvme"). The host refuses a value other than
   * the option's default while none holds ("does nothing without stage=3"), shows the condition
   * in `dtk plugins describe`, and reads such a value of a model plugin's, recorded in a
   * checkpoint, as the default. */
  const char* acts_with;
} dtk_option_spec;
DTK_DEFINE_STRUCT_SIZE(dtk_option_spec, 2_0, choices);
DTK_DEFINE_STRUCT_SIZE(dtk_option_spec, 2_7, acts_with);
DTK_DEFINE_STRUCT_TRAITS(dtk_option_spec, acts_with);

/* Frozen value type (rule 2): an element of dtk_option_values.items, never grows. */
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
DTK_DEFINE_STRUCT_SIZE(dtk_option_values, 2_0, items);
DTK_DEFINE_STRUCT_TRAITS(dtk_option_values, items);

/* ============================================================================================
 * Data tier: plain buffers (dataset plugins, no LibTorch needed)
 * ========================================================================================== */

typedef struct dtk_buffer dtk_buffer;
struct dtk_buffer {
  size_t struct_size;
  void* data;    /* first element */
  int32_t dtype; /* dtk_dtype */
  int32_t ndim;
  const int64_t* shape;   /* ndim entries, owned by the buffer */
  const int64_t* strides; /* ndim entries in ELEMENTS, or NULL for C-contiguous */
  void* manager_ctx;      /* the producer's private state */
  /* [any-thread] Releases the buffer (and its memory or the reference it holds, e.g. on a
   * memory map). Called exactly once by the receiver, possibly on another thread than the one
   * that produced it. May be NULL when nothing needs freeing. */
  void (*deleter)(dtk_buffer* self);
};
DTK_DEFINE_STRUCT_SIZE(dtk_buffer, 2_0, deleter);
DTK_DEFINE_STRUCT_TRAITS(dtk_buffer, deleter);

/* A receiver for named buffers. The callee calls put() once per output, on the thread it was
 * called on. put takes ownership of `buffer` [new] even when it returns an error. */
typedef struct dtk_buffer_sink {
  size_t struct_size;
  void* ctx;
  /* [loader-thread] Called by the dataset inside get_sample (the only call given a buffer sink),
   * which the host runs on its data-loader thread. */
  dtk_status* (*put)(void* ctx, const char* name /*[borrowed]*/, dtk_buffer* buffer /*[new]*/);
} dtk_buffer_sink;
DTK_DEFINE_STRUCT_SIZE(dtk_buffer_sink, 2_0, put);
DTK_DEFINE_STRUCT_TRAITS(dtk_buffer_sink, put);

/* ============================================================================================
 * Compute tier: opaque LibTorch tensor handles
 * ========================================================================================== */

/* An owning reference to one at::Tensor. Layout private to dtk/tensor.hpp (same LibTorch on
 * both sides, enforced by torch_version). Release with dtk_host_services.tensor_release. */
typedef struct dtk_tensor dtk_tensor;

/* Frozen value type (rule 2): an element of dtk_tensor_map.items, never grows. */
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
DTK_DEFINE_STRUCT_SIZE(dtk_tensor_map, 2_0, items);
DTK_DEFINE_STRUCT_TRAITS(dtk_tensor_map, items);

/* A receiver for named tensors. put takes ownership of `tensor` [new], even on error. Called
 * on the thread of the call that was given the sink. */
typedef struct dtk_tensor_sink {
  size_t struct_size;
  void* ctx;
  /* [main-thread] Called inside the call given the sink (model forward, state_save). */
  dtk_status* (*put)(void* ctx, const char* name /*[borrowed]*/, dtk_tensor* tensor /*[new]*/);
} dtk_tensor_sink;
DTK_DEFINE_STRUCT_SIZE(dtk_tensor_sink, 2_0, put);
DTK_DEFINE_STRUCT_TRAITS(dtk_tensor_sink, put);

/* A receiver for scalar metrics (e.g. "lm loss"). */
typedef struct dtk_metric_sink {
  size_t struct_size;
  void* ctx;
  /* [main-thread] Called inside the call given the sink (forward_step). */
  void (*put)(void* ctx, const char* name /*[borrowed]*/, double value);
  /* ABI 2.5. [main-thread] The same, as a one-element tensor on the compute device [new]: the
   * host reads it when it needs the number (once per iteration, for the log line), so the step
   * does not wait for the device, and a step captured into a CUDA graph can report it. The
   * tensor's value must not change afterwards (put a copy, not a buffer the step reuses). */
  void (*put_tensor)(void* ctx, const char* name /*[borrowed]*/, dtk_tensor* value /*[new]*/);
} dtk_metric_sink;
DTK_DEFINE_STRUCT_SIZE(dtk_metric_sink, 2_0, put);
DTK_DEFINE_STRUCT_SIZE(dtk_metric_sink, 2_5, put_tensor);
DTK_DEFINE_STRUCT_TRAITS(dtk_metric_sink, put_tensor);

/* How a parameter is laid out across tensor-parallel ranks, treated by optimizers and owned by
 * a module. Mirrors Megatron's parameter attributes (tensor_model_parallel, partition_dim).
 * 2.0 removed 1.0's partition_stride (always 1 for GPT) and sequence_parallel (no sequence
 * parallelism planned); a later minor appends them if a model needs them. */
typedef struct dtk_param_info {
  size_t struct_size;
  int32_t tensor_parallel; /* 1 if this rank holds a shard of a TP-partitioned weight */
  int32_t partition_dim;   /* dimension split across TP ranks, -1 if replicated */
  int32_t no_weight_decay; /* biases and norm weights: 1 */
  int32_t shared;          /* 1 if tied: read by another use too, here or on another pipeline stage */
  int32_t module_index;    /* the module owning it (dtk_module_info.index), -1 if none */
  /* ABI 2.1. A strategy that hands the optimizer a shard of a parameter (ZeRO) describes it here:
   * the shard is the 1-D run of its numel() elements that starts at element `shard_offset` of the
   * flattened parameter, whose whole size is `full_numel` elements. full_numel == 0: the tensor
   * is the whole parameter (what a 2.0 writer means too). Checkpoints use it to re-partition
   * optimizer state between strategies and data-parallel sizes. */
  int64_t shard_offset;
  int64_t full_numel;
  /* ABI 2.3. 1: a replicated parameter read only on this rank's sequence shard (sequence
   * parallelism: norms, row-parallel biases, position embeddings), so its gradient here is a
   * partial sum; the host sums it over the tensor-parallel group after the strategy's reduction
   * (Megatron's `sequence_parallel` attribute). A replicated parameter read only by this rank's
   * attention heads (per-head query/key norms, Megatron's --qk-layernorm) is a partial sum the
   * same way and is marked alike, with or without sequence parallelism. */
  int32_t sequence_parallel;
  /* ABI 2.9. 1: a weight of one mixture-of-experts expert, which a token reads only when routed to
   * it (dtk_model_info.moe_router_topk of num_experts), so a token's FLOPs count it at that
   * fraction (Megatron-LM's --num-experts). */
  int32_t expert;
  /* ABI 2.18. With expert 1: how many routed experts its layer has, where the model's MoE layers
   * differ (DeepSpeed's pyramid MoE, Megatron-DeepSpeed's --num-experts list); a token reads it at
   * moe_router_topk of this many. 0 (and a 2.17 parameter): dtk_model_info.num_experts. */
  int32_t layer_experts;
} dtk_param_info;
DTK_DEFINE_STRUCT_SIZE(dtk_param_info, 2_0, module_index);
DTK_DEFINE_STRUCT_SIZE(dtk_param_info, 2_1, full_numel);
DTK_DEFINE_STRUCT_SIZE(dtk_param_info, 2_3, sequence_parallel);
DTK_DEFINE_STRUCT_SIZE(dtk_param_info, 2_9, expert);
DTK_DEFINE_STRUCT_SIZE(dtk_param_info, 2_18, layer_experts);
DTK_DEFINE_STRUCT_TRAITS(dtk_param_info, layer_experts);

/* Visitor over named parameters. `tensor` is [borrowed] for the call: a C++ visitor that
 * keeps the tensor copies the at::Tensor (dtk::unwrap(tensor)), which takes its own reference.
 * visit is called on the thread of the call that was given the visitor. */
typedef struct dtk_param_visitor {
  size_t struct_size;
  void* ctx;
  /* [main-thread] Called inside visit_parameters, visit_buffers, optimizer_params or (2.4)
   * init_parameters, where `info` is NULL. */
  dtk_status* (*visit)(void* ctx, const char* name, dtk_tensor* tensor, const dtk_param_info* info);
} dtk_param_visitor;
DTK_DEFINE_STRUCT_SIZE(dtk_param_visitor, 2_0, visit);
DTK_DEFINE_STRUCT_TRAITS(dtk_param_visitor, visit);

/* ============================================================================================
 * Device services: streams, events, pinned host memory (compute tier)
 *
 * What CUDA work needs from the host, declared device-generic. On a CPU run every stream is a
 * valid handle for the CPU's single in-order "stream" (work is synchronous), events record
 * nothing and are always complete, and pinned tensors are plain host tensors: plugin code
 * written for CUDA runs unchanged on CPU.
 * ========================================================================================== */

typedef struct dtk_stream dtk_stream; /* opaque, host-owned */
typedef struct dtk_event dtk_event;   /* opaque, host-owned */

typedef struct dtk_device_services {
  size_t struct_size;
  void* ctx;
  /* [thread-safe] A [new] stream on `device` (release with stream_destroy). priority: 0 =
   * default, negative = higher (CUDA's convention). */
  dtk_status* (*stream_create)(void* ctx, dtk_device device, int32_t priority, dtk_stream** out);
  /* [thread-safe] Releases a stream from stream_create (waits for nothing; pending work
   * completes on its own). */
  void (*stream_destroy)(void* ctx, dtk_stream* stream);
  /* [thread-safe] The calling thread's current stream on `device`, [borrowed] for the
   * process lifetime. Never NULL. */
  dtk_stream* (*current_stream)(void* ctx, dtk_device device);
  /* [thread-safe] Makes `stream` the calling thread's current stream on its device (LibTorch
   * kernels launched by this thread go there). Returns the previous one through *previous
   * [out][borrowed] (may be NULL) so the caller can restore it. */
  dtk_status* (*set_current_stream)(void* ctx, dtk_stream* stream, dtk_stream** previous);
  /* [thread-safe] Blocks until all work queued on `stream` completed. */
  dtk_status* (*stream_synchronize)(void* ctx, dtk_stream* stream);
  /* [thread-safe] A [new] event (release with event_destroy). */
  dtk_status* (*event_create)(void* ctx, dtk_event** out);
  void (*event_destroy)(void* ctx, dtk_event* event); /* [thread-safe] */
  /* [thread-safe] Records `event` at the current end of `stream`'s queue. */
  dtk_status* (*event_record)(void* ctx, dtk_event* event, dtk_stream* stream);
  /* [thread-safe] Makes future work on `stream` wait for `event` (no host blocking). */
  dtk_status* (*stream_wait_event)(void* ctx, dtk_stream* stream, dtk_event* event);
  /* [thread-safe] Blocks the host until `event` completed; timeout_ms <= 0 = the run's
   * collective timeout. DTK_ERR_COMM on timeout. */
  dtk_status* (*event_synchronize)(void* ctx, dtk_event* event, int64_t timeout_ms);
  /* [thread-safe] A [new] host tensor in page-locked memory (fast, asynchronous copies to and
   * from the device), contiguous, uninitialized. On a CPU run: ordinary host memory. */
  dtk_status* (*alloc_pinned)(void* ctx, const int64_t* shape, int32_t ndim, int32_t dtype, dtk_tensor** out);
} dtk_device_services;
DTK_DEFINE_STRUCT_SIZE(dtk_device_services, 2_0, alloc_pinned);
DTK_DEFINE_STRUCT_TRAITS(dtk_device_services, alloc_pinned);

/* ============================================================================================
 * Communication services (process groups and collectives)
 *
 * Overlap pattern (Domino's tensor-parallel layers, ZeRO's prefetch): issue, compute, wait.
 *     args.async = 1; args.work = &w;  all_reduce(ctx, &args);      issue
 *     ... compute that does not read or write the tensor ...        overlap
 *     wait(ctx, w, timeout_ms); work_release(ctx, w);               bounded wait
 * Every wait is bounded (timeout_ms <= 0 = the run's collective timeout): a dead peer ends the
 * run with DTK_ERR_COMM naming the collective, never a hang. Until wait() returns, the tensors
 * of an async collective must not be touched. A work handle dropped without wait() is a leak;
 * the C++ SDK's dtk::Comm::Work waits in its destructor.
 * ========================================================================================== */

/* The process groups of a run. Megatron's layout: world = TP x CP x DP x PP ranks. */
typedef enum dtk_group {
  DTK_GROUP_WORLD = 0,
  DTK_GROUP_DATA_PARALLEL = 1,
  DTK_GROUP_TENSOR_PARALLEL = 2,
  DTK_GROUP_PIPELINE_PARALLEL = 3,
  DTK_GROUP_MODEL_PARALLEL = 4, /* TP x PP ranks sharing a data-parallel replica */
  /* ABI 2.12. Expert parallelism (Megatron's --expert-model-parallel-size, its order
   * tp-ep-dp-pp): the data-parallel group in consecutive runs of E ranks, each run an expert-
   * parallel group whose ranks hold different routed experts (data-parallel rank d is expert-
   * parallel rank d % E); the expert-data-parallel group: the data-parallel ranks with the same
   * expert-parallel rank (d / E its rank), which hold the same experts. Size 1 each without expert
   * parallelism; a 2.11 host answers -1 (unknown) for both. */
  DTK_GROUP_EXPERT_PARALLEL = 5,
  DTK_GROUP_EXPERT_DATA_PARALLEL = 6,
  /* ABI 2.20. Context parallelism (Megatron's --context-parallel-size, its order tp-cp-dp-pp): the
   * ranks that split each sequence (dtk_build_context.cp_rank/cp_size), consecutive runs of C
   * ranks of the data-parallel group. Under it the data-parallel group holds the data- and
   * context-parallel ranks together (Megatron's data-parallel group with context parallel): the
   * ranks that hold the same parameters, over which gradients, optimizer shards and reported
   * values are reduced; only the samples are split over its C-strided subsets, by the host. Size
   * 1 without context parallelism; a 2.19 host answers -1 (unknown). */
  DTK_GROUP_CONTEXT_PARALLEL = 7
} dtk_group;

typedef enum dtk_reduce_op {
  DTK_REDUCE_SUM = 0,
  DTK_REDUCE_AVG = 1,
  DTK_REDUCE_MAX = 2,
  DTK_REDUCE_MIN = 3
} dtk_reduce_op;

/* An in-flight asynchronous collective. [new] from the collective; finish with wait(), then
 * release with work_release(). */
typedef struct dtk_comm_work dtk_comm_work;

/* Arguments of every collective. Each call documents which fields it reads; the others are
 * ignored. Tensors are [borrowed] for the call and, with async != 0, until wait() returned. */
typedef struct dtk_collective_args {
  size_t struct_size;
  int32_t group;        /* dtk_group */
  int32_t op;           /* dtk_reduce_op (all_reduce, reduce_scatter) */
  dtk_tensor* tensor;   /* all_reduce, broadcast: in-place; all_gather, reduce_scatter, all_to_all: input */
  dtk_tensor* output;   /* all_gather, reduce_scatter, all_to_all: output; else unused (NULL) */
  int32_t root;         /* broadcast: source rank within `group` */
  int32_t async;        /* 0: returns when the result is ready; 1: returns at once, *work set */
  dtk_comm_work** work; /* [out][new] with async != 0: the handle to wait() on; else unused */
  /* Stream the collective is ordered after and completes on (NULL = the current stream of
   * the tensor's device). A CPU run ignores it. */
  dtk_stream* stream;
  /* Reserved for a scheduling priority (Domino's high-priority TP all-reduce). Must be 0 in
   * 2.0: a 2.0 host refuses any other value rather than silently ignore it. */
  int32_t priority;
  /* ABI 2.19, all_to_all only: how many rows (along dim 0) this rank receives from, and sends to,
   * each rank of the group, size(group) entries each [borrowed] for the call (with async != 0,
   * until wait() returned); NULL = equal parts of output and tensor. */
  const int64_t* output_splits;
  const int64_t* input_splits;
} dtk_collective_args;
DTK_DEFINE_STRUCT_SIZE(dtk_collective_args, 2_0, priority);
DTK_DEFINE_STRUCT_SIZE(dtk_collective_args, 2_19, input_splits);
DTK_DEFINE_STRUCT_TRAITS(dtk_collective_args, input_splits);

typedef struct dtk_comm_services {
  size_t struct_size;
  void* ctx;
  int32_t (*rank)(void* ctx, int32_t group); /* [thread-safe] -1 for an unknown group */
  int32_t (*size)(void* ctx, int32_t group); /* [thread-safe] -1 for an unknown group */
  /* Collectives, [main-thread] (one thread issues collectives, in the same order on every rank
   * of the group; c10d requires it). */
  /* [main-thread] In-place reduction of args->tensor with args->op. */
  dtk_status* (*all_reduce)(void* ctx, const dtk_collective_args* args);
  /* [main-thread] args->tensor of group rank args->root copied into args->tensor everywhere. */
  dtk_status* (*broadcast)(void* ctx, const dtk_collective_args* args);
  /* [main-thread] args->output has size(group) x args->tensor's first dimension, concatenated
   * along dim 0 in rank order. */
  dtk_status* (*all_gather)(void* ctx, const dtk_collective_args* args);
  /* [main-thread] args->tensor has size(group) x args->output's first dimension; rank r
   * receives reduced chunk r into args->output. */
  dtk_status* (*reduce_scatter)(void* ctx, const dtk_collective_args* args);
  /* [main-thread] Reads args->group only; always synchronous and bounded by the collective
   * timeout. */
  dtk_status* (*barrier)(void* ctx, const dtk_collective_args* args);
  /* [main-thread] Waits for an async collective; timeout_ms <= 0 uses the run's collective
   * timeout. After an error the work is finished: release it. */
  dtk_status* (*wait)(void* ctx, dtk_comm_work* work, int64_t timeout_ms);
  void (*work_release)(void* ctx, dtk_comm_work* work); /* [main-thread] */
  /* ABI 2.19. [main-thread] Personalised exchange (an MoE layer's token dispatch): rank r sends
   * args->tensor's rows in size(group) consecutive parts, part j (args->input_splits[j] rows) to
   * rank j, and receives into args->output rank j's part r (args->output_splits[j] rows), in rank
   * order. Same dtype and trailing dimensions; the splits must agree between sender and receiver.
   * Absent (struct_size) on an earlier host. */
  dtk_status* (*all_to_all)(void* ctx, const dtk_collective_args* args);
} dtk_comm_services;
DTK_DEFINE_STRUCT_SIZE(dtk_comm_services, 2_0, work_release);
DTK_DEFINE_STRUCT_SIZE(dtk_comm_services, 2_19, all_to_all);
DTK_DEFINE_STRUCT_TRAITS(dtk_comm_services, all_to_all);

/* ============================================================================================
 * Host services (rule 9), passed to init() and valid for the process lifetime
 * ========================================================================================== */

/* RNG streams. 2.0 removed 1.0's DTK_RNG_DATA (= 2, never reused): the data seed reaches a
 * dataset through dtk_dataset_context.seed. */
typedef enum dtk_rng_stream {
  DTK_RNG_DEFAULT = 0,        /* identical on all TP ranks of a replica (Megatron: seed+100*pp) */
  DTK_RNG_TENSOR_PARALLEL = 1 /* differs per TP rank (Megatron: seed+2718+tp_rank) */
} dtk_rng_stream;

typedef struct dtk_host_services {
  size_t struct_size;
  uint32_t abi_major;
  uint32_t abi_minor;
  const char* host_version;  /* "0.1.0" */
  const char* torch_version; /* LibTorch the host runs, e.g. "1.13.0" */
  void* ctx;

  /* [thread-safe] Logging into the host's log. `plugin` may be NULL. */
  void (*log)(void* ctx, int32_t level, const char* plugin, const char* file, int32_t line, const char* message);
  /* [thread-safe] A [new] status with a copy of `message`. Never returns NULL. */
  dtk_status* (*make_status)(int32_t code, const char* message);

  /* Communication: always present; a single-process run has groups of size 1. */
  const dtk_comm_services* comm;

  /* [thread-safe] Seed of an RNG stream for this rank (see dtk_rng_stream). */
  uint64_t (*rng_seed)(void* ctx, int32_t stream);

  /* [thread-safe] Releases a [new] tensor handle (compute tier). */
  void (*tensor_release)(dtk_tensor* tensor);

  /* Streams, events and pinned memory: always present (CPU: valid no-ops, see above). */
  const dtk_device_services* device;

  /* [thread-safe] A host-provided extension by id ("dtk.ext.<name>.v<N>", rule 8), or NULL
   * when this host does not provide it. The pointer is static for the process lifetime. */
  const void* (*get_extension)(const char* id);
} dtk_host_services;
DTK_DEFINE_STRUCT_SIZE(dtk_host_services, 2_0, get_extension);
DTK_DEFINE_STRUCT_TRAITS(dtk_host_services, get_extension);

/* Host extension "dtk.ext.trace.v1" (since 2.1): the run's timeline (logging.trace_file). Code
 * marks spans of its work; the host adds every collective (issue to completion) and every wait,
 * and writes a Chrome/Perfetto trace per rank for the iterations being traced. Every function is
 * [thread-safe]; spans recorded while no traced iteration runs are dropped. */
#define DTK_EXT_TRACE_V1 "dtk.ext.trace.v1"
typedef struct dtk_trace_ext {
  size_t struct_size;
  /* [thread-safe] Non-zero while a traced iteration runs: a caller may skip naming its spans
   * otherwise. */
  int32_t (*active)(void);
  /* [thread-safe] The trace's clock (steady, nanoseconds). */
  int64_t (*now_ns)(void);
  /* [thread-safe] A span [start_ns, end_ns] of the calling thread's work; `name` and `category`
   * are copied. */
  void (*span)(const char* name, const char* category, int64_t start_ns, int64_t end_ns);
} dtk_trace_ext;
DTK_DEFINE_STRUCT_SIZE(dtk_trace_ext, 2_1, span);
DTK_DEFINE_STRUCT_TRAITS(dtk_trace_ext, span);

/* Host extension "dtk.ext.capture.v1" (since 2.5): the host may record a micro-batch's forward
 * and backward once into a CUDA graph and replay it (train.cuda_graphs). While it records, kernels
 * are enqueued, not run: code in the step must not read device values on the host (.item(), a copy
 * to the CPU, nonzero) nor branch on them. Layers ask capturing() and then take their sync-free
 * paths, handing the host what they would have checked through defer_check. */
#define DTK_EXT_CAPTURE_V1 "dtk.ext.capture.v1"
typedef struct dtk_capture_ext {
  size_t struct_size;
  /* [thread-safe] Non-zero while the host records the step (its forward on the main thread and
   * its backward, which may run on autograd's device threads). */
  int32_t (*capturing)(void);
  /* [thread-safe] A check whose outcome stays on the device: `failed` [new] is a bool tensor
   * (any shape; true anywhere = failed). The host reads every deferred check of an iteration
   * once, after its backward passes and before the optimizer step, and stops the run with
   * `message` [borrowed, copied] when one failed, so no update is made from a failed check. */
  void (*defer_check)(dtk_tensor* failed /*[new]*/, const char* message /*[borrowed]*/);
  /* ABI 2.6. [thread-safe] Which pass over the step's body is under way while capturing() is
   * non-zero: a number that changes each time the host starts to record the body, or (where a
   * replay runs the body again, as the CPU probe does) to replay it; 0 otherwise. A layer keying
   * state by the pass (the SDK's recomputed dropout masks) forgets the last pass's. */
  int64_t (*recording_id)(void);
  /* ABI 2.6. [thread-safe] A value drawn on the host anew for every replay of the recorded step,
   * as a one-element int64 tensor on the compute device [new] that the step's kernels read instead
   * of a constant (a dropout mask's seed). `ctx` [owned by the host until release(ctx)]; `draw`
   * and `release` [borrowed for the plugin's lifetime]. Before each replay the host calls
   * draw(ctx) on its training thread, once per slot in the order the slots were handed out, and
   * puts the value in the slot; a slot handed out while the body runs for real (a replay that runs
   * it again) is drawn at once, on the calling thread. The host calls release(ctx) exactly once
   * (on any thread) when it no longer needs ctx, also when it returns NULL (no more slots, or the
   * slot could not be made: the layer fails the recording). Neither callback may throw nor call
   * back into this extension. */
  dtk_tensor* (*seed_slot)(uint64_t (*draw)(void* ctx), void* ctx, void (*release)(void* ctx));
} dtk_capture_ext;
DTK_DEFINE_STRUCT_SIZE(dtk_capture_ext, 2_5, defer_check);
DTK_DEFINE_STRUCT_SIZE(dtk_capture_ext, 2_6, seed_slot);
DTK_DEFINE_STRUCT_TRAITS(dtk_capture_ext, seed_slot);
/* Host extension "dtk.ext.aux_loss.v1" (since 2.9): a loss that a layer adds to the training
 * objective inside the model (a mixture-of-experts router's load-balancing and z-losses) reaches
 * the parameters through the layer's own backward, on every pipeline stage, as Megatron-LM's
 * MoEAuxLossAutoScaler does: the layer gives its loss the gradient backward_scale(), the factor the
 * host's backward applies to the step's loss, so both are scaled alike. */
#define DTK_EXT_AUX_LOSS_V1 "dtk.ext.aux_loss.v1"
typedef struct dtk_aux_loss_ext {
  size_t struct_size;
  /* [thread-safe] The factor on the step's loss in the backward under way: the loss scale (1
   * without fp16) divided by the iteration's micro-batches, or the loss scale alone with
   * train.calculate_per_token_loss (the host divides the gradients by the global batch's tokens
   * afterwards). 1 before the first backward; afterwards the last backward's. */
  double (*backward_scale)(void);
  /* [thread-safe] Non-zero with train.calculate_per_token_loss: a layer multiplies its loss by
   * the tokens it covers before the gradient, as Megatron-LM does, so that after the host's
   * division by the global token count it weighs as in the default mode. */
  int32_t (*per_token_loss)(void);
  /* ABI 2.10. [thread-safe] Adds `value` [new] (one element, on the compute device, no graph) to
   * this training iteration's `name` [borrowed, copied] (e.g. "load_balancing_loss"). The host
   * sums a name's values over the iteration's micro-batches and this rank's layers, divides by
   * the micro-batches, sums over the tensor- and pipeline-parallel ranks (a rank records its
   * share: under tensor parallelism without a sequence split, its value / tp) and averages over
   * the data-parallel ones, and reports it after the step's metrics in the log line, TensorBoard
   * and logging.metrics_jsonl (Megatron-LM's MoE metrics tracker). A layer records the mean's
   * share itself (its value / the MoE layers, for a mean over layers). */
  void (*record)(const char* name, dtk_tensor* value);
} dtk_aux_loss_ext;
DTK_DEFINE_STRUCT_SIZE(dtk_aux_loss_ext, 2_9, per_token_loss);
DTK_DEFINE_STRUCT_SIZE(dtk_aux_loss_ext, 2_10, record);
DTK_DEFINE_STRUCT_TRAITS(dtk_aux_loss_ext, record);
/* 1.0's config_get was removed in 2.0: nothing read it, and a plugin that reads the host's
 * configuration by path couples itself to the host's config schema. A plugin gets what it
 * needs through its declared options and the build context. */

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
  /* Samples per micro-batch on this rank: lets a plugin refuse at create time what it cannot
   * run (Domino splits each micro-batch into chunks and needs it divisible). */
  int64_t micro_batch_size;
  uint64_t seed;
  /* ABI 2.3. Megatron's sequence parallelism (set only with tp_size > 1): outside its
   * tensor-parallel blocks the model keeps its activations split along the sequence, each TP rank
   * rows [tp_rank * s / tp_size, (tp_rank + 1) * s / tp_size); pipeline stages exchange
   * [micro_batch_size, seq_length / tp_size, hidden] hidden states. A model that honours it says so
   * in dtk_model_info.sequence_parallel; the host refuses the run otherwise. */
  int32_t sequence_parallel;
  /* ABI 2.4. Partitioned construction (DeepSpeed's zero.Init): 1 when the strategy initialises the
   * parameters itself (ZeRO-3 keeps only this rank's partition). The model then creates every
   * parameter without its values: the right shape, dtype and device, requires_grad set, storage
   * of at most one element; it reports dtk_model_info.deferred_parameters = 1 and hands the
   * initial values out one parameter at a time through dtk_model_api.init_parameters. Set only
   * for a model plugin whose table has init_parameters; a model may ignore it (and report 0). */
  int32_t deferred_parameters;
  /* ABI 2.12. Expert parallelism (DTK_GROUP_EXPERT_PARALLEL; set only with ep_size > 1, else 0
   * and 1): each mixture-of-experts layer keeps the routed experts [ep_rank * n / ep_size,
   * (ep_rank + 1) * n / ep_size) of its n, and tokens reach the experts of the other ranks of
   * the group through its collectives. A model that honours it says so in
   * dtk_model_info.expert_parallel; the host refuses the run otherwise. */
  int32_t ep_rank, ep_size;
  /* ABI 2.13. How the decoder layers split over the pipeline's stages (Megatron-LM's
   * --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers,
   * --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split).
   * pp_rank and pp_size above count the stages of the virtual pipeline; pipeline_chunks is the
   * model chunks of each pipeline rank (1 without the interleaved schedule; 0 from an earlier
   * host means 1): stage j is chunk j / (pp_size / pipeline_chunks) of pipeline rank
   * j % (pp_size / pipeline_chunks). first_stage_layers / last_stage_layers: the layers of the
   * first / last pipeline rank, all its chunks together (0: the middle ranks' share);
   * embedding_in_split / loss_in_split: the embedding / the loss counts as one layer of the first
   * / last stage. All four 0: the even split, num_layers / pp_size consecutive layers per stage.
   * dtk::pipeline_layers (dtk/pipeline_split.hpp) gives a stage's layers; a model that builds
   * them says so in dtk_model_info.pipeline_split, and the host refuses any other split for a
   * model that does not. */
  int32_t pipeline_chunks;
  int32_t first_stage_layers, last_stage_layers;
  int32_t embedding_in_split, loss_in_split;
  /* ABI 2.20. Context parallelism (DTK_GROUP_CONTEXT_PARALLEL; set only with cp_size > 1, else 0
   * and 1; Megatron's --context-parallel-size): every rank of the group reads the same samples and
   * keeps 1 / cp_size of each sequence, Megatron's load-balanced split: the sequence in 2 x cp_size
   * equal chunks, this rank's chunks cp_rank and 2 x cp_size - 1 - cp_rank, in that order
   * (dtk/context_parallel.hpp). The step splits the micro-batch so (its inputs then hold
   * seq_length / cp_size positions, with the positions' own position_ids; an attention mask stays
   * whole); the model's attention reaches the rest of the sequence through the group's
   * collectives, and its layers, sequence parallelism and pipeline stages work on this rank's
   * positions. dp_rank and dp_size above then count the data- and context-parallel ranks together
   * (the data-parallel group's). A model that honours it says so in
   * dtk_model_info.context_parallel; the host refuses the run otherwise. */
  int32_t cp_rank, cp_size;
  /* ABI 2.21. With cp_size > 1, how the attention reaches the rest of the sequence (Megatron's
   * --cp-comm-type): DTK_CP_COMM_A2A trades the shares for whole sequences of 1 / cp_size of the
   * heads (0, and what a 2.20 host meant); DTK_CP_COMM_ALL_GATHER gathers the whole sequence's keys
   * and values and attends to them with this rank's queries (no condition on the heads). Once the
   * model is built the host refuses a run whose context_parallel lacks that exchange's bit. */
  int32_t cp_comm_type;
} dtk_build_context;
/* dtk_build_context.cp_comm_type (ABI 2.21); bit 1 << type of dtk_model_info.context_parallel. */
#define DTK_CP_COMM_A2A 0
#define DTK_CP_COMM_ALL_GATHER 1
DTK_DEFINE_STRUCT_SIZE(dtk_build_context, 2_0, seed);
DTK_DEFINE_STRUCT_SIZE(dtk_build_context, 2_3, sequence_parallel);
DTK_DEFINE_STRUCT_SIZE(dtk_build_context, 2_4, deferred_parameters);
DTK_DEFINE_STRUCT_SIZE(dtk_build_context, 2_12, ep_size);
DTK_DEFINE_STRUCT_SIZE(dtk_build_context, 2_13, loss_in_split);
DTK_DEFINE_STRUCT_SIZE(dtk_build_context, 2_20, cp_size);
DTK_DEFINE_STRUCT_SIZE(dtk_build_context, 2_21, cp_comm_type);
DTK_DEFINE_STRUCT_TRAITS(dtk_build_context, cp_comm_type);

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
  int64_t vocab_size;      /* padded, full (all TP ranks) */
  int32_t recompute;       /* 0 none, 1 full activation recomputation */
  int32_t tied_embeddings; /* 1 if the output layer reuses the word embedding */
  /* ABI 2.3 (a 2.2 model reports 0 for all four; its `recompute` still says full or none). */
  int32_t sequence_parallel;     /* 1: it runs dtk_build_context.sequence_parallel's layout */
  int32_t recompute_granularity; /* 0 none, 1 full, 2 selective (core attention; Megatron's names) */
  int32_t recompute_method;      /* with full: 0 uniform (groups of recompute_num_layers), 1 block */
  int32_t recompute_num_layers;  /* with full: layers per group (uniform) or per stage (block) */
  /* ABI 2.4. 1: created under dtk_build_context.deferred_parameters, the parameters hold no values
   * yet; init_parameters gives them. */
  int32_t deferred_parameters;
  /* ABI 2.9. Mixture of experts: the experts of each MoE layer and how many each token is routed to
   * (0 and 0: a dense model; a 2.8 model reports 0). Where the layers' counts differ (2.18), the
   * largest, each expert weight's own in dtk_param_info.layer_experts. */
  int32_t num_experts;
  int32_t moe_router_topk;
  /* ABI 2.12. 1: it runs dtk_build_context.ep_size's layout: this rank holds only its share of
   * the routed experts (their parameters marked dtk_param_info.expert, named as in the whole
   * model), so their gradients are reduced over DTK_GROUP_EXPERT_DATA_PARALLEL and their
   * parameters counted and saved per expert-parallel rank. */
  int32_t expert_parallel;
  /* ABI 2.13. 1: it built the layers dtk::pipeline_layers gives for dtk_build_context's split
   * (first_stage_layers, last_stage_layers, embedding_in_split, loss_in_split); 0 (and a 2.12
   * model): the even split only, and the host refuses any other. */
  int32_t pipeline_split;
  /* ABI 2.15. Channels of each attention head (Megatron's --kv-channels): the queries, keys and
   * values are num_attention_heads (or groups) x kv_channels wide, the attention's FLOPs count
   * num_attention_heads x kv_channels. 0 (and a 2.14 model): hidden_size / num_attention_heads. */
  int64_t kv_channels;
  /* ABI 2.16. With recompute_granularity 2 (selective), the sub-layers each layer recomputes in
   * backward (Megatron's --recompute-modules), DTK_RECOMPUTE_* bits: core attention, a dense MLP
   * from its norm's output, an MoE MLP (router and experts) from its norm's output. 0 (and a 2.15
   * model): core attention alone; a model that recomputes nothing reports granularity 0. */
  int32_t recompute_modules;
  /* ABI 2.20. 1: it runs dtk_build_context.cp_size's layout (its inputs this rank's share of each
   * sequence, its attention over the whole sequence through DTK_GROUP_CONTEXT_PARALLEL); 0 (and a
   * 2.19 model): the host refuses context parallelism. ABI 2.21: a bit mask, 1 << DTK_CP_COMM_* for
   * each cp_comm_type it runs (1: all-to-all alone, what a 2.20 model's 1 says). */
  int32_t context_parallel;
} dtk_model_info;
/* dtk_model_info.recompute_modules (ABI 2.16). */
#define DTK_RECOMPUTE_CORE_ATTENTION 1
#define DTK_RECOMPUTE_MLP 2
#define DTK_RECOMPUTE_MOE 4
DTK_DEFINE_STRUCT_SIZE(dtk_model_info, 2_0, tied_embeddings);
DTK_DEFINE_STRUCT_SIZE(dtk_model_info, 2_3, recompute_num_layers);
DTK_DEFINE_STRUCT_SIZE(dtk_model_info, 2_4, deferred_parameters);
DTK_DEFINE_STRUCT_SIZE(dtk_model_info, 2_9, moe_router_topk);
DTK_DEFINE_STRUCT_SIZE(dtk_model_info, 2_12, expert_parallel);
DTK_DEFINE_STRUCT_SIZE(dtk_model_info, 2_13, pipeline_split);
DTK_DEFINE_STRUCT_SIZE(dtk_model_info, 2_15, kv_channels);
DTK_DEFINE_STRUCT_SIZE(dtk_model_info, 2_16, recompute_modules);
DTK_DEFINE_STRUCT_SIZE(dtk_model_info, 2_20, context_parallel);
DTK_DEFINE_STRUCT_TRAITS(dtk_model_info, context_parallel);

typedef struct dtk_model_forward_args {
  size_t struct_size;
  /* [borrowed] Inputs by name (GPT: "tokens", "position_ids", "attention_mask", optional
   * "labels"). */
  const dtk_tensor_map* inputs;
  /* Outputs by name (GPT: "logits", or "loss" per token when labels were given). */
  const dtk_tensor_sink* outputs;
} dtk_model_forward_args;
DTK_DEFINE_STRUCT_SIZE(dtk_model_forward_args, 2_0, outputs);
DTK_DEFINE_STRUCT_TRAITS(dtk_model_forward_args, outputs);

typedef struct dtk_model_to_args {
  size_t struct_size;
  dtk_device device;
  int32_t dtype; /* dtk_dtype for floating-point tensors; DTK_DTYPE_INVALID keeps each dtype */
} dtk_model_to_args;
DTK_DEFINE_STRUCT_SIZE(dtk_model_to_args, 2_0, dtype);
DTK_DEFINE_STRUCT_TRAITS(dtk_model_to_args, dtype);

/* A module: a unit of the model whose parameters a ZeRO-3 strategy gathers before it runs and
 * releases after (GPT: the embedding, each transformer layer, the output layer). */
typedef struct dtk_module_info {
  size_t struct_size;
  int32_t index;    /* 0..n-1, in forward order */
  const char* name; /* [borrowed] e.g. "language_model.encoder.layers.3" */
  /* Names (as visit_parameters reports them) of every parameter the module reads in forward:
   * those it owns (dtk_param_info.module_index == index) and tied ones owned by another
   * module (GPT's output layer reads the word embedding). [borrowed] for the call. */
  const char* const* param_names;
  size_t num_params;
} dtk_module_info;
DTK_DEFINE_STRUCT_SIZE(dtk_module_info, 2_0, num_params);
DTK_DEFINE_STRUCT_TRAITS(dtk_module_info, num_params);

typedef struct dtk_module_visitor {
  size_t struct_size;
  void* ctx;
  /* [main-thread] Called inside visit_modules. */
  dtk_status* (*visit)(void* ctx, const dtk_module_info* module /*[borrowed]*/);
} dtk_module_visitor;
DTK_DEFINE_STRUCT_SIZE(dtk_module_visitor, 2_0, visit);
DTK_DEFINE_STRUCT_TRAITS(dtk_module_visitor, visit);

/* Per-module hooks (ZeRO stage 3: gather a module's parameters before it runs, release them
 * after). A model that accepted hooks calls, for every module and every forward:
 *   pre_forward(i)   before module i reads its parameters          [main-thread]
 *   post_forward(i)  after module i's forward                        [main-thread]
 * and, when the forward builds an autograd graph, during backward:
 *   pre_backward(i)  when the gradient reaches module i's output, before its backward
 *   post_backward(i) after module i's backward computed its input and parameter gradients
 * Backward hooks run on LibTorch's autograd thread while the training thread waits in
 * backward(). With full recomputation a module's backward is preceded by a second
 * pre_forward/post_forward pair (the recomputed forward). Modules run in index order in forward
 * and reverse order in backward. A hook's error fails the forward (as its status) or the
 * backward (as the error backward() throws), naming the module. All functions may be NULL. */
typedef struct dtk_module_hooks {
  size_t struct_size;
  void* ctx;
  dtk_status* (*pre_forward)(void* ctx, int32_t module_index);  /* [main-thread] */
  dtk_status* (*post_forward)(void* ctx, int32_t module_index); /* [main-thread] */
  /* [main-thread] Inside backward(): on LibTorch's autograd thread while the training thread
   * waits (rule 6). */
  dtk_status* (*pre_backward)(void* ctx, int32_t module_index);
  /* [main-thread] Inside backward(), as pre_backward. */
  dtk_status* (*post_backward)(void* ctx, int32_t module_index);
} dtk_module_hooks;
DTK_DEFINE_STRUCT_SIZE(dtk_module_hooks, 2_0, post_backward);
DTK_DEFINE_STRUCT_TRAITS(dtk_module_hooks, post_backward);

/* Every function is [main-thread] unless tagged otherwise. */
typedef struct dtk_model_api {
  size_t struct_size;
  /* [main-thread] Builds the part of the model this rank owns (ctx->tp_rank, pre/post_process). */
  dtk_status* (*create)(const dtk_build_context* ctx, dtk_model** out /*[new] destroy()*/);
  void (*destroy)(dtk_model* model); /* [main-thread] */
  /* [main-thread] Forward: named inputs to named outputs (losses computed with the vocab-parallel
   * cross entropy where the model is tensor-parallel). */
  dtk_status* (*forward)(dtk_model* model, const dtk_model_forward_args* args);
  /* [main-thread] Every trainable parameter, in a stable order; tied parameters appear once
   * with shared=1 on the owning stage. */
  dtk_status* (*visit_parameters)(dtk_model* model, const dtk_param_visitor* visitor);
  dtk_status* (*visit_buffers)(dtk_model* model, const dtk_param_visitor* visitor); /* [main-thread] */
  dtk_status* (*set_training)(dtk_model* model, int32_t training);                  /* [main-thread] */
  /* [main-thread] Moves/casts parameters and buffers in place, keeping tensor identity. The host
   * calls it after create when a parameter is not on the build context's device or not of its
   * params_dtype (a model that honours the context is never moved). */
  dtk_status* (*to)(dtk_model* model, const dtk_model_to_args* args);
  /* [main-thread] Checkpoint state: the tensors this rank owns (e.g. the embedding only where
   * it lives). */
  dtk_status* (*state_save)(dtk_model* model, const dtk_tensor_sink* out);
  /* [main-thread] Loads state by name; copies values in place. strict != 0: a missing or
   * unexpected name or a shape mismatch is an error naming the tensor. */
  dtk_status* (*state_load)(dtk_model* model, const dtk_tensor_map* state, int32_t strict);
  /* [main-thread] [out] `info`: the caller sets info->struct_size; the model fills what both know
   * and sets struct_size to what it filled. */
  dtk_status* (*get_info)(dtk_model* model, dtk_model_info* info);
  /* [main-thread] The model's modules, in index order. A model without modules visits
   * nothing. */
  dtk_status* (*visit_modules)(dtk_model* model, const dtk_module_visitor* visitor);
  /* [main-thread] Installs per-module hooks ([borrowed] until replaced, removed with NULL, or the
   * model is destroyed); the table is copied, its ctx must stay valid. DTK_ERR_UNSUPPORTED when
   * the model cannot fire them. */
  dtk_status* (*set_module_hooks)(dtk_model* model, const dtk_module_hooks* hooks);
  /* [main-thread] ABI 2.4. For a model that reports deferred_parameters: computes every
   * parameter's initial value, exactly what an undeferred create would have given it, and calls
   * visitor->visit(ctx, name, value, NULL) once per parameter (names as visit_parameters reports
   * them), one at a time: `value` is [borrowed] for the call, a CPU tensor of the parameter's shape
   * (fp32 or the parameter's dtype; the receiver casts), so at most one parameter's values exist at
   * once; the receiver puts them in place (the model does not). Called once: afterwards the model
   * reports deferred_parameters 0. DTK_ERR_UNSUPPORTED for a model that did not defer. */
  dtk_status* (*init_parameters)(dtk_model* model, const dtk_param_visitor* visitor);
  /* [main-thread] ABI 2.11. Once per training iteration, after its optimizer step (taken or
   * skipped) and before anything reads the model again (the next forward, an evaluation, a
   * checkpoint save): the model updates the state its training forwards gathered and no optimizer
   * owns, e.g. the MoE router's expert bias from the iteration's expert loads (Megatron-LM's
   * finalize_model_grads does it before the step; nothing between reads it). Every rank calls it,
   * so the model may run collectives (dtk::Comm, any group). NULL: nothing to do. */
  dtk_status* (*end_iteration)(dtk_model* model);
} dtk_model_api;
DTK_DEFINE_STRUCT_SIZE(dtk_model_api, 2_0, set_module_hooks);
DTK_DEFINE_STRUCT_SIZE(dtk_model_api, 2_4, init_parameters);
DTK_DEFINE_STRUCT_SIZE(dtk_model_api, 2_11, end_iteration);
DTK_DEFINE_STRUCT_TRAITS(dtk_model_api, end_iteration);

/* A model together with its vtable, so another plugin (a step, a strategy) can call it. */
typedef struct dtk_model_ref {
  size_t struct_size;
  const dtk_model_api* api;
  dtk_model* model; /* [borrowed] */
} dtk_model_ref;
DTK_DEFINE_STRUCT_SIZE(dtk_model_ref, 2_0, model);
DTK_DEFINE_STRUCT_TRAITS(dtk_model_ref, model);

/* ============================================================================================
 * Kind 2: dataset builder (data tier)
 * ========================================================================================== */

typedef struct dtk_dataset dtk_dataset; /* opaque, plugin-owned */

/* The arguments of dtk_dataset_api.create. */
typedef struct dtk_dataset_context {
  size_t struct_size;
  const dtk_option_values* options; /* [borrowed] */
  int64_t seq_length;               /* tokens per sample = seq_length + 1 for LM */
  int64_t num_samples[3];           /* samples requested per dtk_split (0 = split unused) */
  uint64_t seed;                    /* the data seed, identical on all ranks */
  int32_t rank;                     /* global rank and world size: one rank builds caches, */
  int32_t world_size;               /* the others wait for them */
  /* [borrowed] A run-wide directory for index caches, or NULL: 2.0 hosts have no such setting
   * and pass NULL; the plugin then uses its own option or puts caches next to the data. */
  const char* cache_dir;
  /* ABI 2.17. Splits the run reads whole, bit (1 << split) (eval.full_validation, Megatron's
   * --full-validation): build each as one pass over its data, every sample once (Megatron's
   * num_samples None), and report its size; their num_samples entry is 0. A 2.16 plugin sees the
   * split unused, gives it no samples, and the host refuses the run naming it. */
  uint32_t whole_splits;
} dtk_dataset_context;
DTK_DEFINE_STRUCT_SIZE(dtk_dataset_context, 2_0, cache_dir);
DTK_DEFINE_STRUCT_SIZE(dtk_dataset_context, 2_17, whole_splits);
DTK_DEFINE_STRUCT_TRAITS(dtk_dataset_context, whole_splits);

typedef struct dtk_sample_args {
  size_t struct_size;
  int32_t split; /* dtk_split */
  int64_t index; /* 0 <= index < num_samples(split) */
  /* Receives the sample's named buffers. Contract (host and step): EVERY buffer put reaches
   * the step under its name, collated over the micro-batch to [micro_batch_size, ...shape]
   * (so all samples must give a name the same shape and dtype). GPT: "text", int64 or the
   * file's integer dtype, shape [seq_length + 1]. */
  const dtk_buffer_sink* out;
} dtk_sample_args;
DTK_DEFINE_STRUCT_SIZE(dtk_sample_args, 2_0, out);
DTK_DEFINE_STRUCT_TRAITS(dtk_sample_args, out);

typedef struct dtk_dataset_api {
  size_t struct_size;
  /* [main-thread] */
  dtk_status* (*create)(const dtk_dataset_context* ctx, dtk_dataset** out /*[new] destroy()*/);
  void (*destroy)(dtk_dataset* dataset); /* [main-thread] after every loader stopped */
  /* [thread-safe] Samples available in a split (>= requested; 0 if the split is empty). */
  dtk_status* (*num_samples)(dtk_dataset* dataset, int32_t split, int64_t* out);
  /* [loader-thread] One sample. The host prefetches from a background thread while the
   * training thread may call num_samples/vocab_size. */
  dtk_status* (*get_sample)(dtk_dataset* dataset, const dtk_sample_args* args);
  /* [thread-safe] Vocabulary size of the data (0 if unknown) so the host can check it against
   * the model. */
  dtk_status* (*vocab_size)(dtk_dataset* dataset, int64_t* out);
} dtk_dataset_api;
DTK_DEFINE_STRUCT_SIZE(dtk_dataset_api, 2_0, vocab_size);
DTK_DEFINE_STRUCT_TRAITS(dtk_dataset_api, vocab_size);

/* ============================================================================================
 * Kind 3: forward step + loss
 * ========================================================================================== */

typedef struct dtk_step dtk_step; /* opaque, plugin-owned */

typedef struct dtk_step_forward_args {
  size_t struct_size;
  const dtk_model_ref* model; /* [borrowed] */
  /* [borrowed] The raw micro-batch: every buffer the dataset put, by name, collated to
   * [micro_batch_size, ...] (GPT: "text" [b, s+1] int64). May be empty on ranks that receive
   * their inputs by broadcast (TP rank > 0). */
  const dtk_tensor_map* batch;
  /* Reported values, already averaged over the data-parallel group (GPT: "lm loss"). Since 2.8 a
   * tensor value may instead hold two elements, [numerator, denominator], already summed over the
   * data-parallel group: the host sums both over the iteration's micro-batches (or the
   * evaluation's batches) and reports their ratio (Megatron-LM's token-weighted "lm loss"). */
  const dtk_metric_sink* metrics;
  /* [out][new] scalar tensor to call backward on (the mean over valid tokens). */
  dtk_tensor* loss;
  /* ABI 2.8 [in]. Nonzero: Megatron-LM's --calculate-per-token-loss. The step returns in `loss`
   * the sum over the tokens it would average (not their mean) and their number in num_tokens;
   * the host then divides the gradients by the token count of the whole global batch. A step
   * that leaves num_tokens NULL cannot train so: the host refuses the run, naming it. */
  int32_t sum_loss;
  /* ABI 2.8 [out][new] With sum_loss: a one-element tensor, how many tokens `loss` sums over.
   * Read on the last pipeline stage (its last model chunk) only, as Megatron reads it. */
  dtk_tensor* num_tokens;
} dtk_step_forward_args;
DTK_DEFINE_STRUCT_SIZE(dtk_step_forward_args, 2_0, loss);
DTK_DEFINE_STRUCT_SIZE(dtk_step_forward_args, 2_8, num_tokens);
DTK_DEFINE_STRUCT_TRAITS(dtk_step_forward_args, num_tokens);

/* Every function is [main-thread]. */
typedef struct dtk_step_api {
  size_t struct_size;
  dtk_status* (*create)(const dtk_build_context* ctx, dtk_step** out /*[new] destroy()*/); /* [main-thread] */
  void (*destroy)(dtk_step* step);                                                         /* [main-thread] */
  /* [main-thread] One micro-batch: turns the raw batch into model inputs, runs the model,
   * computes the loss into args->loss. */
  dtk_status* (*forward_step)(dtk_step* step, dtk_step_forward_args* args);
} dtk_step_api;
DTK_DEFINE_STRUCT_SIZE(dtk_step_api, 2_0, forward_step);
DTK_DEFINE_STRUCT_TRAITS(dtk_step_api, forward_step);

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
  double lr_scale; /* effective lr = step lr * lr_scale */
} dtk_param_group;
DTK_DEFINE_STRUCT_SIZE(dtk_param_group, 2_0, lr_scale);
DTK_DEFINE_STRUCT_TRAITS(dtk_param_group, lr_scale);

/* The DTK host passes its groups in a fixed order that depends only on the run's configuration,
 * so that a parameter's group, and the state names an optimizer derives from it, do not depend on
 * which other parameters a rank holds: group 0 the parameters with weight decay, group 1 those
 * without (biases, norm weights), then (2.2) the groups of the config's parameter rules
 * (lr.param_rules: a learning-rate and weight-decay multiplier for parameters matched by name).
 * Any group may be empty (count 0): a ZeRO partition can hold no parameter of one kind. */
typedef struct dtk_optimizer_create_args {
  size_t struct_size;
  const dtk_build_context* context; /* [borrowed] */
  const dtk_param_group* groups;    /* [borrowed] num_groups entries, walked by struct_size */
  size_t num_groups;
} dtk_optimizer_create_args;
DTK_DEFINE_STRUCT_SIZE(dtk_optimizer_create_args, 2_0, num_groups);
DTK_DEFINE_STRUCT_TRAITS(dtk_optimizer_create_args, num_groups);

typedef struct dtk_optimizer_step_args {
  size_t struct_size;
  double lr;
  int64_t iteration; /* 1-based optimizer step number */
  double grad_scale; /* gradients are multiplied by 1/grad_scale before use (loss scaling) */
  /* ABI 2.2. This step's weight decay of group g is groups[g].weight_decay x weight_decay_scale
   * (a weight-decay schedule: Megatron's start_weight_decay -> end_weight_decay, where a group's
   * weight_decay is its value at the end of the schedule). 1.0 when the schedule is constant.
   * Written by 2.2 hosts; an optimizer reads it only when struct_size covers it (DTK_HAS_FIELD)
   * and uses 1.0 otherwise (dtk::ParamGroup::decay_at in the SDK does both). */
  double weight_decay_scale;
  /* ABI 2.8. NULL, or this step's learning rate of each parameter group (num_group_lr entries, in
   * the order create() got the groups), replacing lr x groups[g].lr_scale: a group whose
   * lr.param_rules entry has its own max_lr/min_lr (Megatron-LM's --decoupled-lr) follows the
   * schedule between those. `lr` stays the default groups' rate. [borrowed] for the call only: a
   * strategy that applies the update later copies the values (the SDK's dtk::StepArgs does). An
   * optimizer reads it when struct_size covers it (dtk::ParamGroup::lr_at does both); the host
   * refuses such rules with an optimizer or strategy built for an earlier minor. */
  const double* group_lr;
  size_t num_group_lr;
  /* ABI 2.14. 1: this step's Adam betas are beta1 and beta2, for every group, in place of the
   * optimizer's configured ones; 0: the configured ones. DeepSpeed's OneCycle scheduler cycles
   * beta1 inversely to the learning rate and sets beta2 to 0.99. The bias corrections use this
   * step's betas (1 - beta1^t, 1 - beta2^t), as torch.optim.Adam and DeepSpeed's Adams do with a
   * param group's betas changed between steps. The host sets it only for an optimizer whose
   * options include "beta1" (an optimizer with Adam's betas; DeepSpeed asks whether the
   * optimizer's defaults hold "betas"); others never see it. An optimizer reads it when
   * struct_size covers it (dtk::step_betas does both); the host refuses momentum cycling with an
   * optimizer or strategy built for an earlier minor. */
  int32_t has_betas;
  double beta1;
  double beta2;
} dtk_optimizer_step_args;
DTK_DEFINE_STRUCT_SIZE(dtk_optimizer_step_args, 2_0, grad_scale);
DTK_DEFINE_STRUCT_SIZE(dtk_optimizer_step_args, 2_2, weight_decay_scale);
DTK_DEFINE_STRUCT_SIZE(dtk_optimizer_step_args, 2_8, num_group_lr);
DTK_DEFINE_STRUCT_SIZE(dtk_optimizer_step_args, 2_14, beta2);
DTK_DEFINE_STRUCT_TRAITS(dtk_optimizer_step_args, beta2);

/* Every function is [main-thread]. */
typedef struct dtk_optimizer_api {
  size_t struct_size;
  /* [main-thread] */
  dtk_status* (*create)(const dtk_optimizer_create_args* args, dtk_optimizer** out /*[new] destroy()*/);
  void (*destroy)(dtk_optimizer* optimizer);                                          /* [main-thread] */
  dtk_status* (*step)(dtk_optimizer* optimizer, const dtk_optimizer_step_args* args); /* [main-thread] */
  /* [main-thread] Optimizer state for checkpoints (e.g. "g0.p3.exp_avg", "step"). */
  dtk_status* (*state_save)(dtk_optimizer* optimizer, const dtk_tensor_sink* out);
  dtk_status* (*state_load)(dtk_optimizer* optimizer, const dtk_tensor_map* state); /* [main-thread] */
} dtk_optimizer_api;
DTK_DEFINE_STRUCT_SIZE(dtk_optimizer_api, 2_0, state_load);
DTK_DEFINE_STRUCT_TRAITS(dtk_optimizer_api, state_load);

typedef struct dtk_optimizer_ref {
  size_t struct_size;
  const dtk_optimizer_api* api;
  dtk_optimizer* optimizer; /* [borrowed] */
} dtk_optimizer_ref;
DTK_DEFINE_STRUCT_SIZE(dtk_optimizer_ref, 2_0, optimizer);
DTK_DEFINE_STRUCT_TRAITS(dtk_optimizer_ref, optimizer);

/* ============================================================================================
 * Kind 4: parallel strategy (gradient sync, sharding, offload)
 * ========================================================================================== */

typedef struct dtk_strategy dtk_strategy; /* opaque, plugin-owned */

typedef struct dtk_backward_args {
  size_t struct_size;
  int32_t micro_batch; /* 0-based index of the micro-batch in this step */
  int32_t num_micro_batches;
  int32_t is_last; /* micro_batch + 1 == num_micro_batches: reduction may overlap backward */
} dtk_backward_args;
DTK_DEFINE_STRUCT_SIZE(dtk_backward_args, 2_0, is_last);
DTK_DEFINE_STRUCT_TRAITS(dtk_backward_args, is_last);

typedef struct dtk_clip_args {
  size_t struct_size;
  double max_norm; /* clip to this global L2 norm if > 0 */
  double norm;     /* [out] the norm before clipping (NaN/Inf when gradients overflowed) */
} dtk_clip_args;
DTK_DEFINE_STRUCT_SIZE(dtk_clip_args, 2_0, norm);
DTK_DEFINE_STRUCT_TRAITS(dtk_clip_args, norm);

typedef struct dtk_strategy_step_args {
  size_t struct_size;
  const dtk_optimizer_ref* optimizer;  /* [borrowed] */
  const dtk_optimizer_step_args* step; /* [borrowed] passed on to the optimizer */
} dtk_strategy_step_args;
DTK_DEFINE_STRUCT_SIZE(dtk_strategy_step_args, 2_0, step);
DTK_DEFINE_STRUCT_TRAITS(dtk_strategy_step_args, step);

/* What a strategy does with state and memory, so the host can save, load and account for it
 * (ABI 2.1; a 2.0 strategy has no get_info and counts as all zeros). */
typedef struct dtk_strategy_info {
  size_t struct_size;
  /* 1: the optimizer's and the strategy's state differ between data-parallel ranks (ZeRO): every
   * DP rank saves its own, and every entry of that state that belongs to one parameter has the
   * parameter's name in its key ("g0.<name>.exp_avg", "master.<name>") and holds exactly the
   * shard optimizer_params reported for it (dtk_param_info.shard_offset/full_numel). The host then
   * re-partitions saved state on load: another DP size, or another strategy (ddp <-> zero). */
  int32_t sharded_state;
  /* 1: model parameters are not whole outside the module hooks (ZeRO-3): around every read or
   * write of the model's parameters outside a training step (checkpoints) the host calls
   * gather_parameters(1) before and gather_parameters(0) after. */
  int32_t partitions_parameters;
  /* 1: the optimizer steps host tensors (ZeRO-Offload): what it allocates is host memory. */
  int32_t optimizer_on_host;
  /* ABI 2.12. 1: it runs expert parallelism (DTK_GROUP_EXPERT_PARALLEL larger than one): the
   * gradients of the parameters marked dtk_param_info.expert are summed over
   * DTK_GROUP_EXPERT_DATA_PARALLEL and divided by the data-parallel size (every token of the
   * data-parallel group reached its experts through the expert-parallel group, Megatron's
   * expert_gradient_scaling_factor), and clip_and_norm's norm counts every rank's experts once
   * (ddp, zero). The host refuses expert parallelism with a strategy that reports 0. */
  int32_t expert_parallel;
} dtk_strategy_info;
DTK_DEFINE_STRUCT_SIZE(dtk_strategy_info, 2_1, optimizer_on_host);
DTK_DEFINE_STRUCT_SIZE(dtk_strategy_info, 2_12, expert_parallel);
DTK_DEFINE_STRUCT_TRAITS(dtk_strategy_info, expert_parallel);

/* Bytes a strategy holds, by what they are (ABI 2.1), for the memory report. Device bytes are
 * on the run's device (on a CPU run: tensors outside pinned host memory); host bytes are what
 * offload keeps in (pinned) host memory. The optimizer's own state is counted by the host. */
typedef struct dtk_memory_usage {
  size_t struct_size;
  int64_t parameter_bytes; /* model parameters as the model reads them (whole or partitioned) */
  int64_t gradient_bytes;  /* gradients: the model's .grad tensors and the strategy's buffers */
  int64_t master_bytes;    /* fp32 master weights that are not the parameters themselves */
  int64_t host_bytes;      /* all of the above that lives in host memory instead (offload) */
} dtk_memory_usage;
DTK_DEFINE_STRUCT_SIZE(dtk_memory_usage, 2_1, host_bytes);
DTK_DEFINE_STRUCT_TRAITS(dtk_memory_usage, host_bytes);

/* The pipeline's per-iteration contract with a strategy (every call [main-thread]):
 *   defers_parameters(&d)          once, before the model is created (2.4)
 *   setup(model)                   once: wrap the model (DDP buckets, ZeRO partitions)
 *   module_hooks(&hooks)           once, after setup: hooks the host installs on the model
 *   optimizer_params(visitor)      once: the tensors the optimizer is created over
 *   for each micro-batch: forward_step ... before_backward(args) ... backward ...
 *   reduce_gradients()             all-reduce / reduce-scatter gradients
 *   clip_and_norm(args)            global grad norm across DP/TP, clipped if max_norm > 0
 *   optimizer_step(args)           steps the optimizer and makes params current everywhere
 *   zero_grad()
 * Checkpoints: state_save/state_load carry the strategy's own state (e.g. fp32 master weights);
 * a strategy whose state is sharded over data-parallel ranks says so in get_info (2.1). */
typedef struct dtk_strategy_api {
  size_t struct_size;
  dtk_status* (*create)(const dtk_build_context* ctx, dtk_strategy** out /*[new] destroy()*/); /* [main-thread] */
  void (*destroy)(dtk_strategy* strategy);                                                     /* [main-thread] */
  dtk_status* (*setup)(dtk_strategy* strategy, const dtk_model_ref* model);                    /* [main-thread] */
  /* [main-thread] Fills `visitor` with the tensors the optimizer should own, one call per
   * tensor; the info's no_weight_decay splits them into groups. */
  dtk_status* (*optimizer_params)(dtk_strategy* strategy, const dtk_param_visitor* visitor);
  /* [main-thread] Called before each micro-batch's backward. */
  dtk_status* (*before_backward)(dtk_strategy* strategy, const dtk_backward_args* args);
  dtk_status* (*reduce_gradients)(dtk_strategy* strategy);                                   /* [main-thread] */
  dtk_status* (*clip_and_norm)(dtk_strategy* strategy, dtk_clip_args* args);                 /* [main-thread] */
  dtk_status* (*optimizer_step)(dtk_strategy* strategy, const dtk_strategy_step_args* args); /* [main-thread] */
  dtk_status* (*zero_grad)(dtk_strategy* strategy);                                          /* [main-thread] */
  dtk_status* (*state_save)(dtk_strategy* strategy, const dtk_tensor_sink* out);             /* [main-thread] */
  dtk_status* (*state_load)(dtk_strategy* strategy, const dtk_tensor_map* state);            /* [main-thread] */
  /* [main-thread] The per-module hooks this strategy needs (ZeRO-3), or *out = NULL for none. The
   * table is [borrowed] for the strategy's lifetime. The host installs it with the model's
   * set_module_hooks after setup (refusing a model that cannot fire hooks) and removes it before
   * destroying the strategy. */
  dtk_status* (*module_hooks)(dtk_strategy* strategy, const dtk_module_hooks** out);
  /* [main-thread] ABI 2.1. [out] `info`: the caller sets info->struct_size; the strategy fills
   * what both know and sets struct_size to what it filled. Called once, after setup. */
  dtk_status* (*get_info)(dtk_strategy* strategy, dtk_strategy_info* info);
  /* [main-thread] ABI 2.1. whole = 1: make every model parameter whole (the host is about to read
   * or write them); whole = 0: the host is done; take this rank's shard of the (possibly just
   * loaded) values and release the rest. Only called when get_info reports partitions_parameters. */
  dtk_status* (*gather_parameters)(dtk_strategy* strategy, int32_t whole);
  /* [main-thread] ABI 2.1. [out] the bytes held now (caller sets usage->struct_size, as
   * get_info). */
  dtk_status* (*memory_usage)(dtk_strategy* strategy, dtk_memory_usage* usage);
  /* [main-thread] ABI 2.4. Called after create, before the model exists. [out] *deferred = 1: the
   * strategy initialises the parameters in setup through dtk_model_api.init_parameters when the
   * model reports deferred_parameters (partitioned construction), so the host creates the model
   * with dtk_build_context.deferred_parameters = 1; setup must still accept a model that reports
   * 0 (it created its values). NULL: never. */
  dtk_status* (*defers_parameters)(dtk_strategy* strategy, int32_t* deferred);
} dtk_strategy_api;
DTK_DEFINE_STRUCT_SIZE(dtk_strategy_api, 2_0, module_hooks);
DTK_DEFINE_STRUCT_SIZE(dtk_strategy_api, 2_1, memory_usage);
DTK_DEFINE_STRUCT_SIZE(dtk_strategy_api, 2_4, defers_parameters);
DTK_DEFINE_STRUCT_TRAITS(dtk_strategy_api, defers_parameters);

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
  /* [main-thread] Called once after the host validated the entry. `host` is [borrowed] for
   * the process lifetime. A non-NULL status refuses the plugin with its message. */
  dtk_status* (*init)(const dtk_host_services* host);
  void (*deinit)(void); /* [main-thread] may be NULL */
  /* [thread-safe] The kind's function table (see dtk_plugin_kind). Static; never NULL after
   * init. */
  const void* (*get_api)(void);
  const dtk_option_spec* options; /* num_options entries, static */
  size_t num_options;
  /* [thread-safe] A plugin-provided extension by id (rule 8), or NULL. May be NULL itself
   * (no extensions). Callable after init. */
  const void* (*get_extension)(const char* id);
} dtk_plugin_entry;
DTK_DEFINE_STRUCT_SIZE(dtk_plugin_entry, 2_0, get_extension);
DTK_DEFINE_STRUCT_TRAITS(dtk_plugin_entry, get_extension);

typedef const dtk_plugin_entry* (*dtk_plugin_entry_fn)(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DTK_ABI_H_ */
