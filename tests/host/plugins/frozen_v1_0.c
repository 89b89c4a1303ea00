/* Built against the FROZEN copy of the ABI 1.0 header (tests/abi/v1_0/dtk/abi.h), not the
 * current one: ABI 2.0 changed layouts incompatibly, so a plugin from the first release must be
 * refused by every 2.x host with one line naming the file, its ABI and the host's. */
#include <dtk/abi.h>

#include <stdlib.h>

#if DTK_ABI_MAJOR != 1 || DTK_ABI_MINOR != 0
#error "frozen_v1_0.c must be built against the frozen ABI 1.0 header"
#endif

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
static dtk_status* get_sample(dtk_dataset* d, int32_t split, int64_t index, const dtk_buffer_sink* out) {
  (void)d, (void)split, (void)index, (void)out;
  return NULL;
}
static dtk_status* vocab_size(dtk_dataset* d, int64_t* out) {
  (void)d;
  *out = 0;
  return NULL;
}
static const dtk_dataset_api kApi = {sizeof(dtk_dataset_api), create, destroy, num_samples, get_sample, vocab_size};
static dtk_status* init(const dtk_host_services* host) {
  (void)host;
  return NULL;
}
static const void* get_api(void) { return &kApi; }
static const dtk_plugin_entry kEntry = {sizeof(dtk_plugin_entry),
                                        DTK_ABI_MAJOR,
                                        DTK_ABI_MINOR,
                                        NULL,
                                        "frozen_v1_0",
                                        DTK_KIND_DATASET,
                                        "1.0.0",
                                        "Built with the ABI 1.0 header",
                                        init,
                                        NULL,
                                        get_api,
                                        NULL,
                                        0};
DTK_EXPORT const dtk_plugin_entry* dtk_plugin_get_entry(void) { return &kEntry; }
