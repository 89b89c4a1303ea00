// Megatron-layout checkpoints: see dtk/core/checkpoint/checkpoint.hpp for the layout and the atomicity
// protocol. Every rank calls save/load; collectives are bounded (distributed.timeout_seconds)
// and carry a failure flag, so one rank's error stops all ranks instead of stranding them.
#include "dtk/core/checkpoint/checkpoint.hpp"
#include "dtk/core/device/cuda_support.hpp"

#include <ATen/core/Dict.h>
#include <fcntl.h>
#include <glog/logging.h>
#include <google/protobuf/text_format.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <unistd.h>
#include <cctype>
#include <regex>
#include <set>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <optional>
#include <sstream>

#include "checkpoint_io.hpp"
#include "dtk/core/checkpoint/checkpoint_catalog.hpp"
#include "dtk/core/checkpoint/checkpoint_shards.hpp"
#include "dtk/core/config/config.hpp"
#include "dtk/core/memory/memory.hpp"

namespace dtk::core {

namespace fs = std::filesystem;
using host::HostError;
using ckpt::first_line;
using ckpt::from_dict;
using ckpt::slices_to_dict;
using ckpt::fsync_path;
using ckpt::mp_rank_dir;
using ckpt::read_pickled_dict;
using ckpt::shard_file_name;
using ckpt::temp_owner;
using ckpt::write_file_synced;
using ckpt::move_into_place;
using ckpt::write_pickle;
using ckpt::write_tracker;

namespace {

c10::Dict<std::string, at::Tensor> to_dict(const TensorList& list) {
  c10::Dict<std::string, at::Tensor> d;
  // The copies are host memory (an async save holds them through the next iterations): not
  // counted against a CPU run's device budget.
  memory::HostScope host;
  // Own storage per tensor: a view into a larger buffer would otherwise save the whole buffer.
  for (const auto& kv : list) d.insert(kv.first, kv.second.detach().to(at::kCPU).contiguous().clone());
  return d;
}

}  // namespace

int remove_stale_temporaries(const std::string& dir) {
  // iter_NNNNNNN.tmp-[HOST-]PID (a save's directory) and latest_checkpointed_iteration.txt.tmp-...
  static const std::regex name(R"(^(iter_\d+|latest_checkpointed_iteration\.txt)\.tmp-(?:(.+)-)?(\d+)$)");
  const std::string me = temp_owner(0);
  const std::string my_host = me.substr(0, me.size() - 2);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return 0;
  int removed = 0;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string file = e.path().filename().string();
    if (!std::regex_match(file, m, name)) continue;
    if (m[2].matched && m[2].str() != my_host) continue;  // another machine's: not ours to judge
    const long pid = std::stol(m[3].str());
    if (pid <= 0 || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM) continue;  // alive (or not ours)
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    if (!rm) {
      ++removed;
      LOG(WARNING) << "checkpoint: removed " << e.path().string() << ", left by a save whose process (pid " << pid
                   << ") is gone";
    }
  }
  return removed;
}

namespace {

// The generators' states: the host's, and a GPU run's device generator (its dropout draws from
// it: resumed runs continue its stream).
void insert_rng(c10::impl::GenericDict& d) {
  d.insert("rng", at::globalContext().defaultGenerator(at::kCPU).get_state());
  if (const c10::Device device = training_device(); device.is_cuda())
    d.insert("cuda_rng", at::globalContext().defaultGenerator(device).get_state());
}

// What wrote a checkpoint: the resolved config, DTK's version, the plugins.
void insert_provenance(c10::impl::GenericDict& d, const std::string& config_text,
                       const std::vector<std::string>& writers) {
  d.insert("config", config_text);
  d.insert("dtk_version", std::string(DTK_VERSION));
  std::string plugins;
  for (const auto& w : writers) plugins += w + "\n";
  d.insert("plugins", plugins);
}

// SHA256SUMS from the ranks' parts (SHA256SUMS.part-R), in path order; the parts go.
void merge_checksum_parts(const std::string& tmp_dir) {
  const std::string prefix = std::string(ckpt::kChecksumsFile) + ".part-";
  std::vector<std::string> lines;
  std::vector<fs::path> parts;
  for (const auto& e : fs::directory_iterator(tmp_dir)) {
    if (e.path().filename().string().rfind(prefix, 0) != 0) continue;
    parts.push_back(e.path());
    std::ifstream in(e.path());
    std::string line;
    while (std::getline(in, line))
      if (!line.empty()) lines.push_back(line);
  }
  std::sort(lines.begin(), lines.end(), [](const std::string& a, const std::string& b) {
    return a.substr(66) < b.substr(66);
  });
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  write_file_synced((fs::path(tmp_dir) / ckpt::kChecksumsFile).string(), text.data(), text.size());
  for (const auto& p : parts) fs::remove(p);
}

}  // namespace

void write_weights_checkpoint(const std::string& save_dir, const TensorList& model_state,
                              const std::string& config_text, const std::vector<std::string>& writers) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("model", to_dict(model_state));
  d.insert("optimizer", to_dict({}));
  d.insert("strategy", to_dict({}));
  for (const char* key : {"iteration", "consumed_train_samples", "consumed_valid_samples", "scheduler_step"})
    d.insert(key, int64_t{0});
  d.insert("tensor_model_parallel_size", int64_t{1});
  d.insert("data_parallel_size", int64_t{1});
  insert_rng(d);
  insert_provenance(d, config_text, writers);
  ckpt::write_offline_checkpoint(save_dir, 0, {d});
}

