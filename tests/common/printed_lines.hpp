// The per-iteration figures a `dtk` run printed, as strings for exact comparison (resumed ==
// uninterrupted, one offload tier == another): what the log line shows, digit for digit.
#pragma once

#include <map>
#include <regex>
#include <string>

namespace dtk_test {

// iteration -> "lm loss: X grad norm: Y" as the log lines printed them.
inline std::map<int, std::string> printed_loss_and_norm(const std::string& log) {
  std::map<int, std::string> out;
  std::regex re(R"(iteration\s+(\d+)/\s*\d+ \|.*(lm loss: \S+) \|.*(grad norm: \S+) \|)");
  for (std::sregex_iterator it(log.begin(), log.end(), re), end; it != end; ++it)
    out[std::stoi((*it)[1])] = (*it)[2].str() + " " + (*it)[3].str();
  return out;
}

}  // namespace dtk_test
