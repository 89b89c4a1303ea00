// dtk/core/comm/peer_processes.hpp — which process each world rank is ("host pid"), so that a
// failed collective whose backend names only an address shared by several ranks (all ranks of one
// machine listen on one address) can name the rank whose process ended: a rank on this machine
// whose pid is gone or a zombie.
#pragma once

#include <string>
#include <vector>

namespace dtk::core {

// This process as set_rank_processes expects it: "<hostname> <pid>".
std::string this_process_identity();

// Indexed by world rank, as this_process_identity() wrote them on each rank.
void set_rank_processes(std::vector<std::string> identities);

// Of `ranks`, those whose process ran on this machine and has ended (gone, or a zombie).
std::vector<int> ended_ranks(const std::vector<int>& ranks);

}  // namespace dtk::core
