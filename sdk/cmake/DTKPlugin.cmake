# dtk_add_plugin(<target> SOURCES <src>... [NO_TORCH] [CUDA] [LIBRARIES <lib>...] [INSTALL])
#
# Builds a DTK plugin: a MODULE library that exports exactly one symbol (dtk_plugin_get_entry),
# compiled with hidden visibility and linked with a version script. Compute plugins (models,
# steps, optimizers, strategies) link LibTorch, and OpenMP so that at::parallel_for in their own
# code uses LibTorch's threads; data-tier plugins pass NO_TORCH.
# CUDA links dtk::cuda where this DTK has it (DTK_HAS_CUDA) and defines DTK_HAVE_CUDA and
# DTK_TORCH_CUDA (LibTorch itself has CUDA) as 0 or 1, so the plugin's code tests them with #if and
# the same sources build on a CPU-only DTK.
# The output lands in DTK_PLUGIN_OUTPUT_DIR when set (the host's plugin directory in a DTK
# build tree), else in the current binary directory. INSTALL installs it into
# <prefix>/lib/dtk/plugins, where an installed `dtk` discovers it (next to <prefix>/bin/dtk).
set(_DTK_PLUGIN_MAP "${CMAKE_CURRENT_LIST_DIR}/dtk_plugin.map" CACHE INTERNAL "")

function(dtk_add_plugin target)
  cmake_parse_arguments(ARG "NO_TORCH;CUDA;INSTALL" "OUTPUT_DIRECTORY" "SOURCES;LIBRARIES" ${ARGN})
  add_library(${target} MODULE ${ARG_SOURCES} ${ARG_UNPARSED_ARGUMENTS})
  target_link_libraries(${target} PRIVATE dtk::sdk ${ARG_LIBRARIES})
  if(NOT ARG_NO_TORCH)
    if(NOT TARGET torch)
      find_package(Torch REQUIRED)
    endif()
    target_link_libraries(${target} PRIVATE torch)
    # LibTorch 2.12+ headers refuse C++17, whatever standard the plugin's project set.
    if(Torch_VERSION VERSION_GREATER_EQUAL 2.12)
      set_property(TARGET ${target} PROPERTY CXX_STANDARD 20)
    endif()
    # at::parallel_for (LibTorch's intra-op threads) is a header template: without OpenMP in the
    # plugin's own compilation it runs on one thread.
    if(NOT TARGET OpenMP::OpenMP_CXX)
      find_package(OpenMP)
    endif()
    if(TARGET OpenMP::OpenMP_CXX)
      target_link_libraries(${target} PRIVATE OpenMP::OpenMP_CXX)
    endif()
  endif()
  if(ARG_CUDA)
    _dtk_plugin_use_cuda(${target})
  endif()
  set_target_properties(${target} PROPERTIES
    PREFIX ""
    CXX_VISIBILITY_PRESET hidden
    C_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    POSITION_INDEPENDENT_CODE ON
    LINK_DEPENDS "${_DTK_PLUGIN_MAP}")
  target_link_options(${target} PRIVATE "LINKER:--version-script=${_DTK_PLUGIN_MAP}"
                      "LINKER:--no-undefined")
  if(ARG_OUTPUT_DIRECTORY)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${ARG_OUTPUT_DIRECTORY}")
  elseif(DTK_PLUGIN_OUTPUT_DIR)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${DTK_PLUGIN_OUTPUT_DIR}")
  endif()
  if(ARG_INSTALL)
    include(GNUInstallDirs)
    install(TARGETS ${target} LIBRARY DESTINATION lib/dtk/plugins)
  endif()
endfunction()

function(_dtk_plugin_use_cuda target)
  if(TARGET dtk::cuda)
    target_link_libraries(${target} PRIVATE dtk::cuda)  # defines DTK_HAVE_CUDA=1
  else()
    target_compile_definitions(${target} PRIVATE DTK_HAVE_CUDA=0)
  endif()
  # LibTorch's config defines c10_cuda only when it was built with CUDA.
  if(TARGET dtk::cuda AND TARGET c10_cuda)
    target_compile_definitions(${target} PRIVATE DTK_TORCH_CUDA=1)
  else()
    target_compile_definitions(${target} PRIVATE DTK_TORCH_CUDA=0)
  endif()
endfunction()
