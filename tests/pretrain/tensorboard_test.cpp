// TensorBoard event files: the record framing (CRC-32C, TensorFlow's masking), and a real run's
// file read back record by record, its scalars equal to what the log line printed.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "../common/run_dtk.hpp"
#include "../common/tensorboard_reader.hpp"
#include "dtk/core/logging/tensorboard.hpp"

using dtk_test::read_events;

TEST(TensorBoard, Crc32cKnownAnswers) {
  // The CRC-32C check value (RFC 3720 / iSCSI): "123456789" -> 0xE3069283.
  EXPECT_EQ(dtk::core::crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(dtk::core::crc32c("", 0), 0u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(dtk::core::crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
}

TEST(TensorBoard, TrainingRunWritesMegatronScalars) {
  const std::string dir = ::testing::TempDir() + "dtk_tb_test";
  std::filesystem::remove_all(dir);
  const dtk_test::Result r = dtk_test::run_dtk(
      std::string("train --config ") + DTK_SOURCE_DIR +
      "/configs/gpt-tiny.pbtxt --dataset synthetic --set dataset.vocab_size=64 "
      "--set model.vocab_size=64 --set train.train_iters=6 --set lr.lr_warmup_iters=2 "
      "--set logging.log_interval=3 --set eval.eval_iters=1 --threads 2 --set logging.tensorboard_dir=" +
      dir);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string& log = r.out;

  std::vector<std::string> files;
  for (const auto& de : std::filesystem::directory_iterator(dir)) files.push_back(de.path().string());
  ASSERT_EQ(files.size(), 1u);
  EXPECT_NE(files[0].find("/events.out.tfevents."), std::string::npos);
  std::string version;
  const auto records = read_events(files[0], &version);
  EXPECT_EQ(version, "brain.Event:2");
  std::map<std::pair<std::string, int64_t>, float> scalars;
  for (const auto& r : records) scalars[{r.tag, r.step}] = r.value;
  for (const char* tag : {"learning-rate", "batch-size", "lm loss", "grad-norm", "iteration-time", "tokens-per-second"})
    for (int64_t step : {3, 6})
      EXPECT_EQ(scalars.count(std::make_pair(std::string(tag), step)), 1u) << tag << " at " << step;
  for (const char* tag : {"lm loss validation", "lm loss validation ppl", "lm loss test"})
    EXPECT_EQ(scalars.count(std::make_pair(std::string(tag), int64_t{6})), 1u) << tag;
  // As Megatron: TensorBoard has every iteration's own loss, the log line the mean of its window
  // of 3 iterations.
  std::regex re("iteration +([0-9]+)/ .*lm loss: ([0-9.E+-]+) \\|");
  int matched = 0;
  for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it, ++matched) {
    const int64_t step = std::stoll((*it)[1]);
    double mean = 0;
    for (int64_t i = step - 2; i <= step; ++i) {
      ASSERT_EQ(scalars.count(std::make_pair(std::string("lm loss"), i)), 1u) << i;
      mean += scalars[std::make_pair(std::string("lm loss"), i)] / 3.0;
    }
    const double printed = std::stod((*it)[2]);
    EXPECT_NEAR(mean, printed, 1e-5 * printed);
  }
  EXPECT_EQ(matched, 2) << log;
  const float batch_size = scalars[std::make_pair(std::string("batch-size"), int64_t{6})];
  EXPECT_FLOAT_EQ(batch_size, 8.0f);
}

TEST(TensorBoard, UnwritableDirectoryIsOneLineError) {
  const dtk_test::Result r =
      dtk_test::run_dtk(std::string("train --config ") + DTK_SOURCE_DIR +
                            "/configs/gpt-tiny.pbtxt --dataset synthetic --set train.train_iters=2 "
                            "--set lr.lr_warmup_iters=0 --set logging.tensorboard_dir=/proc/dtk_no",
                        120);
  const std::string& log = r.out;
  EXPECT_EQ(r.code, 1) << log;
  // Found before any work (check_output_paths, train/run_setup.hpp), one line naming the option.
  EXPECT_NE(log.find("dtk: error: logging.tensorboard_dir '/proc/dtk_no': cannot create the directory"),
            std::string::npos)
      << log;
}
