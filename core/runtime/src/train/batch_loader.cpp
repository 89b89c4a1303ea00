#include "dtk/core/train/batch_loader.hpp"
#include "dtk/core/device/cuda_support.hpp"

#include <cstring>
#include <string>
#include <utility>

namespace dtk::core {

using host::HostError;

namespace {

// Collects the buffers a dataset puts; releases every one it does not keep.
struct BufferCollector {
  std::vector<std::pair<std::string, dtk_buffer*>> items;
  ~BufferCollector() {
    for (auto& kv : items)
      if (kv.second && kv.second->deleter) kv.second->deleter(kv.second);
  }
};

// A copy of the buffer as a tensor (the buffer is released as soon as the sample is read).
// Integer buffers become int64; uint16 (token files of vocabularies < 65536) is widened by hand
// because LibTorch 1.13 has no uint16.
at::Tensor buffer_to_tensor(const dtk_buffer* b, const std::string& where) {
  if (!DTK_STRUCT_COVERS(dtk_buffer, b, 2_0)) throw HostError(where + ": malformed buffer");
  if (b->ndim < 0 || b->ndim > 8 || (b->ndim > 0 && !b->shape))
    throw HostError(where + ": buffer rank must be 0..8 with a shape, got " + std::to_string(b->ndim));
  std::vector<int64_t> shape(b->shape, b->shape + b->ndim), strides(static_cast<size_t>(b->ndim));
  int64_t numel = 1, contiguous = 1;
  for (int i = b->ndim - 1; i >= 0; --i) {
    if (shape[i] < 0) throw HostError(where + ": negative buffer dimension " + std::to_string(shape[i]));
    strides[i] = b->strides ? b->strides[i] : contiguous;
    if (strides[i] <= 0)
      throw HostError(where + ": buffer strides must be positive, got " + std::to_string(strides[i]));
    contiguous *= shape[i], numel *= shape[i];
  }
  if (numel > 0 && !b->data) throw HostError(where + ": buffer has no data");
  if (b->dtype == DTK_DTYPE_UINT16) {
    auto out = at::empty(shape, at::kLong);
    auto* dst = out.data_ptr<int64_t>();
    const auto* src = static_cast<const uint16_t*>(b->data);
    std::vector<int64_t> idx(static_cast<size_t>(b->ndim), 0);
    for (int64_t n = 0; n < numel; ++n) {  // walk the (strided) source in row-major order
      int64_t off = 0;
      for (int d = 0; d < b->ndim; ++d) off += idx[d] * strides[d];
      dst[n] = src[off];
      for (int d = b->ndim - 1; d >= 0 && ++idx[d] == shape[d]; --d) idx[d] = 0;
    }
    return out;
  }
  at::ScalarType st;
  try {
    st = to_scalar_type(b->dtype);
  } catch (const std::exception&) {
    throw HostError(where + ": unknown buffer dtype code " + std::to_string(b->dtype));
  }
  const at::ScalarType target = at::isIntegralType(st, /*includeBool=*/false) ? at::kLong : st;
  return at::from_blob(b->data, shape, strides, at::TensorOptions().dtype(st))
      .to(target, /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace

TensorList DatasetInstance::get_sample(int32_t split, int64_t index) const {
  BufferCollector c;
  dtk_buffer_sink sink{dtk_buffer_sink_STRUCT_SIZE, &c, [](void* ctx, const char* name, dtk_buffer* b) -> dtk_status* {
                         // The sink owns `b` even on failure: release it if it cannot be kept.
                         try {
                           static_cast<BufferCollector*>(ctx)->items.emplace_back(name ? name : "", b);
                           return nullptr;
                         } catch (...) {
                           if (b && b->deleter) b->deleter(b);
                           return host::make_status(DTK_ERR_INTERNAL, "out of memory collecting a sample buffer");
                         }
                       }};
  const dtk_sample_args args{dtk_sample_args_STRUCT_SIZE, split, index, &sink};
  check_plugin(api_->get_sample(dataset_, &args), plugin_, "get_sample");
  const std::string where = "dataset plugin '" + plugin_.name() + "' sample " + std::to_string(index);
  if (c.items.empty()) throw HostError(where + ": the sample has no buffers");
  TensorList out;
  for (const auto& kv : c.items) {
    if (kv.first.empty()) throw HostError(where + ": a buffer has an empty name");
    if (find(out, kv.first)) throw HostError(where + ": buffer '" + kv.first + "' put twice");
    out.emplace_back(kv.first, buffer_to_tensor(kv.second, where + " buffer '" + kv.first + "'"));
  }
  return out;
}

BatchLoader::BatchLoader(const DatasetInstance& data, int32_t split, int64_t micro_batch_size, int64_t num_batches,
                         std::function<int64_t(int64_t, int64_t)> index_of, int depth, int64_t padding_mask_length)
    : data_(data),
      split_(split),
      mbs_(micro_batch_size),
      num_batches_(num_batches),
      padding_mask_length_(padding_mask_length),
      index_of_(std::move(index_of)),
      depth_(static_cast<size_t>(depth)),
      device_(training_device()) {
  worker_ = std::thread([this] { run(); });
}

BatchLoader::~BatchLoader() {
  {
    // Under the lock: otherwise the worker can test the predicate, miss this store and the
    // notification, and sleep forever while join() waits for it.
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

// Micro-batch k: each buffer name's rows stacked in sample order.
TensorList BatchLoader::collate(int64_t k) const {
  std::vector<TensorList> rows;
  rows.reserve(static_cast<size_t>(mbs_));
  std::vector<int64_t> padding;  // rows past the split's end (eval.full_validation)
  for (int64_t j = 0; j < mbs_; ++j) {
    int64_t index = index_of_(k, j);
    if (index < 0 && padding_mask_length_ > 0) padding.push_back(j), index = 0;
    rows.push_back(data_.get_sample(split_, index));
  }
  const std::string who = "dataset plugin '" + data_.plugin().name() + "': ";
  TensorList batch;
  for (const auto& [name, first] : rows[0]) {
    std::vector<at::Tensor> column;
    column.reserve(rows.size());
    for (const auto& row : rows) {
      const at::Tensor* t = find(row, name);
      if (!t) throw HostError(who + "samples of one batch differ in their buffers ('" + name + "' missing)");
      if (t->sizes() != first.sizes() || t->scalar_type() != first.scalar_type())
        throw HostError(who + "samples of one batch differ in length or dtype of buffer '" + name + "'");
      column.push_back(*t);
    }
    batch.emplace_back(name, device_.is_cuda() ? at::stack(column).pin_memory() : at::stack(column));
  }
  for (const auto& row : rows)
    if (row.size() != batch.size()) throw HostError(who + "samples of one batch differ in their buffers");
  if (padding_mask_length_ > 0) mask_padding(batch, padding);
  return batch;
}

// Every batch of a loader that pads carries a "loss_mask", 0 on its padding rows.
void BatchLoader::mask_padding(TensorList& batch, const std::vector<int64_t>& padding) const {
  at::Tensor* mask = nullptr;
  for (auto& kv : batch)
    if (kv.first == "loss_mask") mask = &kv.second;
  if (!mask) {
    batch.emplace_back("loss_mask", at::ones({mbs_, padding_mask_length_}, at::kFloat));
    if (device_.is_cuda()) batch.back().second = batch.back().second.pin_memory();
    mask = &batch.back().second;
  }
  for (int64_t j : padding) mask->select(0, j).zero_();
}

void BatchLoader::run() {
  try {
    for (int64_t k = 0; k < num_batches_; ++k) {
      TensorList batch = collate(k);
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || queue_.size() < depth_; });
      if (stop_) return;
      queue_.push_back(std::move(batch));
      cv_.notify_all();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::current_exception();
    cv_.notify_all();
  }
}

TensorList BatchLoader::next(bool on_host) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !queue_.empty() || error_ || consumed_ >= num_batches_; });
  if (queue_.empty()) {
    if (error_) std::rethrow_exception(error_);
    throw HostError("data loader: no more batches (requested more than planned)");
  }
  TensorList b = std::move(queue_.front());
  queue_.pop_front();
  ++consumed_;
  cv_.notify_all();
  lock.unlock();
  if (device_.is_cuda() && !on_host)
    for (auto& kv : b) kv.second = kv.second.to(device_, /*non_blocking=*/true);
  return b;
}

}  // namespace dtk::core
