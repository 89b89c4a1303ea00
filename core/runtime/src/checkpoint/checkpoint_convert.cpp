// A checkpoint for another tensor-parallel size: see dtk/core/checkpoint/checkpoint_convert.hpp.
#include "dtk/core/checkpoint/checkpoint_convert.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "checkpoint_io.hpp"
#include "dtk/core/checkpoint/checkpoint.hpp"
#include "dtk/core/checkpoint/checkpoint_shards.hpp"
#include "dtk/host/error.hpp"

namespace dtk::core {

namespace fs = std::filesystem;
using host::HostError;

namespace {

using TensorMap = std::map<std::string, at::Tensor>;

TensorMap tensors_of(const c10::impl::GenericDict& d, const char* key, const std::string& file) {
  auto it = d.find(c10::IValue(std::string(key)));
  if (it == d.end() || !it->value().isGenericDict()) throw HostError("checkpoint " + file + " has no '" + key + "' dict");
  TensorMap out;
  for (const auto& kv : it->value().toGenericDict())
    if (kv.key().isString() && kv.value().isTensor()) out[kv.key().toStringRef()] = kv.value().toTensor();
  return out;
}

c10::Dict<std::string, at::Tensor> to_dict(const std::vector<std::pair<std::string, at::Tensor>>& list) {
  c10::Dict<std::string, at::Tensor> d;
  for (const auto& [name, t] : list) d.insert(name, t.contiguous());
  return d;
}

// Rank `rank`'s piece of `whole` along `dim` for a target of `shape`: rows [rank*t, (rank+1)*t) of
// the whole, zero-filled past its end (a padded vocabulary that grew).
at::Tensor piece(const at::Tensor& whole, int dim, int rank, const at::Tensor& target, const std::string& name) {
  std::vector<int64_t> shape = target.sizes().vec();
  if (dim < 0) {
    if (whole.sizes().vec() != shape)
      throw HostError("checkpoint convert: '" + name + "' has another shape in the checkpoint than the model builds");
    return whole.to(target.scalar_type());
  }
  for (int64_t d = 0; d < whole.dim(); ++d)
    if (d != dim && (d >= static_cast<int64_t>(shape.size()) || whole.size(d) != shape[d]))
      throw HostError("checkpoint convert: '" + name + "' has another shape in the checkpoint than the model builds");
  const int64_t t = shape[dim], begin = rank * t;
  at::Tensor out = at::zeros(shape, whole.options().dtype(target.scalar_type()));
  const int64_t have = std::max<int64_t>(0, std::min<int64_t>(t, whole.size(dim) - begin));
  if (have > 0) out.narrow(dim, 0, have).copy_(whole.narrow(dim, begin, have));
  return out;
}

}  // namespace

std::map<std::string, int> partition_dims(const std::vector<Param>& params) {
  std::map<std::string, int> out;
  for (const Param& p : params) out[p.name] = p.info.tensor_parallel ? p.info.partition_dim : -1;
  return out;
}

at::Tensor merge_partitions(const std::vector<std::map<std::string, at::Tensor>>& ranks, const std::string& name,
                            int dim, const std::string& who) {
  std::vector<at::Tensor> parts;
  for (size_t r = 0; r < ranks.size(); ++r) {
    auto it = ranks[r].find(name);
    if (it == ranks[r].end())
      throw HostError(who + ": the checkpoint has no tensor '" + name + "'" +
                      (ranks.size() > 1 ? " on tensor-parallel rank " + std::to_string(r) : std::string()));
    parts.push_back(it->second);
  }
  return dim < 0 || parts.size() == 1 ? parts[0] : at::cat(parts, dim);
}

namespace {

// A parameter's name in the whole model from its name on pipeline stage `stage` (Megatron's
// convention, which the shipped models follow: each stage numbers its layers from 0, so
// "...layers.<i>..." on stage s is layer offset(s) + i, the offsets of the layout's split,
// dtk/pipeline_split.hpp; the last stage's copy of a tied weight is the first stage's). Names
// without a layer index are the same everywhere.
struct StageNames {
  std::vector<int64_t> offsets;       // each stage's first layer
  std::string tied_first, tied_copy;  // the tied weight on the first stage, its copy on the last

