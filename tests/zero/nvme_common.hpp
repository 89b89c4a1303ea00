// What the two disk-tier suites (nvme_test.cpp: optimizer state on disk; nvme_param_test.cpp:
// parameters on disk) share: the small GPT they train and their checks.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "../common/curves.hpp"
#include "../common/run_dtk.hpp"

namespace zero_nvme_test {

// A small GPT (as zero_train_test.cpp's), `iterations` iterations, clipping active.
inline std::string small_gpt(int iterations) {
  return std::string("train --config ") + DTK_SOURCE_DIR +
         "/configs/gpt-tiny.pbtxt --dataset synthetic --threads 1 "
         "--set model.hidden_dropout=0 --set model.attention_dropout=0 "
         "--set model.vocab_size=512 --set dataset.vocab_size=512 --set train.seq_length=32 "
         "--set train.micro_batch_size=2 --set train.global_batch_size=8 "
         "--set train.train_iters=" +
         std::to_string(iterations) +
         " --set train.clip_grad=0.3 --set lr.lr_warmup_iters=2 "
         "--set logging.log_interval=1 --set eval.eval_interval=0 --set eval.eval_iters=1 ";
}

// The swap files (*.swap) in `dir`.
inline int swap_files_in(const std::string& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) n += e.path().extension() == ".swap";
  return n;
}

// Exactly equal (the same fp32 arithmetic in the same order), iteration by iteration.
inline void expect_identical(const dtk_test::Curve& want, const dtk_test::Curve& got, const std::string& what) {
  ASSERT_EQ(got.loss.size(), want.loss.size()) << what << "\n" << got.run.out;
  for (const auto& [it, loss] : want.loss) {
    EXPECT_EQ(got.loss.at(it), loss) << what << ", lm loss at iteration " << it;
    EXPECT_EQ(got.norm.at(it), want.norm.at(it)) << what << ", grad norm at iteration " << it;
  }
}

// A checkpoint folder saved at 4 and 8 made to resume from 4.
inline void resume_from_4(const std::string& dir) {
  std::filesystem::remove_all(dir + "/iter_0000008");
  std::ofstream(dir + "/latest_checkpointed_iteration.txt") << "4\n";
}

// `dtk train` with the file-size limit `limit_kb` (SIGXFSZ ignored: a write past it fails instead
// of killing the process), as a disk too small for the swap file.
inline dtk_test::Result run_with_file_limit(const std::string& args, int limit_kb) {
  return dtk_test::run_shell("bash -c \"trap '' XFSZ; ulimit -f " + std::to_string(limit_kb) +
                             "; exec timeout -k 10 60 " + DTK_BIN + " " + args + "\" 2>&1");
}

}  // namespace zero_nvme_test
