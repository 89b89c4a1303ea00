#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>

#include "dtk/core/optim/lr_schedule.hpp"
#include "dtk/host/error.hpp"
#include "dtk/core/config/config.hpp"

using dtk::core::apply_override;
using dtk::core::config_value;
using dtk::core::default_config;
using dtk::core::learning_rate;
using dtk::host::HostError;

namespace {
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const HostError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Config, OverridesFieldsAndPluginOptions) {
  auto cfg = default_config();
  apply_override(cfg, "train.micro_batch_size=7");
  apply_override(cfg, "lr.lr_decay_style=linear");
  apply_override(cfg, "model.num_layers=3");
  apply_override(cfg, "dataset.data_path=0.3 a 0.7 b");
  apply_override(cfg, "train.clip_grad=0");  // proto3 zero must still override the default 1.0
  EXPECT_EQ(cfg.train().micro_batch_size(), 7);
  EXPECT_EQ(cfg.lr().lr_decay_style(), "linear");
  EXPECT_EQ(cfg.model().options().at("num_layers"), "3");
  EXPECT_EQ(cfg.dataset().options().at("data_path"), "0.3 a 0.7 b");
  EXPECT_EQ(cfg.train().clip_grad(), 0.0);
  EXPECT_EQ(config_value(cfg, "train.micro_batch_size"), "7");
  EXPECT_EQ(config_value(cfg, "model.num_layers"), "3");
  EXPECT_EQ(config_value(cfg, "model.name"), "gpt");
}

// `dtk config > run.pbtxt` then `--config run.pbtxt` is the same run: zeros where the defaults are
// not zero (min_lr 0, clip_grad 0, weight_decay 0: proto3 does not print zeros) are written too.
TEST(Config, PrintedConfigReadsBackAsTheSameRun) {
  auto cfg = default_config();
  for (const char* set : {"lr.min_lr=0", "train.clip_grad=0", "lr.weight_decay=0", "eval.eval_iters=0",
                          "lr.lr_decay_style=", "model.num_layers=3", "model.hidden_size=64",
                          "dataset.data_path=0.3 a 0.7 b", "train.micro_batch_size=2"})
    apply_override(cfg, set);
  const std::string text = dtk::core::to_text(cfg);
  EXPECT_NE(text.find("  min_lr: 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("  lr_decay_style: \"\"\n"), std::string::npos) << text;
  const std::string path = ::testing::TempDir() + "/printed.pbtxt";
  std::ofstream(path) << text;
  const auto back = dtk::core::load_config(path);
  EXPECT_EQ(dtk::core::to_text(back), text);
  for (const char* field : {"lr.min_lr", "train.clip_grad", "lr.weight_decay", "eval.eval_iters", "lr.lr_decay_style",
                            "model.num_layers", "dataset.data_path", "train.micro_batch_size", "train.seq_length"})
    EXPECT_EQ(config_value(back, field), config_value(cfg, field)) << field;
  // A list field between present fields and zeros (lr.param_rules is field 14, the sample lengths
  // 15 and 16): each field once.
  auto rules = default_config();
  for (const char* set : {"lr.param_rules=match: \"bias$\" wd_mult: 0", "lr.lr_decay_samples=64",
                          "lr.lr_warmup_samples=8", "lr.min_lr=0"})
    apply_override(rules, set);
  const std::string rules_text = dtk::core::to_text(rules);
  EXPECT_EQ(rules_text.find("lr_decay_samples: 64"), rules_text.rfind("lr_decay_samples: 64")) << rules_text;
  std::ofstream(path) << rules_text;
  EXPECT_EQ(dtk::core::to_text(dtk::core::load_config(path)), rules_text);
  // Nothing else changes: the defaults print as before (no zero the defaults also hold).
  EXPECT_EQ(dtk::core::to_text(default_config()).find(": 0\n"), std::string::npos);
}

TEST(Config, BadOverridesNameTheProblem) {
  auto cfg = default_config();
  EXPECT_EQ(error_of([&] { apply_override(cfg, "train.micro_batch_sise=2"); }),
            "--set 'train.micro_batch_sise=2': no config field 'train.micro_batch_sise'; did you mean "
            "'train.micro_batch_size'?");
  EXPECT_EQ(error_of([&] { apply_override(cfg, "train.micro_batch_size=two"); }),
            "--set 'train.micro_batch_size=two': 'two' is not a valid int64 for 'train.micro_batch_size'");
  EXPECT_EQ(error_of([&] { apply_override(cfg, "novalue"); }),
            "--set 'novalue': expected key=value (e.g. lr.lr=3e-4)");
  EXPECT_EQ(error_of([&] { apply_override(cfg, "train=3"); }),
            "--set 'train=3': 'train' is a section, name one of its fields");
}

