// Reading the JSON files of a tokenizer directory: regular files only, a size cap, parse
// errors with the byte offset, and typed field access whose errors name the JSON path.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "runtime/tokenizer/error.hpp"

namespace refit::tokenizer {

// tokenizer.json is at most 64 MiB (Qwen3's is 11 MB); the small config files at most 4 MiB.
inline constexpr std::uintmax_t max_tokenizer_json_bytes = 64ull << 20;
inline constexpr std::uintmax_t max_config_json_bytes = 4ull << 20;

// The bytes of `path`; refuses a missing path, a directory, device, fifo or socket, and a
// file over `cap` bytes, naming the path.
std::string read_regular_file(const std::filesystem::path& path, std::uintmax_t cap);

// Parses `bytes` as JSON; a syntax error names `file` and the byte offset.
nlohmann::json parse_json(std::string_view bytes, const std::string& file);

// A JSON value with its path ("model.merges[3]") for error messages.
class json_node {
public:
  json_node(const nlohmann::json& value, std::string path, const std::string& file)
      : value_(&value), path_(std::move(path)), file_(&file) {}

  const nlohmann::json& value() const { return *value_; }
  const std::string& path() const { return path_; }
  const std::string& file() const { return *file_; }

  bool is_null() const { return value_->is_null(); }
  bool is_object() const { return value_->is_object(); }
  bool is_array() const { return value_->is_array(); }
  bool is_string() const { return value_->is_string(); }
  bool has(const char* key) const;

  // Required member of an object (error when this is not an object or the key is missing).
  json_node at(const char* key) const;
  // Member if present and not null.
  std::optional<json_node> find(const char* key) const;
  json_node at(std::size_t index) const;
  std::size_t size() const; // array or object size (error for other types)

  const std::string& str() const;
  bool boolean() const;
  std::int64_t integer() const;
  // Optional boolean member with a default (null counts as absent).
  bool flag(const char* key, bool dflt) const;
  // Optional string member ("" when absent or null).
  std::string string_or_empty(const char* key) const;

  [[noreturn]] void fail(const std::string& message) const;
  [[noreturn]] void fail_at(const char* key, const std::string& message) const;

private:
  const nlohmann::json* value_;
  std::string path_;
  const std::string* file_;
};

} // namespace refit::tokenizer