namespace {

// Megatron's opt_param_scheduler entry: the schedule the run trained with and its step.
c10::impl::GenericDict schedule_dict(const LrParams& l, const SchedulePosition& at) {
  c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
  g.insert("max_lr", l.max_lr);
  g.insert("min_lr", l.min_lr);
  g.insert("lr_warmup_init", l.init_lr);
  g.insert("lr_warmup_iters", l.warmup_iters);
  g.insert("lr_decay_iters", l.decay_iters);
  g.insert("lr_decay_style", l.style);
  g.insert("lr_warmup_style", l.warmup_style);
  g.insert("lr_wsd_decay_style", l.wsd_style);
  g.insert("lr_wsd_decay_iters", l.wsd_decay_iters);
  g.insert("start_wd", l.start_wd);
  g.insert("end_wd", l.end_wd);
  g.insert("wd_incr_style", l.wd_style);
  g.insert("wd_incr_iters", l.wd_incr_iters);
  // Megatron-DeepSpeed's token counts (None: counted in steps).
  const auto count = [](const std::optional<int64_t>& v) { return v ? c10::IValue(*v) : c10::IValue(); };
  g.insert("lr_warmup_tokens", count(l.warmup_tokens));
  g.insert("lr_decay_tokens", count(l.decay_tokens));
  if (is_deepspeed_cycle_style(l.style)) {  // DeepSpeed's, by its parameters' names
    const CycleParams& c = l.cycle;
    g.insert("lr_range_test_step_size", c.range_step_size);
    g.insert("lr_range_test_step_rate", c.range_step_rate);
    g.insert("lr_range_test_staircase", c.range_staircase);
    g.insert("cycle_first_step_size", c.first_step);
    g.insert("cycle_second_step_size", c.second_step);
    g.insert("cycle_first_stair_count", c.first_stairs);
    g.insert("cycle_second_stair_count", c.second_stairs);
    g.insert("decay_step_size", c.decay_step);
    g.insert("decay_lr_rate", c.decay_lr_rate);
    g.insert("cycle_momentum", c.momentum);
    g.insert("cycle_min_mom", c.min_mom);
    g.insert("cycle_max_mom", c.max_mom);
    g.insert("decay_mom_rate", c.decay_mom_rate);
  }
  g.insert("num_steps", at.step);
  g.insert("num_tokens", at.tokens);
  return g;
}

// What one save writes besides the tensors (every rank the same).
struct SaveContext {
  const TrainProgress& progress;
  const std::string& config_text;
  const std::vector<std::string>& writers;
  const Topology& topo;
  const SaveOptions& what;
};

// The main file of a tensor-/pipeline-parallel rank: the model, the optimizer and strategy state
// unless they are sharded (then in shard files) or not saved (SaveOptions), the progress, the
// layout and the provenance.
c10::impl::GenericDict main_file_dict(const c10::Dict<std::string, at::Tensor>& model_dict,
                                      const TensorList& optim_state, const TensorList& strat_state, bool sharded,
                                      const ModelInstance& model, const SaveContext& c) {
  const TrainProgress& progress = c.progress;
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("model", model_dict);
  // Empty when not here (readers of the layout find the entries either way).
  d.insert("optimizer", to_dict(sharded ? TensorList{} : optim_state));
  d.insert("strategy", to_dict(sharded ? TensorList{} : strat_state));
  if (!c.what.optimizer) d.insert("no_save_optim", true);
  d.insert("iteration", progress.iteration);
  d.insert("consumed_train_samples", progress.consumed_train_samples);
  d.insert("consumed_valid_samples", progress.consumed_valid_samples);
  d.insert("num_floating_point_operations_so_far", progress.floating_point_operations);
  d.insert("scheduler_step", progress.scheduler.step);
  d.insert("scheduler_tokens", progress.scheduler.tokens);
  d.insert("scheduler_warmup_end_tokens", progress.scheduler.warmup_end_tokens);
  if (progress.schedule && c.what.optimizer)
    d.insert("opt_param_scheduler", schedule_dict(*progress.schedule, progress.scheduler));
  if (progress.grad_scaler && c.what.optimizer) {
    c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
    g.insert("scale", progress.grad_scaler->scale);
    g.insert("growth_tracker", progress.grad_scaler->growth_tracker);
    g.insert("hysteresis_tracker", progress.grad_scaler->hysteresis_tracker);
    d.insert("grad_scaler", g);
  }
  d.insert("tensor_model_parallel_size", static_cast<int64_t>(c.topo.tp_size));
  d.insert("pipeline_model_parallel_size", static_cast<int64_t>(c.topo.pp_size));
  d.insert("virtual_pipeline_model_parallel_size", static_cast<int64_t>(model.num_chunks()));
  ckpt::insert_pipeline_split(d, model.split());
  d.insert("data_parallel_size", static_cast<int64_t>(c.topo.dp_size));
  if (c.topo.ep_size > 1) d.insert("expert_model_parallel_size", static_cast<int64_t>(c.topo.ep_size));
  if (sharded) d.insert("optimizer_shards", static_cast<int64_t>(c.topo.dp_size));
  if (c.what.rng) insert_rng(d);
  insert_provenance(d, c.config_text, c.writers);
  return d;
}

// This rank's files of one save, as values: everything copied out of the run (to_dict clones,
// the RNG states read), so that writing them may happen later, on another thread. Data-parallel
// rank 0 writes the model, the progress and the RNG; every DP rank writes its own optimizer and
// strategy state when the strategy shards it (ZeRO), else DP rank 0 does (unless that state is not
// saved).
struct RankFiles {
  std::string tmp_dir;
  std::string rank_name;  // mp_rank_XX[_YYY][_ZZZ]
  int world_rank = 0;
  std::vector<std::pair<std::string, c10::IValue>> files;  // file name in rank_name -> contents
};

RankFiles prepare_rank_files(const std::string& tmp_dir, const ModelInstance& model, const OptimizerInstance& optimizer,
                             StrategyInstance& strategy, const SaveContext& c) {
  const Topology& topo = c.topo;
  // (Under expert parallelism the first rank of each set holding the same experts.)
  const bool writer = topo.edp_rank() == 0;
  const bool sharded = strategy.info().sharded_state != 0 && c.what.optimizer;
  RankFiles out;
  out.tmp_dir = tmp_dir;
  out.world_rank = topo.world_rank;
  out.rank_name = mp_rank_dir(topo.tp_rank, topo.pp_rank, topo.pp_size, topo.ep_rank(), topo.ep_size);
  // Whole parameters (a ZeRO-3 strategy gathers them, with every rank taking part), copied out.
  c10::Dict<std::string, at::Tensor> model_dict;
  strategy.gather_parameters(true);
  if (writer) model_dict = to_dict(model.state_save());
  strategy.gather_parameters(false);
  const TensorList optim_state = c.what.optimizer ? optimizer.state_save() : TensorList{};
  const TensorList strat_state = c.what.optimizer ? strategy.state_save() : TensorList{};
  if (writer)
    out.files.emplace_back(ckpt::kModelFile,
                           c10::IValue(main_file_dict(model_dict, optim_state, strat_state, sharded, model, c)));
  if (sharded) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("optimizer", to_dict(optim_state));
    d.insert("strategy", to_dict(strat_state));
    d.insert("param_slices", slices_to_dict(slices_of(optimizer.params())));
    d.insert("data_parallel_rank", static_cast<int64_t>(topo.dp_rank));
    d.insert("data_parallel_size", static_cast<int64_t>(topo.dp_size));
    out.files.emplace_back(shard_file_name(topo.dp_rank), c10::IValue(d));
  }
  return out;
}

