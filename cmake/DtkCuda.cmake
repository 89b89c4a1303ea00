# DTK_WITH_CUDA=AUTO|ON|OFF. Sets
#   DTK_CUDA_FOUND  a CUDA toolkit (nvcc, cudart) and NCCL were found: core/cuda (dtk_cuda) is
#                   built, CPU-only LibTorch or not, so CI compiles the CUDA path on every change;
#   DTK_TORCH_CUDA  LibTorch itself has CUDA (the GPU machine's PyTorch): the glue to LibTorch's
#                   CUDA state (its current stream) is built too.
set(DTK_CUDA_FOUND FALSE)
set(DTK_TORCH_CUDA FALSE)
if(NOT DTK_WITH_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "DTK_WITH_CUDA must be AUTO, ON or OFF, not '${DTK_WITH_CUDA}'")
endif()
if(NOT DTK_WITH_CUDA STREQUAL "OFF")
  # nvcc off PATH in its usual place (Debian's CUDA installs keep it in /usr/local/cuda/bin).
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # A100 and H100 by default (set CMAKE_CUDA_ARCHITECTURES=native on a GPU machine to build less).
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)
    find_package(CUDAToolkit)
    find_path(DTK_NCCL_INCLUDE_DIR nccl.h HINTS ENV NCCL_HOME PATH_SUFFIXES include
              PATHS ${CUDAToolkit_INCLUDE_DIRS})
    find_library(DTK_NCCL_LIBRARY nccl HINTS ENV NCCL_HOME PATH_SUFFIXES lib lib64
                 PATHS ${CUDAToolkit_LIBRARY_DIR})
  endif()
  if(CUDAToolkit_FOUND AND DTK_NCCL_INCLUDE_DIR AND DTK_NCCL_LIBRARY)
    set(DTK_CUDA_FOUND TRUE)
    message(STATUS "DTK: CUDA ${CUDAToolkit_VERSION} (${CMAKE_CUDA_COMPILER}, architectures ${CMAKE_CUDA_ARCHITECTURES}), "
                   "NCCL ${DTK_NCCL_LIBRARY}: building core/cuda")
  elseif(DTK_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DTK_WITH_CUDA=ON but no CUDA toolkit with NCCL was found (nvcc: '${CMAKE_CUDA_COMPILER}', "
                        "nccl.h: '${DTK_NCCL_INCLUDE_DIR}', libnccl: '${DTK_NCCL_LIBRARY}'); set CUDACXX and NCCL_HOME")
  else()
    message(STATUS "DTK: no CUDA toolkit with NCCL found: CPU-only build (DTK_WITH_CUDA=AUTO)")
  endif()
  # LibTorch's config defines these targets only when it was built with CUDA.
  if(DTK_CUDA_FOUND AND TARGET c10_cuda)
    set(DTK_TORCH_CUDA TRUE)
    message(STATUS "DTK: LibTorch has CUDA: building the GPU training path")
  elseif(DTK_CUDA_FOUND)
    message(STATUS "DTK: LibTorch ${Torch_VERSION} is CPU-only: the CUDA sources build, train.device=cuda needs a CUDA LibTorch")
  endif()
endif()

# dtk_use_cuda(target PUBLIC|PRIVATE): links core/cuda where it is built and defines DTK_HAVE_CUDA
# and DTK_TORCH_CUDA as 0 or 1, so code tests them with #if everywhere.
function(dtk_use_cuda target scope)
  if(DTK_CUDA_FOUND)
    target_link_libraries(${target} ${scope} dtk_cuda)  # dtk_cuda defines DTK_HAVE_CUDA=1
  else()
    target_compile_definitions(${target} ${scope} DTK_HAVE_CUDA=0)
  endif()
  if(DTK_TORCH_CUDA)
    target_compile_definitions(${target} ${scope} DTK_TORCH_CUDA=1)
  else()
    target_compile_definitions(${target} ${scope} DTK_TORCH_CUDA=0)
  endif()
endfunction()
