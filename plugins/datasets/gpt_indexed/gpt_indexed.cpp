// gpt_indexed — Megatron-LM GPT data: one PREFIX (PREFIX.bin + PREFIX.idx, as written by
// `dtk preprocess` or Megatron's preprocess_data.py) or a weighted blend "0.3 A 0.7 B", split
// into train/valid/test by documents ("969,30,1") or given per split, served as samples of
// seq_length + 1 tokens ("text") with Megatron's index construction (see docs/data.md). With
// Megatron-core's add_extra_token off, or a valid split that keeps its partial last sample, the
// samples also carry "loss_mask" (0 for padding labels), which causal_lm applies. Rank 0 builds
// the index caches; the other ranks wait for them.
#include <dtk/dataset.hpp>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "dtk/data/error.hpp"
#include "dtk/data/gpt_dataset.hpp"

namespace {

const dtk_option_spec kOptions[] = {
    dtk::opt_string("data_path", "", "Dataset prefix (PREFIX.bin/.idx), or a blend 'w1 prefix1 w2 prefix2 ...'."),
    dtk::opt_string("split", "969, 30, 1", "Train,valid,test proportions of the documents (Megatron's --split)."),
    dtk::opt_string("cache_dir", "",
                    "Megatron's --data-cache-path: where the index caches are read and written; empty = Megatron's "
                    "default place (PREFIX/cache/GPTDataset_indices, or DIR/index-cache for megatron_legacy)."),
    dtk::opt_enum("order", "megatron_core", "megatron_core|megatron_legacy",
                  "Whose sample order, split rounding, blend sizes and cache files: megatron_core (today's "
                  "Megatron-LM) or megatron_legacy (megatron/data/gpt_dataset.py, as DeepSpeed-Domino ships it)."),
    dtk::only_with("order=megatron_core",
                   dtk::opt_string("megatron_tokenizer", "null",
                                   "The tokenizer's unique_identifiers as JSON, part of the cache description whose "
                                   "md5 names the files (null: none). Megatron's caches are read whatever theirs "
                                   "holds.")),
    dtk::opt_string("train_data_path", "",
                    "Megatron's --train-data-path: the train split's own prefix or blend (all its documents); with "
                    "valid_data_path/test_data_path instead of data_path and split."),
    dtk::opt_string("valid_data_path", "", "Megatron's --valid-data-path (see train_data_path)."),
    dtk::opt_string("test_data_path", "", "Megatron's --test-data-path (see train_data_path)."),
    dtk::only_with("order=megatron_core",
                   dtk::opt_bool("add_extra_token", "true",
                                 "Megatron-core's add_extra_token_to_sequence. true: samples of seq_length+1 tokens "
                                 "(Megatron-LM's setting); false: seq_length tokens, the last label padding "
                                 "(loss-masked).")),
    dtk::only_with("order=megatron_core",
                   dtk::opt_bool("drop_last_partial_validation", "true",
                                 "Megatron-core's drop_last_partial_validation_sequence. false: the valid split keeps "
                                 "its last partial sample, padded and loss-masked.")),
    dtk::opt_int("vocab_size", "0", "Vocabulary size of the tokens (0 = unknown; 50257 for GPT-2)."),
    dtk::opt_float("wait_timeout_s", "1800", "How long ranks other than 0 wait for rank 0 to write the caches."),
};

// Where a split's indices came from: Megatron's cache files read, or built (and written).
std::string cache_note(const dtk::data::TokenDataset& d) {
  std::vector<const dtk::data::GPTDataset*> parts;
  if (const auto* g = dynamic_cast<const dtk::data::GPTDataset*>(&d)) parts.push_back(g);
  std::string blend;
  if (const auto* b = dynamic_cast<const dtk::data::BlendedDataset*>(&d)) {
    blend = b->cache_file("description").empty() ? "blend built, not cached; "
            : b->loaded_from_cache()             ? "blend read from " + b->loaded_from() + "; "
                                                 : "blend built, written to " + b->cache_file("description") + "; ";
    for (size_t k = 0; k < b->num_parts(); ++k)
      if (const auto* g = dynamic_cast<const dtk::data::GPTDataset*>(b->part(k).get())) parts.push_back(g);
  }
  size_t read = 0;
  for (const auto* g : parts) read += g->loaded_from_cache();
  std::string out = blend + std::to_string(read) + " of " + std::to_string(parts.size()) + " index cache(s) read";
  if (read == 1 && parts.size() == 1) out += " from " + parts[0]->loaded_from();
  return out;
}

class GptIndexed : public dtk::Dataset {
 public:
  explicit GptIndexed(const dtk::DatasetContext& ctx)
      : vocab_(ctx.options.get_int("vocab_size")), seq_length_(ctx.seq_length) {
    const std::string data_path = ctx.options.get_string("data_path");
    const std::array<std::string, 3> per_split = {ctx.options.get_string("train_data_path"),
                                                  ctx.options.get_string("valid_data_path"),
                                                  ctx.options.get_string("test_data_path")};
    const bool use_per_split = !per_split[0].empty() || !per_split[1].empty() || !per_split[2].empty();
    if (data_path.empty() && !use_per_split) {
      throw dtk::Error("option 'data_path' is required: a prefix of PREFIX.bin/PREFIX.idx or 'w1 p1 w2 p2 ...' "
                       "(or the per-split train_data_path, valid_data_path, test_data_path)",
                       DTK_ERR_INVALID_ARGUMENT);
    }
    if (!data_path.empty() && use_per_split) {
      throw dtk::Error("option 'data_path' ('" + data_path +
                           "') and the per-split train_data_path/valid_data_path/test_data_path are exclusive: set one",
                       DTK_ERR_INVALID_ARGUMENT);
    }
    if (vocab_ < 0) throw dtk::Error("option 'vocab_size' must be >= 0", DTK_ERR_INVALID_ARGUMENT);
    dtk::data::GptDatasetOptions o;
    o.seq_length = ctx.seq_length;
    o.seed = ctx.seed;
    o.split = ctx.options.get_string("split");
    o.tokenizer_json = ctx.options.get_string("megatron_tokenizer");
    o.cache_dir = ctx.options.get_string("cache_dir");
    if (o.cache_dir.empty()) o.cache_dir = ctx.cache_dir;
    o.cache_mode = ctx.rank == 0 ? dtk::data::GptDatasetOptions::CacheMode::kBuild
                                 : dtk::data::GptDatasetOptions::CacheMode::kWaitOnly;
    o.wait_timeout_s = ctx.options.get_float("wait_timeout_s");
    o.add_extra_token = ctx.options.get_bool("add_extra_token");
    o.drop_last_partial_validation = ctx.options.get_bool("drop_last_partial_validation");
    // Splits whose samples may hold padding hand the step a loss mask with them.
    for (int s = 0; s < 3; ++s) masked_[s] = !o.add_extra_token || (s == 1 && !o.drop_last_partial_validation);
    if (o.wait_timeout_s < 0)
      throw dtk::Error("option 'wait_timeout_s' must be >= 0, got " + std::to_string(o.wait_timeout_s),
                       DTK_ERR_INVALID_ARGUMENT);
    std::array<int64_t, 3> n = {ctx.num_samples[0], ctx.num_samples[1], ctx.num_samples[2]};
    for (int s = 0; s < 3; ++s)
      if (ctx.whole(s)) n[static_cast<size_t>(s)] = dtk::data::kWholeSplit;  // eval.full_validation
    try {
      o.order = dtk::data::parse_order(ctx.options.get_string("order"));
      auto tvt = use_per_split ? dtk::data::build_per_split_datasets(per_split, n, o)
                               : dtk::data::build_train_valid_test_datasets(data_path, n, o);
      splits_ = {tvt.train, tvt.valid, tvt.test};
    } catch (const dtk::data::DataError& e) {
      throw dtk::Error(e.what(), DTK_ERR_INVALID_ARGUMENT);
    }
    for (int s = 0; s < 3; ++s) {
      if (splits_[s]) {
        DTK_LOG(INFO) << "gpt_indexed: split " << s << ": " << splits_[s]->size() << " samples of "
                      << splits_[s]->sample_length() << " tokens ("
                      << (ctx.whole(s) ? std::string("whole split") : std::to_string(n[s]) + " requested") << "; "
                      << dtk::data::order_name(o.order) << " order; " << cache_note(*splits_[s]) << ")";
      } else if (n[s] != 0) {
        DTK_LOG(WARNING) << "gpt_indexed: split " << s << " has no documents"
                         << (use_per_split ? std::string(" (no per-split data path)")
                                           : " under split '" + ctx.options.get_string("split") + "'");
      }
    }
  }

