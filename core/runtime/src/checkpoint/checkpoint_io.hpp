// Checkpoint files (internal to dtk_core): names, synced writes, pickles read with one-line errors,
// and the SHA256SUMS manifest. Shared by the save/load protocol (checkpoint.cpp) and the catalog
// (checkpoint_catalog.cpp: listing, completeness, rotation, inspect).
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <dtk/pipeline_split.hpp>
#include <dtk/tensor.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dtk/core/checkpoint/checkpoint_catalog.hpp"
#include "dtk/core/checkpoint/checkpoint_shards.hpp"

namespace dtk::core::ckpt {

constexpr const char* kModelFile = "model_optim_rng.pt";
// sha256sum's format: "<64 hex digits>  <path relative to the iteration directory>" per line.
constexpr const char* kChecksumsFile = "SHA256SUMS";

std::string first_line(const std::string& s);
// The bytes of a checkpoint file; false when it does not exist. Anything else that keeps it from
// being read (a directory in its place, no permission, an I/O error) is one HostError line naming
// the file and the reason: the one path every checkpoint file is read through.
bool read_file_bytes(const std::string& path, std::string* bytes);
// "mp_rank_03" (one pipeline stage) or Megatron's "mp_rank_03_001" (tensor-parallel rank 3 of
// pipeline stage 1, with pp_size > 1), with Megatron's "_002" after it for expert-parallel rank 2
// (ep_size > 1); "optim_dp_rank_001.pt".
std::string mp_rank_dir(int tp_rank, int pp_rank = 0, int pp_size = 1, int ep_rank = 0, int ep_size = 1);
// The directory of tensor-parallel rank 0 of the first stage in `iter_dir`: "mp_rank_00", or
// "mp_rank_00_000" when the checkpoint has pipeline stages or expert parallelism, or
// "mp_rank_00_000_000" with both.
std::string first_rank_dir(const std::string& iter_dir);
// Why `iter_dir` cannot be read when it is Megatron's distributed checkpoint (--ckpt-format
// torch_dist: metadata.json and .distcp files, no mp_rank_* directories), naming Megatron's
// conversion to its torch format; empty otherwise.
std::string megatron_distributed_checkpoint(const std::string& iter_dir);
// The expert-parallel size the first rank's main file records (1 when it records none; -1 when it
// cannot be read: the caller's own read then says why). Each expert-parallel rank's directory holds its own
// experts (read_stage_model joins them).
int64_t saved_expert_parallel_size(const std::string& iter_dir);
// The layers' split over the pipeline stages in a main file: Megatron's argument names
// (decoder_first_pipeline_num_layers, ...), written only for a split that is not the even one, so
// an even split's file is as before. Reading gives `stages` and `chunks` from the caller.
void insert_pipeline_split(c10::impl::GenericDict& d, const PipelineSplit& split);
PipelineSplit read_pipeline_split(const c10::impl::GenericDict& d, int32_t stages, int32_t chunks);
std::string shard_file_name(int dp_rank);
// "<host>-<pid>": the suffix of a process's temporary names (`iter_N.tmp-HOST-PID`).
std::string temp_owner(int64_t pid);

void fsync_path(const std::string& path, bool directory);
// Writes and fsyncs; a full disk says how much the file needed and how much was free.
void write_file_synced(const std::string& path, const char* data, size_t size);

// Atomically puts directory `from` at `to`: a rename, or an exchange when `to` exists (then `from`
// holds the old one, for the caller to remove).
void move_into_place(const std::string& from, const std::string& to);
// latest_checkpointed_iteration.txt of `save_dir` := iteration, through a temporary file, fsync, rename.
void write_tracker(const std::string& save_dir, int64_t iteration);

struct Written {
  int64_t bytes = 0;
  std::string sha256;
};
// Pickles `value` (torch.save's zip format) into `path`, synced.
Written write_pickle(const std::string& path, const c10::IValue& value);

// The manifest of one iteration directory. `present` is false for checkpoints written before DTK
// recorded checksums (and Megatron's own): those load unverified.
struct Checksums {
  bool present = false;
  std::map<std::string, std::string> sha256;  // relative path -> hex digest
  // What a damage message names to read the file anyway: train's config field (ChecksumCheck's
  // default), or the offline commands' --noverify.
  std::string skip_hint = ChecksumCheck{}.skip_hint;
};
// The manifest when `verify` (else none: the files read unverified), its messages naming `skip_hint`.
Checksums checksums_to_check(const std::string& iter_dir, bool verify, const std::string& skip_hint);
// Throws naming the file when it exists but is not a sha256sum manifest.
Checksums read_checksums(const std::string& iter_dir);

// Publishes iteration `iteration` of `save_dir` written by one process (`dtk import`, `dtk
// checkpoint convert`): rank_files[(pp * ep_size + ep) * tp_size + tp] goes to
// mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt (the stage suffix with pp_size > 1, the expert-parallel
// one with ep_size > 1) in a temporary directory, with SHA256SUMS, then the
// directory is moved into place and the tracker rewritten, as a training save does. Returns the
// bytes written.
int64_t write_offline_checkpoint(const std::string& save_dir, int64_t iteration,
                                 const std::vector<c10::impl::GenericDict>& rank_files, int tp_size = 0,
                                 int pp_size = 1, int ep_size = 1);

// Reads a pickled dict, one line naming the file for anything wrong with it. With `sums` holding a
// manifest, the bytes are checked against the digest recorded for `relative` first.
c10::impl::GenericDict read_pickled_dict(const std::string& file, const std::string& hint = "",
                                         const Checksums* sums = nullptr, const std::string& relative = "");

// A pickled dict of tensors (`key` of `file`, for the error) as a list, in its order.
TensorList from_dict(const c10::IValue& v, const std::string& file, const char* key);
// How a checkpoint's model lies in its directories: with pipeline stages (mp_rank_TT_PPP[_EEE])
// or not, and over how many expert-parallel ranks. One stage with expert parallelism names its
// directories mp_rank_TT_EEE, the pipeline's form: the first rank's main file tells them apart (read
// once, checked against `sums`; what is wrong with it is the error).
struct StageDirs {
  bool staged = false;
  int64_t ep = 1;
};
StageDirs saved_stage_dirs(const std::string& iter_dir, const Checksums& sums);
// The model entries of tensor-parallel rank `tp_rank` of a one-stage checkpoint over `ep_size`
// expert-parallel ranks (saved_stage_dirs): its main file's, or those of every expert-parallel
// rank's directory joined (each holds its own routed experts under their names in the whole layer,
// "experts.<i>.", and the same dense tensors: expert-parallel rank 0's are kept). Every file is
// checked against `sums`. `first`, when given, gets the first main file read (its layout entries).
// `hint` is added to a missing file's error.
TensorList read_stage_model(const std::string& iter_dir, int tp_rank, int64_t ep_size, const Checksums& sums,
                            c10::impl::GenericDict* first = nullptr, const std::string& hint = "");
// What each optimizer tensor of a shard file covers: name -> [offset, numel, full_numel].
c10::Dict<std::string, at::Tensor> slices_to_dict(const SliceMap& slices);
SliceMap slices_from_dict(const TensorList& list, const std::string& file);

// One data-parallel shard file of a ZeRO save (`shard_file_name(dp_rank)` in the tensor-parallel
// rank's directory `rank_dir`; the save had `shards` of them), verified against `sums`.
struct Shard {
  TensorList optimizer, strategy;
  SliceMap slices;  // what its per-parameter entries cover
};
Shard read_shard(const std::string& rank_dir, int dp_rank, int64_t shards, const Checksums& sums);

// Why `dir`, expected to be a directory, is not one: " is not a directory" (something else is
// there) or " does not exist".
std::string not_a_directory(const std::string& dir);

}  // namespace dtk::core::ckpt
