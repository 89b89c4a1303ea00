// dtk/core/checkpoint/checkpoint_shards.hpp — re-partitioning optimizer and strategy state on load.
//
// A strategy whose state is sharded over data-parallel ranks (ZeRO; abi.h dtk_strategy_info.
// sharded_state) hands the optimizer 1-D shards of parameters; each shard is described by
// dtk_param_info.shard_offset/full_numel, and every state entry that belongs to one parameter
// carries the parameter's name in its key ("g0.<name>.exp_avg", "master.<name>") and holds that
// shard's elements. A replicated strategy (ddp) holds whole parameters under the same names.
//
// So state can move between layouts: the loading rank states which run of each parameter it
// needs (its optimizer's parameters), the saved files are read one at a time, and every entry's
// overlap with what is needed is copied into place. That covers resuming at another
// data-parallel size and switching between ddp and zero, with memory for this rank's own state
// plus one saved file. Entries that belong to no parameter (an optimizer's "step") are taken from
// the first file that has them.
#pragma once

#include <dtk/model.hpp>

#include <map>
#include <string>
#include <vector>

namespace dtk::core {

// One rank's run of a parameter: elements [offset, offset + numel) of the flattened parameter of
// full_numel elements.
struct ParamSlice {
  int64_t offset = 0, numel = 0, full_numel = 0;
  bool operator==(const ParamSlice& o) const {
    return offset == o.offset && numel == o.numel && full_numel == o.full_numel;
  }
};
using SliceMap = std::map<std::string, ParamSlice>;

// What an optimizer's parameters cover (a whole parameter when its info has no shard).
SliceMap slices_of(const std::vector<Param>& optimizer_params);

// Finds the parameter a state key belongs to: the longest name of `names` that appears in `key`
// between '.'-separated segments ("g0.<name>.exp_avg", "master.<name>"). Empty when none does.
std::string param_of_key(const std::string& key, const std::map<std::string, ParamSlice>& names);

class StateAssembler {
 public:
  // `wanted`: the loading rank's optimizer parameters (names, shard infos, tensor shapes);
  // `model_params`: every parameter name of the model (a replicated save lists none, and an entry
  // of a parameter this rank does not step must still be recognised as one).
  StateAssembler(const std::vector<Param>& wanted, const std::vector<std::string>& model_params);
  // One saved rank's state. `saved` describes what it held; an entry of a parameter it does not
  // list is a whole parameter (a replicated save).
  void add(const TensorList& optimizer, const TensorList& strategy, const SliceMap& saved);
  // The assembled state, per-parameter entries shaped like the loading optimizer's tensors. Throws
  // naming the first entry that only part of the saved files covered. A parameter that lacks a
  // kind of state the others have (no "exp_avg" for it) is logged as a warning: it starts fresh.
  TensorList optimizer() const { return finish(optimizer_); }
  TensorList strategy() const { return finish(strategy_); }

 private:
  struct Entry {
    std::string param;   // empty: not a per-parameter entry
    at::Tensor value;
    int64_t covered = 0;
  };
  struct Entries {
    std::vector<std::pair<std::string, Entry>> list;  // in first-seen order
    std::map<std::string, size_t> index;              // key -> position in list
  };
  void add_to(Entries& out, const TensorList& saved_state, const SliceMap& saved);
  TensorList finish(const Entries& entries) const;
  void warn_missing(const Entries& entries) const;

  SliceMap wanted_;
  SliceMap names_;  // every parameter name (values unused)
  std::map<std::string, std::vector<int64_t>> shape_;  // per parameter: the optimizer tensor's shape
  Entries optimizer_, strategy_;
};

}  // namespace dtk::core