  std::string global(const std::string& local, int stage) const {
    if (!tied_copy.empty() && local == tied_copy) return tied_first;
    static const std::string kLayers = "layers.";
    const size_t at = local.find(kLayers);
    if (stage == 0 || at == std::string::npos) return local;
    const size_t digits = at + kLayers.size();
    size_t end = digits;
    while (end < local.size() && std::isdigit(static_cast<unsigned char>(local[end]))) ++end;
    if (end == digits || end >= local.size() || local[end] != '.') return local;
    const int64_t i = std::stoll(local.substr(digits, end - digits)) + offsets.at(static_cast<size_t>(stage));
    return local.substr(0, digits) + std::to_string(i) + local.substr(end);
  }
};

// The tied weight of the first stage and its copy on the last stage (dtk_param_info.shared), by
// the models of those stages.
void find_tied(StageNames& n, const std::vector<Param>& first, const std::vector<Param>& last, int stages) {
  if (stages <= 1) return;
  std::vector<std::string> a, b;
  for (const Param& p : first)
    if (p.info.shared) a.push_back(p.name);
  for (const Param& p : last)
    if (p.info.shared) b.push_back(p.name);
  if (a.size() > 1 || b.size() > 1 || a.size() != b.size())
    throw HostError("checkpoint convert: the model's tied weights (dtk_param_info.shared) are not one on the first "
                    "and one on the last pipeline stage (" + std::to_string(a.size()) + " and " +
                    std::to_string(b.size()) + "): cannot tell which copy is which");
  if (!a.empty()) n.tied_first = a[0], n.tied_copy = b[0];
}

}  // namespace

namespace {


// The entries of `m` under `prefix`, the prefix taken off.
TensorMap under_prefix(const TensorMap& m, const std::string& prefix) {
  TensorMap out;
  for (const auto& [name, t] : m)
    if (name.compare(0, prefix.size(), prefix) == 0) out[name.substr(prefix.size())] = t;
  return out;
}

}  // namespace

namespace {

// A parallel layout: tensor-parallel size, pipeline size, model chunks per pipeline rank, the
// layers' split over the stages and the expert-parallel size. Stages of the (virtual) pipeline:
// chunk k of pipeline rank r is stage k x pp + r of pp x v.
struct Layout {
  int64_t tp = 1, pp = 1, v = 1, ep = 1;
  PipelineSplit rule;  // its first/last layers and counted embedding/loss; stages and chunks below
  int64_t stages() const { return pp * v; }
  PipelineSplit split() const {
    PipelineSplit s = rule;
    s.stages = static_cast<int32_t>(stages()), s.chunks = static_cast<int32_t>(v);
    return s;
  }
};

using StateEntries = std::vector<std::tuple<std::string, std::string, at::Tensor>>;  // key, param, value

// The layout the checkpoint was saved with (its first file says), and its iteration.
Layout read_saved_layout(const std::string& iter_dir, const ckpt::Checksums& sums, int64_t* iteration) {
  Layout old;
  old.pp = ckpt::first_rank_dir(iter_dir) != ckpt::mp_rank_dir(0) ? 2 : 1;
  const std::string relative = ckpt::first_rank_dir(iter_dir) + "/" + ckpt::kModelFile;
  const std::string file = (fs::path(iter_dir) / relative).string();
  const auto d = ckpt::read_pickled_dict(file, "", &sums, relative);
  auto tp = d.find(c10::IValue(std::string("tensor_model_parallel_size")));
  if (tp == d.end() || !tp->value().isInt() || tp->value().toInt() < 1)
    throw HostError("checkpoint " + file + " records no tensor_model_parallel_size");
  old.tp = tp->value().toInt();
  auto ep = d.find(c10::IValue(std::string("expert_model_parallel_size")));
  if (ep != d.end() && ep->value().isInt()) old.ep = std::max<int64_t>(1, ep->value().toInt());
  auto pp = d.find(c10::IValue(std::string("pipeline_model_parallel_size")));
  if (pp != d.end() && pp->value().isInt()) old.pp = std::max<int64_t>(1, pp->value().toInt());
  auto v = d.find(c10::IValue(std::string("virtual_pipeline_model_parallel_size")));
  if (v != d.end() && v->value().isInt()) old.v = std::max<int64_t>(1, v->value().toInt());
  auto it = d.find(c10::IValue(std::string("iteration")));
  *iteration = it != d.end() && it->value().isInt() ? it->value().toInt() : 0;
  old.rule = ckpt::read_pipeline_split(d, static_cast<int32_t>(old.stages()), static_cast<int32_t>(old.v));
  return old;
}

// The layout asked for: 0 keeps the checkpoint's size; model chunks per rank are kept with the
// pipeline size, else one unless asked; the split is kept with both, else even unless asked.
Layout resolve_new_layout(const Layout& old, const ConvertTarget& target) {
  Layout nl;
  nl.tp = target.tp == 0 ? old.tp : target.tp;
  nl.pp = target.pp == 0 ? old.pp : target.pp;
  nl.v = target.v == 0 ? (nl.pp == old.pp ? old.v : 1) : target.v;
  nl.ep = target.ep == 0 ? old.ep : target.ep;
  if (nl.v > 1 && nl.pp < 2)
    throw HostError("checkpoint convert: --virtual_pipeline_model_parallel_size " + std::to_string(nl.v) +
                    " (the interleaved schedule) needs --pipeline_model_parallel_size 2 or more");
  if (target.split)
    nl.rule = *target.split;
  else if (nl.pp == old.pp && nl.v == old.v)
    nl.rule = old.rule;
  return nl;
}

// Names on each stage <-> names in the whole model, for a layout's stages.
StageNames stage_names(const ModelAtLayout& build, int64_t layers, const Layout& layout) {
  StageNames names;
  for (const StageLayers& stage : pipeline_stage_layers(layout.split(), layers)) names.offsets.push_back(stage.offset);
  const int stages = static_cast<int>(layout.stages());
  find_tied(names, build(0, 1, 0, layout.split(), 0, 1)->parameters(),
            build(0, 1, stages - 1, layout.split(), 0, 1)->parameters(), stages);
  return names;
}

// The checkpoint being converted.
struct Source {
  const std::string& iter_dir;
  const ckpt::Checksums& sums;
  const ModelAtLayout& build;
  Layout old;
  StageNames names;
};

// The whole model gathered from the old layout, under the whole model's names.
struct WholeModel {
  TensorMap model;
  std::map<std::string, int> dim;  // whole-model name -> partition dim
  StateEntries optimizer, strategy;
  std::set<std::string> seen_keys;
  std::vector<c10::impl::GenericDict> first_files;  // stage 0's, kept for the progress entries
};

// One old pipeline rank's tensor-parallel ranks: model, optimizer and strategy state.
struct RankStates {
  std::vector<TensorMap> model, optimizer, strategy;
};

// One rank of the old layout: pipeline rank `pp`, tensor-parallel rank `tp`, expert-parallel rank
// `ep`.
struct OldRank {
  int64_t pp = 0, tp = 0, ep = 0;
};

std::string old_rank_dir(const Source& src, const OldRank& at) {
  return ckpt::mp_rank_dir(static_cast<int>(at.tp), static_cast<int>(at.pp), static_cast<int>(src.old.pp),
                           static_cast<int>(at.ep), static_cast<int>(src.old.ep));
}

// The model of chunk `chunk` of old rank `at`.
std::unique_ptr<ModelInstance> old_chunk_model(const Source& src, const OldRank& at, int64_t chunk) {
  return src.build(static_cast<int>(at.tp), static_cast<int>(src.old.tp), static_cast<int>(chunk * src.old.pp + at.pp),
                   src.old.split(), static_cast<int>(at.ep), static_cast<int>(src.old.ep));
}

// The parameters of old rank `at`'s chunks (prefixed as the file names them).
std::vector<Param> old_rank_params(const Source& src, const OldRank& at) {
  std::vector<Param> params;
  for (int64_t k = 0; k < src.old.v; ++k)
    for (Param& p : old_chunk_model(src, at, k)->parameters()) {
      p.name = ModelInstance::chunk_prefix(k, src.old.v) + p.name;
      params.push_back(std::move(p));
    }
  return params;
}

// ZeRO: the data-parallel shards of old rank `at` consolidated into whole parameters' state (the
// layout ddp saves; a ZeRO run loading it shards it again, dtk/core/checkpoint/checkpoint_shards.hpp).
// Under expert parallelism data-parallel rank k's shard is in expert-parallel rank k % E's
// directory, with its share of the dense parameters and of that rank's experts (partitioned over
// the ranks k' with k' % E = k % E). Expert-parallel rank 0 reads every shard (the dense
// parameters and the step come from it); the others only their experts' shards.
void consolidate_shards(const Source& src, const OldRank& at, int64_t shards, RankStates& st) {
  std::vector<Param> params = old_rank_params(src, at);
  std::vector<std::string> names;
  for (const Param& p : params) names.push_back(p.name);
  if (at.ep > 0)
    params.erase(
        std::remove_if(params.begin(), params.end(), [](const Param& p) { return !dtk::is_routed_expert(p.info); }),
        params.end());
  StateAssembler whole(params, names);
  const std::string rank_dir = (fs::path(src.iter_dir) / old_rank_dir(src, at)).string();
  for (int64_t k = 0; k < shards; ++k) {
    if (at.ep > 0 && k % src.old.ep != at.ep) continue;
    const OldRank holder{at.pp, at.tp, k % src.old.ep};
    const std::string dir = (fs::path(src.iter_dir) / old_rank_dir(src, holder)).string();
    const ckpt::Shard shard = ckpt::read_shard(dir, static_cast<int>(k), shards, src.sums);
    whole.add(shard.optimizer, shard.strategy, shard.slices);
  }
  TensorMap o, s;
  try {
    for (auto& [key, value] : whole.optimizer()) o[key] = value;
    for (auto& [key, value] : whole.strategy()) s[key] = value;
  } catch (const std::exception& e) {
    throw HostError("checkpoint convert: " + rank_dir + ": " + ckpt::first_line(e.what()));
  }
  st.optimizer.push_back(std::move(o));
  st.strategy.push_back(std::move(s));
}

// Old pipeline rank `rank_pp`, expert-parallel rank `ep`: its tensor-parallel ranks' files
// (verified), sharded state consolidated.
RankStates read_old_rank(const Source& src, int64_t rank_pp, int64_t ep, WholeModel& whole, ConvertReport& report) {
  RankStates st;
  for (int64_t r = 0; r < src.old.tp; ++r) {
    const OldRank at{rank_pp, r, ep};
    const std::string relative = old_rank_dir(src, at) + "/" + ckpt::kModelFile;
    const std::string file = (fs::path(src.iter_dir) / relative).string();
    const auto d = ckpt::read_pickled_dict(file, "", &src.sums, relative);
    if (rank_pp == 0 && ep == 0) whole.first_files.push_back(d);
    st.model.push_back(tensors_of(d, "model", file));
    auto shards = d.find(c10::IValue(std::string("optimizer_shards")));
    if (shards == d.end()) {
      st.optimizer.push_back(tensors_of(d, "optimizer", file));
      st.strategy.push_back(tensors_of(d, "strategy", file));
      continue;
    }
    if (!shards->value().isInt() || shards->value().toInt() < 1)
      throw HostError("checkpoint " + file + ": 'optimizer_shards' is not a positive count");
    consolidate_shards(src, at, shards->value().toInt(), st);
    report.consolidated_shards = shards->value().toInt();
  }
  return st;
}

// Chunk `chunk` of old pipeline rank `at.pp`, expert-parallel rank `at.ep`: its parameters and
// their state made whole, under the whole model's names. Optimizer/strategy entries: a
// parameter's follow it (renamed); the others come from the first stage's tensor-parallel rank 0
// of expert-parallel rank 0. A tied weight's copy repeats the first stage's values, the dense
// parameters of another expert-parallel rank (the same values) expert-parallel rank 0's.
// `rank_names`: every parameter name of the rank (all its chunks).
void merge_old_chunk(const Source& src, const OldRank& at, int64_t chunk, const RankStates& st,
                     const SliceMap& rank_names, WholeModel& whole) {
  const int64_t stage = chunk * src.old.pp + at.pp;
  const std::string prefix = ModelInstance::chunk_prefix(chunk, src.old.v);
  const std::unique_ptr<ModelInstance> built = old_chunk_model(src, OldRank{at.pp, 0, at.ep}, chunk);
  const std::map<std::string, int> stage_dims = partition_dims(built->parameters());
  std::vector<TensorMap> chunk_model;
  for (const TensorMap& m : st.model) chunk_model.push_back(under_prefix(m, prefix));
  auto join = [&](const std::vector<TensorMap>& ranks, const std::string& name, int d) {
    return merge_partitions(ranks, name, d, "checkpoint convert");
  };
  for (const auto& [name, d] : stage_dims) {
    const std::string g = src.names.global(name, static_cast<int>(stage));
    whole.dim[g] = d;
    if (!whole.model.count(g)) whole.model[g] = join(chunk_model, name, d);
  }
  // The model's buffers (an MoE router's expert bias) are replicated: tensor-parallel rank 0's.
  // Other non-parameter state (the dropout generators) stays the new model's own.
  for (const Param& b : dtk::ModelHandle(built->ref()).buffers()) {
    const auto it = chunk_model[0].find(b.name);
    if (it == chunk_model[0].end()) continue;
    const std::string g = src.names.global(b.name, static_cast<int>(stage));
    whole.dim[g] = -1;
    if (!whole.model.count(g)) whole.model[g] = it->second;
  }
  auto add_state = [&](const std::vector<TensorMap>& ranks, StateEntries& out, const char* which) {
    for (const auto& [key, value] : ranks[0]) {
      const std::string param = param_of_key(key, rank_names);
      if (param.empty()) {
        if (stage == 0 && at.ep == 0) out.emplace_back(key, "", value);
        continue;
      }
      if (param.compare(0, prefix.size(), prefix) != 0) continue;  // another chunk's
      const std::string local = param.substr(prefix.size());
      const std::string g = src.names.global(local, static_cast<int>(stage));
      const size_t at = key.find(param);
      const std::string global_key = key.substr(0, at) + g + key.substr(at + param.size());
      if (!whole.seen_keys.insert(std::string(which) + global_key).second) continue;  // a tied copy's
      out.emplace_back(global_key, g, join(ranks, key, stage_dims.at(local)));
    }
  };
  add_state(st.optimizer, whole.optimizer, "o:");
  add_state(st.strategy, whole.strategy, "s:");
}

// One rank of the new layout: its parameters (by whole-model name), their names in its files,
// and its model tensors cut from the whole model.
struct NewRank {
  TensorMap target_params;                      // whole-model name -> this rank's parameter
  std::map<std::string, std::string> local_of;  // whole-model name -> name in this rank's files
  std::vector<std::pair<std::string, at::Tensor>> model;
};

// One rank of the new layout.
struct NewRankAt {
  int pp = 0, tp = 0, ep = 0;
};

NewRank cut_model(const ModelAtLayout& build, const Layout& nl, const StageNames& new_names, const WholeModel& whole,
                  const NewRankAt& at) {
  const int r = at.tp;
  NewRank nr;
  for (int chunk = 0; chunk < nl.v; ++chunk) {
    const int stage = chunk * static_cast<int>(nl.pp) + at.pp;
    const std::string prefix = ModelInstance::chunk_prefix(chunk, static_cast<int>(nl.v));
    std::unique_ptr<ModelInstance> m =
        build(r, static_cast<int>(nl.tp), stage, nl.split(), at.ep, static_cast<int>(nl.ep));
    for (const Param& p : m->parameters()) {
      const std::string g = new_names.global(p.name, stage);
      nr.target_params[g] = p.tensor;
      nr.local_of[g] = prefix + p.name;
    }
    for (const auto& [name, target] : m->state_save()) {
      const std::string g = new_names.global(name, stage);
      auto it = whole.model.find(g);
      if (it == whole.model.end() && nr.target_params.count(g))
        throw HostError("checkpoint convert: the checkpoint has no tensor '" + g + "'");
      // Not a parameter (the dropout generators): the new model's own.
      nr.model.emplace_back(prefix + name,
                            it == whole.model.end() ? target : piece(it->second, whole.dim.at(g), r, target, name));
    }
  }
  return nr;
}

// The state entries of new rank `nr` (tensor-parallel rank r): the ones of no parameter as they
// are, a parameter's cut like it (those of another stage's parameters left out).
std::vector<std::pair<std::string, at::Tensor>> cut_state(const StateEntries& entries, const NewRank& nr,
                                                          const WholeModel& whole, int r) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [key, param, value] : entries) {
    if (param.empty()) {
      out.emplace_back(key, value);
      continue;
    }
    auto local = nr.local_of.find(param);
    if (local == nr.local_of.end()) continue;  // a parameter of another stage or expert-parallel rank
    const size_t at = key.find(param);
    const std::string local_key = key.substr(0, at) + local->second + key.substr(at + param.size());
    const at::Tensor& target = nr.target_params.at(param);
    // State kept in another dtype than the parameter (fp32 masters of bf16 weights) stays so.
    out.emplace_back(local_key, piece(value, whole.dim.at(param), r, target.to(value.scalar_type()), local_key));
  }
  return out;
}

