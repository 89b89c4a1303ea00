// Crash safety, as a guarantee the suite keeps (synchronous and asynchronous saves): a run saving every iteration is
// SIGKILLed again and again — half the time at a random moment, half the time the instant a save's temporary directory
// appears (mid-save for certain) — and restarted from its save directory each time. After every
// kill the tracker's checkpoint must be complete (`dtk checkpoint inspect`, every SHA-256
// verified), the restart must resume from it, and every iteration any of the runs printed must
// equal the uninterrupted run's, to the printed digit (dropout on).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../common/run_dtk.hpp"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::vector<std::string> split(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> out;
  std::string w;
  while (in >> w) out.push_back(w);
  return out;
}

// `dtk` with these arguments, output to `log`; the pid (exec'd directly: a kill hits dtk itself).
pid_t spawn(const std::string& args, const std::string& log) {
  std::vector<std::string> words = split(args);
  const pid_t pid = ::fork();
  if (pid == 0) {
    FILE* f = std::freopen(log.c_str(), "w", stdout);
    if (!f || ::dup2(STDOUT_FILENO, STDERR_FILENO) < 0) ::_exit(127);
    std::vector<char*> argv{const_cast<char*>(DTK_BIN)};
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    ::execv(DTK_BIN, argv.data());
    ::_exit(127);
  }
  return pid;
}

// Waits for `pid` at most `seconds`; kills it (a hang) after that. The exit status, -signal if killed.
int finish(pid_t pid, double seconds) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1000;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

bool has_save_temporary(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("iter_", 0) == 0 && e.path().filename().string().find(".tmp-") != std::string::npos)
      return true;
  return false;
}

std::map<int, std::string> losses(const std::string& log) { return dtk_test::printed_losses(log); }

// A very small model so that saves (write + fsync + rename) are a large part of each iteration.
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --set dataset.vocab_size=64 "
                           "--set model.vocab_size=64 --set model.num_layers=1 --set model.hidden_size=32 "
                           "--set model.hidden_dropout=0.1 --set optimizer.name=adamw --set train.seq_length=16 "
                           "--set train.micro_batch_size=4 --set train.global_batch_size=4 "
                           "--set train.train_iters=100000 --set logging.log_interval=1 --set lr.lr_warmup_iters=10 "
                           "--set eval.eval_interval=1000000 --threads 1 ";

}  // namespace

