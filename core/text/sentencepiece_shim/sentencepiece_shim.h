/* dtk_sentencepiece: a C face over libsentencepiece, loaded by dtk_text with dlopen(RTLD_DEEPBIND).
 * Why: Debian's libsentencepiece carries (and exports) its own copy of protobuf-lite 3.14, while
 * dtk links libprotobuf 3.21 for its configs. Linked into one process, SentencePiece's protobuf
 * calls bind to dtk's 3.21 and abort ("compiled against version 3.14.0 ..."). Loaded with
 * RTLD_DEEPBIND, this library and libsentencepiece resolve their own symbols first.
 * Every function returns 0 on success; on failure it writes a one-line reason into err. */
#ifndef DTK_SENTENCEPIECE_SHIM_H_
#define DTK_SENTENCEPIECE_SHIM_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dtk_sp dtk_sp;

int dtk_sp_load(const char* model_file, dtk_sp** out, char* err, size_t err_size);
void dtk_sp_free(dtk_sp* sp);
/* piece count; bos, eos, pad, unk ids (-1: none) */
void dtk_sp_info(const dtk_sp* sp, int* pieces, int* bos, int* eos, int* pad, int* unk);
int dtk_sp_piece_to_id(const dtk_sp* sp, const char* piece, size_t len);
/* The piece of `id` into buf (NUL-terminated, cut at buf_size - 1); returns its full length. */
size_t dtk_sp_id_to_piece(const dtk_sp* sp, int id, char* buf, size_t buf_size);
/* ids: malloc'd, freed with dtk_sp_free_buffer. */
int dtk_sp_encode(const dtk_sp* sp, const char* text, size_t len, int** ids, size_t* count, char* err,
                  size_t err_size);
int dtk_sp_decode(const dtk_sp* sp, const int* ids, size_t count, char** text, size_t* len, char* err,
                  size_t err_size);
void dtk_sp_free_buffer(void* buffer);

#ifdef __cplusplus
}
#endif
#endif
