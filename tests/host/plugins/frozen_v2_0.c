/* Built against the FROZEN copy of the ABI 2.0 header (tests/abi/v2_0/dtk/abi.h), not the
 * current one: a plugin built for 2.0 must keep loading, and working, in every 2.x host. */
#include <dtk/abi.h>

#include <stdlib.h>

#if DTK_ABI_MAJOR != 2 || DTK_ABI_MINOR != 0
#error "frozen_v2_0.c must be built against the frozen ABI 2.0 header"
#endif

static const dtk_host_services* g_host;

static dtk_status* create(const dtk_dataset_context* ctx, dtk_dataset** out) {
  (void)ctx;
  *out = (dtk_dataset*)malloc(1);
  return NULL;
}
static void destroy(dtk_dataset* d) { free(d); }
static dtk_status* num_samples(dtk_dataset* d, int32_t split, int64_t* out) {
  (void)d;
  *out = split == DTK_SPLIT_TRAIN ? 7 : 0;
  return NULL;
}
static dtk_status* get_sample(dtk_dataset* d, const dtk_sample_args* args) {
  (void)d;
  if (!DTK_STRUCT_COVERS(dtk_sample_args, args, 2_0))
    return g_host->make_status(DTK_ERR_ABI, "get_sample args smaller than ABI 2.0's");
  return g_host->make_status(DTK_ERR_OUT_OF_RANGE, "frozen_v2_0 has no samples");
}
static dtk_status* vocab_size(dtk_dataset* d, int64_t* out) {
  (void)d;
  *out = 0;
  return NULL;
}
static const dtk_dataset_api kApi = {dtk_dataset_api_STRUCT_SIZE, create, destroy, num_samples, get_sample, vocab_size};
static dtk_status* init(const dtk_host_services* host) {
  if (!DTK_STRUCT_COVERS(dtk_host_services, host, 2_0)) return NULL;
  g_host = host;
  return NULL;
}
static const void* get_api(void) { return &kApi; }
/* Specs of 2.0's size: the host must not read a 2.7 acts_with past their end. */
static const dtk_option_spec kOptions[] = {
    {dtk_option_spec_STRUCT_SIZE, "level", DTK_OPT_INT, "1", "A number.", NULL},
    {dtk_option_spec_STRUCT_SIZE, "name", DTK_OPT_STRING, "x", "A string.", NULL},
};
static const dtk_plugin_entry kEntry = {dtk_plugin_entry_STRUCT_SIZE,
                                        DTK_ABI_MAJOR,
                                        DTK_ABI_MINOR,
                                        NULL,
                                        "frozen_v2_0",
                                        DTK_KIND_DATASET,
                                        "2.0.0",
                                        "Built with the ABI 2.0 header",
                                        init,
                                        NULL,
                                        get_api,
                                        kOptions,
                                        2,
                                        NULL};
DTK_EXPORT const dtk_plugin_entry* dtk_plugin_get_entry(void) { return &kEntry; }