// The main file of new rank `at`: stage 0's progress entries, the new layout and config, the cut
// model and (consolidated: whole parameters') state.
c10::impl::GenericDict new_rank_file(const ModelAtLayout& build, const Layout& nl, const StageNames& new_names,
                                     const WholeModel& whole, const NewRankAt& at,
                                     const std::function<std::string(const ConvertReport&)>& config_text,
                                     ConvertReport& report) {
  const NewRank nr = cut_model(build, nl, new_names, whole, at);
  const auto new_optimizer = cut_state(whole.optimizer, nr, whole, at.tp),
             new_strategy = cut_state(whole.strategy, nr, whole, at.tp);
  c10::impl::GenericDict d = whole.first_files[0].copy();
  (void)d.erase("optimizer_shards");  // consolidated: whole parameters' state in this file
  d.insert_or_assign("model", to_dict(nr.model));
  d.insert_or_assign("optimizer", to_dict(new_optimizer));
  d.insert_or_assign("strategy", to_dict(new_strategy));
  d.insert_or_assign("tensor_model_parallel_size", nl.tp);
  d.insert_or_assign("pipeline_model_parallel_size", nl.pp);
  d.insert_or_assign("virtual_pipeline_model_parallel_size", nl.v);
  (void)d.erase("expert_model_parallel_size");  // a training save records it only when above 1
  if (nl.ep > 1) d.insert("expert_model_parallel_size", nl.ep);
  // The saved data-parallel size, raised to a multiple of the expert-parallel size (the smallest
  // layout that resumes it) where it is not one.
  if (auto dp = d.find(c10::IValue(std::string("data_parallel_size"))); dp != d.end() && dp->value().isInt())
    d.insert_or_assign("data_parallel_size", (std::max<int64_t>(1, dp->value().toInt()) + nl.ep - 1) / nl.ep * nl.ep);
  ckpt::insert_pipeline_split(d, nl.split());
  d.insert_or_assign("config", config_text(report));
  report.model_tensors = static_cast<int64_t>(nr.model.size());
  report.state_tensors = static_cast<int64_t>(new_optimizer.size() + new_strategy.size());
  return d;
}

