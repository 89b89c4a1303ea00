// `dtk launch`: starts N copies of this dtk binary on one machine with the torchrun
// environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
#pragma once

#include <string>

// args: everything after "launch". Returns the exit code of the launcher; an error is one
// "dtk: error: launch: ..." line and code 1. bin/dtk (front.cpp) runs it, without LibTorch; the
// host (main.cpp) too when libexec/dtk is started directly.
int launch_command(int argc, char** argv);
