// The CPU emulation's stand-in for <cuda_runtime.h> (simt_runtime.hpp).
#pragma once
#include "simt_runtime.hpp"
