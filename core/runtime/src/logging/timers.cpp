#include "dtk/core/logging/timers.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <cstdio>
#include <memory>

namespace dtk::core {

namespace {
struct PhaseInfo {
  const char* name;
  int level;
};
// Megatron logs batch-generator at level 2; DTK shows the data wait from level 1, so a slow
// loader is visible without the per-micro-batch timers.
constexpr PhaseInfo kPhases[] = {
    {"forward-backward", 1},         {"batch-generator", 1},  {"forward-compute", 2},
    {"backward-compute", 2},         {"forward-recv", 2},     {"backward-recv", 2},
    {"all-grads-sync", 1},   {"optimizer-clip-main-grad", 1},
    {"optimizer-inner-step", 1},     {"optimizer", 1},        {"evaluate", 1},
    {"save-checkpoint", 1},
};
static_assert(sizeof(kPhases) / sizeof(kPhases[0]) == static_cast<int>(Phase::kCount));
}  // namespace

const char* phase_name(Phase p) { return kPhases[static_cast<int>(p)].name; }
int phase_level(Phase p) { return kPhases[static_cast<int>(p)].level; }

void* Timers::Scope::begin_record(Phase p) {
  if (!at::hasCallbacks()) return nullptr;  // no profiler (nor other observer): nothing to record
  auto record = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!record->isActive()) return nullptr;
  record->before(phase_name(p));
  return record.release();
}

void Timers::Scope::end_record(void* record) { delete static_cast<at::RecordFunction*>(record); }

void Timers::read_device_clock() {
  if (!clock_) return;
  for (const auto& [phase, from, to] : marks_) seconds_[static_cast<int>(phase)] += clock_->seconds(from, to);
  marks_.clear();
  clock_->reset();
}

void Timers::reset() {
  if (clock_) marks_.clear(), clock_->reset();
  seconds_.fill(0);
}

std::vector<Timers::Row> Timers::window(int64_t iterations, const Topology& topo) {
  std::vector<Row> rows;
  if (level_ <= 0) return rows;
  read_device_clock();
  constexpr int n = static_cast<int>(Phase::kCount);
  // One tensor: [max of t..., max of -t...] -> max and min in a single collective.
  at::Tensor t = at::empty({2 * n}, at::kDouble);
  for (int i = 0; i < n; ++i) {
    const double per_iteration_ms = 1e3 * seconds_[i] / static_cast<double>(std::max<int64_t>(iterations, 1));
    t[i] = per_iteration_ms;
    t[n + i] = -per_iteration_ms;
  }
  if (topo.world_size > 1) all_reduce(t, DTK_GROUP_WORLD, DTK_REDUCE_MAX).wait();
  for (int i = 0; i < n; ++i) {
    const Phase p = static_cast<Phase>(i);
    if (phase_level(p) > level_) continue;
    const double max_ms = t[i].item<double>(), min_ms = -t[n + i].item<double>();
    if (max_ms <= 0) continue;  // not run in this window by any rank
    rows.push_back(Row{phase_name(p), min_ms, max_ms});
  }
  return rows;
}

std::string Timers::format(const std::vector<Row>& rows) {
  std::string out = "(min, max) time across ranks (ms):";
  char buf[160];
  for (const auto& r : rows) {
    std::string label = r.name + " ";
    if (label.size() < 48) label.append(48 - label.size(), '.');
    std::snprintf(buf, sizeof buf, "\n    %s: (%.2f, %.2f)", label.c_str(), r.min_ms, r.max_ms);
    out += buf;
  }
  return out;
}

}  // namespace dtk::core
