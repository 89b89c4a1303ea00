// `dtk launch`: starts N copies of this dtk binary on one machine with the torchrun
// environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
#pragma once

// args: everything after "launch". Returns the exit code of the launcher.
int run_launch(int argc, char** argv);
