// Reads a whole input file, refusing anything that is not a regular file (a directory,
// /dev/zero, a FIFO, a socket) and anything larger than `max_bytes`, before reading it. The
// cap is checked again while reading (a file that grows meanwhile is refused, not followed).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace refit::fileio {

// Caps of the files refit reads (bytes).
inline constexpr std::uint64_t max_config_bytes = 16ull << 20;   // a recipe (YAML)
inline constexpr std::uint64_t max_journal_bytes = 4ull << 30;   // an actor journal
inline constexpr std::uint64_t max_pem_bytes = 1ull << 20;       // a TLS certificate, key or CA bundle
inline constexpr std::uint64_t max_tokenizer_bytes = 256ull << 20; // a tokenizer.json

struct file_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The contents of `path`. `what` names the kind of file in errors ("config file", "journal").
// Throws file_error: "<what> '<path>': <why>".
std::string read_regular_file(const std::string& path, std::uint64_t max_bytes, const std::string& what);

} // namespace refit::fileio
