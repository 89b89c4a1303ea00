// dtk/core/train/batch_loader.hpp — micro-batches from a dataset plugin, prefetched on a background
// thread so the training step does not wait on data.
//
// Named buffers: every buffer a dataset puts for a sample reaches the step under its name
// ("text" for the GPT datasets; a dataset may add e.g. "loss_mask"), collated along a new first
// dimension into [micro_batch_size, ...]. Integer buffers become int64 (token ids; LibTorch 1.13
// has no uint16), floating and bool buffers keep their dtype. Every sample of a split must put
// the same names with the same shapes.
//
// On a GPU run (training_device() is CUDA) the worker puts each batch in page-locked host memory
// and next() starts its copy to the device without blocking (on LibTorch's current stream, so
// the step's kernels run after it).
#pragma once

#include <c10/core/Device.h>
#include <dtk/tensor.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "dtk/core/components/components.hpp"

namespace dtk::core {

class BatchLoader {
 public:
  // `index_of(k, j)`: sample index of row j of the k-th micro-batch produced. `depth` batches
  // are prepared ahead. `padding_mask_length` > 0 (eval.full_validation): index_of may return -1,
  // a padding row (the split's end inside a micro-batch): it holds sample 0, and every batch gets a
  // "loss_mask" (the dataset's, or ones of [micro_batch_size, padding_mask_length]) that is 0 on
  // padding rows, so a step that applies it counts none of their tokens.
  BatchLoader(const DatasetInstance& data, int32_t split, int64_t micro_batch_size, int64_t num_batches,
              std::function<int64_t(int64_t, int64_t)> index_of, int depth = 4, int64_t padding_mask_length = 0);
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // The next micro-batch by buffer name; rethrows the worker's error, if any. `on_host`: as
  // collated (page-locked on a GPU run), without the copy to the training device.
  TensorList next(bool on_host = false);

 private:
  void run();
  TensorList collate(int64_t k) const;
  void mask_padding(TensorList& batch, const std::vector<int64_t>& padding) const;
  const DatasetInstance& data_;
  int32_t split_;
  int64_t mbs_, num_batches_, padding_mask_length_;
  std::function<int64_t(int64_t, int64_t)> index_of_;
  size_t depth_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TensorList> queue_;
  std::exception_ptr error_;
  int64_t consumed_ = 0;
  bool stop_ = false;  // guarded by mu_
  c10::Device device_;  // where next() delivers (the run's training device)
  std::thread worker_;
};

}  // namespace dtk::core
