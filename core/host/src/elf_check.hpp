// elf_check.hpp — a plugin file is checked before it is mapped into the process.
//
// dlopen() maps a shared library's segments and faults them in on use: a file cut short (an
// interrupted copy, a full disk) maps fine and then kills the process with SIGBUS the first time a
// missing page is touched, with no message, even for `dtk plugins list`. Reading the ELF headers
// first turns that into a refusal naming the file.
#pragma once

#include <string>

namespace dtk::host {

// Throws HostError "<where>: <problem>" unless `path` is a complete ELF shared object for this
// machine: ELF magic, 64-bit, this byte order and machine, ET_DYN, and every program header and
// loaded segment (and the section header table) inside the file.
void check_elf_file(const std::string& path, const std::string& where);

}  // namespace dtk::host
