// apps/dtk/command_line.hpp — a dtk command line as both executables read it: the host
// (libexec/dtk, main.cpp) and bin/dtk, whose `dtk launch` checks its ranks' command line once
// before it starts them. No LibTorch: flags/*.cpp define the flags, these check them.
#pragma once

#include <string>
#include <vector>

// dtk's commands (launch starts one of them in each rank).
const std::vector<std::string>& command_names();
bool is_command(const std::string& name);

// gflags exits on an unknown flag with its own message; this throws HostError first, with the
// usual one-line error and a suggestion, for unknown flags and values of the wrong type.
void check_flags(int argc, char** argv);

// Pulls every "--set X" / "--set=X" out of argv (gflags would keep only the last one).
std::vector<std::string> extract_sets(int* argc, char** argv);

// The command of a dtk command line (args: what follows "dtk"), after checking its flags as dtk
// does (unknown flags, values of the wrong type); "" when it names none.
std::string rank_command(int argc, char** argv);
