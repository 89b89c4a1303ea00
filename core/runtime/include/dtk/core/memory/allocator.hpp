// dtk/core/memory/allocator.hpp — dtk runs on a caching allocator by default.
//
// With glibc malloc a training step spends about half its time in the kernel: every large
// activation (the [tokens, vocabulary] logits, their gradient) is returned to the OS with munmap
// when freed and faulted in again the next iteration. tcmalloc keeps such memory for reuse (the
// main job ran 4.7x faster with it on a 2-vCPU VM, docs/benchmarks.md). Every tensor and
// every plugin of the process allocates through malloc, so the allocator is chosen for the whole
// process, once, before anything runs: with Debian's tcmalloc (libtcmalloc-minimal4) in
// LD_PRELOAD. bin/dtk, the front that links no LibTorch, puts the preload in place before it
// executes the host, so the host loads LibTorch once; a host started directly re-executes itself
// with it (loading LibTorch twice: about 0.6 s more). Children (`dtk launch` ranks) inherit it.
//
//   DTK_ALLOCATOR=system       glibc malloc (no re-exec); tcmalloc (the default) or nothing else
//   DTK_TCMALLOC_PATH=FILE     this tcmalloc instead of the one found when dtk was configured
#pragma once

#include <string>

namespace dtk::core {

// The malloc this process runs on: "tcmalloc" or "glibc malloc".
std::string malloc_name();

// Call first thing in main(). For `dtk train` it re-executes dtk (execv of /proc/self/exe)
// unless dtk already runs on tcmalloc, was asked not to, or no tcmalloc is installed; for
// `dtk launch` it puts the preload into the environment its ranks inherit; other commands
// (config, plugins, preprocess) start once, on malloc.
void use_caching_allocator(int argc, char** argv);

// For bin/dtk (apps/dtk/front.cpp), before it executes the host with the same arguments: the
// environment use_caching_allocator would re-execute with, without re-executing this process.
void pass_caching_allocator_on(int argc, char** argv);

// The same for a program that always trains (the benchmarks): re-executes it with tcmalloc
// preloaded unless it runs on it already or DTK_ALLOCATOR=system.
void reexec_with_caching_allocator(char** argv);

}  // namespace dtk::core
