# Empty stand-ins for the libraries LibTorch links but never calls.
#
# Debian's LibTorch 1.13 names 22 libraries it imports no symbol from (OpenCV, FFmpeg, ZeroMQ,
# LevelDB, LMDB, Snappy, Zstandard), and through them 230 more (Qt, GTK, GDAL, codecs). The loader
# maps and relocates all 290 in every process that loads LibTorch: 0.3 s of its 0.8 s start on
# this project's 2-core VM, paid by every `dtk` command, every rank, every test process. An empty
# library with the same name (a soname and nothing else) satisfies the loader at no cost.
#
# cmake/torch_unused_deps.sh finds the set from the files themselves (what no loaded object
# imports), so a LibTorch that links only what it uses (PyTorch's wheels) gets none. The
# stand-ins go to lib/dtk/torch-standins, which
#   - bin/dtk puts first in LD_LIBRARY_PATH for the host it executes (dtk/host/torch_standins.hpp;
#     DTK_TORCH_STANDINS=off runs on the real libraries), and
#   - the test executables name in their DT_RPATH.
# A plugin that does call one of them (one linking OpenCV for images, say) fails to load with the
# loader's "undefined symbol" and dtk's hint to set DTK_TORCH_STANDINS=off.
#
# Sets DTK_TORCH_STANDINS_DIR (empty when there are none).
option(DTK_TORCH_STANDINS "Empty stand-ins for the libraries LibTorch links but never calls" ON)
set(DTK_TORCH_STANDINS_DIR "")
get_filename_component(_torch_dir "${TORCH_LIBRARY}" DIRECTORY)
find_library(DTK_TORCH_CPU_LIBRARY NAMES torch_cpu HINTS "${_torch_dir}" NO_DEFAULT_PATH)
if(DTK_TORCH_STANDINS AND DTK_TORCH_CPU_LIBRARY)
  # The set is computed once per LibTorch file (4 s of nm and readelf).
  file(TIMESTAMP "${DTK_TORCH_CPU_LIBRARY}" _torch_stamp)
  set(_key "${DTK_TORCH_CPU_LIBRARY}@${_torch_stamp}")
  if(NOT DTK_TORCH_UNUSED_DEPS_KEY STREQUAL _key)
    execute_process(COMMAND bash "${PROJECT_SOURCE_DIR}/cmake/torch_unused_deps.sh" "${DTK_TORCH_CPU_LIBRARY}"
                    OUTPUT_VARIABLE _unused RESULT_VARIABLE _rc ERROR_VARIABLE _err)
    if(NOT _rc EQUAL 0)
      message(WARNING "DTK: no LibTorch stand-ins (cmake/torch_unused_deps.sh failed: ${_err})")
      set(_unused "")
    endif()
    string(REGEX REPLACE "\n+$" "" _unused "${_unused}")
    string(REPLACE "\n" ";" _unused "${_unused}")
    set(DTK_TORCH_UNUSED_DEPS "${_unused}" CACHE INTERNAL "LibTorch's dependencies no loaded object calls")
    set(DTK_TORCH_UNUSED_DEPS_KEY "${_key}" CACHE INTERNAL "")
  endif()
  if(DTK_TORCH_UNUSED_DEPS)
    set(DTK_TORCH_STANDINS_DIR "${PROJECT_BINARY_DIR}/lib/dtk/torch-standins")
    file(REMOVE_RECURSE "${DTK_TORCH_STANDINS_DIR}")
    file(MAKE_DIRECTORY "${DTK_TORCH_STANDINS_DIR}")
    foreach(_soname IN LISTS DTK_TORCH_UNUSED_DEPS)
      execute_process(COMMAND "${CMAKE_C_COMPILER}" -shared -nostdlib -x c /dev/null "-Wl,-soname,${_soname}"
                              -o "${DTK_TORCH_STANDINS_DIR}/${_soname}" RESULT_VARIABLE _rc)
      if(NOT _rc EQUAL 0)
        message(FATAL_ERROR "DTK: could not build the stand-in ${_soname}")
      endif()
    endforeach()
    list(LENGTH DTK_TORCH_UNUSED_DEPS _n)
    message(STATUS "DTK: ${_n} LibTorch dependencies stood in (never called): ${DTK_TORCH_STANDINS_DIR}")
    install(DIRECTORY "${DTK_TORCH_STANDINS_DIR}/" DESTINATION lib/dtk/torch-standins USE_SOURCE_PERMISSIONS)
  endif()
endif()
