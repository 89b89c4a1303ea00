// Megatron's progress.txt: the format of megatron/training/utils/log_utils.py
// append_to_progress_log and the arithmetic of training.py's
// compute_throughputs_and_append_to_progress_log and get_start_time_from_progress_log.
#include "dtk/core/logging/progress_log.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <optional>
#include <sstream>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace dtk::core {

namespace {

constexpr const char* kTimeFormat = "%Y-%m-%d %H:%M:%S";

std::string now_text() {
  const std::time_t t = std::time(nullptr);
  std::tm local{};
  localtime_r(&t, &local);
  char buf[32];
  std::strftime(buf, sizeof buf, kTimeFormat, &local);
  return buf;
}

// Seconds since a line's local timestamp; nullopt when it does not parse.
std::optional<double> seconds_since(const std::string& stamp) {
  std::tm tm{};
  std::istringstream in(stamp);
  in >> std::get_time(&tm, kTimeFormat);
  if (in.fail()) return std::nullopt;
  tm.tm_isdst = -1;
  const std::time_t t = std::mktime(&tm);
  if (t == static_cast<std::time_t>(-1)) return std::nullopt;
  return std::difftime(std::time(nullptr), t);
}

std::vector<std::string> fields(const std::string& line) {
  std::vector<std::string> out;
  std::string f;
  std::istringstream in(line);
  while (std::getline(in, f, '\t')) out.push_back(f);
  return out;
}

// "Name: value" -> value (Megatron's _get_field: what follows ": ").
std::string value_of(const std::string& field) {
  const size_t at = field.find(": ");
  return at == std::string::npos ? std::string() : field.substr(at + 2);
}

// Where the jobs of this world size began (the earliest "Starting job" since the last line of
// another world size) and the operations committed by then. Lines that do not parse are skipped.
struct CumulativeStart {
  std::optional<double> seconds_ago;
  double flops = 0;
};

CumulativeStart cumulative_start(const std::string& path, int world_size) {
  CumulativeStart start;
  double latest = 0;
  std::optional<double> uncommitted;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const std::vector<std::string> f = fields(line);
    if (f.size() < 4) continue;
    const std::string& event = f[3];
    if (f.size() > 7 && event == "Saved checkpoint") latest = std::strtod(value_of(f[7]).c_str(), nullptr);
    if (f.size() > 7 && event == "Saving async checkpoint") uncommitted = std::strtod(value_of(f[7]).c_str(), nullptr);
    if (event == "Saved async checkpoint" && uncommitted) latest = *uncommitted, uncommitted.reset();
    if (std::atoi(value_of(f[2]).c_str()) != world_size) {
      start = CumulativeStart{};  // restart the search after a job of another world size
      continue;
    }
    if (event == "Starting job" && !start.seconds_ago) {
      start.seconds_ago = seconds_since(f[0]);
      start.flops = latest;
    }
  }
  return start;
}

}  // namespace

// /proc/self/stat's 22nd field, the start in clock ticks since boot, against /proc/uptime. (The
// second field, the command's name in parentheses, may hold spaces: count from its last ')'.)
double seconds_since_process_start() {
  std::ifstream stat("/proc/self/stat"), uptime_file("/proc/uptime");
  std::string text;
  std::getline(stat, text);
  double uptime = 0;
  uptime_file >> uptime;
  const size_t name_end = text.rfind(')');
  const long ticks = ::sysconf(_SC_CLK_TCK);
  if (name_end == std::string::npos || !uptime_file || ticks <= 0) return 0;
  std::istringstream rest(text.substr(name_end + 1));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i < 22) continue;
    const double seconds = uptime - std::strtod(field.c_str(), nullptr) / static_cast<double>(ticks);
    return seconds > 0 ? seconds : 0;
  }
  return 0;
}

ProgressLog::ProgressLog(const std::string& save_dir, int world_size, double flops_so_far, double job_seconds)
    : path_((std::filesystem::path(save_dir) / "progress.txt").string()),
      world_size_(world_size),
      job_start_flops_(flops_so_far),
      job_start_(std::chrono::steady_clock::now() - std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                        std::chrono::duration<double>(job_seconds))),
      start_line_(std::chrono::steady_clock::now()) {
  std::error_code ec;
  std::filesystem::create_directories(save_dir, ec);
  append("Starting job");
}

// One write() of the whole line on an O_APPEND descriptor (no half line for Megatron's parser to
// trip on). A failure is a warning and ends the file's lines: the run, whose checkpoints are
// published already, goes on (only world rank 0 writes; an error there would strand the others).
void ProgressLog::append(const std::string& event) {
  if (failed_) return;
  const char* job = std::getenv("SLURM_JOB_ID");
  const std::string line =
      now_text() + "\tJob ID: " + (job ? job : "") + "\t# GPUs: " + std::to_string(world_size_) + "\t" + event + "\n";
  errno = 0;
  const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const ssize_t n = fd < 0 ? -1 : ::write(fd, line.data(), line.size());
  int error = errno;
  // NFS and quotas report a failed write only when the file is closed.
  if (fd >= 0 && ::close(fd) != 0 && error == 0) error = errno;
  if (n == static_cast<ssize_t>(line.size()) && error == 0) return;
  failed_ = true;
  std::fprintf(stderr, "dtk: warning: logging.log_progress: cannot write %s (%s); it gets no more lines in this run\n",
               path_.c_str(), error != 0 ? std::strerror(error) : "a short write");
}

void ProgressLog::saved(int64_t iteration, double flops_so_far, int64_t tokens_so_far, bool async) {
  const auto now = std::chrono::steady_clock::now();
  const double job_seconds = std::chrono::duration<double>(now - job_start_).count();
  const double job = (flops_so_far - job_start_flops_) / (job_seconds * 1e12 * world_size_);
  const CumulativeStart start = cumulative_start(path_, world_size_);
  // Timestamps have whole seconds: a first save within a second of this job's start line counts
  // the time since that line. Without a start line of this world size (the file edited), the job's
  // own figure.
  double elapsed = job_seconds, from = job_start_flops_;
  if (start.seconds_ago) {
    elapsed = std::max(*start.seconds_ago, std::chrono::duration<double>(now - start_line_).count());
    from = start.flops;
  }
  const double cumulative = (flops_so_far - from) / (elapsed * 1e12 * world_size_);
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%s\tIteration: %lld\tJob throughput: %.1f TFLOP/s/GPU\tCumulative throughput: %.1f TFLOP/s/GPU\t"
                "Floating-point operations: %.2e\tTokens (in billions): %.2f",
                async ? "Saving async checkpoint" : "Saved checkpoint", static_cast<long long>(iteration), job,
                cumulative, flops_so_far, static_cast<double>(tokens_so_far) / 1e9);
  append(buf);
}

void ProgressLog::async_saved(int64_t iteration) {
  append("Saved async checkpoint\tIteration: " + std::to_string(iteration));
}

void ProgressLog::deleted(int64_t iteration) { append("Deleted checkpoint\tIteration: " + std::to_string(iteration)); }

}  // namespace dtk::core
