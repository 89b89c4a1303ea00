// A test dataset that puts several named buffers per sample, of different dtypes, ranks and
// strides, with values that are functions of the sample index, so the host's collation can be
// checked element by element. Option `drop_mask_at` makes one sample omit a buffer (an error).
#include <dtk/dataset.hpp>

#include <memory>
#include <vector>

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_int("drop_mask_at", "-1", "Sample index that omits its 'loss_mask' buffer (-1: none)."),
};

template <class T>
dtk_buffer* buffer(std::vector<T> values, int32_t dtype, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  struct Owned {
    dtk_buffer b{};
    std::vector<T> values;
    std::vector<int64_t> shape, strides;
  };
  auto* o = new Owned{{}, std::move(values), std::move(shape), std::move(strides)};
  o->b.struct_size = dtk_buffer_STRUCT_SIZE;
  o->b.data = o->values.data();
  o->b.dtype = dtype;
  o->b.ndim = static_cast<int32_t>(o->shape.size());
  o->b.shape = o->shape.data();
  o->b.strides = o->strides.empty() ? nullptr : o->strides.data();
  o->b.manager_ctx = o;
  o->b.deleter = [](dtk_buffer* b) { delete static_cast<Owned*>(b->manager_ctx); };
  return &o->b;
}

class NamedBuffers : public dtk::Dataset {
 public:
  explicit NamedBuffers(const dtk::DatasetContext& ctx)
      : seq_(ctx.seq_length), drop_(ctx.options.get_int("drop_mask_at")) {}
  int64_t num_samples(int32_t) override { return 1000; }
  void get_sample(int32_t, int64_t i, const dtk_buffer_sink* out) override {
    // "text": uint16 tokens i, i+1, ... (widened to int64 by the host).
    std::vector<uint16_t> text(static_cast<size_t>(seq_ + 1));
    for (size_t k = 0; k < text.size(); ++k) text[k] = static_cast<uint16_t>(i + static_cast<int64_t>(k));
    dtk::put(out, "text", buffer(std::move(text), DTK_DTYPE_UINT16, {seq_ + 1}, {}));
    // "loss_mask": float32, 0.5 * i everywhere (kept float).
    if (i != drop_)
      dtk::put(out, "loss_mask",
               buffer(std::vector<float>(static_cast<size_t>(seq_), 0.5f * static_cast<float>(i)), DTK_DTYPE_FLOAT32,
                      {seq_}, {}));
    // "grid": a transposed [2, 3] int32 view of storage [3, 2] = {10i + r*2 + c}; element (a, b)
    // of the view is storage (b, a).
    std::vector<int32_t> storage(6);
    for (int k = 0; k < 6; ++k) storage[k] = static_cast<int32_t>(10 * i + k);
    dtk::put(out, "grid", buffer(std::move(storage), DTK_DTYPE_INT32, {2, 3}, {1, 2}));
  }

 private:
  int64_t seq_, drop_;
};

}  // namespace

DTK_PLUGIN("named_buffers", DTK_KIND_DATASET, "1.0.0", "Test dataset with several named buffers", DTK_NO_TORCH,
           dtk::dataset_api<NamedBuffers>(), kOptions)