// Writes one rank's files into the temporary directory, with its lines of the manifest
// ("<sha256>  <relative path>"; world rank 0 merges them before publishing). Reads nothing of the
// run: safe on a thread of its own. Returns the bytes written.
int64_t write_rank_files(const RankFiles& r) {
  if (r.files.empty()) return 0;
  const std::string rank_dir = (fs::path(r.tmp_dir) / r.rank_name).string();
  std::error_code ec;
  fs::create_directories(rank_dir, ec);
  if (ec) throw HostError("checkpoint: cannot create " + rank_dir + ": " + ec.message());
  int64_t bytes = 0;
  std::string sums;
  for (const auto& [name, contents] : r.files) {
    const ckpt::Written w = write_pickle((fs::path(rank_dir) / name).string(), contents);
    bytes += w.bytes;
    sums += w.sha256 + "  " + r.rank_name + "/" + name + "\n";
  }
  fsync_path(rank_dir, true);
  write_file_synced(
      (fs::path(r.tmp_dir) / (std::string(ckpt::kChecksumsFile) + ".part-" + std::to_string(r.world_rank))).string(),
      sums.data(), sums.size());
  return bytes;
}

// World rank 0 publishes: directory into place, then the tracker file. A failure becomes
// `error` (agreed on by every rank next).
void publish_checkpoint(const std::string& save_dir, const std::string& tmp_dir, const std::string& final_dir,
                        int64_t iteration, std::string& error) {
  try {
    merge_checksum_parts(tmp_dir);
    fsync_path(tmp_dir, true);
    std::error_code exists;
    if (fs::exists(final_dir, exists))
      LOG(WARNING) << "checkpoint: replacing " << final_dir << " (saved there before this save)";
    move_into_place(tmp_dir, final_dir);
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);  // the replaced old directory, if any
    fsync_path(save_dir, true);
    write_tracker(save_dir, iteration);
  } catch (const std::exception& e) {
    error = first_line(e.what());
    // Nothing half-written stays (a full disk while merging the checksums, say): before the move
    // (or where the move failed and put the old directory back) the temporary directory is this
    // save, after it the directory this save replaced.
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
  }
}

// Total size over every rank's files, for the log line.
int64_t bytes_over_ranks(int64_t bytes, const Topology& topo) {
  if (topo.world_size <= 1) return bytes;
  at::Tensor t = at::full({1}, bytes, at::kLong);
  try {
    all_reduce(t, DTK_GROUP_WORLD, DTK_REDUCE_SUM).wait();
  } catch (const std::exception& e) {
    throw host::HostError(std::string("checkpoint: summing file sizes: ") + e.what());
  }
  return t.item<int64_t>();
}

}  // namespace

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Where one save goes: its iteration directory and the temporary directory the ranks write into.
struct SaveTarget {
  std::string save_dir;
  std::string final_dir;
  std::string tmp_dir;
  int64_t iteration = 0;
  int64_t keep_last = 0;
};

// Collective: the temporary directory, one for all ranks, named after world rank 0's pid; what
// saves that died left behind (a crash, a kill, a full disk) goes before this one adds.
SaveTarget begin_save(const std::string& save_dir, int64_t iteration, int64_t keep_last, const Topology& topo) {
  SaveTarget t{save_dir, checkpoint_iter_dir(save_dir, iteration), "", iteration, keep_last};
  const int64_t pid = world_max(topo.world_rank == 0 ? static_cast<int64_t>(::getpid()) : 0, topo,
                                "checkpoint: agreeing on the temporary directory");
  t.tmp_dir = t.final_dir + ".tmp-" + temp_owner(pid);
  if (topo.world_rank == 0) remove_stale_temporaries(save_dir);
  return t;
}

// Collective, once every rank has written (or failed to write: `error`): world rank 0 publishes
// and rotates, then every rank learns whether it worked. Throws HostError on every rank otherwise.
SaveReport end_save(const SaveTarget& t, std::string error, int64_t bytes, const Topology& topo) {
  try {
    agree(error, topo, "checkpoint: waiting for every rank to write its file");
  } catch (...) {
    // A failed save (a full disk, say) leaves nothing behind: the tracker still names the last
    // complete checkpoint.
    if (topo.world_rank == 0) {
      std::error_code ec;
      fs::remove_all(t.tmp_dir, ec);
    }
    throw;
  }
  SaveReport report;
  report.dir = t.final_dir;
  if (topo.world_rank == 0) {
    publish_checkpoint(t.save_dir, t.tmp_dir, t.final_dir, t.iteration, error);
    // checkpoint.keep_last: older iterations go once the new one is published (never the one the
    // tracker names). A failure to remove is a warning: training goes on.
    if (error.empty() && t.keep_last > 0) report.removed = rotate_checkpoints(t.save_dir, t.keep_last);
  }
  agree(error, topo, "checkpoint: waiting for rank 0 to publish the checkpoint");
  report.megabytes = static_cast<double>(bytes_over_ranks(bytes, topo)) / 1e6;
  return report;
}

}  // namespace

