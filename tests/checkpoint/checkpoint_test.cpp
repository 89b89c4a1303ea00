// Checkpoints end to end through the `dtk` binary: Megatron's layout, exact resume (dropout on),
// atomic publication, one-line errors for bad checkpoints, and a 2-process data-parallel run.
#include <gtest/gtest.h>
#include <cctype>

#include <sys/wait.h>
#include <unistd.h>
#include "../common/run_dtk.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

using dtk_test::Result;
Result run(const std::string& args, int timeout_s = 300) { return dtk_test::run_dtk(args, timeout_s); }

std::string fresh_dir(const std::string& name) { return dtk_test::fresh_dir(DTK_TEST_TMP, name); }

// gpt-tiny on synthetic tokens with dropout on, 2 micro-batches per step, validation every 4.
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --set dataset.vocab_size=64 "
                           "--set model.vocab_size=64 --set model.hidden_dropout=0.1 "
                           "--set model.attention_dropout=0.1 --set optimizer.name=adamw "
                           "--set train.train_iters=8 --set train.global_batch_size=16 "
                           "--set logging.log_interval=1 --set lr.lr_warmup_iters=2 "
                           "--set eval.eval_interval=4 --set eval.eval_iters=1 ";

// iteration -> "lm loss: X | ... grad norm: Y" as printed (the strings, not parsed numbers).
std::map<int, std::string> train_lines(const std::string& log) {
  std::map<int, std::string> out;
  std::regex re(R"(iteration\s+(\d+)/\s*\d+ \|.*learning rate: (\S+) \|.*(lm loss: \S+) \|.*(grad norm: \S+) \|)");
  for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it)
    out[std::stoi((*it)[1])] = "lr " + (*it)[2].str() + " " + (*it)[3].str() + " " + (*it)[4].str();
  return out;
}

// Every validation line at `iteration`: the loop's and, at the last, the one after training.
std::string validation_line(const std::string& log, int iteration) {
  const std::regex re(" validation loss at iteration " + std::to_string(iteration) +
                      R"(( on validation set)? \| [^\n]*)");
  std::string out;
  for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it) out += (*it)[0].str() + "\n";
  return out;
}

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string read(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

using dtk_test::expect_one_line_error;

// One uninterrupted 8-iteration run saving every 4 iterations, shared by the tests below.
struct Reference {
  std::string dir;
  Result result;
};
const Reference& reference() {
  static const Reference ref = [] {
    Reference r;
    r.dir = fresh_dir("reference");
    r.result = run(kTrain + "--threads 2 --set checkpoint.save=" + r.dir + " --set checkpoint.save_interval=4");
    return r;
  }();
  return ref;
}

// A copy of the reference checkpoints whose tracker points at iteration 4.
std::string copy_at_iteration_4(const std::string& name) {
  const std::string d = fresh_dir(name);
  fs::copy(reference().dir, d, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  fs::remove_all(fs::path(d) / "iter_0000008");
  write(d + "/latest_checkpointed_iteration.txt", "4\n");
  return d;
}

const std::string kFile4 = "/iter_0000004/mp_rank_00/model_optim_rng.pt";

// Takes `dir`'s tracker back to iteration 4 (the later iterations removed), resumes there with
// `command` and expects iterations 5 to 8 as `uninterrupted` printed them.
void expect_resume_at_4(const std::string& dir, const std::string& command, const std::string& uninterrupted) {
  for (const char* later : {"/iter_0000006", "/iter_0000008"}) fs::remove_all(dir + later);
  write(dir + "/latest_checkpointed_iteration.txt", "4\n");
  const Result resumed = run(command + "--set checkpoint.load=" + dir, 300);
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  const auto a = train_lines(uninterrupted), b = train_lines(resumed.out);
  ASSERT_EQ(b.size(), 4u) << resumed.out;  // iterations 5..8 only
  for (int it = 5; it <= 8; ++it) EXPECT_EQ(a.at(it), b.count(it) ? b.at(it) : "") << "iteration " << it;
  EXPECT_EQ(validation_line(uninterrupted, 8), validation_line(resumed.out, 8));
}

}  // namespace

TEST(Checkpoint, MegatronLayoutAndLogLines) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  EXPECT_TRUE(fs::is_regular_file(ref.dir + kFile4));
  EXPECT_TRUE(fs::is_regular_file(ref.dir + "/iter_0000008/mp_rank_00/model_optim_rng.pt"));
  EXPECT_EQ(read(ref.dir + "/latest_checkpointed_iteration.txt"), "8\n");
  for (const auto& e : fs::directory_iterator(ref.dir))  // no temporary left behind
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  for (int it : {4, 8})
    EXPECT_NE(ref.result.out.find(" saved checkpoint at iteration " + std::to_string(it) + " to " + ref.dir + " ("),
              std::string::npos)
        << ref.result.out;
  // A torch.save-compatible zip archive ("PK" magic).
  EXPECT_EQ(read(ref.dir + kFile4).substr(0, 2), "PK");
}

