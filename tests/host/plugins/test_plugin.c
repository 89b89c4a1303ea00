/* A plain-C dataset plugin used by the loader tests. Each VARIANT_* macro breaks exactly one
 * rule so each refusal the host must produce has its own plugin file. Also proves a data-tier
 * plugin needs nothing but abi.h. */
#include <dtk/abi.h>

#include <stdlib.h>
#include <string.h>

#ifndef PLUGIN_NAME
#define PLUGIN_NAME "good_c"
#endif

static const dtk_host_services* g_host;

static const dtk_option_spec kOptions[] = {
#ifdef VARIANT_BAD_DEFAULT
    {sizeof(dtk_option_spec), "num", DTK_OPT_INT, "three", "An integer.", NULL},
#else
    {sizeof(dtk_option_spec), "num", DTK_OPT_INT, "3", "An integer.", NULL},
#endif
    {sizeof(dtk_option_spec), "rate", DTK_OPT_FLOAT, "0.5", "A number.", NULL},
    {sizeof(dtk_option_spec), "flag", DTK_OPT_BOOL, "false", "A switch.", NULL},
    {sizeof(dtk_option_spec), "mode", DTK_OPT_ENUM, "a", "A choice.", "a|b"},
    {sizeof(dtk_option_spec), "path", DTK_OPT_STRING, NULL, "Required string.", NULL},
};

typedef struct state {
  int64_t n;
} state;

static dtk_status* create(const dtk_dataset_context* ctx, dtk_dataset** out) {
  state* s = (state*)malloc(sizeof(state));
  (void)ctx;
  s->n = 3;
  *out = (dtk_dataset*)s;
  return NULL;
}
static void destroy(dtk_dataset* d) { free(d); }
static dtk_status* num_samples(dtk_dataset* d, int32_t split, int64_t* out) {
  (void)split;
  *out = ((state*)d)->n;
  return NULL;
}
typedef struct sample {
  dtk_buffer b;
  int64_t shape[1];
  int64_t tokens[4];
} sample;
static void free_sample(dtk_buffer* b) { free(b->manager_ctx); }
static dtk_status* get_sample(dtk_dataset* d, int32_t split, int64_t index, const dtk_buffer_sink* out) {
  sample* s;
  int i;
  (void)split;
  if (index < 0 || index >= ((state*)d)->n) return g_host->make_status(DTK_ERR_OUT_OF_RANGE, "index out of range");
  s = (sample*)calloc(1, sizeof(sample));
  for (i = 0; i < 4; ++i) s->tokens[i] = index + i;
  s->shape[0] = 4;
  s->b.struct_size = sizeof(dtk_buffer);
  s->b.data = s->tokens;
  s->b.dtype = DTK_DTYPE_INT64;
  s->b.ndim = 1;
  s->b.shape = s->shape;
  s->b.strides = NULL;
  s->b.manager_ctx = s;
  s->b.deleter = free_sample;
  return out->put(out->ctx, "text", &s->b);
}
static dtk_status* vocab_size(dtk_dataset* d, int64_t* out) {
  (void)d;
  *out = 8;
  return NULL;
}

static dtk_dataset_api kApi = {sizeof(dtk_dataset_api), create, destroy, num_samples, get_sample, vocab_size};

static dtk_status* init(const dtk_host_services* host) {
  g_host = host;
#ifdef VARIANT_INIT_FAIL
  return host->make_status(DTK_ERR_UNSUPPORTED, "no accelerator found");
#else
  return NULL;
#endif
}
static void deinit(void) {}
static const void* get_api(void) {
#ifdef VARIANT_SMALL_API
  kApi.struct_size = 2 * sizeof(void*);
#endif
  return &kApi;
}

static const dtk_plugin_entry kEntry = {
#ifdef VARIANT_SMALL_ENTRY
    offsetof(dtk_plugin_entry, options),
#else
    sizeof(dtk_plugin_entry),
#endif
#ifdef VARIANT_MAJOR
    DTK_ABI_MAJOR + 1,
#else
    DTK_ABI_MAJOR,
#endif
#ifdef VARIANT_NEWER
    DTK_ABI_MINOR + 1,
#else
    DTK_ABI_MINOR,
#endif
#if defined(VARIANT_TORCH)
    "0.0.1", /* torch_version */
#elif defined(VARIANT_COMPUTE)
    "1.13.0-test",
#else
    NULL,
#endif
    PLUGIN_NAME,
#if defined(VARIANT_TORCH) || defined(VARIANT_COMPUTE) || defined(VARIANT_COMPUTE_NO_TORCH)
    DTK_KIND_MODEL,
#else
    DTK_KIND_DATASET,
#endif
    "1.2.3",
    "A test plugin written in C",
    init,
    deinit,
    get_api,
    kOptions,
    sizeof(kOptions) / sizeof(kOptions[0])};

DTK_EXPORT const dtk_plugin_entry* dtk_plugin_get_entry(void) { return &kEntry; }