// `kills` runs killed and restarted, checked as the top of this file says; `saving`: the checkpoint settings beyond
// save, save_interval=1 and keep_last=3 (checkpoint.async_save, say).
static void kill_and_resume(const std::string& name, int kills, const std::string& saving) {
  const std::string dir = dtk_test::fresh_dir(DTK_TEST_TMP, name);
  const std::string save = dir + "/ck";
  std::mt19937 gen(20261124);
  std::map<int, std::string> seen;  // iteration -> loss, from every run
  int mid_save = 0, resumed = 0, max_iteration = 0;
  const auto start = Clock::now();
  for (int k = 0; k < kills; ++k) {
    const bool tracked = fs::exists(save + "/latest_checkpointed_iteration.txt");
    const std::string log = dir + "/run" + std::to_string(k) + ".log";
    const pid_t pid =
        spawn(kTrain + "--set checkpoint.save=" + save + " --set checkpoint.save_interval=1 " +
                  "--set checkpoint.keep_last=3 " + saving + (tracked ? " --set checkpoint.load=" + save : ""),
              log);
    ASSERT_GT(pid, 0);
    bool killed_mid_save = false;
    if (k % 2 == 0) {
      // A random moment: from process start-up to well into training.
      std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 2500)(gen)));
    } else {
      // The instant a save's temporary directory appears, after a few random saves.
      const int skip = std::uniform_int_distribution<int>(0, 5)(gen);
      const auto deadline = Clock::now() + std::chrono::seconds(60);
      int appeared = 0;
      bool was = false;
      while (Clock::now() < deadline) {
        const bool now = has_save_temporary(save);
        if (now && !was && appeared++ == skip) {
          killed_mid_save = true;
          break;
        }
        was = now;
        int status = 0;
        if (::waitpid(pid, &status, WNOHANG) == pid) FAIL() << "dtk exited early:\n" << read(log);
        std::this_thread::sleep_for(std::chrono::microseconds(300));
      }
      ASSERT_TRUE(killed_mid_save) << "no save started within 60 s:\n" << read(log);
    }
    ::kill(pid, SIGKILL);
    ASSERT_EQ(finish(pid, 30), -SIGKILL) << read(log);
    mid_save += killed_mid_save || has_save_temporary(save);

    const std::string out = read(log);
    ASSERT_EQ(out.find("dtk: error"), std::string::npos) << out;
    if (tracked) {
      // It resumed from the tracker's checkpoint (unless killed before it got that far).
      const bool loaded = out.find(" loaded checkpoint from " + save + " at iteration ") != std::string::npos;
      resumed += loaded;
    }
    for (const auto& [it, loss] : losses(out)) {
      auto [where, fresh] = seen.emplace(it, loss);
      EXPECT_EQ(where->second, loss) << "iteration " << it << " printed differently by two runs (run " << k << ")";
      max_iteration = std::max(max_iteration, it);
    }
    // The tracker's checkpoint is complete and every file matches its SHA-256.
    if (fs::exists(save + "/latest_checkpointed_iteration.txt")) {
      const dtk_test::Result inspect = dtk_test::run_dtk("checkpoint inspect " + save, 60);
      ASSERT_EQ(inspect.code, 0) << "after kill " << k << ":\n" << inspect.out;
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("%d kills in %.0f s: %d mid-save, %d runs resumed from the tracker's checkpoint, %d iterations reached\n",
              kills, seconds, mid_save, resumed, max_iteration);
  EXPECT_GE(mid_save, kills / 2);
  EXPECT_GE(resumed, kills / 4);
  ASSERT_GT(max_iteration, 10);

  // A last run, not killed: resumes, cleans up what the kills left, and goes two iterations on.
  const int last = std::stoi(read(save + "/latest_checkpointed_iteration.txt"));
  const dtk_test::Result final_run =
      dtk_test::run_dtk(kTrain + "--set checkpoint.save=" + save + " --set checkpoint.save_interval=1 " +
                            "--set checkpoint.keep_last=3 " + saving + " --set checkpoint.load=" + save +
                            " --set train.exit_interval=" + std::to_string(last + 2),
                        120);
  ASSERT_EQ(final_run.code, 0) << final_run.out;
  EXPECT_FALSE(has_save_temporary(save));
  // The exit's checkpoint is published before the line that says to resume from it.
  EXPECT_EQ(read(save + "/latest_checkpointed_iteration.txt"), std::to_string(last + 2) + "\n");
  const size_t saved_at = final_run.out.find(" saved checkpoint at iteration " + std::to_string(last + 2) + " ");
  ASSERT_NE(saved_at, std::string::npos) << final_run.out;
  EXPECT_LT(saved_at, final_run.out.find(" exiting program ")) << final_run.out;
  for (const auto& [it, loss] : losses(final_run.out)) seen.emplace(it, loss);

  // The uninterrupted run: every iteration any run printed, to the printed digit.
  const int upto = std::max(max_iteration, last + 2);
  const dtk_test::Result reference =
      dtk_test::run_dtk(kTrain + "--set train.exit_interval=" + std::to_string(upto), 300);
  ASSERT_EQ(reference.code, 0) << reference.out;
  const auto expected = losses(reference.out);
  ASSERT_EQ(static_cast<int>(expected.size()), upto) << reference.out;
  for (const auto& [it, loss] : seen) EXPECT_EQ(loss, expected.at(it)) << "iteration " << it;
}

TEST(CrashSafety, KilledAtRandomMomentsAlwaysResumesFromACompleteCheckpoint) { kill_and_resume("crash", 24, ""); }

// checkpoint.async_save: the kills land while a background thread writes (the instant its
// temporary directory appears, or anywhere), with the training thread a step ahead.
TEST(CrashSafety, AsyncSavesKilledAtRandomMomentsAlwaysResumeFromACompleteCheckpoint) {
  kill_and_resume("crash-async", 12, "--set checkpoint.async_save=true");
}
