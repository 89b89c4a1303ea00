/* Compiled with -std=c99 -pedantic -Werror: abi.h must stay pure C99, traits included. */
#include <dtk/abi.h>

int dtk_abi_c99_check(const dtk_plugin_entry* e) {
  if (!DTK_STRUCT_COVERS(dtk_plugin_entry, e, 2_0)) return -1;
  return DTK_HAS_FIELD(dtk_plugin_entry, e, get_extension) ? (int)e->abi_major : (int)dtk_plugin_entry_STRUCT_SIZE;
}
