#include "elf_check.hpp"

#include <elf.h>

#include <cstring>
#include <fstream>
#include <vector>

#include "dtk/host/error.hpp"

namespace dtk::host {
namespace {

#if defined(__x86_64__)
constexpr uint16_t kMachine = EM_X86_64;
constexpr const char* kMachineName = "x86-64";
#elif defined(__aarch64__)
constexpr uint16_t kMachine = EM_AARCH64;
constexpr const char* kMachineName = "aarch64";
#else
constexpr uint16_t kMachine = 0;  // not checked
constexpr const char* kMachineName = "this machine";
#endif

}  // namespace

void check_elf_file(const std::string& path, const std::string& where) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw HostError(where + ": cannot open the file for reading");
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  Elf64_Ehdr eh{};
  const auto bad = [&](const std::string& what) {
    return HostError(where + ": not a loadable plugin file (" + what + ")");
  };
  if (size < sizeof(eh) || !in.read(reinterpret_cast<char*>(&eh), sizeof(eh)))
    throw bad("only " + std::to_string(size) + " bytes, too short for an ELF header");
  if (std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0) throw bad("not an ELF file");
  if (eh.e_ident[EI_CLASS] != ELFCLASS64) throw bad("not a 64-bit ELF file");
  if (eh.e_ident[EI_DATA] != ELFDATA2LSB) throw bad("not little-endian");
  if (eh.e_type != ET_DYN) throw bad("an ELF file, but not a shared library");
  if (kMachine != 0 && eh.e_machine != kMachine)
    throw bad("built for another processor (ELF machine " + std::to_string(eh.e_machine) + "), not " + kMachineName);
  const auto truncated = [&](const std::string& what, uint64_t end) {
    return HostError(where + ": truncated or corrupt plugin file: " + what + " ends at byte " + std::to_string(end) +
                     ", the file has " + std::to_string(size) + " bytes");
  };
  if (eh.e_phentsize != sizeof(Elf64_Phdr) || eh.e_phnum == 0) throw bad("no valid program headers");
  const uint64_t ph_end = eh.e_phoff + static_cast<uint64_t>(eh.e_phnum) * eh.e_phentsize;
  if (ph_end > size) throw truncated("the program header table", ph_end);
  std::vector<Elf64_Phdr> ph(eh.e_phnum);
  in.seekg(static_cast<std::streamoff>(eh.e_phoff));
  if (!in.read(reinterpret_cast<char*>(ph.data()), static_cast<std::streamsize>(ph.size() * sizeof(Elf64_Phdr))))
    throw truncated("the program header table", ph_end);
  for (size_t i = 0; i < ph.size(); ++i) {
    // A position-independent executable is ET_DYN too; it names its program interpreter.
    if (ph[i].p_type == PT_INTERP) throw bad("an executable program, not a shared library");
    if (ph[i].p_type != PT_LOAD && ph[i].p_type != PT_DYNAMIC) continue;
    const uint64_t end = ph[i].p_offset + ph[i].p_filesz;
    if (end < ph[i].p_offset || end > size)
      throw truncated(std::string(ph[i].p_type == PT_LOAD ? "loadable segment " : "dynamic segment ") +
                          std::to_string(i),
                      end);
  }
  if (eh.e_shoff != 0) {
    const uint64_t sh_end = eh.e_shoff + static_cast<uint64_t>(eh.e_shnum) * eh.e_shentsize;
    if (sh_end > size) throw truncated("the section header table", sh_end);
  }
}

}  // namespace dtk::host