SaveReport save_checkpoint(const std::string& save_dir, const TrainProgress& progress, const ModelInstance& model,
                           const OptimizerInstance& optimizer, StrategyInstance& strategy,
                           const std::string& config_text, const std::vector<std::string>& writers,
                           const Topology& topo, const SaveOptions& what) {
  const auto start = Clock::now();
  const SaveTarget target = begin_save(save_dir, progress.iteration, what.keep_last, topo);
  std::string error;
  int64_t bytes = 0;
  try {
    bytes = write_rank_files(prepare_rank_files(target.tmp_dir, model, optimizer, strategy,
                                                SaveContext{progress, config_text, writers, topo, what}));
  } catch (const std::exception& e) {
    error = first_line(e.what());
  }
  SaveReport report = end_save(target, error, bytes, topo);
  report.seconds = report.blocked_seconds = seconds_since(start);
  return report;
}

struct AsyncSave::State {
  // The background thread's result: the bytes written and how long that took, or why it failed.
  struct Written {
    int64_t bytes = 0;
    double seconds = 0;
    std::string error;
  };

  SaveTarget target;
  Topology topo;
  double blocked_seconds = 0;
  std::string error;  // preparing the files failed (the thread then had nothing to write)
  std::future<Written> written;
};

AsyncSave::AsyncSave(const std::string& save_dir, const TrainProgress& progress, const ModelInstance& model,
                     const OptimizerInstance& optimizer, StrategyInstance& strategy, const std::string& config_text,
                     const std::vector<std::string>& writers, const Topology& topo, const SaveOptions& what)
    : state_(std::make_unique<State>()) {
  const auto start = Clock::now();
  State& s = *state_;
  s.topo = topo;
  s.target = begin_save(save_dir, progress.iteration, what.keep_last, topo);
  std::shared_ptr<RankFiles> files;
  try {
    files = std::make_shared<RankFiles>(prepare_rank_files(s.target.tmp_dir, model, optimizer, strategy,
                                                           SaveContext{progress, config_text, writers, topo, what}));
  } catch (const std::exception& e) {
    s.error = first_line(e.what());  // agreed on in finish, as a synchronous save agrees
  }
  s.written = std::async(std::launch::async, [files]() mutable -> State::Written {
    // The lowest CPU priority (this thread's nice value) and the idle I/O class (as Megatron's
    // async_ckpt_io_priority 3): the writer takes the cores and the disk time training leaves
    // idle instead of slowing its threads down (a GPU run leaves most cores idle).
    const auto tid = ::syscall(SYS_gettid);
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(tid), 19);
    constexpr int kIoprioWhoProcess = 1, kIoprioClassIdle = 3, kIoprioClassShift = 13;
    (void)::syscall(SYS_ioprio_set, kIoprioWhoProcess, tid, kIoprioClassIdle << kIoprioClassShift);
    State::Written w;
    if (!files) return w;
    const auto start = Clock::now();
    try {
      w.bytes = write_rank_files(*files);
    } catch (const std::exception& e) {
      w.error = first_line(e.what());
    }
    files.reset();  // the copy goes as soon as it is written, not at the next poll
    w.seconds = seconds_since(start);
    return w;
  });
  s.blocked_seconds = seconds_since(start);
}

// The future's destructor waits for the thread: nothing is left writing into a directory.
AsyncSave::~AsyncSave() = default;

int64_t AsyncSave::iteration() const { return state_->target.iteration; }

bool AsyncSave::written_everywhere() {
  const bool mine = state_->written.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  return world_max(mine ? 0 : 1, state_->topo, "checkpoint: asking whether every rank has written its files") == 0;
}

SaveReport AsyncSave::finish() {
  State& s = *state_;
  const auto wait_start = Clock::now();
  State::Written w = s.written.get();
  if (w.error.empty()) w.error = s.error;
  SaveReport report = end_save(s.target, w.error, w.bytes, s.topo);
  report.seconds = w.seconds;
  report.blocked_seconds = s.blocked_seconds + seconds_since(wait_start);
  return report;
}

