# Empty stand-ins for the libraries LibTorch links but never calls.
#
# Debian's LibTorch 1.13 names 22 libraries it imports no symbol from (OpenCV, FFmpeg, ZeroMQ,
# LevelDB, LMDB, Snappy, Zstandard), and through them 230 more (Qt, GTK, GDAL, codecs). The loader
# maps and relocates all of them, about 290 libraries with LibTorch's own, in every process that
# loads LibTorch: 0.3 s of its 0.8 s start on this project's 2-core VM, paid by every `dtk`
# command, every rank, every test process that links LibTorch. An empty library with the same name
# (a soname and nothing else) satisfies the loader at no cost.
#
# cmake/torch_unused_deps.sh finds the set from the files themselves (what nothing in LibTorch's
# dependency tree imports), so a LibTorch that links only what it uses gets none; nor does one
# with a RUNPATH of its own (PyTorch's wheels), which the executables' search path cannot reach.
# ctest's torch_standins_resolve_every_symbol checks the rest of the process: dtk started with
# LD_BIND_NOW=1 (every symbol of the host and its libraries bound at start) loading every plugin.
# The stand-ins go to lib/dtk/torch-standins, which
#   - bin/dtk puts first in LD_LIBRARY_PATH for the host it executes (dtk/host/torch_standins.hpp;
#     DTK_TORCH_STANDINS=off runs on the real libraries), and
#   - the test executables name in their DT_RPATH.
# A plugin that does call one of them (one linking OpenCV for images, say) fails to load with the
# loader's "undefined symbol" and dtk's hint to set DTK_TORCH_STANDINS=off.
#
# Sets DTK_TORCH_STANDINS_DIR (empty when there are none).
option(DTK_TORCH_STANDINS "Empty stand-ins for the libraries LibTorch links but never calls" ON)
set(DTK_TORCH_STANDINS_DIR "")
# A folder left by an earlier configure (or install) would go on being used: start without one.
file(REMOVE_RECURSE "${PROJECT_BINARY_DIR}/lib/dtk/torch-standins")
install(CODE "file(REMOVE_RECURSE \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/lib/dtk/torch-standins\")")
get_filename_component(_torch_dir "${TORCH_LIBRARY}" DIRECTORY)
# Found afresh at every configure (4-6 s of nm and readelf), never cached: a LibTorch or one of its
# dependencies upgraded in place changes the answer.
set(_roots "")
foreach(_lib torch_cpu torch c10 torch_cuda c10_cuda)  # torch_cpu first: its dependencies are the candidates
  unset(_found)
  find_library(_found NAMES ${_lib} HINTS "${_torch_dir}" NO_DEFAULT_PATH NO_CACHE)
  if(_found)
    list(APPEND _roots "${_found}")
  endif()
endforeach()
set(DTK_TORCH_UNUSED_DEPS "")
if(DTK_TORCH_STANDINS AND _roots MATCHES "libtorch_cpu")
  execute_process(COMMAND bash "${PROJECT_SOURCE_DIR}/cmake/torch_unused_deps.sh" ${_roots}
                  OUTPUT_VARIABLE _unused RESULT_VARIABLE _rc ERROR_VARIABLE _err)
  if(_rc EQUAL 0)
    string(REGEX REPLACE "\n+$" "" _unused "${_unused}")
    string(REPLACE "\n" ";" DTK_TORCH_UNUSED_DEPS "${_unused}")
  else()
    message(WARNING "DTK: no LibTorch stand-ins (cmake/torch_unused_deps.sh failed: ${_err})")
  endif()
endif()
if(DTK_TORCH_UNUSED_DEPS)
  set(DTK_TORCH_STANDINS_DIR "${PROJECT_BINARY_DIR}/lib/dtk/torch-standins")
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
