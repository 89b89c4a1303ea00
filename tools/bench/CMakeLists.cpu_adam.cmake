# dtk_bench_cpu_adam: the cpu_adam kernel's step (bf16 copy-out) next to torch::optim::AdamW::step on
# the same tensors and a multi-threaded memcpy of the same byte count, in the same run. Include from
# tools/CMakeLists.txt (or the kernel's standalone/ project) once dtk_cpu_adam_kernel exists.
add_executable(dtk_bench_cpu_adam ${CMAKE_CURRENT_LIST_DIR}/bench_cpu_adam.cpp)
target_link_libraries(dtk_bench_cpu_adam PRIVATE dtk_cpu_adam_kernel torch)
target_compile_options(dtk_bench_cpu_adam PRIVATE -O3)