namespace {

// Loads optimizer state and checks that the optimizer took all of it: an optimizer keeps the
// entries it knows and ignores the rest, so adamw's moments loaded into sgd (or the reverse) would
// silently start fresh. The optimizer's state after loading must hold every entry given
// (adamw <-> cpu_adam share their names and pass).
void load_optimizer_state(OptimizerInstance& optimizer, const TensorList& state, const std::string& saved_with) {
  optimizer.state_load(state);
  const TensorList after = optimizer.state_save();
  std::set<std::string> held;
  for (const auto& [name, t] : after) held.insert(name);
  std::vector<std::string> lost;
  for (const auto& [name, t] : state)
    if (!held.count(name)) lost.push_back(name);
  if (lost.empty()) return;
  throw HostError("optimizer plugin '" + optimizer.plugin().name() + "' did not take " + std::to_string(lost.size()) +
                  " of the " + std::to_string(state.size()) + " optimizer state entries (the first: '" + lost.front() +
                  "'); the checkpoint was written with optimizer '" + saved_with +
                  "': resume with it, or set checkpoint.no_load_optim=true to start the optimizer state fresh");
}

// The optimizer plugin a checkpoint was written with, from its config entry ("" if unknown).
std::string saved_optimizer(const c10::impl::GenericDict& d) {
  auto it = d.find(c10::IValue(std::string("config")));
  if (it == d.end() || !it->value().isString()) return "";
  config::RunConfig cfg;
  if (!google::protobuf::TextFormat::ParseFromString(it->value().toStringRef(), &cfg)) return "";
  return cfg.optimizer().name();
}

// Optimizer and strategy state across layouts (dtk/core/checkpoint/checkpoint_shards.hpp): from the main
// file of a replicated save, or from the shard files of a sharded one (this rank's own first: when
// it was saved with the same layout it is the only one read).
void load_resharded(const fs::path& rank_dir, int64_t shards, const c10::impl::GenericDict& main,
                    const ckpt::Checksums& sums, const ModelInstance& model, OptimizerInstance& optimizer,
                    StrategyInstance& strategy, const Topology& topo, const LoadOptions& what) {
  std::vector<std::string> names;
  for (const Param& p : model.parameters()) names.push_back(p.name);
  StateAssembler assembler(optimizer.params(), names);
  std::string where = (rank_dir / ckpt::kModelFile).string();
  try {
    if (shards == 0) {
      assembler.add(from_dict(main.at("optimizer"), where, "optimizer"), from_dict(main.at("strategy"), where, "strategy"),
                    {});
    } else {
      std::vector<int64_t> order;
      if (topo.dp_rank < shards) order.push_back(topo.dp_rank);
      for (int64_t k = 0; k < shards; ++k)
        if (k != topo.dp_rank) order.push_back(k);
      const SliceMap mine = slices_of(optimizer.params());
      for (size_t i = 0; i < order.size(); ++i) {
        // Under expert parallelism each DP rank's file is in its expert-parallel rank's directory
        // (the same expert-parallel size: check_expert_naming); its dense shards are wanted here too.
        const int ep_rank = static_cast<int>(order[i] % topo.ep_size);
        const fs::path dir =
            rank_dir.parent_path() / mp_rank_dir(topo.tp_rank, topo.pp_rank, topo.pp_size, ep_rank, topo.ep_size);
        where = (dir / shard_file_name(static_cast<int>(order[i]))).string();
        const ckpt::Shard shard = ckpt::read_shard(dir.string(), static_cast<int>(order[i]), shards, sums);
        assembler.add(shard.optimizer, shard.strategy, shard.slices);
        if (i == 0 && shard.slices == mine) break;  // saved with this rank's layout: exact resume from one file
      }
    }
    where = rank_dir.string();
    if (what.optimizer) load_optimizer_state(optimizer, assembler.optimizer(), saved_optimizer(main));
    strategy.state_load(assembler.strategy());
  } catch (const std::exception& e) {
    throw HostError("checkpoint " + where + ": " + first_line(e.what()));
  }
}

// A rank's main file as read: its entries, each missing or ill-typed one an error naming the file.
struct SavedFile {
  const c10::impl::GenericDict& d;
  const std::string& file;
  c10::IValue get(const char* key) const {
    auto it = d.find(c10::IValue(std::string(key)));
    if (it == d.end()) throw HostError("checkpoint " + file + " has no '" + key + "' entry");
    return it->value();
  }
  int64_t get_int(const char* key) const {
    c10::IValue v = get(key);
    if (!v.isInt()) throw HostError("checkpoint " + file + ": '" + key + "' is not an integer");
    return v.toInt();
  }
};

// A checkpoint of another pipeline layout names its directories differently: say so before the
// missing file is reported.
void check_pipeline_naming(const std::string& iter_dir, const fs::path& rank_dir, const Topology& topo) {
  std::error_code ec;
  if (fs::is_directory(rank_dir, ec)) return;
  const std::string first = ckpt::first_rank_dir(iter_dir);
  const bool staged = first != mp_rank_dir(0);
  // Expert-parallel directories (the same expert-parallel size: check_expert_naming) of another
  // tensor- or pipeline-parallel layout.
  if (ckpt::saved_expert_parallel_size(iter_dir) > 1)
    throw HostError("checkpoint " + iter_dir + " has no " + rank_dir.filename().string() +
                    ": it was saved with expert parallelism and another tensor- or pipeline-parallel layout than "
                    "this run's (dtk checkpoint inspect shows it; dtk checkpoint convert SRC DST "
                    "--tensor_model_parallel_size " +
                    std::to_string(topo.tp_size) + " --pipeline_model_parallel_size " + std::to_string(topo.pp_size) +
                    " makes one for it)");
  if (staged == (topo.pp_size > 1) || !fs::is_directory(fs::path(iter_dir) / first, ec)) return;
  // The tensor-parallel size too, from the first stage's folders: the conversion must name both.
  int saved_tp = 0;
  while (fs::is_directory(fs::path(iter_dir) / mp_rank_dir(saved_tp, 0, staged ? 2 : 1), ec)) ++saved_tp;
  const bool tp_differs = saved_tp != topo.tp_size;
  throw HostError(
      "checkpoint " + iter_dir + " was saved " +
      (staged ? std::string("with pipeline stages (") + first + ")" : "as one pipeline stage (" + first + ")") +
      (tp_differs ? " at tensor-parallel size " + std::to_string(saved_tp) : std::string()) +
      ", this run has pipeline-parallel size " + std::to_string(topo.pp_size) +
      (tp_differs ? " and tensor-parallel size " + std::to_string(topo.tp_size) : std::string()) +
      " (dtk checkpoint convert SRC DST" +
      (tp_differs ? " --tensor_model_parallel_size " + std::to_string(topo.tp_size) : std::string()) +
      " --pipeline_model_parallel_size " + std::to_string(topo.pp_size) + " makes one for it)");
}

// Each expert-parallel rank saves its own experts: a checkpoint of another expert-parallel size has
// other directories, and experts another rank held.
std::string expert_parallel_differs(int64_t saved, const Topology& topo) {
  return "was saved with expert-parallel size " + std::to_string(saved) + ", this run has " +
         std::to_string(topo.ep_size) +
         " (distributed.expert_model_parallel_size: each expert-parallel rank saves its own experts; dtk checkpoint "
         "convert SRC DST --expert_model_parallel_size " +
         std::to_string(topo.ep_size) + " --tensor_model_parallel_size " + std::to_string(topo.tp_size) +
         " --pipeline_model_parallel_size " + std::to_string(topo.pp_size) + " re-splits them for this run's sizes)";
}
void check_expert_naming(const std::string& iter_dir, const fs::path& rank_dir, const Topology& topo) {
  std::error_code ec;
  if (fs::is_directory(rank_dir, ec)) return;
  const int64_t saved = ckpt::saved_expert_parallel_size(iter_dir);
  if (saved > 0 && saved != topo.ep_size)
    throw HostError("checkpoint " + iter_dir + " " + expert_parallel_differs(saved, topo));
}

// The layout the file was saved with must be this run's: tensor- and pipeline-parallel sizes and
// model chunks per rank (dtk checkpoint convert changes them), and the expert-parallel size.
void check_saved_layout(const SavedFile& f, const Topology& topo, const ModelInstance& model) {
  const std::string& file = f.file;
  const int64_t saved_ep = f.d.contains("expert_model_parallel_size") ? f.get_int("expert_model_parallel_size") : 1;
  if (saved_ep != topo.ep_size) throw HostError("checkpoint " + file + " " + expert_parallel_differs(saved_ep, topo));
  const int64_t saved_tp = f.get_int("tensor_model_parallel_size");
  if (saved_tp != topo.tp_size)
    throw HostError("checkpoint " + file + " was saved with tensor-parallel size " + std::to_string(saved_tp) +
                    ", this run has " + std::to_string(topo.tp_size));
  const int64_t saved_pp = f.d.contains("pipeline_model_parallel_size") ? f.get_int("pipeline_model_parallel_size") : 1;
  if (saved_pp != topo.pp_size)
    throw HostError("checkpoint " + file + " was saved with pipeline-parallel size " + std::to_string(saved_pp) +
                    ", this run has " + std::to_string(topo.pp_size) +
                    " (dtk checkpoint convert SRC DST --pipeline_model_parallel_size " + std::to_string(topo.pp_size) +
                    " makes one for it)");
  const int64_t saved_virtual =
      f.d.contains("virtual_pipeline_model_parallel_size") ? f.get_int("virtual_pipeline_model_parallel_size") : 1;
  if (saved_virtual != model.num_chunks())
    throw HostError("checkpoint " + file + " was saved with " + std::to_string(saved_virtual) +
                    " model chunk(s) per pipeline rank (virtual_pipeline_model_parallel_size), this run has " +
                    std::to_string(model.num_chunks()) +
                    " (dtk checkpoint convert SRC DST --virtual_pipeline_model_parallel_size " +
                    std::to_string(model.num_chunks()) + " makes one for it)");
  // Each stage names its layers from 0: another split would load other layers under those names.
  const PipelineSplit saved_split = ckpt::read_pipeline_split(f.d, static_cast<int32_t>(saved_pp * saved_virtual),
                                                              static_cast<int32_t>(saved_virtual));
  // Settings that place every layer alike (first=2 of 4 layers on 2 ranks, and the even split) agree.
  const PipelineSplit& split = model.split();
  const int64_t layers = model.info().num_layers;
  auto placed = [layers](const PipelineSplit& s) {
    std::vector<std::pair<int64_t, int64_t>> out;
    if (pipeline_split_refusal(s, layers).empty())
      for (const StageLayers& stage : pipeline_stage_layers(s, layers)) out.emplace_back(stage.offset, stage.count);
    return out;
  };
  const auto saved_layers = placed(saved_split), run_layers = placed(split);
  if (saved_layers.empty() || saved_layers != run_layers)
    throw HostError(
        "checkpoint " + file + " was saved with " + describe_pipeline_split(saved_split) +
        " over the pipeline stages, this run asks for " + describe_pipeline_split(split) +
        " (distributed.decoder_first/last_pipeline_num_layers, account_for_embedding/loss_in_pipeline_split; "
        "dtk checkpoint convert re-splits a checkpoint)");
}

// Megatron's opt_param_scheduler entry: the schedule the checkpoint's run trained with.
LrParams read_schedule(const SavedFile& f) {
  const c10::IValue g = f.get("opt_param_scheduler");
  auto bad = [&](const char* key) {
    return HostError("checkpoint " + f.file + ": 'opt_param_scheduler' has no valid '" + key + "'");
  };
  if (!g.isGenericDict()) throw bad("(a dict)");
  const auto gd = g.toGenericDict();
  auto entry = [&](const char* key) {
    auto it = gd.find(c10::IValue(std::string(key)));
    if (it == gd.end()) throw bad(key);
    return it->value();
  };
  auto real = [&](const char* key) {
    const c10::IValue v = entry(key);
    if (!v.isDouble()) throw bad(key);
    return v.toDouble();
  };
  auto integer = [&](const char* key) {
    const c10::IValue v = entry(key);
    if (!v.isInt()) throw bad(key);
    return v.toInt();
  };
  auto text = [&](const char* key) {
    const c10::IValue v = entry(key);
    if (!v.isString()) throw bad(key);
    return v.toStringRef();
  };
  LrParams l;
  l.max_lr = real("max_lr"), l.min_lr = real("min_lr"), l.init_lr = real("lr_warmup_init");
  l.warmup_iters = real("lr_warmup_iters"), l.decay_iters = integer("lr_decay_iters");
  l.style = text("lr_decay_style"), l.wsd_style = text("lr_wsd_decay_style");
  l.wsd_decay_iters = integer("lr_wsd_decay_iters");
  // The warm-up's shape, saved since DTK read DeepSpeed's schedulers; before, always linear.
  if (gd.contains(c10::IValue(std::string("lr_warmup_style")))) l.warmup_style = text("lr_warmup_style");
  // The weight-decay schedule, saved since ABI 2.2's DTK; an older checkpoint has none.
  l.has_wd = gd.contains(c10::IValue(std::string("wd_incr_style")));
  if (l.has_wd) {
    l.start_wd = real("start_wd"), l.end_wd = real("end_wd"), l.wd_style = text("wd_incr_style");
    l.wd_incr_iters = real("wd_incr_iters");
  }
  // The token counts, saved since DTK read Megatron-DeepSpeed's; before, none.
  auto count = [&](const char* key) -> std::optional<int64_t> {
    if (!gd.contains(c10::IValue(std::string(key)))) return std::nullopt;
    const c10::IValue v = entry(key);
    if (v.isNone()) return std::nullopt;
    if (!v.isInt()) throw bad(key);
    return v.toInt();
  };
  l.warmup_tokens = count("lr_warmup_tokens"), l.decay_tokens = count("lr_decay_tokens");
  if (is_deepspeed_cycle_style(l.style)) {  // saved with them since DTK ran them
    auto flag = [&](const char* key) {
      const c10::IValue v = entry(key);
      if (!v.isBool()) throw bad(key);
      return v.toBool();
    };
    CycleParams& c = l.cycle;
    c.range_step_size = real("lr_range_test_step_size"), c.range_step_rate = real("lr_range_test_step_rate");
    c.range_staircase = flag("lr_range_test_staircase");
    c.first_step = real("cycle_first_step_size"), c.second_step = real("cycle_second_step_size");
    c.first_stairs = integer("cycle_first_stair_count"), c.second_stairs = integer("cycle_second_stair_count");
    c.decay_step = real("decay_step_size"), c.decay_lr_rate = real("decay_lr_rate");
    c.momentum = flag("cycle_momentum");
    c.min_mom = real("cycle_min_mom"), c.max_mom = real("cycle_max_mom"), c.decay_mom_rate = real("decay_mom_rate");
  }
  return l;
}

// Megatron's optimizer 'grad_scaler' entry: a dynamic loss scaler's state.
GradScaler::State read_grad_scaler(const SavedFile& f) {
  const c10::IValue g = f.get("grad_scaler");
  auto bad = [&]() {
    return HostError("checkpoint " + f.file + ": 'grad_scaler' is not {scale, growth_tracker, hysteresis_tracker}");
  };
  if (!g.isGenericDict()) throw bad();
  const auto gd = g.toGenericDict();
  auto entry = [&](const char* key) {
    auto it = gd.find(c10::IValue(std::string(key)));
    if (it == gd.end()) throw bad();
    return it->value();
  };
  const c10::IValue scale = entry("scale"), growth = entry("growth_tracker"), hyst = entry("hysteresis_tracker");
  if (!scale.isDouble() || !growth.isInt() || !hyst.isInt() || !(scale.toDouble() > 0)) throw bad();
  return GradScaler::State{scale.toDouble(), growth.toInt(), hyst.toInt()};
}

// The progress entries, the schedule and (with the optimizer) the loss scaler.
TrainProgress read_progress(const SavedFile& f, const LoadOptions& what) {
  TrainProgress p;
  p.iteration = f.get_int("iteration");
  p.consumed_train_samples = f.get_int("consumed_train_samples");
  p.consumed_valid_samples = f.get_int("consumed_valid_samples");
  p.scheduler.step = f.get_int("scheduler_step");
  if (f.d.contains("scheduler_tokens")) {  // saved since DTK counted tokens
    p.scheduler.tokens = f.get_int("scheduler_tokens");
    p.scheduler.warmup_end_tokens = f.get_int("scheduler_warmup_end_tokens");
  } else {
    p.scheduler.tokens = -1;  // unknown: the trainer derives it from the consumed samples
  }
  if (f.d.contains("opt_param_scheduler")) p.schedule = read_schedule(f);
  if (f.d.contains("num_floating_point_operations_so_far")) {  // saved since --log-progress
    const c10::IValue v = f.get("num_floating_point_operations_so_far");
    // A float as Megatron saves it; an integer as its converter writes 0.
    if (!v.isDouble() && !v.isInt())
      throw HostError("checkpoint " + f.file + ": 'num_floating_point_operations_so_far' is not a number");
    p.floating_point_operations = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  }
  if (what.optimizer && f.d.contains("grad_scaler")) p.grad_scaler = read_grad_scaler(f);
  return p;
}

// A checkpoint saved without the optimizer's state (Megatron's --no-save-optim) or the RNG's
// (--no-save-rng) loads only when this run does not ask for it: as Megatron, which stops with
// "Unable to load optimizer from checkpoint ... Specify --no-load-optim or --finetune".
void check_saved_state(const SavedFile& f, const LoadOptions& what) {
  if (what.optimizer && f.d.contains("no_save_optim"))
    throw HostError("checkpoint " + f.file +
                    " was saved without the optimizer's state (checkpoint.no_save_optim, --no-save-optim): load it "
                    "with checkpoint.no_load_optim=true (the optimizer, the loss scaler and the schedule start fresh) "
                    "or checkpoint.finetune=true");
  if (what.rng && !f.d.contains("rng"))
    throw HostError("checkpoint " + f.file +
                    " was saved without the host's random generators (checkpoint.no_save_rng, --no-save-rng): load "
                    "it with checkpoint.no_load_rng=true (they keep this run's seed) or checkpoint.finetune=true");
}

// The saved RNG streams: the CPU's, and a GPU's when this run trains on one and the checkpoint
// has it (a checkpoint written on a CPU has no device stream: the GPU's stays at the run's seed).
void restore_rng(const SavedFile& f, const c10::IValue& rng) {
  {
    at::Generator gen = at::globalContext().defaultGenerator(at::kCPU);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng.toTensor());
  }
  if (const c10::Device device = training_device(); device.is_cuda() && f.d.contains("cuda_rng")) {
    const c10::IValue cuda_rng = f.get("cuda_rng");
    if (!cuda_rng.isTensor()) throw HostError("checkpoint " + f.file + ": 'cuda_rng' is not a tensor");
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(cuda_rng.toTensor());
  }
}