TEST(Config, FileParseErrorsGiveLineAndColumn) {
  const std::string path = ::testing::TempDir() + "/bad.pbtxt";
  std::ofstream(path) << "train {\n  micro_batch_size: 4\n  bogus_field: 1\n}\n";
  const std::string msg = error_of([&] { dtk::core::load_config(path); });
  EXPECT_EQ(msg.rfind("config '" + path + "': line 3 column ", 0), 0u) << msg;
  EXPECT_NE(msg.find("bogus_field"), std::string::npos) << msg;
  EXPECT_EQ(error_of([&] { dtk::core::load_config("/nonexistent.pbtxt"); }),
            "config '/nonexistent.pbtxt': no such file");
}

TEST(Config, ValidationCatchesBadValues) {
  auto cfg = default_config();
  apply_override(cfg, "train.params_dtype=fp8");
  EXPECT_EQ(error_of([&] { dtk::core::validate_config(cfg); }),
            "config: train.params_dtype must be fp32, bf16 or fp16, got 'fp8'");
  cfg = default_config();
  apply_override(cfg, "lr.min_lr=1");
  EXPECT_EQ(error_of([&] { dtk::core::validate_config(cfg); }),
            "config: lr.min_lr (1.000000) is larger than lr.lr (0.000300)");
  cfg = default_config();
  apply_override(cfg, "lr.lr_warmup_iters=500");
  EXPECT_EQ(error_of([&] { dtk::core::validate_config(cfg); }),
            "config: lr.lr_warmup_iters (500) must be smaller than the decay length (100 = lr.lr_decay_iters, or "
            "train.train_iters when that is 0)");
  cfg = default_config();
  apply_override(cfg, "train.params_dtype=fp16");
  EXPECT_EQ(error_of([&] { dtk::core::validate_config(cfg); }),
            "config: train.params_dtype=fp16 needs train.device=cuda (LibTorch has no fp16 matmul on CPU); use bf16 "
            "on CPU");
  cfg = default_config();
  apply_override(cfg, "checkpoint.save_interval=5");  // no effect without a directory, as in Megatron
  EXPECT_EQ(error_of([&] { dtk::core::validate_config(cfg); }), "");
  apply_override(cfg, "checkpoint.save=/tmp/x");
  EXPECT_EQ(error_of([&] { dtk::core::validate_config(cfg); }), "");
  cfg = default_config();
  EXPECT_EQ(error_of([&] { config_value(cfg, "model.options"); }),
            "config field 'model.options' is a map; ask for one entry (e.g. model.num_layers)");
  cfg = default_config();
  apply_override(cfg, "train.train_iters=0");
  EXPECT_EQ(error_of([&] { dtk::core::validate_config(cfg); }), "config: train.train_iters must be positive, got 0");
}

// Megatron's OptimizerParamScheduler, computed independently here.
TEST(LrSchedule, MatchesMegatron) {
  const double max_lr = 1e-3, min_lr = 1e-4;
  const int64_t warmup = 10, decay = 100;
  EXPECT_DOUBLE_EQ(learning_rate(5, max_lr, min_lr, warmup, decay, "cosine"), max_lr * 5 / 10);
  EXPECT_DOUBLE_EQ(learning_rate(10, max_lr, min_lr, warmup, decay, "cosine"), max_lr);
  const double ratio = (55.0 - 10) / (100 - 10);
  EXPECT_NEAR(learning_rate(55, max_lr, min_lr, warmup, decay, "cosine"),
              min_lr + 0.5 * (std::cos(M_PI * ratio) + 1) * (max_lr - min_lr), 1e-15);
  EXPECT_NEAR(learning_rate(55, max_lr, min_lr, warmup, decay, "linear"), min_lr + (1 - ratio) * (max_lr - min_lr),
              1e-15);
  EXPECT_DOUBLE_EQ(learning_rate(100, max_lr, min_lr, warmup, decay, "cosine"), min_lr);
  EXPECT_DOUBLE_EQ(learning_rate(150, max_lr, min_lr, warmup, decay, "cosine"), min_lr);
  EXPECT_DOUBLE_EQ(learning_rate(150, max_lr, min_lr, warmup, decay, "constant"), max_lr);
  EXPECT_NEAR(learning_rate(40, max_lr, min_lr, warmup, decay, "inverse-square-root"),
              max_lr * std::sqrt(10.0) / std::sqrt(40.0), 1e-15);
  // Megatron returns min_lr past the decay length for every style but constant.
  EXPECT_DOUBLE_EQ(learning_rate(101, max_lr, min_lr, warmup, decay, "inverse-square-root"), min_lr);
  // The scheduler starts at step 0: the first update of a warmup uses lr 0, as Megatron's.
  EXPECT_DOUBLE_EQ(learning_rate(0, max_lr, min_lr, warmup, decay, "cosine"), 0.0);
}
