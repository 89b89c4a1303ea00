// dtk/core/checkpoint/checkpoint_catalog.hpp — what a save directory holds: its iterations, whether each is
// complete, rotation (checkpoint.keep_last), the candidates of checkpoint.fallback, and the report
// of `dtk checkpoint inspect`.
//
// Complete means: the iteration directory has its SHA256SUMS manifest (written last, before the
// directory is renamed into place) and every file the manifest lists, and — when hashing is asked
// for — each file's SHA-256 equals the recorded one. A directory without a manifest (written by
// Megatron, or by DTK before checksums) counts as complete when mp_rank_00/model_optim_rng.pt
// exists; it is then reported as unverified.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <dtk/tensor.hpp>

namespace dtk::core {

// The iteration latest_checkpointed_iteration.txt names; one line naming the file otherwise.
int64_t read_checkpoint_tracker(const std::string& dir);

// Iterations with an iter_NNNNNNN directory in `dir` (complete or not), ascending.
std::vector<int64_t> list_checkpoint_iterations(const std::string& dir);

// The iteration a load of save directory `dir` starts from: its tracker's (one that holds no
// iteration number throws, as for training's load), else `newest`, its newest iteration.
int64_t tracked_or_newest_iteration(const std::string& dir, int64_t newest);

struct IterationState {
  bool complete = false;
  bool checksummed = false;  // it has a SHA256SUMS manifest
  std::string problem;       // why it is not complete
};
IterationState check_checkpoint_iteration(const std::string& dir, int64_t iteration, bool hash_files);

// The one verdict on iteration `iteration` of save directory `dir`, shared by `dtk checkpoint
// inspect`, every load and checkpoint.fallback's choice: "" when it is complete (above), else why
// not, one line naming the file.
std::string checkpoint_verdict(const std::string& dir, int64_t iteration, bool hash_files);
// Throws that verdict (without hashing) as one line: "checkpoint: iteration N of DIR is incomplete: ...".
void require_complete_iteration(const std::string& dir, int64_t iteration);

// The newest iteration below `before` (any, when before < 0) that is complete without hashing (the
// load that follows verifies the checksums); -1 if none.
int64_t older_complete_iteration(const std::string& dir, int64_t before);

// checkpoint.keep_last: removes every iteration but the `keep_last` highest-numbered ones and the
// one the tracker names; returns the removed iterations. Each directory is first renamed to a
// temporary name of this process, so a removal cut short is cleaned up like a crashed save's.
std::vector<int64_t> rotate_checkpoints(const std::string& dir, int64_t keep_last);

// PATH as `dtk export`, `generate` and `checkpoint convert` take it: an iter_NNNNNNN directory, or a
// save directory (its tracker's iteration, else its newest; a tracker that holds no iteration number
// is an error, as for training's load). `verify`: the iteration must pass checkpoint_verdict, every
// file its manifest lists there (for readers of the whole checkpoint; generate and export read the
// model files only, which read_model_state verifies). Returns the iteration directory; one line
// naming PATH otherwise.
std::string resolve_iteration_dir(const std::string& path, int64_t* iteration = nullptr, bool verify = true);

// Whether a reader checks each file against the iteration's SHA256SUMS, and what its message on a
// damaged file names to read it anyway: dtk train's config field, or the offline commands' flag.
struct ChecksumCheck {
  bool verify = true;
  std::string skip_hint = "checkpoint.no_verify_checksums=true";
};
inline ChecksumCheck offline_checksum_check(bool verify) { return {verify, "--noverify"}; }

// The run configuration (text format) recorded in an iteration's mp_rank_00 file, verified
// against SHA256SUMS as `check` says; throws when the file is damaged or has none.
std::string checkpoint_config_text(const std::string& iter_dir, const ChecksumCheck& check);

// Tensor-parallel rank `tp_rank`'s model tensors of iteration directory `iter_dir` (the "model"
// dict of its mp_rank file), verified against SHA256SUMS when `verify`: what `dtk generate` loads.
TensorList read_model_state(const std::string& iter_dir, int tp_rank, bool verify);

struct InspectOptions {
  bool verify = true;        // hash every file against SHA256SUMS
  bool all_tensors = false;  // list optimizer and strategy tensors too, not only the model's
};
// `dtk checkpoint inspect PATH`: PATH is a save directory (its tracker's iteration, else its
// newest) or one iteration directory. Writes the report to `out`; returns "" when the inspected
// iteration is complete, else why not (one line).
std::string inspect_checkpoint(const std::string& path, const InspectOptions& options, std::ostream& out);

}  // namespace dtk::core
