// `dtk launch`: starts N copies of this dtk binary on one machine with the torchrun
// environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
#pragma once

#include <string>

// args: everything after "launch". Returns the exit code of the launcher.
int run_launch(int argc, char** argv);

// Whether `name` is one of dtk's commands (main.cpp keeps the list): the launcher refuses anything
// else once, rather than every rank refusing it.
bool is_command(const std::string& name);

// The command of a dtk command line (args: what follows "dtk"), after checking its flags as dtk
// does (unknown flags, values of the wrong type); "" when it names none. main.cpp keeps the rules.
std::string rank_command(int argc, char** argv);
