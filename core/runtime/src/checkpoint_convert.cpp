// A checkpoint for another tensor-parallel size: see dtk/core/checkpoint_convert.hpp.
#include "dtk/core/checkpoint_convert.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>

#include <filesystem>
#include <map>
#include <vector>

#include "checkpoint_io.hpp"
#include "dtk/core/checkpoint.hpp"
#include "dtk/core/checkpoint_shards.hpp"
#include "dtk/host/plugin_host.hpp"

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

ConvertReport convert_tensor_parallel(const std::string& iter_dir, const std::string& save_dir, int new_tp,
                                      const std::string& config_text, const ModelAtLayout& build) {
  if (new_tp < 1) throw HostError("checkpoint convert: the tensor-parallel size must be >= 1");
  std::error_code ec;
  if (fs::exists(save_dir, ec) && !(fs::is_directory(save_dir, ec) && fs::is_empty(save_dir, ec)))
    throw HostError("checkpoint convert: " + save_dir + " exists and is not an empty directory");
  ConvertReport report;
  report.new_tp = new_tp;

  // The old ranks' files, verified.
  const ckpt::Checksums sums = ckpt::read_checksums(iter_dir);
  std::vector<c10::impl::GenericDict> old;
  std::vector<TensorMap> model, optimizer, strategy;
  int64_t old_tp = 1;
  for (int64_t r = 0; r < old_tp; ++r) {
    const std::string relative = ckpt::mp_rank_dir(static_cast<int>(r)) + "/" + ckpt::kModelFile;
    const std::string file = (fs::path(iter_dir) / relative).string();
    old.push_back(ckpt::read_pickled_dict(file, "", &sums, relative));
    const auto& d = old.back();
    if (r == 0) {
      auto tp = d.find(c10::IValue(std::string("tensor_model_parallel_size")));
      if (tp == d.end() || !tp->value().isInt() || tp->value().toInt() < 1)
        throw HostError("checkpoint " + file + " records no tensor_model_parallel_size");
      old_tp = tp->value().toInt();
      auto it = d.find(c10::IValue(std::string("iteration")));
      report.iteration = it != d.end() && it->value().isInt() ? it->value().toInt() : 0;
    }
    model.push_back(tensors_of(d, "model", file));
    auto shards = d.find(c10::IValue(std::string("optimizer_shards")));
    if (shards == d.end()) {
      optimizer.push_back(tensors_of(d, "optimizer", file));
      strategy.push_back(tensors_of(d, "strategy", file));
      continue;
    }
    // ZeRO: the data-parallel shards consolidated into whole parameters' state (the layout ddp
    // saves; a ZeRO run loading it shards it again, dtk/core/checkpoint_shards.hpp).
    if (!shards->value().isInt() || shards->value().toInt() < 1)
      throw HostError("checkpoint " + file + ": 'optimizer_shards' is not a positive count");
    std::unique_ptr<ModelInstance> m = build(static_cast<int>(r), static_cast<int>(old_tp));
    const std::vector<Param> params = m->parameters();
    std::vector<std::string> names;
    for (const Param& p : params) names.push_back(p.name);
    StateAssembler whole(params, names);
    const std::string rank_dir = (fs::path(iter_dir) / ckpt::mp_rank_dir(static_cast<int>(r))).string();
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
  report.old_tp = static_cast<int>(old_tp);

  // Partition dims from the model at the new layout (the same names at every layout).
  std::map<std::string, int> dim = partition_dims(build(0, new_tp)->parameters());
  SliceMap names;
  for (const auto& [name, d] : dim) names[name] = ParamSlice{};
  auto whole = [&](const std::vector<TensorMap>& ranks, const std::string& name, int d) {
    return merge_partitions(ranks, name, d, "checkpoint convert");
  };
  TensorMap model_whole;
  for (const auto& [name, d] : dim) model_whole[name] = whole(model, name, d);
  // Optimizer/strategy entries: a parameter's follow it; the rest are copied from rank 0.
  auto state_whole = [&](const std::vector<TensorMap>& ranks) {
    std::vector<std::tuple<std::string, std::string, at::Tensor>> out;  // key, parameter, whole value
    for (const auto& [key, value] : ranks[0]) {
      const std::string param = param_of_key(key, names);
      const int d = param.empty() ? -1 : dim[param];
      out.emplace_back(key, param, param.empty() ? value : whole(ranks, key, d));
    }
    return out;
  };
  const auto optimizer_whole = state_whole(optimizer), strategy_whole = state_whole(strategy);

  // The new ranks' files, then published as a training save is (SHA256SUMS, rename, tracker).
  std::vector<c10::impl::GenericDict> files;
  for (int r = 0; r < new_tp; ++r) {
    std::unique_ptr<ModelInstance> m = build(r, new_tp);
    TensorMap target_params;
    for (const Param& p : m->parameters()) target_params[p.name] = p.tensor;
    std::vector<std::pair<std::string, at::Tensor>> new_model;
    for (const auto& [name, target] : m->state_save()) {
      auto it = model_whole.find(name);
      // Not a parameter (the dropout generators): the new model's own.
      new_model.emplace_back(name, it == model_whole.end() ? target : piece(it->second, dim[name], r, target, name));
    }
    auto cut = [&](const std::vector<std::tuple<std::string, std::string, at::Tensor>>& entries) {
      std::vector<std::pair<std::string, at::Tensor>> out;
      for (const auto& [key, param, value] : entries) {
        if (param.empty()) {
          out.emplace_back(key, value);
          continue;
        }
        const at::Tensor& target = target_params.at(param);
        // State kept in another dtype than the parameter (fp32 masters of bf16 weights) stays so.
        out.emplace_back(key, piece(value, dim[param], r, target.to(value.scalar_type()), key));
      }
      return out;
    };
    const auto new_optimizer = cut(optimizer_whole), new_strategy = cut(strategy_whole);
    c10::impl::GenericDict d = old[0].copy();
    (void)d.erase("optimizer_shards");  // consolidated: whole parameters' state in this file
    d.insert_or_assign("model", to_dict(new_model));
    d.insert_or_assign("optimizer", to_dict(new_optimizer));
    d.insert_or_assign("strategy", to_dict(new_strategy));
    d.insert_or_assign("tensor_model_parallel_size", static_cast<int64_t>(new_tp));
    d.insert_or_assign("config", config_text);
    files.push_back(d);
    report.model_tensors = static_cast<int64_t>(new_model.size());
    report.state_tensors = static_cast<int64_t>(new_optimizer.size() + new_strategy.size());
  }
  report.megabytes = static_cast<double>(ckpt::write_offline_checkpoint(save_dir, report.iteration, files)) / 1e6;
  return report;
}

}  // namespace dtk::core
