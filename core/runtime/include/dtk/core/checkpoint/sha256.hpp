// dtk/core/checkpoint/sha256.hpp — SHA-256 (FIPS 180-4) for checkpoint checksums.
//
// Checkpoints record a SHA-256 per file in a `sha256sum`-format manifest, so that a user can check
// one with the standard tool (`cd iter_0000004 && sha256sum -c SHA256SUMS`) as well as with DTK.
// The x86 SHA extensions are used where the CPU has them (~1.5 GB/s per core against ~0.3 GB/s
// for the portable code): a checkpoint is hashed once when saved and once when loaded.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtk::core {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t size);
  std::array<uint8_t, 32> finish();  // the digest; the object is spent afterwards
  std::string finish_hex();          // the digest as 64 lowercase hex digits

 private:
  void blocks(const uint8_t* data, size_t count);
  uint32_t state_[8];
  uint8_t pending_[64];
  size_t pending_size_ = 0;
  uint64_t total_ = 0;
};

std::string sha256_hex(const void* data, size_t size);
// Streams the file; throws dtk::host::HostError naming it when it cannot be read.
std::string sha256_file_hex(const std::string& path);

// Whether the SHA extensions are in use; tests turn them off to check the portable code too.
bool sha256_accelerated();
void sha256_force_portable(bool portable);

}  // namespace dtk::core