// Loads iteration `iteration` of `load_dir` into this rank's model, optimizer, strategy and RNG.
TrainProgress load_rank(const std::string& load_dir, int64_t iteration, ModelInstance& model,
                        OptimizerInstance& optimizer, StrategyInstance& strategy, const Topology& topo,
                        const LoadOptions& what) {
  const std::string iter_dir = checkpoint_iter_dir(load_dir, iteration);
  std::error_code ec;
  if (!fs::is_directory(iter_dir, ec))
    throw HostError("checkpoint: " + iter_dir + ckpt::not_a_directory(iter_dir) + " (named by " +
                    checkpoint_tracker_file(load_dir) + ")");
  if (const std::string why = ckpt::megatron_distributed_checkpoint(iter_dir); !why.empty())
    throw HostError("checkpoint: " + why);
  // The verdict inspect and fallback use (every file the manifest lists is there), then the
  // manifest, when the checkpoint has one and verification is wanted.
  if (what.verify) require_complete_iteration(load_dir, iteration);
  const ckpt::Checksums sums = what.verify ? ckpt::read_checksums(iter_dir) : ckpt::Checksums{};
  const std::string rank_name = mp_rank_dir(topo.tp_rank, topo.pp_rank, topo.pp_size, topo.ep_rank(), topo.ep_size);
  const fs::path rank_dir = fs::path(checkpoint_iter_dir(load_dir, iteration)) / rank_name;
  const std::string file = (rank_dir / ckpt::kModelFile).string();
  check_expert_naming(iter_dir, rank_dir, topo);
  check_pipeline_naming(iter_dir, rank_dir, topo);
  const c10::impl::GenericDict d =
      read_pickled_dict(file,
                        topo.tp_rank > 0 || topo.pp_rank > 0
                            ? " (was the checkpoint saved with a smaller tensor- or pipeline-parallel size?)"
                            : "",
                        &sums, rank_name + "/" + ckpt::kModelFile);
  const SavedFile f{d, file};
  check_saved_layout(f, topo, model);
  check_saved_state(f, what);
  TrainProgress p = read_progress(f, what);
  if (p.iteration != iteration)
    throw HostError("checkpoint " + file + " holds iteration " + std::to_string(p.iteration) + ", not " +
                    std::to_string(iteration) + " as its directory's name says");
  const TensorList model_state = from_dict(f.get("model"), file, "model");
  const int64_t shards = d.contains("optimizer_shards") ? f.get_int("optimizer_shards") : 0;
  const c10::IValue rng = what.rng ? f.get("rng") : c10::IValue();
  if (what.rng && !rng.isTensor()) throw HostError("checkpoint " + file + ": 'rng' is not a tensor");
  try {
    model.state_load(model_state, /*strict=*/true);
  } catch (const std::exception& e) {
    throw HostError("checkpoint " + file + ": " + first_line(e.what()));
  }
  // An offloaded optimizer's state is host memory, here as in the step (dtk/core/memory/memory.hpp).
  std::optional<memory::HostScope> host;
  if (strategy.info().optimizer_on_host) host.emplace();
  if (shards == 0 && !strategy.info().sharded_state) {
    // Replicated state saved and wanted (ddp to ddp): as saved.
    try {
      if (what.optimizer)
        load_optimizer_state(optimizer, from_dict(f.get("optimizer"), file, "optimizer"), saved_optimizer(d));
      strategy.state_load(from_dict(f.get("strategy"), file, "strategy"));
    } catch (const std::exception& e) {
      throw HostError("checkpoint " + file + ": " + first_line(e.what()));
    }
  } else {
    load_resharded(rank_dir, shards, d, sums, model, optimizer, strategy, topo, what);
  }
  host.reset();
  if (what.rng) restore_rng(f, rng);
  return p;
}

