// `dtk launch`: starts N copies of this dtk binary on one machine with the torchrun
// environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
#pragma once

#include <string>

// args: everything after "launch". Returns the exit code of the launcher; an error is one
// "dtk: error: ..." line and code 1. bin/dtk (front.cpp) runs it, without LibTorch; the
// host (main.cpp) too when libexec/dtk is started directly.
int launch_command(int argc, char** argv);

// Whether this process can check a launch's command line as the host would: every flag in it is
// registered here, and DTK_CPU_GEMM is unset or names an engine that needs no check of LibTorch
// (auto, aten). bin/dtk's registry lacks LibTorch's own flags (caffe2_*, torch_*, ...), which only
// a process that loaded LibTorch knows; for those it executes the host's launcher instead.
bool launcher_can_check(int argc, char** argv);
