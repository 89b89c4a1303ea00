#include "test_hooks.hpp"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdlib>
#include <set>
#include <string>
#include <utility>

#include "dtk/core/launch/distributed.hpp"
#include "dtk/host/error.hpp"

namespace dtk::app {

namespace {

// ITERATION or ITERATION@RANK items, comma-separated; rank -1: every rank.
std::set<std::pair<int64_t, int>> parse_nonfinite_iterations(const std::string& s) {
  std::set<std::pair<int64_t, int>> out;
  for (size_t at = 0; at < s.size();) {
    const size_t comma = s.find(',', at);
    const std::string item = s.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    const size_t rank_at = item.find('@');
    try {
      size_t used = 0;
      const std::string iteration = item.substr(0, rank_at);
      const int64_t it = std::stoll(iteration, &used);
      if (used != iteration.size()) throw std::invalid_argument(item);
      out.emplace(it, rank_at == std::string::npos ? -1 : std::stoi(item.substr(rank_at + 1)));
    } catch (const std::exception&) {
      throw host::HostError("DTK_TEST_NONFINITE_ITERS: '" + item + "' is not ITERATION or ITERATION@RANK");
    }
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

}  // namespace

core::TrainerHooks trainer_hooks_from_environment() {
  core::TrainerHooks hooks;
  if (const char* probe = std::getenv("DTK_TEST_CUDA_GRAPH_PROBE")) hooks.cuda_graph_probe = std::string(probe) == "1";
  const char* v = std::getenv("DTK_TEST_NONFINITE_ITERS");
  if (!v) return hooks;
  hooks.scaled_loss = [items = parse_nonfinite_iterations(v)](int64_t iteration, int64_t m, const at::Tensor& loss) {
    const int rank = core::topology().world_rank;
    if (m == 0 && (items.count({iteration, -1}) || items.count({iteration, rank}))) return loss * INFINITY;
    return loss;
  };
  return hooks;
}

}  // namespace dtk::app
