// A checkpoint for another tensor-parallel size: see dtk/core/checkpoint/checkpoint_convert.hpp.
#include "dtk/core/checkpoint/checkpoint_convert.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>

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
// "...layers.<i>..." on stage s is layer s x layers_per_stage + i; the last stage's copy of a tied
// weight is the first stage's). Names without a layer index are the same everywhere.
struct StageNames {
  int64_t layers_per_stage = 0;
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
    const int64_t i = std::stoll(local.substr(digits, end - digits)) + stage * layers_per_stage;
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

ConvertReport convert_checkpoint(const std::string& iter_dir, const std::string& save_dir, int new_tp, int new_pp,
                                 int new_v, const std::function<std::string(int tp, int pp, int v)>& config_text,
                                 const ModelAtLayout& build) {
  if (new_tp < 0 || new_pp < 0 || new_v < 0) throw HostError("checkpoint convert: parallel sizes must be >= 1");
  std::error_code ec;
  if (fs::exists(save_dir, ec) && !(fs::is_directory(save_dir, ec) && fs::is_empty(save_dir, ec)))
    throw HostError("checkpoint convert: " + save_dir + " exists and is not an empty directory");
  ConvertReport report;

  // The layout the checkpoint was saved with (its first file says).
  const ckpt::Checksums sums = ckpt::read_checksums(iter_dir);
  int64_t old_tp = 1, old_pp = ckpt::first_rank_dir(iter_dir) != ckpt::mp_rank_dir(0) ? 2 : 1, old_v = 1;
  {
    const std::string relative = ckpt::first_rank_dir(iter_dir) + "/" + ckpt::kModelFile;
    const std::string file = (fs::path(iter_dir) / relative).string();
    const auto d = ckpt::read_pickled_dict(file, "", &sums, relative);
    auto tp = d.find(c10::IValue(std::string("tensor_model_parallel_size")));
    if (tp == d.end() || !tp->value().isInt() || tp->value().toInt() < 1)
      throw HostError("checkpoint " + file + " records no tensor_model_parallel_size");
    old_tp = tp->value().toInt();
    auto pp = d.find(c10::IValue(std::string("pipeline_model_parallel_size")));
    if (pp != d.end() && pp->value().isInt()) old_pp = std::max<int64_t>(1, pp->value().toInt());
    auto v = d.find(c10::IValue(std::string("virtual_pipeline_model_parallel_size")));
    if (v != d.end() && v->value().isInt()) old_v = std::max<int64_t>(1, v->value().toInt());
    auto it = d.find(c10::IValue(std::string("iteration")));
    report.iteration = it != d.end() && it->value().isInt() ? it->value().toInt() : 0;
  }
  if (new_tp == 0) new_tp = static_cast<int>(old_tp);
  if (new_pp == 0) new_pp = static_cast<int>(old_pp);
  // Model chunks per rank: kept with the pipeline size, else one unless asked.
  if (new_v == 0) new_v = new_pp == old_pp ? static_cast<int>(old_v) : 1;
  if (new_v > 1 && new_pp < 2)
    throw HostError("checkpoint convert: --virtual_pipeline_model_parallel_size " + std::to_string(new_v) +
                    " (the interleaved schedule) needs --pipeline_model_parallel_size 2 or more");
  report.old_tp = static_cast<int>(old_tp);
  report.old_pp = static_cast<int>(old_pp);
  report.old_v = static_cast<int>(old_v);
  report.new_tp = new_tp, report.new_pp = new_pp, report.new_v = new_v;
  // Stages of the (virtual) pipeline: chunk k of pipeline rank r is stage k x pp + r of pp x v.
  const int64_t old_stages = old_pp * old_v, new_stages = int64_t{new_pp} * new_v;

  // Names on each stage <-> names in the whole model.
  const int64_t layers = build(0, 1, 0, 1)->info().num_layers;
  for (int64_t stages : {old_stages, new_stages})
    if (layers % stages != 0)
      throw HostError("checkpoint convert: the model's " + std::to_string(layers) + " layers do not split into " +
                      std::to_string(stages) + " pipeline stages (pipeline size x model chunks per rank)");
  StageNames old_names, new_names;
  old_names.layers_per_stage = layers / old_stages;
  new_names.layers_per_stage = layers / new_stages;
  find_tied(old_names, build(0, 1, 0, static_cast<int>(old_stages))->parameters(),
            build(0, 1, static_cast<int>(old_stages) - 1, static_cast<int>(old_stages))->parameters(),
            static_cast<int>(old_stages));
  find_tied(new_names, build(0, 1, 0, static_cast<int>(new_stages))->parameters(),
            build(0, 1, static_cast<int>(new_stages) - 1, static_cast<int>(new_stages))->parameters(),
            static_cast<int>(new_stages));

  // Every old pipeline rank: its tensor-parallel ranks' files (verified); then each of its chunks'
  // parameters and their state made whole, under the whole model's names. A tied weight's copy
  // repeats the first stage's values.
  TensorMap model_whole;
  std::map<std::string, int> dim;                       // whole-model name -> partition dim
  std::vector<std::tuple<std::string, std::string, at::Tensor>> optimizer_whole, strategy_whole;  // key, param, value
  std::set<std::string> seen_keys;
  std::vector<c10::impl::GenericDict> first_files;  // stage 0's, kept for the progress entries
  for (int64_t rank_pp = 0; rank_pp < old_pp; ++rank_pp) {
    // The parameters of the rank's chunks (prefixed as the file names them), on tensor-parallel rank r.
    auto rank_params = [&](int64_t r) {
      std::vector<Param> params;
      for (int64_t k = 0; k < old_v; ++k)
        for (Param& p : build(static_cast<int>(r), static_cast<int>(old_tp), static_cast<int>(k * old_pp + rank_pp),
                              static_cast<int>(old_stages))
                            ->parameters()) {
          p.name = ModelInstance::chunk_prefix(k, old_v) + p.name;
          params.push_back(std::move(p));
        }
      return params;
    };
    std::vector<TensorMap> model, optimizer, strategy;
    for (int64_t r = 0; r < old_tp; ++r) {
      const std::string rank_dir_name =
          ckpt::mp_rank_dir(static_cast<int>(r), static_cast<int>(rank_pp), static_cast<int>(old_pp));
      const std::string relative = rank_dir_name + "/" + ckpt::kModelFile;
      const std::string file = (fs::path(iter_dir) / relative).string();
      const auto d = ckpt::read_pickled_dict(file, "", &sums, relative);
      if (rank_pp == 0) first_files.push_back(d);
      model.push_back(tensors_of(d, "model", file));
      auto shards = d.find(c10::IValue(std::string("optimizer_shards")));
      if (shards == d.end()) {
        optimizer.push_back(tensors_of(d, "optimizer", file));
        strategy.push_back(tensors_of(d, "strategy", file));
        continue;
      }
      // ZeRO: the data-parallel shards consolidated into whole parameters' state (the layout ddp
      // saves; a ZeRO run loading it shards it again, dtk/core/checkpoint/checkpoint_shards.hpp).
      if (!shards->value().isInt() || shards->value().toInt() < 1)
        throw HostError("checkpoint " + file + ": 'optimizer_shards' is not a positive count");
      const std::vector<Param> params = rank_params(r);
      std::vector<std::string> names;
      for (const Param& p : params) names.push_back(p.name);
      StateAssembler whole(params, names);
      const std::string rank_dir = (fs::path(iter_dir) / rank_dir_name).string();
      for (int64_t k = 0; k < shards->value().toInt(); ++k) {
        const ckpt::Shard shard = ckpt::read_shard(rank_dir, static_cast<int>(k), shards->value().toInt(), sums);
        whole.add(shard.optimizer, shard.strategy, shard.slices);
      }
      TensorMap o, st;
      try {
        for (auto& [key, value] : whole.optimizer()) o[key] = value;
        for (auto& [key, value] : whole.strategy()) st[key] = value;
      } catch (const std::exception& e) {
        throw HostError("checkpoint convert: " + rank_dir + ": " + ckpt::first_line(e.what()));
      }
      optimizer.push_back(std::move(o));
      strategy.push_back(std::move(st));
      report.consolidated_shards = shards->value().toInt();
    }
    // Every parameter name of the rank (all its chunks): which entries are a parameter's.
    SliceMap rank_names;
    for (const Param& p : rank_params(0)) rank_names[p.name] = ParamSlice{};
    for (int64_t chunk = 0; chunk < old_v; ++chunk) {
      const int64_t stage = chunk * old_pp + rank_pp;
      const std::string prefix = ModelInstance::chunk_prefix(chunk, old_v);
      const std::map<std::string, int> stage_dims = partition_dims(
          build(0, static_cast<int>(old_tp), static_cast<int>(stage), static_cast<int>(old_stages))->parameters());
      std::vector<TensorMap> chunk_model;
      for (const TensorMap& m : model) chunk_model.push_back(under_prefix(m, prefix));
      auto whole = [&](const std::vector<TensorMap>& ranks, const std::string& name, int d) {
        return merge_partitions(ranks, name, d, "checkpoint convert");
      };
      for (const auto& [name, d] : stage_dims) {
        const std::string g = old_names.global(name, static_cast<int>(stage));
        dim[g] = d;
        if (!model_whole.count(g)) model_whole[g] = whole(chunk_model, name, d);
      }
      // Optimizer/strategy entries: a parameter's follow it (renamed); the others come from the
      // first stage's tensor-parallel rank 0.
      auto add_state = [&](const std::vector<TensorMap>& ranks, auto& out, const char* which) {
        for (const auto& [key, value] : ranks[0]) {
          const std::string param = param_of_key(key, rank_names);
          if (param.empty()) {
            if (stage == 0) out.emplace_back(key, "", value);
            continue;
          }
          if (param.compare(0, prefix.size(), prefix) != 0) continue;  // another chunk's
          const std::string local = param.substr(prefix.size());
          const std::string g = old_names.global(local, static_cast<int>(stage));
          const size_t at = key.find(param);
          const std::string global_key = key.substr(0, at) + g + key.substr(at + param.size());
          if (!seen_keys.insert(std::string(which) + global_key).second) continue;  // a tied copy's
          out.emplace_back(global_key, g, whole(ranks, key, stage_dims.at(local)));
        }
      };
      add_state(optimizer, optimizer_whole, "o:");
      add_state(strategy, strategy_whole, "s:");
    }
  }

  // The new ranks' files (pipeline rank by pipeline rank, tensor-parallel rank by rank; each with
  // its chunks), then published as a training save is (SHA256SUMS, rename, tracker).
  std::vector<c10::impl::GenericDict> files;
  for (int rank_pp = 0; rank_pp < new_pp; ++rank_pp) {
    for (int r = 0; r < new_tp; ++r) {
      TensorMap target_params;                      // whole-model name -> this rank's parameter
      std::map<std::string, std::string> local_of;  // whole-model name -> name in this rank's files
      std::vector<std::pair<std::string, at::Tensor>> new_model;
      for (int chunk = 0; chunk < new_v; ++chunk) {
        const int stage = chunk * new_pp + rank_pp;
        const std::string prefix = ModelInstance::chunk_prefix(chunk, new_v);
        std::unique_ptr<ModelInstance> m = build(r, new_tp, stage, static_cast<int>(new_stages));
        for (const Param& p : m->parameters()) {
          const std::string g = new_names.global(p.name, stage);
          target_params[g] = p.tensor;
          local_of[g] = prefix + p.name;
        }
        for (const auto& [name, target] : m->state_save()) {
          const std::string g = new_names.global(name, stage);
          auto it = model_whole.find(g);
          if (it == model_whole.end() && target_params.count(g))
            throw HostError("checkpoint convert: the checkpoint has no tensor '" + g + "'");
          // Not a parameter (the dropout generators): the new model's own.
          new_model.emplace_back(prefix + name,
                                 it == model_whole.end() ? target : piece(it->second, dim.at(g), r, target, name));
        }
      }
      auto cut = [&](const std::vector<std::tuple<std::string, std::string, at::Tensor>>& entries) {
        std::vector<std::pair<std::string, at::Tensor>> out;
        for (const auto& [key, param, value] : entries) {
          if (param.empty()) {
            out.emplace_back(key, value);
            continue;
          }
          auto local = local_of.find(param);
          if (local == local_of.end()) continue;  // a parameter of another stage
          const size_t at = key.find(param);
          const std::string local_key = key.substr(0, at) + local->second + key.substr(at + param.size());
          const at::Tensor& target = target_params.at(param);
          // State kept in another dtype than the parameter (fp32 masters of bf16 weights) stays so.
          out.emplace_back(local_key, piece(value, dim.at(param), r, target.to(value.scalar_type()), local_key));
        }
        return out;
      };
      const auto new_optimizer = cut(optimizer_whole), new_strategy = cut(strategy_whole);
      c10::impl::GenericDict d = first_files[0].copy();
      (void)d.erase("optimizer_shards");  // consolidated: whole parameters' state in this file
      d.insert_or_assign("model", to_dict(new_model));
      d.insert_or_assign("optimizer", to_dict(new_optimizer));
      d.insert_or_assign("strategy", to_dict(new_strategy));
      d.insert_or_assign("tensor_model_parallel_size", static_cast<int64_t>(new_tp));
      d.insert_or_assign("pipeline_model_parallel_size", static_cast<int64_t>(new_pp));
      d.insert_or_assign("virtual_pipeline_model_parallel_size", static_cast<int64_t>(new_v));
      d.insert_or_assign("config", config_text(new_tp, new_pp, new_v));
      files.push_back(d);
      report.model_tensors = static_cast<int64_t>(new_model.size());
      report.state_tensors = static_cast<int64_t>(new_optimizer.size() + new_strategy.size());
    }
  }
  report.megabytes =
      static_cast<double>(ckpt::write_offline_checkpoint(save_dir, report.iteration, files, new_tp, new_pp)) / 1e6;
  return report;
}

}  // namespace dtk::core
