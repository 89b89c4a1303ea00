/* Compiled with -std=c99 -pedantic -Werror: abi.h must stay pure C99. */
#include <dtk/abi.h>

int dtk_abi_c99_check(const dtk_plugin_entry* e) {
  return DTK_HAS_FIELD(dtk_plugin_entry, e, num_options) ? (int)e->abi_major : -1;
}