// (a) resumed == uninterrupted, to the printed digit, dropout included.
TEST(Checkpoint, ResumeReproducesUninterruptedRun) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  const std::string d = copy_at_iteration_4("resume");
  const Result r = run(kTrain + "--threads 2 --set checkpoint.load=" + d);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(" loaded checkpoint from " + d + " at iteration 4\n"), std::string::npos) << r.out;
  const auto a = train_lines(ref.result.out), b = train_lines(r.out);
  ASSERT_EQ(a.size(), 8u) << ref.result.out;
  ASSERT_EQ(b.size(), 4u) << r.out;  // iterations 5..8 only
  for (int it = 5; it <= 8; ++it) {
    ASSERT_TRUE(b.count(it)) << it << "\n" << r.out;
    EXPECT_EQ(a.at(it), b.at(it)) << "iteration " << it;
  }
  // Validation continues with the batches the uninterrupted run used.
  EXPECT_FALSE(validation_line(ref.result.out, 8).empty()) << ref.result.out;
  EXPECT_EQ(validation_line(ref.result.out, 8), validation_line(r.out, 8));
}

// A pid that no process has now: a child that has exited and been reaped.
int dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  ::waitpid(pid, nullptr, 0);
  return static_cast<int>(pid);
}

std::string host_name() {
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  std::string h = host;
  for (char& c : h)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_') c = '_';
  return h;
}

// (b) atomicity: leftovers of a crashed save do not matter; a re-save replaces completely; the
// leftovers of dead processes of this machine are removed (at load and at save), a live
// process's and another machine's are not.
TEST(Checkpoint, LeftoversOfACrashedSaveAreIgnoredAndCleanedUp) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  const std::string d = copy_at_iteration_4("leftovers");
  const std::string dead_dir = "iter_0000004.tmp-" + std::to_string(dead_pid());
  const std::string dead_tracker =
      "latest_checkpointed_iteration.txt.tmp-" + host_name() + "-" + std::to_string(dead_pid());
  const std::string live_dir = "iter_0000008.tmp-" + host_name() + "-" + std::to_string(::getpid());
  const std::string other_host = "iter_0000008.tmp-some-other-host-" + std::to_string(dead_pid());
  for (const std::string& dir : {dead_dir, live_dir, other_host}) {
    fs::create_directories(d + "/" + dir + "/mp_rank_00");
    write(d + "/" + dir + "/mp_rank_00/model_optim_rng.pt", "half a file");
  }
  write(d + "/garbage", "not a checkpoint");
  write(d + "/" + dead_tracker, "8");  // an unfinished tracker update
  const Result r = run(kTrain + "--threads 2 --set checkpoint.load=" + d);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto a = train_lines(ref.result.out), b = train_lines(r.out);
  for (int it = 5; it <= 8; ++it) EXPECT_EQ(a.at(it), b.count(it) ? b.at(it) : "") << "iteration " << it;
  EXPECT_FALSE(fs::exists(d + "/" + dead_dir)) << "a dead process's temporary directory was kept";
  EXPECT_FALSE(fs::exists(d + "/" + dead_tracker));
  EXPECT_NE(r.out.find("left by a save whose process (pid "), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(d + "/" + live_dir)) << "a live process's temporary directory was removed";
  EXPECT_TRUE(fs::exists(d + "/" + other_host)) << "another machine's temporary directory was removed";

  // Saving an iteration that already exists replaces it whole and leaves no temporary behind.
  const Result again =
      run(kTrain + "--threads 2 --set train.train_iters=4 --set lr.lr_decay_iters=8 --set checkpoint.save=" + d);
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_EQ(read(d + "/latest_checkpointed_iteration.txt"), "4\n");
  EXPECT_EQ(read(d + kFile4).substr(0, 2), "PK");
  int tmp = 0;
  for (const auto& e : fs::directory_iterator(d))
    if (e.path().filename().string().find(".tmp-") != std::string::npos && e.path().filename() != live_dir &&
        e.path().filename() != other_host)
      ++tmp;
  EXPECT_EQ(tmp, 0);
}