  int64_t num_samples(int32_t split) override {
    return splits_.at(CheckSplit(split)) ? static_cast<int64_t>(splits_[static_cast<size_t>(split)]->size()) : 0;
  }

  void get_sample(int32_t split, int64_t index, const dtk_buffer_sink* out) override {
    const auto& ds = splits_.at(CheckSplit(split));
    if (!ds || index < 0 || static_cast<uint64_t>(index) >= ds->size()) {
      throw dtk::Error("sample " + std::to_string(index) + " of split " + std::to_string(split) + " out of range (" +
                           std::to_string(ds ? ds->size() : 0) + " samples)",
                       DTK_ERR_OUT_OF_RANGE);
    }
    std::vector<int64_t> tokens(ds->sample_length());
    try {
      ds->get(static_cast<size_t>(index), tokens.data());
    } catch (const dtk::data::DataError& e) {
      throw dtk::Error(e.what());
    }
    std::vector<float> loss_mask;
    if (masked_[static_cast<size_t>(split)]) {
      // Megatron-core's tokens and labels (padding read as 0) as the step's "text", and the loss mask.
      std::vector<int64_t> text;
      dtk::data::megatron_step_inputs(tokens.data(), tokens.size(), seq_length_, &text, &loss_mask);
      tokens = std::move(text);
    }
    if (vocab_ > 0) {
      for (int64_t t : tokens) {
        if (t < 0 || t >= vocab_) {
          throw dtk::Error("token " + std::to_string(t) + " in sample " + std::to_string(index) +
                           " is outside the vocabulary of " + std::to_string(vocab_));
        }
      }
    }
    dtk::put(out, "text", dtk::make_buffer(std::move(tokens)));
    if (masked_[static_cast<size_t>(split)]) {
      auto mask = std::make_shared<std::vector<float>>(std::move(loss_mask));
      void* data = mask->data();
      const auto count = static_cast<int64_t>(mask->size());
      dtk::put(out, "loss_mask", dtk::make_buffer(data, DTK_DTYPE_FLOAT32, count, std::move(mask)));
    }
  }

  int64_t vocab_size() override { return vocab_; }

 private:
  static size_t CheckSplit(int32_t split) {
    if (split < 0 || split > 2) throw dtk::Error("unknown split " + std::to_string(split), DTK_ERR_OUT_OF_RANGE);
    return static_cast<size_t>(split);
  }
  int64_t vocab_;
  int64_t seq_length_;
  std::array<bool, 3> masked_{};
  std::array<std::shared_ptr<const dtk::data::TokenDataset>, 3> splits_;
};

}  // namespace

DTK_PLUGIN("gpt_indexed", DTK_KIND_DATASET, "1.0.0",
           "Megatron indexed GPT data (.bin/.idx prefix or weighted blend), Megatron sample order", DTK_NO_TORCH,
           dtk::dataset_api<GptIndexed>(), kOptions)
