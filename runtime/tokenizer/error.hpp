// The one exception type of refit::tokenizer: what was wrong, in which file and which JSON
// field (or byte offset), so a bad tokenizer directory is fixed from the message alone.
#pragma once

#include <stdexcept>
#include <string>

namespace refit::tokenizer {

struct tokenizer_error : std::runtime_error {
  // what() reads "<file>: <field>: <message>" (parts that are empty are left out).
  tokenizer_error(std::string file, std::string field, const std::string& message);
  std::string file;
  std::string field;
};

} // namespace refit::tokenizer
