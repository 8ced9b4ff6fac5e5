// JSON parsing for checkpoint files: nlohmann::json with duplicate keys refused (nlohmann
// keeps the last one silently) and a nesting limit, every failure a checkpoint_error.
#pragma once

#include "runtime/checkpoint/safetensors.hpp"

#include <nlohmann/json.hpp>

#include <string>

namespace refit::checkpoint {

// Parses [begin, end) of `file`. Objects and arrays may nest at most `max_depth` deep (the
// root is depth 1). With `root_keys_are_tensors` a duplicate root key is reported as a
// duplicate tensor name (safetensors headers) and deeper errors name the tensor.
nlohmann::json parse_json_strict(const char* begin, const char* end, const std::string& file,
                                 int max_depth, bool root_keys_are_tensors);

// Reads and parses a whole (small) JSON file: config.json, the index.
nlohmann::json read_json_file(const std::string& path, int max_depth);

} // namespace refit::checkpoint