// Why the model cannot be split over `ep` expert-parallel ranks ("" if it can): checked before any
// rank's tensors are gathered (only the recorded configuration and the first main file are read).
std::string expert_split_refusal(const dtk_model_info& info, const std::vector<Param>& params, int64_t ep) {
  if (ep <= 1) return "";
  const bool moe = info.struct_size >= dtk_model_info_STRUCT_SIZE_2_12 && info.num_experts > 0;
  if (!moe) return "the model has no mixture-of-experts layers (num_experts 0): only routed experts are split";
  if (info.expert_parallel == 0)
    return "the model plugin does not run expert parallelism (its dtk_model_info.expert_parallel is 0)";
  if (info.num_experts % ep != 0)
    return "it does not divide the model's " + std::to_string(info.num_experts) + " experts (num_experts)";
  for (const Param& p : params)  // a pyramid MoE's smaller layers (dtk_param_info.layer_experts)
    if (const int64_t n = routed_layer_experts(p.info, info.num_experts); is_routed_expert(p.info) && n % ep != 0)
      return "it does not divide the " + std::to_string(n) + " experts of the layer of " + p.name +
             " (moe_layer_num_experts)";
  return "";
}

}  // namespace

void require_new_or_empty_folder(const std::string& dir, const std::string& command) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return;
  if (!fs::is_directory(dir, ec))
    throw HostError(command + ": " + dir + " is a file, not a folder: give a new or empty folder to write into");
  if (!fs::is_empty(dir, ec)) throw HostError(command + ": " + dir + " exists and is not an empty directory");
}

