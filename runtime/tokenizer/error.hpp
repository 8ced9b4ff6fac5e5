// The one exception type of refit::tokenizer: what was wrong, in which file and which JSON
// field (or byte offset), so a bad tokenizer directory is fixed from the message alone.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace refit::tokenizer {

// The largest token id refit accepts (2^22 - 1; real vocabularies stay below 2^20). Ids index
// dense tables, so a file naming id 68,888,888 would otherwise cost gigabytes (found by
// fuzz_tokenizer_json).
inline constexpr std::int64_t max_token_id = (std::int64_t{1} << 22) - 1;

struct tokenizer_error : std::runtime_error {
  // what() reads "<file>: <field>: <message>" (parts that are empty are left out).
  tokenizer_error(std::string file, std::string field, const std::string& message);
  std::string file;
  std::string field;
};

} // namespace refit::tokenizer