// Whether an older iteration might load where iteration `iteration` failed with `error`: the
// failure is this iteration's damage (a file fails its checksum, one its manifest lists is gone,
// the tracker holds no iteration), or cannot be told apart from it (a checkpoint without
// SHA256SUMS, or a load told not to verify checksums: their files' damage shows as any error). A
// complete iteration whose files were verified and that failed does not match the run.
bool older_iteration_might_load(const std::string& dir, int64_t iteration, const std::string& error, bool verified) {
  if (error.find(" is a Megatron distributed checkpoint") != std::string::npos) return false;  // sound, another format
  if (error.find(" was saved without the ") != std::string::npos) return false;  // sound, a setting this run asks
  if (!verified || iteration < 0 || error.find(" is damaged") != std::string::npos ||
      error.find(" is incomplete") != std::string::npos)
    return true;
  const IterationState state = check_checkpoint_iteration(dir, iteration, /*hash_files=*/false);
  return !state.complete || !state.checksummed;
}

}  // namespace

TrainProgress load_checkpoint(const std::string& load_dir, ModelInstance& model, OptimizerInstance& optimizer,
                              StrategyInstance& strategy, const Topology& topo, const LoadOptions& what,
                              std::vector<std::string>* skipped) {
  TrainProgress p;
  std::string error;
  if (topo.world_rank == 0) remove_stale_temporaries(load_dir);
  int64_t iteration = -1;
  try {
    std::error_code ec;
    if (!fs::is_directory(load_dir, ec)) throw HostError("checkpoint: load directory " + load_dir + " does not exist");
    iteration = read_checkpoint_tracker(load_dir);
  } catch (const std::exception& e) {
    error = first_line(e.what());
  }
  // Whole parameters to load into (ZeRO-3: a collective, before anything a rank can fail on);
  // afterwards the strategy takes its shards of the loaded values.
  strategy.gather_parameters(true);
  // The tracker's iteration, then (checkpoint.fallback) older ones, newest first, as long as one
  // fails on any rank. World rank 0 picks each next candidate, so every rank tries the same.
  for (;;) {
    if (error.empty()) {
      try {
        p = load_rank(load_dir, iteration, model, optimizer, strategy, topo, what);
      } catch (const std::exception& e) {
        error = first_line(e.what());
      }
    }
    const bool failed = world_max(error.empty() ? 0 : 1, topo, "checkpoint: waiting for every rank to load") != 0;
    if (!failed) break;
    // An older iteration helps only where this one is damaged; a run that cannot take a sound
    // checkpoint (another optimizer, tensor-parallel size, ...) cannot take an older one either.
    const bool damaged = world_max(!error.empty() && older_iteration_might_load(load_dir, iteration, error, what.verify) ? 1 : 0,
                                   topo, "checkpoint: agreeing on the iteration to fall back to") != 0;
    int64_t next = -1;
    if (topo.world_rank == 0 && damaged) next = older_complete_iteration(load_dir, iteration);
    next = world_max(next, topo, "checkpoint: agreeing on the iteration to fall back to");
    const std::string what_failed = error.empty() ? "another rank could not load it" : error;
    if (!what.fallback || next < 0) {
      if (!error.empty() && !what.fallback && next >= 0)
        error += "; checkpoint.fallback=true loads iteration " + std::to_string(next) +
                 ", the newest complete checkpoint before it";
      else if (!error.empty() && what.fallback && damaged)
        error += "; no older complete checkpoint in " + load_dir + " to fall back to";
      agree(error, topo, "checkpoint: waiting for every rank to load");
      throw HostError(what_failed);  // not reached: agree throws when any rank failed
    }
    if (skipped)
      skipped->push_back((iteration >= 0 ? "iteration " + std::to_string(iteration) : std::string("the tracker")) +
                         ": " + what_failed + "; falling back to iteration " + std::to_string(next));
    iteration = next;
    error.clear();
  }
  strategy.gather_parameters(false);
  // Every rank must resume at the same iteration.
  const int64_t hi = world_max(p.iteration, topo, "checkpoint: comparing iterations");
  const int64_t lo = -world_max(-p.iteration, topo, "checkpoint: comparing iterations");
  if (hi != lo) throw HostError("checkpoint: ranks of " + load_dir + " hold different iterations");
  return p;
}

}  // namespace dtk::core
