// refit-bench tokenize: single-thread encode throughput over a list of texts.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/tokenizer/tokenizer.hpp"

namespace refit::tokenizer {

// Encodes all `texts` in passes until `min_seconds` have passed (at least one pass). Returns
// {"mb_per_s", "bytes_per_pass", "passes", "seconds", "tokens_per_pass", "ids_digest"
// (FNV-1a 64 over one pass's ids, hex; every pass must give the same), "threads": 1}.
// MB = 10^6 bytes.
nlohmann::json run_tokenize_bench(const tokenizer& tok, const std::vector<std::string>& texts,
                                  double min_seconds);

} // namespace refit::tokenizer