// checkpoint.load_if_present (Megatron's --save X --load X): the first run finds nothing and starts
// from scratch, saying so; the same command line then resumes, equal to the uninterrupted run.
TEST(Checkpoint, LoadIfPresentStartsFreshThenResumes) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  const std::string d = fresh_dir("load-if-present") + "/ck";  // not there yet
  const std::string both =
      "--threads 2 --set lr.lr_decay_iters=8 --set checkpoint.save=" + d + " --set checkpoint.load=" + d + " ";
  // (checkpoint.fallback needs a load: a fresh start drops it with the load.)
  const Result first = run(
      kTrain + both + "--set train.train_iters=4 --set checkpoint.load_if_present=true --set checkpoint.fallback=true");
  ASSERT_EQ(first.code, 0) << first.out;
  EXPECT_NE(first.out.find("dtk: note: checkpoint.load '" + d +
                           "' holds no checkpoint yet: the run starts from scratch (checkpoint.load_if_present)"),
            std::string::npos)
      << first.out;
  EXPECT_EQ(read(d + "/latest_checkpointed_iteration.txt"), "4\n");
  const Result second = run(kTrain + both + "--set train.train_iters=8 --set checkpoint.load_if_present=true");
  ASSERT_EQ(second.code, 0) << second.out;
  EXPECT_EQ(second.out.find("holds no checkpoint yet"), std::string::npos) << second.out;
  const auto a = train_lines(ref.result.out), b = train_lines(second.out);
  EXPECT_EQ(b.count(4), 0u) << second.out;  // resumed after iteration 4
  for (int it = 5; it <= 8; ++it) EXPECT_EQ(a.at(it), b.count(it) ? b.at(it) : "") << "iteration " << it;
  // A save begun in the folder (an iter_* folder, no tracker) is not "nothing": its error stands.
  const std::string begun = fresh_dir("load-if-present-begun");
  fs::create_directories(begun + "/iter_0000004");
  expect_one_line_error(run(kTrain + "--set checkpoint.load_if_present=true --set checkpoint.load=" + begun),
                        begun + "/latest_checkpointed_iteration.txt");
}

