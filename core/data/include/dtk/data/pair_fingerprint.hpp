// pair_fingerprint.hpp — PREFIX.fingerprint: what `dtk preprocess` records of a .bin/.idx pair it
// wrote together, so that a pair that no longer belongs together is refused instead of training
// on tokens read from the wrong places. The reader already refuses a .bin that holds more or less
// than its .idx describes (IndexedDataset::check_bin_matches_index); what the files alone cannot
// show is another corpus's .idx that happens to describe the very same byte layout, or a .bin
// replaced by another of the same size. Megatron's format has no field for it, hence a file
// beside them. Megatron-made pairs have none and are read as before.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "dtk/data/mapped_file.hpp"

namespace dtk::data {

inline std::string fingerprint_path(const std::string& prefix) { return prefix + ".fingerprint"; }

// One line: both sizes and a 64-bit FNV-1a hash of the first and last 64 KiB of each file, so
// checking it reads at most 256 KiB whatever the corpus's size.
std::string pair_fingerprint(const MappedFile& bin, const MappedFile& idx);

// Writes PREFIX.fingerprint from the files on disk (through a temporary, renamed into place).
void write_pair_fingerprint(const std::string& prefix);

// Removes PREFIX.fingerprint if there is one (before a new pair replaces the files).
void remove_pair_fingerprint(const std::string& prefix);

// Throws DataError naming the files and both fingerprints when PREFIX.fingerprint exists and the
// pair no longer matches it.
void check_pair_fingerprint(const std::string& prefix, const MappedFile& bin, const MappedFile& idx);

}  // namespace dtk::data
