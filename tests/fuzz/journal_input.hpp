// What the journal fuzz targets share: a fuzz input read as an untrusted journal file, the way
// refit-replay reads one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "runtime/journal/journal_file.hpp"

namespace refit::fuzz {

// The journal in `data`, or nothing when the reader refuses it with a journal_error.
inline std::optional<journal::file> parse_journal_input(const std::uint8_t* data, std::size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  try {
    return journal::parse(bytes, "<fuzz>");
  } catch (const journal::journal_error&) {
    return std::nullopt;
  }
}

} // namespace refit::fuzz