// (c) bad inputs: one line naming the file (or the tensor), exit 1.
TEST(Checkpoint, BadCheckpointsAreOneLineErrors) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  const std::string missing = std::string(DTK_TEST_TMP) + "/no-such-checkpoint";
  expect_one_line_error(run(kTrain + "--set checkpoint.load=" + missing), missing);

  const std::string empty = fresh_dir("no-tracker");
  expect_one_line_error(run(kTrain + "--set checkpoint.load=" + empty), empty + "/latest_checkpointed_iteration.txt");

  const std::string bad_tracker = copy_at_iteration_4("bad-tracker");
  write(bad_tracker + "/latest_checkpointed_iteration.txt", "four\n");
  expect_one_line_error(run(kTrain + "--set checkpoint.load=" + bad_tracker),
                        bad_tracker + "/latest_checkpointed_iteration.txt");

  const std::string no_iter = copy_at_iteration_4("no-iter");
  write(no_iter + "/latest_checkpointed_iteration.txt", "12\n");
  expect_one_line_error(
      run(kTrain + "--set checkpoint.load=" + no_iter),
      no_iter + "/iter_0000012 does not exist (named by " + no_iter + "/latest_checkpointed_iteration.txt)");

  const std::string truncated = copy_at_iteration_4("truncated");
  fs::resize_file(truncated + kFile4, fs::file_size(truncated + kFile4) / 2);
  expect_one_line_error(run(kTrain + "--set checkpoint.load=" + truncated), truncated + kFile4);

  const std::string garbage = copy_at_iteration_4("garbage");
  write(garbage + kFile4, "this is not a pickle");
  expect_one_line_error(run(kTrain + "--set checkpoint.load=" + garbage), garbage + kFile4);

  const std::string shape = copy_at_iteration_4("shape");
  // Another shape is another model: refused from the model the checkpoint records, before any
  // tensor is read (checkpoint_model.hpp).
  const Result r = run(kTrain + "--set model.hidden_size=32 --set checkpoint.load=" + shape);
  expect_one_line_error(r, "checkpoint " + shape + " was trained with model.hidden_size=64 but this run has 32");

  // Megatron's distributed checkpoint (--ckpt-format torch_dist): named as such, with Megatron's
  // conversion to the torch format DTK reads, by a load and by inspect.
  const std::string dist = fresh_dir("megatron-torch-dist");
  fs::create_directories(dist + "/iter_0000010");
  write(dist + "/latest_checkpointed_iteration.txt", "10\n");
  write(dist + "/iter_0000010/metadata.json", "{\"sharded_backend\": \"torch_dist\", \"sharded_backend_version\": 1}");
  write(dist + "/iter_0000010/__0_0.distcp", "x");
  const std::string why = dist + "/iter_0000010 is a Megatron distributed checkpoint (--ckpt-format torch_dist";
  expect_one_line_error(run(kTrain + "--set checkpoint.load=" + dist), why);
  const Result inspected = run("checkpoint inspect " + dist);
  EXPECT_NE(inspected.code, 0);
  EXPECT_NE(inspected.out.find("--ckpt-convert-format torch --ckpt-convert-save"), std::string::npos) << inspected.out;
}

// (d) two data-parallel processes: one file (data-parallel rank 0 writes), identical resume.
TEST(Checkpoint, DataParallelRunSavesOnceAndResumes) {
  const std::string d = fresh_dir("dp2");
  const std::string launch = "launch --nproc_per_node 2 " + kTrain + "--threads 1 ";
  const Result full = run(launch + "--set checkpoint.save=" + d + " --set checkpoint.save_interval=4", 300);
  ASSERT_EQ(full.code, 0) << full.out;
  EXPECT_TRUE(fs::is_regular_file(d + kFile4));
  EXPECT_FALSE(fs::exists(d + "/iter_0000004/mp_rank_01"));
  size_t n = 0;
  for (size_t at = full.out.find(" saved checkpoint at iteration 4 "); at != std::string::npos;
       at = full.out.find(" saved checkpoint at iteration 4 ", at + 1))
    ++n;
  EXPECT_EQ(n, 1u) << full.out;  // printed by rank 0 only
  expect_resume_at_4(d, launch, full.out);
}

// A checkpoint of a tensor-parallel run has one file per TP rank; another TP size is refused
// with one line naming the file.
TEST(Checkpoint, TensorParallelSizeMustMatch) {
  const std::string d = fresh_dir("tp2");
  const Result saved = run("launch --nproc_per_node 2 " + kTrain +
                               "--threads 1 --set train.train_iters=4 --set distributed.tensor_model_parallel_size=2 "
                               "--set checkpoint.save=" +
                               d,
                           300);
  ASSERT_EQ(saved.code, 0) << saved.out;
  EXPECT_TRUE(fs::is_regular_file(d + kFile4));
  EXPECT_TRUE(fs::is_regular_file(d + "/iter_0000004/mp_rank_01/model_optim_rng.pt"));
  expect_one_line_error(run(kTrain + "--threads 2 --set checkpoint.load=" + d),
                        d + kFile4 + " was saved with tensor-parallel size 2, this run has 1");
}

