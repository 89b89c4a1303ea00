// Checkpoint integrity: SHA-256 (FIPS vectors, both code paths, sha256sum as the outside reader),
// the SHA256SUMS manifest, damaged files named at load, checkpoint.fallback, keep_last rotation,
// and `dtk checkpoint inspect`.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <string>

#include "../common/run_dtk.hpp"
#include "dtk/core/checkpoint/checkpoint_catalog.hpp"
#include "dtk/core/checkpoint/sha256.hpp"

namespace fs = std::filesystem;

namespace {

using dtk_test::Result;
Result run(const std::string& args, int timeout_s = 300) { return dtk_test::run_dtk(args, timeout_s); }
std::string fresh_dir(const std::string& name) { return dtk_test::fresh_dir(DTK_TEST_TMP, name); }

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void write(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

Result shell(const std::string& cmd) { return dtk_test::run_shell("timeout 60 " + cmd + " 2>&1"); }

// A tiny model with dropout, saving every 2 iterations.
const std::string kTrain = std::string("train --config ") + DTK_SOURCE_DIR +
                           "/configs/gpt-tiny.pbtxt --dataset synthetic --set dataset.vocab_size=64 "
                           "--set model.vocab_size=64 --set model.hidden_dropout=0.1 --set optimizer.name=adamw "
                           "--set train.train_iters=6 --set logging.log_interval=1 --set lr.lr_warmup_iters=1 "
                           "--threads 1 ";

std::map<int, std::string> losses(const std::string& log) { return dtk_test::printed_losses(log); }

const std::string kFile4 = "/iter_0000004/mp_rank_00/model_optim_rng.pt";

// One uninterrupted run saving at 2, 4 and 6, shared by the tests below.
struct Reference {
  std::string dir;
  Result result;
};
const Reference& reference() {
  static const Reference ref = [] {
    Reference r;
    r.dir = fresh_dir("reference");
    r.result = run(kTrain + "--set checkpoint.save=" + r.dir + " --set checkpoint.save_interval=2");
    return r;
  }();
  return ref;
}

// A copy of the reference whose tracker names iteration 4 (iteration 6 removed).
std::string copy_at_4(const std::string& name) {
  const std::string d = fresh_dir(name);
  fs::copy(reference().dir, d, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  fs::remove_all(d + "/iter_0000006");
  write(d + "/latest_checkpointed_iteration.txt", "4\n");
  return d;
}

void flip_byte(const std::string& path, double where) {
  std::string data = read(path);
  data[static_cast<size_t>(static_cast<double>(data.size()) * where)] ^= 0x5a;
  write(path, data);
}

}  // namespace

TEST(Sha256, FipsVectorsOnBothCodePaths) {
  const std::string million(1000000, 'a');
  const std::pair<std::string, std::string> vectors[] = {
      {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
      {million, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"}};
  for (bool portable : {false, true}) {
    dtk::core::sha256_force_portable(portable);
    for (const auto& [text, hex] : vectors) EXPECT_EQ(dtk::core::sha256_hex(text.data(), text.size()), hex) << portable;
  }
  dtk::core::sha256_force_portable(false);
  std::printf("SHA extensions in use: %s\n", dtk::core::sha256_accelerated() ? "yes" : "no (portable code only)");
}

// Every length around the block and padding boundaries, fed in random pieces, agrees between the
// two code paths and with one-shot hashing.
TEST(Sha256, PiecewiseAndBothPathsAgree) {
  std::mt19937 gen(7);
  std::string data(1000, '\0');
  for (char& c : data) c = static_cast<char>(gen());
  for (size_t n = 0; n <= 300; ++n) {
    dtk::core::sha256_force_portable(true);
    const std::string portable = dtk::core::sha256_hex(data.data(), n);
    dtk::core::sha256_force_portable(false);
    EXPECT_EQ(dtk::core::sha256_hex(data.data(), n), portable) << n;
    dtk::core::Sha256 h;
    size_t done = 0;
    while (done < n) {
      const size_t piece = std::min<size_t>(n - done, gen() % 70);
      h.update(data.data() + done, piece);
      done += piece;
    }
    EXPECT_EQ(h.finish_hex(), portable) << n;
  }
}

// The manifest is sha256sum's: coreutils checks it, and it covers every file of the checkpoint.
TEST(CheckpointIntegrity, ManifestIsCheckedBySha256sum) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  for (const char* it : {"iter_0000002", "iter_0000004", "iter_0000006"}) {
    const std::string dir = ref.dir + "/" + it;
    EXPECT_EQ(read(dir + "/SHA256SUMS").substr(64), "  mp_rank_00/model_optim_rng.pt\n") << it;
    const Result r = shell("sh -c 'cd " + dir + " && sha256sum -c SHA256SUMS'");
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("mp_rank_00/model_optim_rng.pt: OK"), std::string::npos) << r.out;
  }
  // A sharded (ZeRO) save at DP2 lists the main file and both shard files.
  const std::string z = fresh_dir("zero");
  const Result r = run("launch --nproc_per_node 2 " + kTrain +
                       "--set train.train_iters=2 --set train.global_batch_size=16 --strategy zero "
                       "--set strategy.stage=2 --set checkpoint.save=" + z + " --set checkpoint.save_interval=2");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string sums = read(z + "/iter_0000002/SHA256SUMS");
  EXPECT_NE(sums.find("  mp_rank_00/model_optim_rng.pt\n"), std::string::npos) << sums;
  EXPECT_NE(sums.find("  mp_rank_00/optim_dp_rank_000.pt\n"), std::string::npos) << sums;
  EXPECT_NE(sums.find("  mp_rank_00/optim_dp_rank_001.pt\n"), std::string::npos) << sums;
  EXPECT_EQ(shell("sh -c 'cd " + z + "/iter_0000002 && sha256sum -c SHA256SUMS'").code, 0);
  const Result inspect = run("checkpoint inspect " + z);
  EXPECT_EQ(inspect.code, 0) << inspect.out;
  EXPECT_NE(inspect.out.find("optimizer state sharded over 2 data-parallel files"), std::string::npos) << inspect.out;
  EXPECT_NE(inspect.out.find("complete: yes (3 files, every checksum matches)"), std::string::npos) << inspect.out;
}

// A byte flipped inside tensor data: the load names the file (LibTorch's reader alone may not
// notice), suggests the fallback; with checkpoint.fallback the older checkpoint loads and the run
// continues exactly as the uninterrupted one did from there.
TEST(CheckpointIntegrity, DamagedFileIsNamedAndFallbackLoadsTheOlderOne) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  const std::string d = copy_at_4("damaged");
  flip_byte(d + kFile4, 0.5);
  const Result refused = run(kTrain + "--set checkpoint.load=" + d);
  dtk_test::expect_one_line_error(refused, "checkpoint " + d + kFile4 + " is damaged: its SHA-256 is ");
  EXPECT_NE(refused.out.find("checkpoint.fallback=true loads iteration 2"), std::string::npos) << refused.out;

  const Result inspect = run("checkpoint inspect " + d);
  EXPECT_EQ(inspect.code, 1) << inspect.out;
  EXPECT_NE(inspect.out.find("mp_rank_00/model_optim_rng.pt"), std::string::npos);
  EXPECT_NE(inspect.out.find("DAMAGED: sha256"), std::string::npos) << inspect.out;
  EXPECT_NE(inspect.out.find("complete: NO: " + d + kFile4 + " is damaged"), std::string::npos) << inspect.out;
  dtk_test::expect_one_line_error(inspect, "checkpoint inspect: " + d + kFile4 + " is damaged");
  // The offline readers verify too, and say how to read it anyway (they take no --set).
  const Result convert = run("checkpoint convert " + d + " " + d + "-tp2 --tensor_model_parallel_size 2");
  dtk_test::expect_one_line_error(convert, "checkpoint " + d + kFile4 + " is damaged: its SHA-256 is ");
  EXPECT_NE(convert.out.find(" bytes now; --noverify loads it anyway)"), std::string::npos) << convert.out;
  EXPECT_EQ(refused.out.find("--noverify"), std::string::npos) << refused.out;  // train names its own field
  const Result converted = run("checkpoint convert " + d + " " + d + "-tp2 --tensor_model_parallel_size 2 --noverify");
  EXPECT_EQ(converted.code, 0) << converted.out;
  // The older iteration is complete on its own.
  const Result older = run("checkpoint inspect " + d + "/iter_0000002/");
  EXPECT_EQ(older.code, 0) << older.out;
  EXPECT_NE(older.out.find("iteration 2: " + d + "/iter_0000002"), std::string::npos) << older.out;

  const Result fell_back = run(kTrain + "--set checkpoint.load=" + d + " --set checkpoint.fallback=true");
  ASSERT_EQ(fell_back.code, 0) << fell_back.out;
  EXPECT_NE(fell_back.out.find(" checkpoint.fallback: iteration 4: checkpoint " + d + kFile4 + " is damaged"),
            std::string::npos)
      << fell_back.out;
  EXPECT_NE(fell_back.out.find("; falling back to iteration 2\n"), std::string::npos) << fell_back.out;
  EXPECT_NE(fell_back.out.find(" loaded checkpoint from " + d + " at iteration 2\n"), std::string::npos);
  const auto a = losses(ref.result.out), b = losses(fell_back.out);
  ASSERT_EQ(b.size(), 4u) << fell_back.out;
  for (int it = 3; it <= 6; ++it) EXPECT_EQ(a.at(it), b.at(it)) << "iteration " << it;

  // A file missing from the tracker's iteration, and a tracker that holds garbage, fall back too.
  const std::string m = copy_at_4("missing");
  fs::remove(m + kFile4);
  // The verdict inspect and fallback use: the manifest lists a file that is gone.
  dtk_test::expect_one_line_error(run(kTrain + "--set checkpoint.load=" + m),
                                  "checkpoint: iteration 4 of " + m + " is incomplete: " + m + kFile4 +
                                      " is missing (listed in SHA256SUMS)");
  const Result missing = run(kTrain + "--set checkpoint.load=" + m + " --set checkpoint.fallback=true");
  EXPECT_EQ(missing.code, 0) << missing.out;
  EXPECT_NE(missing.out.find(" loaded checkpoint from " + m + " at iteration 2\n"), std::string::npos) << missing.out;
  const std::string g = copy_at_4("garbage");
  write(g + "/latest_checkpointed_iteration.txt", "garbage");
  const Result garbage = run(kTrain + "--set checkpoint.load=" + g + " --set checkpoint.fallback=true");
  EXPECT_EQ(garbage.code, 0) << garbage.out;
  EXPECT_NE(garbage.out.find("checkpoint.fallback: the tracker: "), std::string::npos) << garbage.out;
  EXPECT_NE(garbage.out.find(" loaded checkpoint from " + g + " at iteration 4\n"), std::string::npos) << garbage.out;

  // A sound checkpoint the run cannot take (another optimizer) is not damage: no fallback is
  // suggested, and checkpoint.fallback does not try the older one, which cannot match either.
  const std::string o = copy_at_4("other_optimizer");
  const Result other = run(kTrain + "--set checkpoint.load=" + o + " --set optimizer.name=sgd");
  dtk_test::expect_one_line_error(other, "optimizer plugin 'sgd' did not take ");
  EXPECT_EQ(other.out.find("checkpoint.fallback"), std::string::npos) << other.out;
  const Result other_fallback = run(kTrain + "--set checkpoint.load=" + o + " --set optimizer.name=sgd --set checkpoint.fallback=true");
  dtk_test::expect_one_line_error(other_fallback, "optimizer plugin 'sgd' did not take ");
  EXPECT_EQ(other_fallback.out.find("falling back"), std::string::npos) << other_fallback.out;
  EXPECT_EQ(other_fallback.out.find("no older complete checkpoint"), std::string::npos) << other_fallback.out;

  // Nothing older to fall back to: one line saying so.
  const std::string n = copy_at_4("nothing_older");
  fs::remove_all(n + "/iter_0000002");
  flip_byte(n + kFile4, 0.5);
  dtk_test::expect_one_line_error(run(kTrain + "--set checkpoint.load=" + n + " --set checkpoint.fallback=true"),
                                  "no older complete checkpoint in " + n + " to fall back to");
  // checkpoint.no_verify_checksums skips the check (for files edited on purpose).
  const Result unverified = run(kTrain + "--set checkpoint.load=" + n + " --set checkpoint.no_verify_checksums=true");
  EXPECT_EQ(unverified.out.find("SHA-256"), std::string::npos) << unverified.out;
  // Unverified, a damaged file shows as whatever the reader says: still damage, so the fallback
  // (and its suggestion) applies.
  const std::string t = copy_at_4("truncated_unverified");
  write(t + kFile4, read(t + kFile4).substr(0, 1000));
  const std::string no_verify = " --set checkpoint.no_verify_checksums=true";
  const Result cut = run(kTrain + "--set checkpoint.load=" + t + no_verify);
  EXPECT_NE(cut.code, 0) << cut.out;
  EXPECT_NE(cut.out.find("checkpoint.fallback=true loads iteration 2"), std::string::npos) << cut.out;
  const Result cut_fallback = run(kTrain + "--set checkpoint.load=" + t + no_verify + " --set checkpoint.fallback=true");
  EXPECT_EQ(cut_fallback.code, 0) << cut_fallback.out;
  EXPECT_NE(cut_fallback.out.find(" loaded checkpoint from " + t + " at iteration 2\n"), std::string::npos)
      << cut_fallback.out;
}

TEST(CheckpointIntegrity, InspectShowsProgressLayoutTensorsAndConfig) {
  const Reference& ref = reference();
  ASSERT_EQ(ref.result.code, 0) << ref.result.out;
  const Result r = run("checkpoint inspect " + ref.dir);
  ASSERT_EQ(r.code, 0) << r.out;
  for (const std::string& want :
       {std::string("  tracker: latest_checkpointed_iteration.txt names iteration 6\n"),
        std::string("  iterations: 2, 4, 6 (tracker)\n"), "iteration 6: " + ref.dir + "/iter_0000006\n",
        std::string("  iteration 6, consumed samples: train 48, validation 0; scheduler step 6\n"),
        std::string("  layout: tensor-parallel 1, data-parallel 1\n"), std::string("    plugin.model=gpt "),
        std::string("language_model.encoder.layers.1.self_attention.query_key_value.weight  [192, 64]"),
        std::string("  config:\n    model { name: \"gpt\" "), std::string("complete: yes (1 file, every checksum matches)\n")})
    EXPECT_NE(r.out.find(want), std::string::npos) << "wanted: " << want << "\n" << r.out;
  // The optimizer's tensors on request.
  const Result all = run("checkpoint inspect --all_tensors " + ref.dir);
  EXPECT_NE(all.out.find("    optimizer:\n"), std::string::npos) << all.out;
  // Bad inputs: one line each.
  dtk_test::expect_one_line_error(run("checkpoint inspect /nonexistent/dir"), "/nonexistent/dir is not a directory");
  dtk_test::expect_one_line_error(run("checkpoint inspect " + std::string(DTK_SOURCE_DIR)), "holds no iter_NNNNNNN");
  dtk_test::expect_one_line_error(run("checkpoint inspect"), "usage: dtk checkpoint inspect DIR");
  dtk_test::expect_one_line_error(run("checkpoint show " + ref.dir), "usage: dtk checkpoint inspect DIR");
}

// keep_last keeps the newest N and never the tracker's iteration away; a removal cut short is a
// dead process's temporary.
TEST(CheckpointIntegrity, KeepLastRotation) {
  const std::string d = fresh_dir("rotate");
  const Result r = run(kTrain + "--set checkpoint.save=" + d + " --set checkpoint.save_interval=1 --set checkpoint.keep_last=2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(dtk::core::list_checkpoint_iterations(d), (std::vector<int64_t>{5, 6}));
  EXPECT_NE(r.out.find(" saved checkpoint at iteration 3 to " + d), std::string::npos);
  EXPECT_NE(r.out.find("; removed iteration 1 (checkpoint.keep_last=2)\n"), std::string::npos) << r.out;
  EXPECT_EQ(losses(r.out), losses(reference().result.out));  // saving and rotating change nothing

  // The catalog directly: directories 1..5, the tracker at 2.
  const std::string c = fresh_dir("catalog");
  for (int it = 1; it <= 5; ++it) fs::create_directories(c + "/iter_000000" + std::to_string(it) + "/mp_rank_00");
  fs::create_directories(c + "/iter_0000009.tmp-otherhost-1");  // not an iteration
  write(c + "/latest_checkpointed_iteration.txt", "2\n");
  EXPECT_EQ(dtk::core::rotate_checkpoints(c, 2), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(dtk::core::list_checkpoint_iterations(c), (std::vector<int64_t>{2, 4, 5}));
  EXPECT_TRUE(fs::exists(c + "/iter_0000009.tmp-otherhost-1"));
  // Without a readable tracker nothing goes.
  write(c + "/latest_checkpointed_iteration.txt", "x");
  EXPECT_TRUE(dtk::core::rotate_checkpoints(c, 1).empty());
  EXPECT_EQ(dtk::core::list_checkpoint_iterations(c).size(), 3u);
  // Bad settings.
  dtk_test::expect_one_line_error(run(kTrain + "--set checkpoint.keep_last=-1"), "checkpoint.keep_last must be >= 0");
  dtk_test::expect_one_line_error(run(kTrain + "--set checkpoint.keep_last=2"), "checkpoint.keep_last needs checkpoint.save");
  dtk_test::expect_one_line_error(run(kTrain + "--set checkpoint.fallback=true"), "checkpoint.fallback needs checkpoint.load");
}

// `dtk checkpoint convert`: a TP2 checkpoint resumed at TP1, and a TP1 one at TP2, continue with the
// losses of the runs they came from, to the printed digit. The vocabulary is padded alike at both
// sizes (make_vocab_size_divisible_by 64: 50304 rows at TP1 and TP2); with Megatron's default 128,
// TP2 pads 128 rows more, whose logits enter the softmax, so TP1 and TP2 runs differ anyway.
TEST(CheckpointConvert, TensorParallelTwoToOneAndBackContinueWithTheSameLosses) {
  const std::string d = fresh_dir("convert");
  const std::string train = std::string("train --config ") + DTK_SOURCE_DIR +
                            "/configs/gpt-tiny.pbtxt --dataset synthetic --set model.hidden_dropout=0 "
                            "--set model.attention_dropout=0 --set train.train_iters=6 --set lr.lr_warmup_iters=1 "
                            "--set logging.log_interval=1 --threads 1 --set model.make_vocab_size_divisible_by=64 ";
  const std::string tp2 = "launch --nproc_per_node 2 " + train + "--set distributed.tensor_model_parallel_size=2 ";
  const Result a = run(tp2 + "--set checkpoint.save=" + d + "/tp2 --set checkpoint.save_interval=4");
  ASSERT_EQ(a.code, 0) << a.out;
  const Result converted = run("checkpoint convert " + d + "/tp2/iter_0000004 " + d + "/to1 --tensor_model_parallel_size 1");
  ASSERT_EQ(converted.code, 0) << converted.out;
  EXPECT_NE(converted.out.find("converted iteration 4 of " + d + "/tp2/iter_0000004 from tensor-parallel size 2 to 1"),
            std::string::npos)
      << converted.out;
  EXPECT_EQ(run("checkpoint inspect " + d + "/to1").code, 0);
  const Result b = run(train + "--set checkpoint.load=" + d + "/to1");
  ASSERT_EQ(b.code, 0) << b.out;
  const auto la = losses(a.out), lb = losses(b.out);
  ASSERT_EQ(lb.size(), 2u) << b.out;
  for (int it : {5, 6}) EXPECT_EQ(la.at(it), lb.at(it)) << "TP2 -> TP1, iteration " << it;

  const Result c = run(train + "--set checkpoint.save=" + d + "/tp1 --set checkpoint.save_interval=4");
  ASSERT_EQ(c.code, 0) << c.out;
  ASSERT_EQ(run("checkpoint convert " + d + "/tp1/iter_0000004 " + d + "/to2 --tensor_model_parallel_size 2").code, 0);
  EXPECT_TRUE(fs::is_regular_file(d + "/to2/iter_0000004/mp_rank_01/model_optim_rng.pt"));
  const Result e = run(tp2 + "--set checkpoint.load=" + d + "/to2");
  ASSERT_EQ(e.code, 0) << e.out;
  const auto lc = losses(c.out), le = losses(e.out);
  ASSERT_EQ(le.size(), 2u) << e.out;
  for (int it : {5, 6}) EXPECT_EQ(lc.at(it), le.at(it)) << "TP1 -> TP2, iteration " << it;

  // Refusals: one line each.
  dtk_test::expect_one_line_error(run("checkpoint convert " + d + "/tp1 " + d + "/to2 --tensor_model_parallel_size 2"),
                                  d + "/to2 exists and is not an empty directory");
  std::ofstream(d + "/afile") << "x";
  dtk_test::expect_one_line_error(
      run("checkpoint convert " + d + "/tp1 " + d + "/afile --tensor_model_parallel_size 2"),
      "checkpoint convert: " + d + "/afile is a file, not a folder");
  dtk_test::expect_one_line_error(run("checkpoint convert " + d + "/tp1 " + d + "/x"), "--tensor_model_parallel_size N");
  dtk_test::expect_one_line_error(
      run("checkpoint convert " + d + "/tp1 " + d + "/ep2 --expert_model_parallel_size 2"),
      "checkpoint convert: --expert_model_parallel_size 2: the model has no mixture-of-experts layers (num_experts 0)");
  EXPECT_FALSE(fs::exists(d + "/ep2"));
}

// ZeRO's data-parallel shards are consolidated by convert (issue 15 item 2, the DP/ZeRO half): a
// ZeRO stage-2 run at DP=2 converted to TP=2 resumes under zero at TP=2 (sharding it again), and
// converted at TP=1 (consolidation alone) resumes under ddp in one process, both with the
// uninterrupted run's losses to the printed digit.
TEST(CheckpointConvert, ZeroShardsAreConsolidatedAndResumeUnderZeroAndDdp) {
  const std::string d = fresh_dir("convert-zero");
  const std::string train = std::string("train --config ") + DTK_SOURCE_DIR +
                            "/configs/gpt-tiny.pbtxt --dataset synthetic --set model.hidden_dropout=0 "
                            "--set model.attention_dropout=0 --set train.train_iters=6 --set lr.lr_warmup_iters=1 "
                            "--set logging.log_interval=1 --threads 1 --set model.make_vocab_size_divisible_by=64 "
                            "--set train.global_batch_size=16 ";
  const std::string zero = "launch --nproc_per_node 2 " + train + "--strategy zero --set strategy.stage=2 ";
  const Result a = run(zero + "--set checkpoint.save=" + d + "/z --set checkpoint.save_interval=4");
  ASSERT_EQ(a.code, 0) << a.out;
  ASSERT_TRUE(fs::is_regular_file(d + "/z/iter_0000004/mp_rank_00/" + "optim_dp_rank_001.pt")) << "a sharded save";
  const Result to2 = run("checkpoint convert " + d + "/z/iter_0000004 " + d + "/to2 --tensor_model_parallel_size 2");
  ASSERT_EQ(to2.code, 0) << to2.out;
  EXPECT_NE(to2.out.find("the ZeRO optimizer state (2 data-parallel shards per rank) is consolidated"), std::string::npos)
      << to2.out;
  EXPECT_FALSE(fs::exists(d + "/to2/iter_0000004/mp_rank_00/optim_dp_rank_000.pt")) << "whole state, no shard files";
  const Result b = run(zero + "--set distributed.tensor_model_parallel_size=2 --set checkpoint.load=" + d + "/to2");
  ASSERT_EQ(b.code, 0) << b.out;
  const Result to1 = run("checkpoint convert " + d + "/z/iter_0000004 " + d + "/to1 --tensor_model_parallel_size 1");
  ASSERT_EQ(to1.code, 0) << to1.out;
  const Result c = run(train + "--set checkpoint.load=" + d + "/to1");
  ASSERT_EQ(c.code, 0) << c.out;
  const auto la = losses(a.out), lb = losses(b.out), lc = losses(c.out);
  ASSERT_EQ(lb.size(), 2u) << b.out;
  ASSERT_EQ(lc.size(), 2u) << c.out;
  for (int it : {5, 6}) {
    EXPECT_EQ(la.at(it), lb.at(it)) << "ZeRO DP2 -> TP2 zero, iteration " << it;
    EXPECT_EQ(la.at(it), lc.at(it)) << "ZeRO DP2 -> TP1 ddp, iteration " << it;
  }
}
