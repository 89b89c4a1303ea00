// The memory report a `dtk` run prints once (rank 0, after its first logged iteration: Megatron's
// report_memory line with DTK's breakdown), read back as numbers (MiB).
#pragma once

#include <regex>
#include <string>

namespace dtk_test {

struct Memory {
  double allocated = -1, max_allocated, parameters, gradients, masters, optimizer, host;
  bool optimizer_on_host = false;
};

// The memory report line of rank 0 (MiB); allocated stays -1 where the log has none.
inline Memory memory_of(const std::string& log) {
  std::smatch m;
  Memory out;
  const std::regex re(
      R"(memory \(MB\) \| allocated: (\S+) \| max allocated: (\S+) \| parameters: (\S+) \| gradients: (\S+) \| )"
      R"(fp32 masters: (\S+) \| optimizer state: (\S+)( \(host\))? \| host allocated: (\S+) \|)");
  if (!std::regex_search(log, m, re)) return out;
  out.allocated = std::stod(m[1]), out.max_allocated = std::stod(m[2]), out.parameters = std::stod(m[3]);
  out.gradients = std::stod(m[4]), out.masters = std::stod(m[5]), out.optimizer = std::stod(m[6]);
  out.optimizer_on_host = m[7].matched;
  out.host = std::stod(m[8]);
  return out;
}

}  // namespace dtk_test