// The llama plugin resumes exactly too (dropout on: its generator states are in the checkpoint),
// with grouped-query attention and its untied output layer.
TEST(Checkpoint, LlamaResumeReproducesUninterruptedRun) {
  const std::string llama =
      std::string("train --config ") + DTK_SOURCE_DIR +
      "/configs/llama-tiny.pbtxt --dataset synthetic --set dataset.vocab_size=64 "
      "--set model.vocab_size=64 --set model.hidden_dropout=0.1 "
      "--set model.attention_dropout=0.1 --set train.train_iters=8 "
      "--set train.global_batch_size=16 --set logging.log_interval=1 "
      "--set lr.lr_warmup_iters=2 --set eval.eval_interval=4 --set eval.eval_iters=1 --threads 2 ";
  const std::string full_dir = fresh_dir("llama-full");
  const Result full = run(llama + "--set checkpoint.save=" + full_dir + " --set checkpoint.save_interval=4");
  ASSERT_EQ(full.code, 0) << full.out;
  fs::remove_all(fs::path(full_dir) / "iter_0000008");
  write(full_dir + "/latest_checkpointed_iteration.txt", "4\n");
  const Result resumed = run(llama + "--set checkpoint.load=" + full_dir);
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  const auto a = train_lines(full.out), b = train_lines(resumed.out);
  ASSERT_EQ(a.size(), 8u) << full.out;
  ASSERT_EQ(b.size(), 4u) << resumed.out;
  for (int it = 5; it <= 8; ++it) {
    ASSERT_TRUE(b.count(it)) << it << "\n" << resumed.out;
    EXPECT_EQ(a.at(it), b.at(it)) << "iteration " << it;
  }
}

// Megatron's --no-save-optim and --no-save-rng: the file leaves the optimizer's state and the
// generators' out, a load that asks for either is one line naming the setting, and with
// no_load_optim and no_load_rng it loads as the full checkpoint does with them (the same losses,
// dropout on).
TEST(Checkpoint, SavedWithoutOptimizerOrRngLoadsOnlyWithoutThem) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  const std::string slim = fresh_dir("no-save");
  const Result saved = run(kTrain +
                           "--threads 2 --set train.exit_interval=4 --set checkpoint.no_save_optim=true "
                           "--set checkpoint.no_save_rng=true --set checkpoint.save=" +
                           slim);
  ASSERT_EQ(saved.code, 0) << saved.out;
  EXPECT_NE(saved.out.find(", without the optimizer's state, without the RNG states)"), std::string::npos) << saved.out;
  // adamw keeps two moments per weight: the file is about a third of the full one.
  EXPECT_LT(fs::file_size(slim + kFile4), fs::file_size(ref.dir + kFile4) / 2);
  const Result inspected = run("checkpoint inspect " + slim);
  EXPECT_EQ(inspected.code, 0) << inspected.out;
  EXPECT_NE(inspected.out.find("saved without the optimizer's state (checkpoint.no_save_optim)"), std::string::npos)
      << inspected.out;
  EXPECT_NE(inspected.out.find("saved without the host's random generators (checkpoint.no_save_rng)"),
            std::string::npos)
      << inspected.out;

  expect_one_line_error(run(kTrain + "--threads 2 --set checkpoint.load=" + slim),
                        slim + kFile4 +
                            " was saved without the optimizer's state (checkpoint.no_save_optim, --no-save-optim): "
                            "load it with checkpoint.no_load_optim=true");
  expect_one_line_error(run(kTrain + "--threads 2 --set checkpoint.no_load_optim=true --set checkpoint.load=" + slim),
                        slim + kFile4 +
                            " was saved without the host's random generators (checkpoint.no_save_rng, "
                            "--no-save-rng): load it with checkpoint.no_load_rng=true");

  const std::string without = " --set checkpoint.no_load_optim=true --set checkpoint.no_load_rng=true ";
  const Result from_slim = run(kTrain + "--threads 2" + without + "--set checkpoint.load=" + slim);
  const Result from_full =
      run(kTrain + "--threads 2" + without + "--set checkpoint.load=" + copy_at_iteration_4("full"));
  ASSERT_EQ(from_slim.code, 0) << from_slim.out;
  ASSERT_EQ(from_full.code, 0) << from_full.out;
  const auto a = train_lines(from_full.out), b = train_lines(from_slim.out);
  ASSERT_EQ(b.size(), 4u) << from_slim.out;
  for (int it = 5; it <= 8; ++it) EXPECT_EQ(a.at(it), b.count(it) ? b.at(it) : "") << "iteration " << it;
  // Not the reference's resume: the optimizer and the schedule started fresh.
  EXPECT_NE(train_lines(ref.result.out).at(6), b.at(6));
}

