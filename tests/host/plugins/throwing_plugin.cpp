// A C++ dataset plugin (SDK, no LibTorch) whose calls throw: the SDK's guard must turn every
// exception into a status, so the host sees an error message and never an exception.
#include <dtk/dataset.hpp>

namespace {
class Exploding : public dtk::Dataset {
 public:
  explicit Exploding(const dtk::DatasetContext& ctx) {
    if (ctx.seq_length < 0) throw std::runtime_error("negative seq_length");
  }
  int64_t num_samples(int32_t) override { throw std::out_of_range("num_samples exploded"); }
  void get_sample(int32_t, int64_t, const dtk_buffer_sink*) override {
    throw dtk::Error("sample exploded", DTK_ERR_IO);
  }
  int64_t vocab_size() override { throw 42; }  // not even a std::exception
};
}  // namespace

DTK_PLUGIN("exploding", DTK_KIND_DATASET, "0.0.1", "Throws from every call", DTK_NO_TORCH,
           dtk::dataset_api<Exploding>(), DTK_NO_OPTIONS)
