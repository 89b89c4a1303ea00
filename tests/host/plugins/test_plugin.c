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
    {dtk_option_spec_STRUCT_SIZE, "num", DTK_OPT_INT, "three", "An integer.", NULL, NULL},
#else
    {dtk_option_spec_STRUCT_SIZE, "num", DTK_OPT_INT, "3", "An integer.", NULL, NULL},
#endif
    {dtk_option_spec_STRUCT_SIZE, "rate", DTK_OPT_FLOAT, "0.5", "A number.", NULL, NULL},
    {dtk_option_spec_STRUCT_SIZE, "flag", DTK_OPT_BOOL, "false", "A switch.", NULL, NULL},
    {dtk_option_spec_STRUCT_SIZE, "mode", DTK_OPT_ENUM, "a", "A choice.", "a|b", NULL},
#ifdef VARIANT_ACTS_REQUIRED
    {dtk_option_spec_STRUCT_SIZE, "path", DTK_OPT_STRING, NULL, "Required string.", NULL, "flag=true"},
#else
    {dtk_option_spec_STRUCT_SIZE, "path", DTK_OPT_STRING, NULL, "Required string.", NULL, NULL},
#endif
/* ABI 2.7: options that act only with other settings; each broken variant misdeclares one. */
#if defined(VARIANT_ACTS_UNKNOWN)
    {dtk_option_spec_STRUCT_SIZE, "depth", DTK_OPT_INT, "2", "Acts with mode b.", NULL, "modes=b"},
#elif defined(VARIANT_ACTS_BAD_VALUE)
    {dtk_option_spec_STRUCT_SIZE, "depth", DTK_OPT_INT, "2", "Acts with mode b.", NULL, "mode=c"},
#elif defined(VARIANT_ACTS_MALFORMED)
    {dtk_option_spec_STRUCT_SIZE, "depth", DTK_OPT_INT, "2", "Acts with mode b.", NULL, "mode"},
#else
    {dtk_option_spec_STRUCT_SIZE, "depth", DTK_OPT_INT, "2", "Acts with mode b.", NULL, "mode=b"},
#endif
    {dtk_option_spec_STRUCT_SIZE, "tag", DTK_OPT_STRING, "", "Acts with the flag or mode b.", NULL, "flag=1,mode=b"},
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
static dtk_status* get_sample(dtk_dataset* d, const dtk_sample_args* args) {
  sample* s;
  int i;
  int64_t index;
  if (!DTK_STRUCT_COVERS(dtk_sample_args, args, 2_0))
    return g_host->make_status(DTK_ERR_ABI, "get_sample args smaller than ABI 2.0's");
  index = args->index;
  if (index < 0 || index >= ((state*)d)->n) return g_host->make_status(DTK_ERR_OUT_OF_RANGE, "index out of range");
  s = (sample*)calloc(1, sizeof(sample));
  for (i = 0; i < 4; ++i) s->tokens[i] = index + i;
  s->shape[0] = 4;
  s->b.struct_size = dtk_buffer_STRUCT_SIZE;
  s->b.data = s->tokens;
  s->b.dtype = DTK_DTYPE_INT64;
  s->b.ndim = 1;
  s->b.shape = s->shape;
  s->b.strides = NULL;
  s->b.manager_ctx = s;
  s->b.deleter = free_sample;
  return args->out->put(args->out->ctx, "text", &s->b);
}
static dtk_status* vocab_size(dtk_dataset* d, int64_t* out) {
  (void)d;
  *out = 8;
  return NULL;
}

static dtk_dataset_api kApi = {dtk_dataset_api_STRUCT_SIZE, create, destroy, num_samples, get_sample, vocab_size};

/* One extension, to test the lookup by id (abi.h rule 8). */
typedef struct test_answer_ext {
  size_t struct_size;
  int32_t answer;
} test_answer_ext;
static const test_answer_ext kAnswer = {sizeof(test_answer_ext), 42};
static const void* get_extension(const char* id) {
  return id && strcmp(id, "dtk.ext.test_answer.v1") == 0 ? &kAnswer : NULL;
}

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
#ifdef VARIANT_NULL_FUNCTION
  kApi.get_sample = NULL;
#endif
  return &kApi;
}

static const dtk_plugin_entry kEntry = {
#ifdef VARIANT_SMALL_ENTRY
    offsetof(dtk_plugin_entry, options),
#else
    dtk_plugin_entry_STRUCT_SIZE,
#endif
#ifdef VARIANT_MAJOR
    DTK_ABI_MAJOR + 1,
#else
    DTK_ABI_MAJOR,
#endif
#if defined(VARIANT_NEWER)
    DTK_ABI_MINOR + 1,
#elif defined(VARIANT_MAJOR)
    0, /* the first minor of the next major */
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
    sizeof(kOptions) / sizeof(kOptions[0]),
    get_extension};

DTK_EXPORT const dtk_plugin_entry* dtk_plugin_get_entry(void) { return &kEntry; }