// A ZeRO run's --no-save-optim leaves its shard files out: only the main file of each rank's
// model is written, and the run continues from it with no_load_optim.
TEST(Checkpoint, ZeroSavedWithoutOptimizerWritesNoShards) {
  const std::string d = fresh_dir("zero-no-save");
  const std::string launch =
      "launch --nproc_per_node 2 " + kTrain + "--threads 1 --strategy zero --set strategy.stage=2 ";
  const Result saved = run(launch +
                               "--set train.exit_interval=4 --set checkpoint.no_save_optim=true "
                               "--set checkpoint.save=" +
                               d,
                           300);
  ASSERT_EQ(saved.code, 0) << saved.out;
  EXPECT_TRUE(fs::is_regular_file(d + kFile4));
  EXPECT_FALSE(fs::exists(d + "/iter_0000004/mp_rank_00/optim_dp_rank_000.pt"));
  EXPECT_FALSE(fs::exists(d + "/iter_0000004/mp_rank_00/optim_dp_rank_001.pt"));
  EXPECT_EQ(read(d + "/iter_0000004/SHA256SUMS").substr(64), "  mp_rank_00/model_optim_rng.pt\n");
  const Result resumed = run(launch + "--set checkpoint.no_load_optim=true --set checkpoint.load=" + d, 300);
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_NE(resumed.out.find(" loaded checkpoint from " + d + " at iteration 4\n"), std::string::npos) << resumed.out;
  EXPECT_EQ(train_lines(resumed.out).size(), 4u) << resumed.out;
}

// checkpoint.async_save: the interval saves are written in the background and published later;
// training is the reference's to the printed digit, the last save (which ends the run) is written
// at once, and each background checkpoint resumes exactly.
TEST(Checkpoint, AsyncSavesTrainAsTheReferenceAndResumeExactly) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  const std::string d = fresh_dir("async");
  const Result r = run(kTrain + "--threads 2 --set checkpoint.async_save=true --set checkpoint.save=" + d +
                       " --set checkpoint.save_interval=2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(train_lines(r.out), train_lines(ref.result.out));
  size_t previous = 0;
  for (int it : {2, 4, 6, 8}) {
    const size_t at = r.out.find(" saved checkpoint at iteration " + std::to_string(it) + " to " + d + " (");
    ASSERT_NE(at, std::string::npos) << r.out;
    EXPECT_GT(at, r.out.find(" iteration        " + std::to_string(it) + "/")) << r.out;
    EXPECT_GT(at, previous) << "published out of order:\n" << r.out;
    previous = at;
    const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
    EXPECT_EQ(line.find(" written in the background in ") != std::string::npos, it < 8) << line;
    EXPECT_EQ(line.find(" s, training waited ") != std::string::npos, it < 8) << line;
  }
  EXPECT_EQ(read(d + "/latest_checkpointed_iteration.txt"), "8\n");
  for (const auto& e : fs::directory_iterator(d))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
  const Result inspect = run("checkpoint inspect " + d, 60);
  EXPECT_EQ(inspect.code, 0) << inspect.out;
  // Iteration 4, published while iterations 5 and 6 trained, resumes as the reference's does.
  expect_resume_at_4(d, kTrain + "--threads 2 ", ref.result.out);
}

// ZeRO's shard files, written by each of two ranks on its own thread: the run publishes each
// save once and resumes from a background one as it trained on.
TEST(Checkpoint, AsyncSavesOfZeroShardsResumeExactly) {
  const std::string d = fresh_dir("async-zero");
  const std::string launch =
      "launch --nproc_per_node 2 " + kTrain + "--threads 1 --strategy zero --set strategy.stage=1 ";
  const Result full =
      run(launch + "--set checkpoint.async_save=true --set checkpoint.save_interval=2 --set checkpoint.save=" + d, 300);
  ASSERT_EQ(full.code, 0) << full.out;
  for (const char* f : {"/model_optim_rng.pt", "/optim_dp_rank_000.pt", "/optim_dp_rank_001.pt"})
    EXPECT_TRUE(fs::is_regular_file(d + "/iter_0000004/mp_rank_00" + f)) << f;
  const std::string line = " saved checkpoint at iteration 4 to " + d + " (";
  const size_t at = full.out.find(line);
  ASSERT_NE(at, std::string::npos) << full.out;
  EXPECT_EQ(full.out.find(line, at + 1), std::string::npos) << "printed twice:\n" << full.out;
  EXPECT_NE(full.out.find(" written in the background in ", at), std::string::npos) << full.out;
  expect_resume_at_4(d, launch, full.out);
}

