// dtk/core/device/cuda_support.hpp — what this dtk build can do with CUDA, for the host's messages
// (dtk --version, the refusal of train.device=cuda / distributed.backend=nccl). No CUDA types:
// the CUDA half itself is core/cuda (dtk/cuda/*.hpp) and core/runtime/src/cuda_glue.hpp.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace dtk::core {

// Whether this dtk can train on CUDA devices: built with core/cuda against a CUDA LibTorch, and
// a device is visible. Otherwise *why says, in one sentence, what is missing.
bool cuda_training_available(std::string* why);

// Whether `spec` is a train.device value: "cpu", "cuda" or "cuda:N".
bool valid_device_spec(const std::string& spec);

// The device this process trains on, from train.device: the CPU, or a GPU: "cuda:N", or for
// "cuda" the local rank's (LOCAL_RANK under dtk launch or torchrun, SLURM_LOCALID under srun,
// else 0), as PyTorch's launchers place ranks. A GPU is made the current device of CUDA and
// LibTorch. Throws HostError (one line naming train.device) where this build or machine cannot
// train there (mpirun: OMPI_COMM_WORLD_LOCAL_RANK). training_device() is the one selected (the
// CPU until then).
// `local_rank`: this process's rank on its machine (launch/distributed.hpp's launch environment).
c10::Device select_training_device(const std::string& spec, int local_rank);
c10::Device training_device();
// The memory of the GPU `device` in bytes (0 for the CPU or without CUDA).
int64_t cuda_device_memory_bytes(const c10::Device& device);

// One line for `dtk --version`: what this build has of CUDA, NCCL and devices.
std::string cuda_build_summary();

}  // namespace dtk::core
