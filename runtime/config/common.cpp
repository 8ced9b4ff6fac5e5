// Tables and text helpers shared by parsing, validation and YAML emit (common.hpp).
#include "runtime/config/common.hpp"

#include <cctype>
#include <cstdio>
#include <cstdlib>

namespace refit::config::detail {


// ---------------------------------------------------------------------------------------
// Tables shared by parsing and validation
// ---------------------------------------------------------------------------------------

const std::vector<timeout_field>& timeout_fields() {
  static const std::vector<timeout_field> fields = {
    {"describe", &timeouts::describe},
    {"generate", &timeouts::generate},
    {"sleep", &timeouts::sleep},
    {"wake_up", &timeouts::wake_up},
    {"init_weight_transfer", &timeouts::init_weight_transfer},
    {"start_weight_update", &timeouts::start_weight_update},
    {"update_weights", &timeouts::update_weights},
    {"finish_weight_update", &timeouts::finish_weight_update},
    {"release_ipc", &timeouts::release_ipc},
    {"reset_prefix_cache", &timeouts::reset_prefix_cache},
    {"shutdown", &timeouts::shutdown},
    {"startup", &timeouts::startup},
  };
  return fields;
}

const std::vector<std::string> fault_commands = {
  "describe",       "generate",           "sleep",          "wake_up",
  "init_weight_transfer", "start_weight_update", "update_weights", "finish_weight_update",
  "release_ipc",    "reset_prefix_cache", "shutdown",
};

const std::vector<std::string> fault_kinds = {
  "stall",    "exit",          "sigkill",      "error",         "bad_frame",
  "wrong_id", "wrong_command", "wrong_result", "wrong_version", "forge_receipt",
  "skew_logprobs",
};
std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items)
    out += (out.empty() ? "" : ", ") + item;
  return out;
}

std::string child_path(const std::string& parent, const std::string& name) {
  return parent.empty() ? name : parent + "." + name;
}

std::string index_path(const std::string& parent, std::size_t index) {
  return parent + "[" + std::to_string(index) + "]";
}

// `what()` of model_error / device::parse errors starts with "<where>: "; drop it so the
// config_error does not repeat its key.
std::string without_prefix(const std::string& what, const std::string& where) {
  const std::string prefix = where + ": ";
  return what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what;
}

// ---------------------------------------------------------------------------------------
// Scalar text
// ---------------------------------------------------------------------------------------

std::string format_double(double value) {
  // Shortest %g form that reads back to the same double (at most 17 significant digits).
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, value);
    if (std::strtod(buf, nullptr) == value)
      break;
  }
  return buf;
}

// A YAML scalar that reads back as `text` inside a flow map: plain when it is a simple
// name, double-quoted (with escapes) otherwise.
std::string quote_if_needed(const std::string& text) {
  const bool simple_name =
    !text.empty() && (std::isalpha(static_cast<unsigned char>(text[0])) || text[0] == '_')
    && text.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
         == std::string::npos
    && text != "null" && text != "Null" && text != "NULL";
  if (simple_name)
    return text;
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char escape[8];
      std::snprintf(escape, sizeof(escape), "\\x%02x", static_cast<unsigned char>(c));
      out += escape;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

bool is_env_name(const std::string& name) {
  if (name.empty() || std::isdigit(static_cast<unsigned char>(name[0])))
    return false;
  return name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
         == std::string::npos;
}

} // namespace refit::config::detail