// logging.log_progress (Megatron's --log-progress): progress.txt in the save directory, in
// Megatron's format, its operation count carried by the checkpoints across a resume; an async
// save is logged when started and when published, keep_last's removals as they happen.
TEST(Checkpoint, ProgressLogIsMegatronsAndCountsOperationsAcrossResumes) {
  const std::string d = fresh_dir("progress");
  const std::string args = kTrain + "--threads 2 --set train.train_iters=16 --set logging.log_progress=true " +
                           "--set checkpoint.save=" + d + " --set checkpoint.save_interval=4 ";
  const Result first = run(args + "--set train.exit_interval=8");
  ASSERT_EQ(first.code, 0) << first.out;
  const Result second =
      run(args + "--set checkpoint.load=" + d + " --set checkpoint.async_save=true --set checkpoint.keep_last=2");
  ASSERT_EQ(second.code, 0) << second.out;
  std::vector<std::vector<std::string>> lines;
  std::istringstream in(read(d + "/progress.txt"));
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> f;
    std::istringstream fields(line);
    for (std::string x; std::getline(fields, x, '\t');) f.push_back(x);
    ASSERT_GE(f.size(), 4u) << line;
    EXPECT_TRUE(std::regex_match(f[0], std::regex(R"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)"))) << line;
    EXPECT_EQ(f[1].rfind("Job ID: ", 0), 0u) << line;
    EXPECT_EQ(f[2], "# GPUs: 1") << line;
    lines.push_back(std::vector<std::string>(f.begin() + 3, f.end()));
  }
  std::vector<std::string> events;
  for (const auto& l : lines) events.push_back(l[0] + (l.size() > 1 ? " " + l[1] : ""));
  const std::vector<std::string> expected = {"Starting job",
                                             "Saved checkpoint Iteration: 4",
                                             "Saved checkpoint Iteration: 8",
                                             "Starting job",
                                             "Saving async checkpoint Iteration: 12",
                                             "Deleted checkpoint Iteration: 4",
                                             "Saved async checkpoint Iteration: 12",
                                             "Deleted checkpoint Iteration: 8",
                                             "Saved checkpoint Iteration: 16"};
  ASSERT_EQ(events, expected) << read(d + "/progress.txt");
  // The operations so far, saved with each checkpoint: the same per iteration in both jobs.
  std::map<int, double> flops;
  for (const auto& l : lines) {
    if (l.size() < 6) continue;
    EXPECT_EQ(l[2].rfind("Job throughput: ", 0), 0u);
    EXPECT_NE(l[2].find(" TFLOP/s/GPU"), std::string::npos);
    EXPECT_EQ(l[3].rfind("Cumulative throughput: ", 0), 0u);
    EXPECT_EQ(l[4].rfind("Floating-point operations: ", 0), 0u);
    EXPECT_EQ(l[5], "Tokens (in billions): 0.00");
    flops[std::stoi(l[1].substr(11))] = std::stod(l[4].substr(27));
  }
  ASSERT_EQ(flops.size(), 4u);
  ASSERT_GT(flops[4], 0);
  for (int it : {8, 12, 16}) EXPECT_NEAR(flops[it] / flops[4], it / 4.0, 0.01 * it / 4.0) << "iteration " << it;
  // Without a save directory there is nowhere to write it, as Megatron's: a note says so.
  const Result alone = run(kTrain + "--threads 2 --set train.train_iters=3 --set logging.log_progress=true");
  ASSERT_EQ(alone.code, 0) << alone.out;
  EXPECT_NE(alone.out.find(" > logging.log_progress has no effect without checkpoint.save"), std::string::npos)
      << alone.out;
  // A progress.txt this run cannot append to is refused before training.
  const std::string blocked = fresh_dir("progress-blocked");
  fs::create_directories(blocked + "/progress.txt");
  const Result refused = run(args.substr(0, args.find("--set checkpoint.save=")) + "--set checkpoint.save=" + blocked);
  expect_one_line_error(refused, "logging.log_progress: " + blocked + "/progress.txt exists and is not a file");
}
