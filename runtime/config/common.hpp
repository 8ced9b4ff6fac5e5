// Internal to runtime/config: the tables and text helpers that parsing, validation and YAML
// emit share. Not installed, not included outside runtime/config/.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/config/config.hpp"

namespace refit::config::detail {

struct timeout_field {
  const char* name;
  std::uint32_t timeouts::*member;
};
// Every runtime.timeouts_ms key with its member, in recipe order.
const std::vector<timeout_field>& timeout_fields();

extern const std::vector<std::string> fault_commands;
extern const std::vector<std::string> fault_kinds;

constexpr std::uint32_t timeout_min_ms = 1;
constexpr std::uint32_t timeout_max_ms = 3600000;
constexpr std::uint32_t kill_grace_max_ms = 60000;
constexpr std::uint64_t frame_bytes_min = 4096;
constexpr std::uint64_t frame_bytes_max = std::uint64_t{1} << 30;
constexpr std::uint64_t kv_cache_bytes_min = 4096;
constexpr std::size_t min_token_chars = 16;

std::string join(const std::vector<std::string>& items);
std::string child_path(const std::string& parent, const std::string& name);
std::string index_path(const std::string& parent, std::size_t index);
// `what()` of model_error / device::parse errors starts with "<where>: "; drop it so the
// config_error does not repeat its key.
std::string without_prefix(const std::string& what, const std::string& where);

// Shortest %g form that reads back to the same double (at most 17 significant digits).
std::string format_double(double value);
// A YAML scalar that reads back as `text` inside a flow map: plain when it is a simple
// name, double-quoted (with escapes) otherwise.
std::string quote_if_needed(const std::string& text);
bool is_env_name(const std::string& name);

// Returns the text appended to an error about `key` (where it came from), or "".
using locator = std::function<std::string(const std::string& key)>;
// Range and cross-key checks of a whole recipe; throws config_error naming the key.
void validate_config(const refit_config& cfg, const locator& locate);

} // namespace refit::config::detail
