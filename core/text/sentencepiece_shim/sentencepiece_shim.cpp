// See sentencepiece_shim.h for why this is a separate library behind a C face.
#include "sentencepiece_shim.h"

#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

struct dtk_sp {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

void write_error(const std::string& what, char* err, size_t size) {
  if (err == nullptr || size == 0) return;
  std::strncpy(err, what.c_str(), size - 1);
  err[size - 1] = '\0';
}

}  // namespace

extern "C" {

int dtk_sp_load(const char* model_file, dtk_sp** out, char* err, size_t err_size) {
  auto* sp = new dtk_sp;
  const auto status = sp->processor.Load(model_file);
  if (!status.ok()) {
    write_error(status.ToString(), err, err_size);
    delete sp;
    return 1;
  }
  *out = sp;
  return 0;
}

void dtk_sp_free(dtk_sp* sp) { delete sp; }

void dtk_sp_info(const dtk_sp* sp, int* pieces, int* bos, int* eos, int* pad, int* unk) {
  *pieces = sp->processor.GetPieceSize();
  *bos = sp->processor.bos_id();
  *eos = sp->processor.eos_id();
  *pad = sp->processor.pad_id();
  *unk = sp->processor.unk_id();
}

int dtk_sp_piece_to_id(const dtk_sp* sp, const char* piece, size_t len) {
  return sp->processor.PieceToId(std::string(piece, len));
}

size_t dtk_sp_id_to_piece(const dtk_sp* sp, int id, char* buf, size_t buf_size) {
  const std::string& piece = sp->processor.IdToPiece(id);
  if (buf_size > 0) {
    const size_t n = piece.size() < buf_size - 1 ? piece.size() : buf_size - 1;
    std::memcpy(buf, piece.data(), n);
    buf[n] = '\0';
  }
  return piece.size();
}

int dtk_sp_encode(const dtk_sp* sp, const char* text, size_t len, int** ids, size_t* count, char* err,
                  size_t err_size) {
  std::vector<int> v;
  const auto status = sp->processor.Encode(std::string(text, len), &v);
  if (!status.ok()) {
    write_error(status.ToString(), err, err_size);
    return 1;
  }
  *count = v.size();
  *ids = static_cast<int*>(std::malloc((v.empty() ? 1 : v.size()) * sizeof(int)));
  if (!v.empty()) std::memcpy(*ids, v.data(), v.size() * sizeof(int));
  return 0;
}

int dtk_sp_decode(const dtk_sp* sp, const int* ids, size_t count, char** text, size_t* len, char* err,
                  size_t err_size) {
  std::string s;
  const auto status = sp->processor.Decode(std::vector<int>(ids, ids + count), &s);
  if (!status.ok()) {
    write_error(status.ToString(), err, err_size);
    return 1;
  }
  *len = s.size();
  *text = static_cast<char*>(std::malloc(s.size() + 1));
  std::memcpy(*text, s.c_str(), s.size() + 1);
  return 0;
}

void dtk_sp_free_buffer(void* buffer) { std::free(buffer); }

}  // extern "C"
