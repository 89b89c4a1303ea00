// layout.hpp — where every parameter element lives under ZeRO: the bucketed flat layout and each
// data-parallel rank's partition of it. Plain arithmetic, no tensors.
//
// The parameters are laid out in the order their gradients become ready in backward (the reverse
// of the modules' forward order) and cut into buckets of about `bucket_numel` elements (a
// parameter is never split across buckets). ZeRO-3's on-demand parameters come first, grouped by
// the module whose gradient completes them (the lowest module reading them; a tied weight goes
// with the embedding), and a bucket never mixes two such groups: a module is gathered by gathering
// the buckets of every parameter it reads. Each bucket is padded to a multiple of N x 16 elements
// (N = data-parallel size) and split into N equal, contiguous chunks: rank r owns chunk r of every
// bucket, which is what a reduce-scatter of the bucket gives it and what it contributes to the
// bucket's all-gather. This is Megatron's distributed-optimizer layout (buckets partitioned, not
// the whole buffer), so every collective is one bucket, balanced over the ranks. A rank's
// partition is the concatenation of its chunks, in bucket order.
//
// A tied embedding under pipeline stages fills a bucket alone (LayoutParam.own_bucket).
//
// Expert parallelism: the routed experts' weights differ between expert-parallel ranks, so they
// fill buckets of their own (one open bucket per kind, so an MoE layer does not cut the dense
// buckets short), split over the expert-data-parallel group (the ranks holding the same experts,
// N_e of them) instead: rank r owns chunk r_e of those, its rank in that group. Megatron's
// distributed optimizer shards its expert buffers the same way.
//
//   flat:       | bucket 0: chunk0 chunk1 ... chunkN-1 | bucket 1: chunk0 ... | ...
//   partition r:| bucket 0 chunk r | bucket 1 chunk r | ...
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtk::zero {

struct LayoutParam {
  std::string name;
  int64_t numel = 0;
  // The module whose post_backward completes this parameter's gradient: the lowest-index module
  // that reads it (backward runs modules in reverse). -1: no module reads it (its gradient is
  // collected when backward ends).
  int32_t ready_module = -1;
  // ZeRO-3: gathered around the modules that read it, released otherwise. False: always whole
  // (stages 1 and 2; ZeRO-3 parameters at or below the persistence threshold).
  bool on_demand = false;
  // A routed expert's weight under expert parallelism: split over the expert-data-parallel group.
  bool expert = false;
  // A bucket of its own: the tied word embedding under pipeline stages, so that the first and the
  // last stage partition it alike (rank r owns the same elements of both copies) and their
  // shards' gradients can be summed over the pipeline group after the reduce-scatter (Megatron's
  // distributed optimizer puts the shared embedding in its own bucket for the same reason).
  bool own_bucket = false;
};

struct Slot {
  size_t param = 0;     // index into the layout's params
  int64_t offset = 0;   // first element within the bucket
  int64_t numel = 0;
};

struct Bucket {
  std::vector<Slot> slots;
  int64_t numel = 0;             // padded: a multiple of split x kChunkAlign
  int64_t chunk = 0;             // numel / split: what each rank owns of it
  int split = 1;                 // the ranks it is split over: the dp size, or expert_dp for experts
  bool expert = false;           // routed experts' weights (expert parallelism)
  int64_t flat_offset = 0;       // of the bucket in the flat layout
  int64_t partition_offset = 0;  // of a rank's chunk in that rank's partition
  bool on_demand = false;
  int32_t ready_module = -1;     // the lowest ready module of its parameters (-1: some have none)
};

// The run of one parameter that a rank owns (a ZeRO shard, abi.h dtk_param_info.shard_offset).
struct Shard {
  size_t param = 0;
  size_t bucket = 0;
  int64_t param_offset = 0;      // first element of the parameter (flattened) in this shard
  int64_t numel = 0;
  int64_t partition_offset = 0;  // where the shard starts in the rank's partition
};

constexpr int64_t kChunkAlign = 16;  // 64-byte aligned fp32 chunks (SIMD-friendly optimizer runs)

class Layout {
 public:
  // `params` in the model's order; the layout orders them itself. bucket_numel >= 1. expert_dp:
  // the expert-data-parallel size that experts' buckets are split over (it divides dp_size; 0:
  // dp_size, as without expert parallelism).
  Layout(std::vector<LayoutParam> params, int dp_size, int64_t bucket_numel, int expert_dp = 0);

  const std::vector<LayoutParam>& params() const { return params_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  int dp_size() const { return dp_; }
  int expert_dp_size() const { return expert_dp_; }
  int64_t flat_numel() const { return flat_numel_; }
  int64_t partition_numel() const { return partition_numel_; }
  // Where parameter p starts in the flat layout, and its bucket.
  int64_t flat_offset(size_t p) const { return flat_offset_[p]; }
  size_t bucket_of(size_t p) const { return bucket_of_[p]; }
  // The shards of data-parallel rank `rank`, whose rank in the expert-data-parallel group is
  // `expert_rank` (the same without expert parallelism), in partition order.
  std::vector<Shard> shards(int rank, int expert_rank) const;
  // (Data-parallel rank d is expert-data-parallel rank d / (dp / expert_dp): launch/distributed.cpp.)
  std::vector<Shard> shards(int rank) const { return shards(rank, rank / (dp_ / expert_dp_)); }

 private:
  std::vector<LayoutParam> params_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> flat_offset_;
  std::vector<size_t> bucket_of_;
  int dp_, expert_dp_;
  int64_t flat_numel_ = 0, partition_numel_ = 0;
};

}  // namespace dtk::zero
