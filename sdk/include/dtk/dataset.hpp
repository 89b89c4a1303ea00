// dtk/dataset.hpp — a data-tier dataset plugin in plain C++ (no LibTorch):
//
//   class MyData : public dtk::Dataset { ... };      // constructor: (const dtk::DatasetContext&)
//   DTK_PLUGIN("my_data", DTK_KIND_DATASET, "1.0.0", "What it is", DTK_NO_TORCH,
//              dtk::dataset_api<MyData>(), kOptions)
//
// Threads (abi.h rule 6): get_sample runs on the host's loader thread while the training thread
// may call num_samples and vocab_size; keep them free of unsynchronized shared state.
#pragma once

#include <dtk/plugin.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dtk {

// ------------------------------------------------------------------------------------------
// Data tier: buffers
// ------------------------------------------------------------------------------------------

namespace detail {
struct OwnedBuffer {
  dtk_buffer buffer{};
  std::vector<int64_t> shape;
  std::shared_ptr<void> keepalive;  // owns (or pins) the memory `buffer.data` points into
};
inline void delete_owned_buffer(dtk_buffer* b) { delete static_cast<OwnedBuffer*>(b->manager_ctx); }
}  // namespace detail

// A 1-D buffer over `count` elements at `data`, kept alive by `keepalive` (e.g. a shared
// pointer to a memory map or to a std::vector). Ownership: [new], deleter frees it.
inline dtk_buffer* make_buffer(void* data, int32_t dtype, int64_t count, std::shared_ptr<void> keepalive) {
  auto* owned = new detail::OwnedBuffer();
  owned->shape = {count};
  owned->keepalive = std::move(keepalive);
  owned->buffer.struct_size = dtk_buffer_STRUCT_SIZE;
  owned->buffer.data = data;
  owned->buffer.dtype = dtype;
  owned->buffer.ndim = 1;
  owned->buffer.shape = owned->shape.data();
  owned->buffer.strides = nullptr;
  owned->buffer.manager_ctx = owned;
  owned->buffer.deleter = &detail::delete_owned_buffer;
  return &owned->buffer;
}

// A buffer that owns a copy of `values` (int64 tokens).
inline dtk_buffer* make_buffer(std::vector<int64_t> values) {
  auto storage = std::make_shared<std::vector<int64_t>>(std::move(values));
  void* data = storage->data();
  const auto n = static_cast<int64_t>(storage->size());
  return make_buffer(data, DTK_DTYPE_INT64, n, std::move(storage));
}

inline void put(const dtk_buffer_sink* sink, const char* name, dtk_buffer* buffer) {
  check(sink->put(sink->ctx, name, buffer));
}

// C++ view of the dataset context.
struct DatasetContext {
  explicit DatasetContext(const dtk_dataset_context* in)
      : DatasetContext(read_struct(in, dtk_dataset_context_STRUCT_SIZE_2_0, "dataset context")) {}
  explicit DatasetContext(const dtk_dataset_context& c)
      : options(c.options),
        seq_length(c.seq_length),
        seed(c.seed),
        rank(c.rank),
        world_size(c.world_size),
        cache_dir(c.cache_dir ? c.cache_dir : ""),
        whole_splits(c.whole_splits) {  // 0 from a 2.16 host (read_struct zero-fills)
    for (int i = 0; i < 3; ++i) num_samples[i] = c.num_samples[i];
  }
  // ABI 2.17: the run reads `split` whole (eval.full_validation): build it as one pass over its
  // data, every sample once, and report that size (num_samples[split] is then 0).
  bool whole(int32_t split) const { return split >= 0 && split < 3 && (whole_splits >> split) & 1u; }
  Options options;
  int64_t seq_length;
  int64_t num_samples[3];
  uint64_t seed;
  int32_t rank, world_size;
  std::string cache_dir;  // "" when the host has no run-wide cache directory
  uint32_t whole_splits;  // bit (1 << split): see whole()
};

// Base class of a C++ dataset plugin. Constructor: Class(const dtk::DatasetContext&).
// Contracts (docs/plugin-guide.md, "Contracts"; the host checks the first batches and names this
// plugin when they are broken):
//   * The host asks for samples 0, 1, 2, ... of a split in order (each data-parallel rank its share
//     of every global batch, a resumed run from where it stopped): shuffling is the dataset's job.
//   * Sample i is a pure function of (split, i, options, seed): any rank, thread or rerun gets the
//     same one.
//   * The shipped causal_lm step reads "text": seq_length + 1 token ids per sample (it shifts them
//     into tokens and labels), each in [0, vocab_size()) when vocab_size() is declared.
class Dataset {
 public:
  virtual ~Dataset() = default;
  // Samples of the split (0 train, 1 validation, 2 test); at least DatasetContext::num_samples
  // when the run asks for them.
  virtual int64_t num_samples(int32_t split) = 0;
  // [loader-thread] Puts the sample's named buffers into `out` (GPT: "text", seq_length + 1
  // tokens). Every buffer reaches the step by name, collated to [micro_batch_size, ...].
  virtual void get_sample(int32_t split, int64_t index, const dtk_buffer_sink* out) = 0;
  // The token ids this dataset can produce (0: not declared).
  virtual int64_t vocab_size() { return 0; }
};

// The dtk_dataset_api table for a dtk::Dataset subclass.
template <class T>
const dtk_dataset_api* dataset_api() {
  static const dtk_dataset_api api = {
      dtk_dataset_api_STRUCT_SIZE,
      [](const dtk_dataset_context* ctx, dtk_dataset** out) {
        return guard([&] { *out = reinterpret_cast<dtk_dataset*>(new T(DatasetContext(ctx))); });
      },
      [](dtk_dataset* d) { delete reinterpret_cast<T*>(d); },
      [](dtk_dataset* d, int32_t split, int64_t* out) {
        return guard([&] { *out = reinterpret_cast<T*>(d)->num_samples(split); });
      },
      [](dtk_dataset* d, const dtk_sample_args* args) {
        return guard([&] {
          const dtk_sample_args a = read_struct(args, dtk_sample_args_STRUCT_SIZE_2_0, "get_sample args");
          reinterpret_cast<T*>(d)->get_sample(a.split, a.index, a.out);
        });
      },
      [](dtk_dataset* d, int64_t* out) { return guard([&] { *out = reinterpret_cast<T*>(d)->vocab_size(); }); },
  };
  return &api;
}

}  // namespace dtk
