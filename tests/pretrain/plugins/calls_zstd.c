/* A library that calls Zstandard, which LibTorch links without calling: it loads only where dtk
 * runs on the real library (DTK_TORCH_STANDINS=off), not on the empty stand-in. Not a DTK plugin. */
unsigned ZSTD_versionNumber(void);
unsigned zstd_version_seen_by_a_plugin(void) { return ZSTD_versionNumber(); }