ConvertReport convert_checkpoint(const std::string& iter_dir, const std::string& save_dir, const ConvertTarget& target,
                                 const std::function<std::string(const ConvertReport&)>& config_text,
                                 const ModelAtLayout& build, bool verify) {
  if (target.tp < 0 || target.pp < 0 || target.v < 0 || target.ep < 0)
    throw HostError("checkpoint convert: parallel sizes must be >= 1");
  require_new_or_empty_folder(save_dir, "checkpoint convert");
  ConvertReport report;
  const ckpt::Checksums sums = ckpt::checksums_to_check(iter_dir, verify, "--noverify");
  const Layout old = read_saved_layout(iter_dir, sums, &report.iteration);
  const Layout nl = resolve_new_layout(old, target);
  report.old_tp = static_cast<int>(old.tp), report.old_pp = static_cast<int>(old.pp);
  report.old_v = static_cast<int>(old.v);
  report.new_tp = static_cast<int>(nl.tp), report.new_pp = static_cast<int>(nl.pp),
  report.new_v = static_cast<int>(nl.v);
  report.old_ep = static_cast<int>(old.ep), report.new_ep = static_cast<int>(nl.ep);
  report.old_split = old.split(), report.new_split = nl.split();

  dtk_model_info info;
  std::string expert_refusal;
  {
    const std::unique_ptr<ModelInstance> whole_model = build(0, 1, 0, PipelineSplit{}, 0, 1);
    info = whole_model->info();
    expert_refusal = expert_split_refusal(info, whole_model->parameters(), nl.ep);
  }
  const int64_t layers = info.num_layers;
  if (const std::string& refusal = expert_refusal; !refusal.empty())
    throw HostError("checkpoint convert: --expert_model_parallel_size " + std::to_string(nl.ep) + ": " + refusal);
  if ((!old.split().even() || !nl.split().even()) && !builds_pipeline_split(info))
    throw HostError(
        "checkpoint convert: the model plugin builds only the even split of its layers over the pipeline "
        "stages (its dtk_model_info.pipeline_split is 0), and " +
        std::string(old.split().even() ? "the new layout asks for " : "the checkpoint has ") +
        describe_pipeline_split(old.split().even() ? nl.split() : old.split()));
  for (const auto& [layout, which] :
       {std::pair<const Layout*, const char*>{&old, "the checkpoint's"}, {&nl, "the new"}})
    if (const std::string refusal = pipeline_split_refusal(layout->split(), layers); !refusal.empty())
      throw HostError(std::string("checkpoint convert: ") + which + " layout: " + refusal);
  const Source src{iter_dir, sums, build, old, stage_names(build, layers, old)};
  const StageNames new_names = stage_names(build, layers, nl);

  // Every old pipeline and expert-parallel rank: its files, then each of its chunks made whole.
  WholeModel whole;
  for (int64_t rank_pp = 0; rank_pp < old.pp; ++rank_pp)
    for (int64_t ep = 0; ep < old.ep; ++ep) {
      const RankStates st = read_old_rank(src, rank_pp, ep, whole, report);
      SliceMap rank_names;
      for (const Param& p : old_rank_params(src, OldRank{rank_pp, 0, ep})) rank_names[p.name] = ParamSlice{};
      for (int64_t chunk = 0; chunk < old.v; ++chunk)
        merge_old_chunk(src, OldRank{rank_pp, 0, ep}, chunk, st, rank_names, whole);
    }

  // The new ranks' files (pipeline rank by pipeline rank, then expert-parallel and tensor-parallel
  // rank; each with its chunks), then published as a training save is (SHA256SUMS, rename, tracker).
  std::vector<c10::impl::GenericDict> files;
  for (int rank_pp = 0; rank_pp < nl.pp; ++rank_pp)
    for (int ep = 0; ep < nl.ep; ++ep)
      for (int r = 0; r < nl.tp; ++r)
        files.push_back(new_rank_file(build, nl, new_names, whole, NewRankAt{rank_pp, r, ep}, config_text, report));
  report.megabytes = static_cast<double>(ckpt::write_offline_checkpoint(save_dir, report.iteration, files,
                                                                        report.new_tp, report.new_pp, report.new_ep)) /
                     1e6;
  return report;
}

}  // namespace dtk::core
