// Per-iteration lm loss and grad norm of a `dtk` run, read back from its TensorBoard event file
// (full float precision; the log line prints the norm with three decimals), and the comparison
// the equivalence tests make (DP2 == DP1, ZeRO == DDP, Domino == TP, ...).
#pragma once

#include <cctype>
#include <cmath>
#include <map>
#include <string>

#include "run_dtk.hpp"
#include "tensorboard_reader.hpp"

namespace dtk_test {

struct Curve {
  std::map<int64_t, float> loss, norm;
  Result run;  // the run's exit code and output
};

// Runs `dtk <args> --set logging.tensorboard_dir=<fresh dir under tmp_base named after name>`.
inline Curve run_curve(const std::string& args, const std::string& tmp_base, const std::string& name,
                       int timeout_s = 300) {
  std::string safe = name;  // a directory name the shell takes as one word
  for (char& c : safe)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '-';
  const std::string tb = fresh_dir(tmp_base, "tb-" + safe);
  Curve c;
  c.run = run_dtk(args + " --set logging.tensorboard_dir=" + tb, timeout_s);
  EXPECT_EQ(c.run.code, 0) << name << "\n" << c.run.out;
  auto scalars = read_scalars(tb);
  c.loss = scalars["lm loss"];
  c.norm = scalars["grad-norm"];
  return c;
}

// Every TensorBoard scalar of a run, by tag (for the tags run_curve does not keep); the run's
// exit code and output in *result.
inline std::map<std::string, std::map<int64_t, float>> run_scalars(const std::string& args,
                                                                   const std::string& tmp_base,
                                                                   const std::string& name, Result* result,
                                                                   int timeout_s = 300) {
  const std::string tb = fresh_dir(tmp_base, "tb-" + name);
  *result = run_dtk(args + " --set logging.tensorboard_dir=" + tb, timeout_s);
  return read_scalars(tb);
}

// Every iteration's loss and norm within a relative `tol` (the first `iterations` of both).
inline void expect_same_curve(const Curve& want, const Curve& got, size_t iterations, const std::string& what,
                              double tol = 1e-5) {
  ASSERT_EQ(got.loss.size(), iterations) << what;
  ASSERT_EQ(want.loss.size(), iterations) << what;
  for (const auto& [it, loss] : want.loss) {
    EXPECT_NEAR(got.loss.at(it), loss, tol * std::abs(loss)) << what << ", lm loss at iteration " << it;
    EXPECT_NEAR(got.norm.at(it), want.norm.at(it), tol * std::abs(want.norm.at(it)))
        << what << ", grad norm at iteration " << it;
  }
}

// A resumed run's iterations (the `iterations` after its checkpoint) exactly those of the
// uninterrupted run `whole`: the same fp32 loss and grad norm.
inline void expect_resumed_curve(const Curve& whole, const Curve& resumed, size_t iterations) {
  ASSERT_EQ(resumed.loss.size(), iterations) << resumed.run.out;
  for (const auto& [it, loss] : resumed.loss) {
    EXPECT_FLOAT_EQ(loss, whole.loss.at(it)) << "iteration " << it;
    EXPECT_FLOAT_EQ(resumed.norm.at(it), whole.norm.at(it)) << "iteration " << it;
  }
}

}  // namespace dtk_test
