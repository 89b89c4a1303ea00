// swap.hpp — the disk tier of ZeRO offload (offload_optimizer=nvme, ZeRO-Infinity): this rank's
// fp32 masters and Adam moments (exp_avg, exp_avg_sq) live in one swap file under
// strategy.nvme_path, and each optimizer step streams them through a bounded host buffer.
//
// The step works as DeepSpeed's pipelined optimizer swapper does: the file holds the masters, the
// exp_avg and the exp_avg_sq of every optimizer parameter (one shard per model parameter) in three
// regions, each parameter contiguous in each; the step cuts that order into slices whose three
// kinds fit one half of the buffer; while slice k is updated in one half, slice k+1 is read into
// the other and slice k-1 written back behind it (aio.hpp, io_uring). A parameter larger than a
// slice is stepped in pieces, one per slice it spans (DeepSpeed's sub-groups: Adam is elementwise,
// so the pieces step as the whole would), so the buffer bounds host memory whatever the model's
// largest parameter (GPT-2's embedding alone is 464 MB of fp32 state). The optimizer plugin steps
// slice by slice: only that slice's pieces carry gradients, and its tensors (masters, moments) are
// re-pointed at the buffer (Tensor::set_data, as DeepSpeed assigns param.data and the state's
// tensors). This relies on the Adam plugins' state layout (dtk::AdamMoments, dtk/optimizer.hpp):
// state_save hands out the live moment tensors, state_load of "step" alone sets the step count
// (restored before each slice, so every slice steps with the same count), and a parameter without
// a gradient is not stepped. The first step checks each of these and names the one that fails.
//
// Between steps every one of those tensors is a view of the file through a shared mapping, so
// whatever the host reads or writes there (a checkpoint's state, a resumed run's masters) is the
// state on disk, without the state ever being whole in host memory; the page cache holds what was
// touched. Written pages are flushed before a step reads the file directly (O_DIRECT).
//
// The swap file is not a checkpoint: it is named per host, process and rank, removed when the
// strategy ends, and one left by a killed run on this host is removed by the next run that uses
// the directory.
#pragma once

#include <dtk/optimizer.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "aio.hpp"

namespace dtk::zero {

class OptimizerSwap {
 public:
  // `numels`, `names`: this rank's optimizer parameters (shards), in order. `buffer_bytes`: the
  // host buffer, both halves together. `rank_tag` names this rank in the file name.
  OptimizerSwap(const std::string& dir, const std::string& rank_tag, const std::vector<int64_t>& numels,
                const std::vector<std::string>& names, int64_t buffer_bytes);
  ~OptimizerSwap();
  OptimizerSwap(const OptimizerSwap&) = delete;
  OptimizerSwap& operator=(const OptimizerSwap&) = delete;

  // The tensor handed to the host as optimizer parameter i (a view of the file between steps).
  const at::Tensor& param(size_t i) const { return params_[i]; }
  // Parameter i's fp32 master in the file (a new view each call; not re-pointed by step()).
  at::Tensor master(size_t i) const { return file_view(i, kMaster); }

  // One optimizer step over every slice. `grads[i]`: parameter i's gradient (1-D);
  // `updated(i, offset, values)` runs for each piece of each parameter right after its slice was
  // stepped, with the new fp32 values of elements [offset, offset + values.numel()).
  using Updated = std::function<void(size_t, int64_t, const at::Tensor&)>;
  void step(const dtk_optimizer_ref* optimizer, const dtk_optimizer_step_args& args,
            const std::vector<at::Tensor>& grads, const Updated& updated);

  int64_t buffer_bytes() const { return buffer_.defined() ? static_cast<int64_t>(buffer_.nbytes()) : 0; }
  int64_t file_bytes() const { return file_bytes_; }
  std::string describe() const;  // where the state lives and how it moves (one log line)

 private:
  enum Kind { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };
  struct Piece {  // elements [offset, offset + numel) of parameter `param`, in one slice
    size_t param;
    int64_t offset;  // into the parameter
    int64_t numel;
    int64_t at;  // into each kind's part of a buffer half
  };
  struct Slice {
    int64_t first;  // elements [first, first + numel) of each kind's region of the file
    int64_t numel;
    std::vector<Piece> pieces;
  };
  struct Moments {  // the optimizer's live state, from its state_save
    int64_t step = -1;
    std::vector<at::Tensor> exp_avg, exp_avg_sq;
  };
  struct Mapping;

  void plan_slices(const std::vector<int64_t>& numels, int64_t buffer_bytes);
  float* file_ptr(size_t i, Kind kind) const;
  at::Tensor file_view(size_t i, Kind kind) const;
  at::Tensor slot_view(const Piece& p, Kind kind, int slot) const;
  void transfer_slice(bool write, int slot, const Slice& slice);
  float* slot_base(int slot) const;
  Moments moments(const dtk_optimizer_ref* optimizer) const;
  void set_step(const dtk_optimizer_ref* optimizer, int64_t step) const;
  // The optimizer's moments of parameter i become `m`/`v`'s storage, its values copied there first
  // when they are elsewhere (a loaded checkpoint's, or the ones a first step just created).
  void take_moments(Moments& held, size_t i, const at::Tensor& m, const at::Tensor& v);
  void bind_to_file(const dtk_optimizer_ref* optimizer);

  std::vector<int64_t> numel_, start_;  // per parameter: elements, first element in each kind's region
  std::vector<std::string> names_;
  std::vector<Slice> slices_;
  std::vector<at::Tensor> params_;
  std::vector<char> has_moments_;  // per parameter: its moments are in the file
  int64_t file_bytes_ = 0, region_numel_ = 0;  // region: one kind of state, every parameter (padded)
  int64_t slot_numel_ = 0, part_numel_ = 0;    // a buffer half; each kind's part of it
  std::unique_ptr<AsyncFile> file_;
  std::shared_ptr<Mapping> mapping_;
  at::Tensor buffer_;         // both halves (host memory of the DTK allocator)
  float* aligned_ = nullptr;  // the first half's start, on AsyncFile::kAlign
  bool checked_ = false;      // the optimizer steps its moments in place (checked on a slice whose moments existed)
};

// `dir`/dtk-zero-<kind>-<host>-<pid>-<rank_tag>.swap (kind: optimizer or params).
std::string swap_file_path(const std::string& dir, const std::string& kind, const std::string& rank_tag);

// Removes the swap files (optimizer and params) in `dir` left by processes of this host that are gone (a killed run);
// returns what it removed. Another live run's files are left alone.
std::vector<std::string> remove_stale_swap_files(const std::string& dir);

}  // namespace dtk::zero
