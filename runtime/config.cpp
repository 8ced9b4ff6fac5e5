#include "runtime/config.hpp"

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include <yaml-cpp/yaml.h>

#include "runtime/device.hpp"

namespace refit::config {
namespace {

// ---------------------------------------------------------------------------------------
// Tables shared by parsing and validation
// ---------------------------------------------------------------------------------------

struct timeout_field {
  const char* name;
  std::uint32_t timeouts::*member;
};

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
};

constexpr std::uint32_t timeout_min_ms = 1;
constexpr std::uint32_t timeout_max_ms = 3600000;
constexpr std::uint32_t kill_grace_max_ms = 60000;
constexpr std::uint64_t frame_bytes_min = 4096;
constexpr std::uint64_t frame_bytes_max = std::uint64_t{1} << 30;
constexpr std::uint64_t kv_cache_bytes_min = 4096;
constexpr std::size_t min_token_chars = 16;

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

// ---------------------------------------------------------------------------------------
// Strict reader over a YAML tree: every error names the full key path, the offending value
// and where in the source it was.
// ---------------------------------------------------------------------------------------

const char* describe_kind(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Sequence: return "a sequence";
    case YAML::NodeType::Null: return "an empty value";
    default: return "a scalar";
  }
}

class yaml_reader {
public:
  // One key of a map: how to read its value, and whether it must be present.
  struct field {
    std::string name;
    std::function<void(const YAML::Node& value, const std::string& path)> read;
    bool required = false;
  };

  explicit yaml_reader(std::string origin) : origin_(std::move(origin)) {}

  [[noreturn]] void fail(const std::string& key, const YAML::Node& at,
                         const std::string& what) const {
    throw config_error(key, what + location(at.Mark()));
  }

  // " (at origin:line:column)" for a key read by this reader, " (in origin)" otherwise.
  std::string locate(const std::string& key) const {
    auto it = marks_.find(key);
    return it == marks_.end() ? " (in " + origin_ + ")" : location(it->second);
  }

  void read_map(const YAML::Node& node, const std::string& path,
                const std::vector<field>& fields) {
    if (!node.IsMap())
      fail(path, node, std::string("expected a map, got ") + describe_kind(node));
    std::set<std::string> seen;
    for (const auto& entry : node) {
      const YAML::Node& key = entry.first;
      if (!key.IsScalar())
        fail(path, key, std::string("map keys must be names, got ") + describe_kind(key));
      const std::string name = key.Scalar();
      const std::string key_path = child_path(path, name);
      const field* match = nullptr;
      for (const auto& f : fields)
        if (f.name == name)
          match = &f;
      if (match == nullptr)
        fail(key_path, key, "unknown key (known keys: " + known_names(fields) + ")");
      if (!seen.insert(name).second)
        fail(key_path, key, "duplicate key");
      marks_[key_path] = entry.second.Mark();
      match->read(entry.second, key_path);
    }
    for (const auto& f : fields)
      if (f.required && seen.count(f.name) == 0)
        fail(child_path(path, f.name), node, "required key is missing");
  }

  template <class Fn>
  void read_sequence(const YAML::Node& node, const std::string& path, Fn&& read_element) {
    if (!node.IsSequence())
      fail(path, node, std::string("expected a sequence, got ") + describe_kind(node));
    for (std::size_t i = 0; i < node.size(); ++i) {
      const std::string element_path = index_path(path, i);
      marks_[element_path] = node[i].Mark();
      read_element(node[i], element_path);
    }
  }

  std::string string(const YAML::Node& node, const std::string& path) const {
    if (!node.IsScalar())
      fail(path, node, std::string("expected a string, got ") + describe_kind(node));
    return node.Scalar();
  }

  std::uint64_t unsigned_integer(const YAML::Node& node, const std::string& path,
                                 std::uint64_t max) const {
    const std::string text = plain_scalar(node, path, "an unsigned integer");
    if (!text.empty() && text[0] == '-')
      fail(path, node, "expected an unsigned integer, got '" + text + "' (negative)");
    if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
      fail(path, node, "expected an unsigned integer, got '" + text + "'");
    std::uint64_t value = 0;
    const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
    if (result.ec == std::errc::result_out_of_range || value > max)
      fail(path, node, "'" + text + "' is too large (maximum " + std::to_string(max) + ")");
    return value;
  }

  std::uint32_t u32(const YAML::Node& node, const std::string& path) const {
    return static_cast<std::uint32_t>(
      unsigned_integer(node, path, std::numeric_limits<std::uint32_t>::max()));
  }

  std::uint64_t u64(const YAML::Node& node, const std::string& path) const {
    return unsigned_integer(node, path, std::numeric_limits<std::uint64_t>::max());
  }

  bool boolean(const YAML::Node& node, const std::string& path) const {
    const std::string text = plain_scalar(node, path, "true or false");
    if (text == "true")
      return true;
    if (text == "false")
      return false;
    fail(path, node, "expected true or false, got '" + text + "'");
  }

  double number(const YAML::Node& node, const std::string& path) const {
    const std::string text = plain_scalar(node, path, "a number");
    double value = 0;
    const char* first = text.data();
    const char* last = text.data() + text.size();
    const auto [end, ec] = std::from_chars(first, last, value, std::chars_format::general);
    if (ec != std::errc() || end != last || !std::isfinite(value))
      fail(path, node, "expected a finite number, got '" + text + "'");
    return value;
  }

private:
  // Numbers and booleans must be plain (unquoted) scalars: "2" in quotes is a string.
  std::string plain_scalar(const YAML::Node& node, const std::string& path,
                           const std::string& expected) const {
    if (!node.IsScalar())
      fail(path, node, "expected " + expected + ", got " + describe_kind(node));
    if (node.Tag() == "!")
      fail(path, node, "expected " + expected + ", got the quoted string '" + node.Scalar() + "'");
    return node.Scalar();
  }

  std::string location(const YAML::Mark& mark) const {
    if (mark.is_null())
      return " (in " + origin_ + ")";
    return " (at " + origin_ + ":" + std::to_string(mark.line + 1) + ":"
           + std::to_string(mark.column + 1) + ")";
  }

  static std::string known_names(const std::vector<field>& fields) {
    std::vector<std::string> names;
    for (const auto& f : fields)
      names.push_back(f.name);
    return join(names);
  }

  std::string origin_;
  std::map<std::string, YAML::Mark> marks_; // key path -> where its value starts
};

YAML::Node load_document(const std::string& text, const std::string& origin) {
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(text);
  } catch (const YAML::ParserException& e) {
    throw config_error("", origin + ":" + std::to_string(e.mark.line + 1) + ":"
                             + std::to_string(e.mark.column + 1)
                             + ": invalid YAML: " + e.msg);
  }
  if (documents.size() > 1)
    throw config_error("", origin + ": expected one YAML document, found "
                             + std::to_string(documents.size()));
  if (documents.empty() || documents[0].IsNull())
    throw config_error("", origin + ": the document is empty");
  return documents[0];
}

// ---------------------------------------------------------------------------------------
// Sections
// ---------------------------------------------------------------------------------------

using field = yaml_reader::field;

void read_model(yaml_reader& r, const YAML::Node& node, const std::string& path,
                model::model_config& m) {
  auto u32_field = [&](const char* name, std::uint32_t& target) {
    return field{name, [&r, &target](const YAML::Node& v, const std::string& p) {
                   target = r.u32(v, p);
                 }, true};
  };
  auto bool_field = [&](const char* name, bool& target) {
    return field{name, [&r, &target](const YAML::Node& v, const std::string& p) {
                   target = r.boolean(v, p);
                 }};
  };
  auto double_field = [&](const char* name, double& target) {
    return field{name, [&r, &target](const YAML::Node& v, const std::string& p) {
                   target = r.number(v, p);
                 }};
  };
  auto string_field = [&](const char* name, std::string& target) {
    return field{name, [&r, &target](const YAML::Node& v, const std::string& p) {
                   target = r.string(v, p);
                 }};
  };
  r.read_map(node, path, {
    string_field("model_type", m.model_type),
    u32_field("num_hidden_layers", m.num_hidden_layers),
    u32_field("hidden_size", m.hidden_size),
    u32_field("num_attention_heads", m.num_attention_heads),
    u32_field("num_key_value_heads", m.num_key_value_heads),
    u32_field("head_dim", m.head_dim),
    u32_field("num_experts", m.num_experts),
    u32_field("num_experts_per_tok", m.num_experts_per_tok),
    u32_field("moe_intermediate_size", m.moe_intermediate_size),
    u32_field("vocab_size", m.vocab_size),
    bool_field("tie_word_embeddings", m.tie_word_embeddings),
    double_field("rms_norm_eps", m.rms_norm_eps),
    double_field("rope_theta", m.rope_theta),
    bool_field("norm_topk_prob", m.norm_topk_prob),
    field{"torch_dtype",
          [&r, &m](const YAML::Node& v, const std::string& p) {
            const std::string text = r.string(v, p);
            try {
              m.torch_dtype = model::parse_dtype(text, p);
            } catch (const model::model_error& e) {
              r.fail(p, v, without_prefix(e.what(), e.where));
            }
          }},
    string_field("quantization", m.quantization),
    bool_field("lora", m.lora),
  });
}

void read_timeouts(yaml_reader& r, const YAML::Node& node, const std::string& path,
                   timeouts& t) {
  std::vector<field> fields;
  for (const auto& tf : timeout_fields())
    fields.push_back({tf.name, [&r, &t, member = tf.member](const YAML::Node& v,
                                                            const std::string& p) {
                        t.*member = r.u32(v, p);
                      }});
  r.read_map(node, path, fields);
}

void read_fault(yaml_reader& r, const YAML::Node& node, const std::string& path,
                runtime_fault& f) {
  r.read_map(node, path, {
    {"command", [&](const YAML::Node& v, const std::string& p) { f.command = r.string(v, p); },
     true},
    {"kind", [&](const YAML::Node& v, const std::string& p) { f.kind = r.string(v, p); }, true},
    {"after", [&](const YAML::Node& v, const std::string& p) { f.after = r.u32(v, p); }},
    {"incarnation",
     [&](const YAML::Node& v, const std::string& p) { f.incarnation = r.u32(v, p); }},
  });
}

void read_runtime(yaml_reader& r, const YAML::Node& node, const std::string& path,
                  runtime_config& rt) {
  r.read_map(node, path, {
    {"executable",
     [&](const YAML::Node& v, const std::string& p) { rt.executable = r.string(v, p); }},
    {"tp_size", [&](const YAML::Node& v, const std::string& p) { rt.tp_size = r.u32(v, p); }},
    {"devices",
     [&](const YAML::Node& v, const std::string& p) {
       rt.devices.clear();
       r.read_sequence(v, p, [&](const YAML::Node& element, const std::string& element_path) {
         rt.devices.push_back(r.string(element, element_path));
       });
     }},
    {"kv_cache_bytes",
     [&](const YAML::Node& v, const std::string& p) { rt.kv_cache_bytes = r.u64(v, p); }},
    {"max_frame_bytes",
     [&](const YAML::Node& v, const std::string& p) { rt.max_frame_bytes = r.u64(v, p); }},
    {"kill_grace_ms",
     [&](const YAML::Node& v, const std::string& p) { rt.kill_grace_ms = r.u32(v, p); }},
    {"timeouts_ms",
     [&](const YAML::Node& v, const std::string& p) { read_timeouts(r, v, p, rt.timeouts_ms); }},
    {"faults",
     [&](const YAML::Node& v, const std::string& p) {
       rt.faults.clear();
       r.read_sequence(v, p, [&](const YAML::Node& element, const std::string& element_path) {
         read_fault(r, element, element_path, rt.faults.emplace_back());
       });
     }},
  });
}

void read_supervisor(yaml_reader& r, const YAML::Node& node, const std::string& path,
                     supervisor_config& s) {
  r.read_map(node, path, {
    {"max_restarts",
     [&](const YAML::Node& v, const std::string& p) { s.max_restarts = r.u32(v, p); }},
    {"backoff_initial_ms",
     [&](const YAML::Node& v, const std::string& p) { s.backoff_initial_ms = r.u32(v, p); }},
    {"backoff_max_ms",
     [&](const YAML::Node& v, const std::string& p) { s.backoff_max_ms = r.u32(v, p); }},
    {"restart_window_ms",
     [&](const YAML::Node& v, const std::string& p) { s.restart_window_ms = r.u32(v, p); }},
  });
}

void read_trainer_fault(yaml_reader& r, const YAML::Node& node, const std::string& path,
                        trainer_fault& f) {
  r.read_map(node, path, {
    {"rank", [&](const YAML::Node& v, const std::string& p) { f.rank = r.u32(v, p); }, true},
    {"kind", [&](const YAML::Node& v, const std::string& p) { f.kind = r.string(v, p); }, true},
    {"tensor", [&](const YAML::Node& v, const std::string& p) { f.tensor = r.string(v, p); }},
    {"chunk", [&](const YAML::Node& v, const std::string& p) { f.chunk = r.u32(v, p); }},
    {"repeat", [&](const YAML::Node& v, const std::string& p) { f.repeat = r.boolean(v, p); }},
  });
}

void read_trainer(yaml_reader& r, const YAML::Node& node, const std::string& path,
                  trainer_config& t) {
  r.read_map(node, path, {
    {"devices",
     [&](const YAML::Node& v, const std::string& p) {
       t.devices.clear();
       r.read_sequence(v, p, [&](const YAML::Node& element, const std::string& element_path) {
         t.devices.push_back(r.string(element, element_path));
       });
     }},
    {"lr", [&](const YAML::Node& v, const std::string& p) {
       t.lr = static_cast<float>(r.number(v, p)); }},
    {"init_scale", [&](const YAML::Node& v, const std::string& p) {
       t.init_scale = static_cast<float>(r.number(v, p)); }},
    {"faults",
     [&](const YAML::Node& v, const std::string& p) {
       t.faults.clear();
       r.read_sequence(v, p, [&](const YAML::Node& element, const std::string& element_path) {
         read_trainer_fault(r, element, element_path, t.faults.emplace_back());
       });
     }},
  });
}

void read_publication(yaml_reader& r, const YAML::Node& node, const std::string& path,
                      publication_config& pc) {
  r.read_map(node, path, {
    {"buffer_bytes",
     [&](const YAML::Node& v, const std::string& p) { pc.buffer_bytes = r.u64(v, p); }},
    {"buffer_count",
     [&](const YAML::Node& v, const std::string& p) { pc.buffer_count = r.u32(v, p); }},
    {"transport",
     [&](const YAML::Node& v, const std::string& p) { pc.transport = r.string(v, p); }},
    {"verify", [&](const YAML::Node& v, const std::string& p) { pc.verify = r.boolean(v, p); }},
    {"gate_deadline_ms",
     [&](const YAML::Node& v, const std::string& p) { pc.gate_deadline_ms = r.u32(v, p); }},
    {"memory_headroom_bytes",
     [&](const YAML::Node& v, const std::string& p) { pc.memory_headroom_bytes = r.u64(v, p); }},
    {"republish_attempts",
     [&](const YAML::Node& v, const std::string& p) { pc.republish_attempts = r.u32(v, p); }},
  });
}

void read_job(yaml_reader& r, const YAML::Node& node, const std::string& path, job_config& j) {
  r.read_map(node, path, {
    {"iterations",
     [&](const YAML::Node& v, const std::string& p) { j.iterations = r.u32(v, p); }},
    {"seed", [&](const YAML::Node& v, const std::string& p) { j.seed = r.u64(v, p); }},
    {"prompts",
     [&](const YAML::Node& v, const std::string& p) {
       j.prompts.clear();
       r.read_sequence(v, p, [&](const YAML::Node& element, const std::string& element_path) {
         j.prompts.push_back(r.string(element, element_path));
       });
     }},
    {"n", [&](const YAML::Node& v, const std::string& p) { j.n = r.u32(v, p); }},
    {"max_tokens", [&](const YAML::Node& v, const std::string& p) { j.max_tokens = r.u32(v, p); }},
    {"temperature", [&](const YAML::Node& v, const std::string& p) {
       j.temperature = static_cast<float>(r.number(v, p)); }},
    {"top_k", [&](const YAML::Node& v, const std::string& p) {
       j.top_k = static_cast<std::int32_t>(r.unsigned_integer(v, p, 1u << 30)); }},
    {"top_p", [&](const YAML::Node& v, const std::string& p) {
       j.top_p = static_cast<float>(r.number(v, p)); }},
    {"max_prompt_length", [&](const YAML::Node& v, const std::string& p) {
       j.max_prompt_length = r.u32(v, p); }},
    {"parity_tolerance", [&](const YAML::Node& v, const std::string& p) {
       j.parity_tolerance = static_cast<float>(r.number(v, p)); }},
  });
}

void read_journal(yaml_reader& r, const YAML::Node& node, const std::string& path,
                  journal_config& j) {
  r.read_map(node, path, {
    {"enabled", [&](const YAML::Node& v, const std::string& p) { j.enabled = r.boolean(v, p); }},
    {"path", [&](const YAML::Node& v, const std::string& p) { j.path = r.string(v, p); }},
  });
}

void read_tls(yaml_reader& r, const YAML::Node& node, const std::string& path, tls_config& t) {
  r.read_map(node, path, {
    {"enabled", [&](const YAML::Node& v, const std::string& p) { t.enabled = r.boolean(v, p); }},
    {"certificate",
     [&](const YAML::Node& v, const std::string& p) { t.certificate = r.string(v, p); }},
    {"key", [&](const YAML::Node& v, const std::string& p) { t.key = r.string(v, p); }},
    {"passphrase",
     [&](const YAML::Node& v, const std::string& p) { t.passphrase = r.string(v, p); }},
    {"cafile", [&](const YAML::Node& v, const std::string& p) { t.cafile = r.string(v, p); }},
  });
}

void read_serve(yaml_reader& r, const YAML::Node& node, const std::string& path,
                serve_config& s) {
  s.present = true;
  r.read_map(node, path, {
    {"host", [&](const YAML::Node& v, const std::string& p) { s.host = r.string(v, p); }},
    {"port", [&](const YAML::Node& v, const std::string& p) { s.port = r.u32(v, p); }},
    {"token", [&](const YAML::Node& v, const std::string& p) { s.token = r.string(v, p); }},
    {"token_env",
     [&](const YAML::Node& v, const std::string& p) { s.token_env = r.string(v, p); }},
    {"world_size",
     [&](const YAML::Node& v, const std::string& p) { s.world_size = r.u32(v, p); }},
    {"embedded", [&](const YAML::Node& v, const std::string& p) { s.embedded = r.boolean(v, p); }},
    {"join_timeout_ms",
     [&](const YAML::Node& v, const std::string& p) { s.join_timeout_ms = r.u32(v, p); }},
    {"publish_barrier_ms",
     [&](const YAML::Node& v, const std::string& p) { s.publish_barrier_ms = r.u32(v, p); }},
    {"publish_timeout_ms",
     [&](const YAML::Node& v, const std::string& p) { s.publish_timeout_ms = r.u32(v, p); }},
    {"tls", [&](const YAML::Node& v, const std::string& p) { read_tls(r, v, p, s.tls); }},
  });
}

bool is_env_name(const std::string& name) {
  if (name.empty() || std::isdigit(static_cast<unsigned char>(name[0])))
    return false;
  return name.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
         == std::string::npos;
}

// ---------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------

// Returns the text appended to an error about `key` (where it came from), or "".
using locator = std::function<std::string(const std::string& key)>;

void validate_config(const refit_config& cfg, const locator& locate) {
  auto fail = [&](const std::string& key, const std::string& what) {
    throw config_error(key, what + locate(key));
  };
  auto check_range = [&](const std::string& key, std::uint64_t value, std::uint64_t min,
                         std::uint64_t max) {
    if (value < min || value > max)
      fail(key, std::to_string(value) + " is out of range [" + std::to_string(min) + ", "
                  + std::to_string(max) + "]");
  };
  auto check_at_least = [&](const std::string& key, std::uint64_t value, std::uint64_t min) {
    if (value < min)
      fail(key, std::to_string(value) + " is too small (minimum " + std::to_string(min) + ")");
  };
  auto check_one_of = [&](const std::string& key, const std::string& value,
                          const std::vector<std::string>& allowed) {
    for (const auto& a : allowed)
      if (a == value)
        return;
    fail(key, "'" + value + "' is not one of " + join(allowed));
  };

  const runtime_config& rt = cfg.runtime;
  if (rt.executable.empty())
    fail("runtime.executable", "must not be empty");
  check_at_least("runtime.tp_size", rt.tp_size, 1);
  if (rt.devices.size() != rt.tp_size)
    fail("runtime.devices", "lists " + std::to_string(rt.devices.size())
                              + " devices but runtime.tp_size is "
                              + std::to_string(rt.tp_size) + " (one device per TP worker)");
  std::vector<device::spec> devices;
  for (std::size_t i = 0; i < rt.devices.size(); ++i) {
    const std::string key = index_path("runtime.devices", i);
    device::spec parsed;
    try {
      parsed = device::parse(rt.devices[i], key);
    } catch (const std::invalid_argument& e) {
      fail(key, without_prefix(e.what(), key));
    }
    for (std::size_t j = 0; j < devices.size(); ++j)
      if (devices[j].k == parsed.k && devices[j].index == parsed.index)
        fail(key, "device '" + rt.devices[i] + "' is already used by runtime.devices["
                    + std::to_string(j) + "]");
    devices.push_back(parsed);
  }
  check_at_least("runtime.kv_cache_bytes", rt.kv_cache_bytes, kv_cache_bytes_min);
  check_range("runtime.max_frame_bytes", rt.max_frame_bytes, frame_bytes_min, frame_bytes_max);
  check_range("runtime.kill_grace_ms", rt.kill_grace_ms, 0, kill_grace_max_ms);
  for (const auto& tf : timeout_fields())
    check_range(std::string("runtime.timeouts_ms.") + tf.name, rt.timeouts_ms.*tf.member,
                timeout_min_ms, timeout_max_ms);
  for (std::size_t i = 0; i < rt.faults.size(); ++i) {
    const std::string key = index_path("runtime.faults", i);
    check_one_of(key + ".command", rt.faults[i].command, fault_commands);
    check_one_of(key + ".kind", rt.faults[i].kind, fault_kinds);
    for (std::size_t j = 0; j < i; ++j) {
      const auto& a = rt.faults[j];
      const auto& b = rt.faults[i];
      bool same_runtime = a.incarnation == 0 || b.incarnation == 0 || a.incarnation == b.incarnation;
      if (same_runtime && a.command == b.command && a.after == b.after)
        fail(key, "targets the same occurrence of '" + b.command + "' as runtime.faults["
                    + std::to_string(j) + "] (one fault per occurrence)");
    }
  }

  const supervisor_config& sv = cfg.supervisor;
  if (sv.backoff_initial_ms > sv.backoff_max_ms)
    fail("supervisor.backoff_initial_ms",
         std::to_string(sv.backoff_initial_ms) + " exceeds supervisor.backoff_max_ms ("
           + std::to_string(sv.backoff_max_ms) + ")");

  const trainer_config& tr = cfg.trainer;
  if (!tr.devices.empty() && tr.devices.size() != rt.tp_size)
    fail("trainer.devices", "lists " + std::to_string(tr.devices.size())
                              + " devices; one per trainer rank (runtime.tp_size "
                              + std::to_string(rt.tp_size) + ") is required");
  for (std::size_t i = 0; i < tr.devices.size(); ++i) {
    const std::string key = index_path("trainer.devices", i);
    try {
      device::parse(tr.devices[i], key);
    } catch (const std::invalid_argument& e) {
      fail(key, without_prefix(e.what(), key));
    }
  }
  if (!(tr.lr >= 0.0f && tr.lr <= 1.0f))
    fail("trainer.lr", std::to_string(tr.lr) + " is out of range [0, 1]");
  if (!(tr.init_scale > 0.0f && tr.init_scale <= 10.0f))
    fail("trainer.init_scale", std::to_string(tr.init_scale) + " is out of range (0, 10]");
  for (std::size_t i = 0; i < tr.faults.size(); ++i) {
    const std::string key = index_path("trainer.faults", i);
    const trainer_fault& f = tr.faults[i];
    check_one_of(key + ".kind", f.kind,
                 {"drop_tensor", "wrong_shape", "fail_materialize", "never_report",
                  "wrong_manifest", "reject_final"});
    if (f.rank >= rt.tp_size)
      fail(key + ".rank", "rank " + std::to_string(f.rank) + " does not exist (runtime.tp_size "
                            + std::to_string(rt.tp_size) + " trainer ranks)");
    if ((f.kind == "drop_tensor" || f.kind == "wrong_shape") && f.tensor.empty())
      fail(key + ".tensor", "a " + f.kind + " fault names the tensor");
  }

  const publication_config& pc = cfg.publication;
  check_at_least("publication.buffer_bytes", pc.buffer_bytes, 4096);
  check_range("publication.buffer_count", pc.buffer_count, 2, 16);
  check_one_of("publication.transport", pc.transport, {"shm", "cuda_ipc"});
  // The transport follows the devices: memfd buffers between CPU devices, CUDA IPC between
  // GPUs; trainer ranks and TP workers share their devices (same kind on both sides).
  {
    const bool want_cuda = pc.transport == "cuda_ipc";
    for (std::size_t i = 0; i < devices.size(); ++i)
      if ((devices[i].k == device::kind::cuda) != want_cuda)
        fail("publication.transport",
             "transport '" + pc.transport + "' needs " + (want_cuda ? "cuda:N" : "cpu:N")
               + " devices, but runtime.devices[" + std::to_string(i) + "] is '"
               + rt.devices[i] + "' (use '" + (want_cuda ? "shm" : "cuda_ipc") + "')");
    for (std::size_t i = 0; i < tr.devices.size(); ++i)
      if ((device::parse(tr.devices[i], "trainer.devices").k == device::kind::cuda) != want_cuda)
        fail(index_path("trainer.devices", i),
             "'" + tr.devices[i] + "' is not the device kind publication.transport '"
               + pc.transport + "' connects");
  }
  check_range("publication.gate_deadline_ms", pc.gate_deadline_ms, timeout_min_ms,
              timeout_max_ms);
  check_range("publication.republish_attempts", pc.republish_attempts, 0, 10);

  const job_config& jb = cfg.job;
  check_at_least("job.iterations", jb.iterations, 1);
  if (jb.prompts.empty())
    fail("job.prompts", "at least one prompt is required");
  for (std::size_t i = 0; i < jb.prompts.size(); ++i)
    if (jb.prompts[i].empty())
      fail(index_path("job.prompts", i), "a prompt must not be empty");
  check_range("job.n", jb.n, 1, 64);
  check_range("job.max_tokens", jb.max_tokens, 1, 4096);
  if (!(jb.temperature >= 0.0f && jb.temperature <= 10.0f))
    fail("job.temperature", std::to_string(jb.temperature) + " is out of range [0, 10]");
  if (!(jb.top_p > 0.0f && jb.top_p <= 1.0f))
    fail("job.top_p", std::to_string(jb.top_p) + " is out of range (0, 1]");
  if (!(jb.parity_tolerance > 0.0f && jb.parity_tolerance < 1.0f))
    fail("job.parity_tolerance", std::to_string(jb.parity_tolerance) + " is out of range (0, 1)");

  if (cfg.journal.enabled && cfg.journal.path.empty())
    fail("journal.path", "must not be empty when journal.enabled is true");
  const serve_config& srv = cfg.serve;
  if (srv.host.empty() || srv.host.find_first_of(" \t\r\n") != std::string::npos)
    fail("serve.host", "'" + srv.host + "' is not a host name or address");
  check_range("serve.port", srv.port, 0, 65535);
  if (!srv.token.empty() && !srv.token_env.empty())
    fail("serve.token", "set exactly one of serve.token and serve.token_env, not both");
  if (srv.present && srv.token.empty() && srv.token_env.empty())
    fail("serve.token_env", "a shared secret is required to join: set serve.token_env (the "
                            "name of an environment variable) or serve.token");
  if (!srv.token.empty() && srv.token.size() < min_token_chars)
    fail("serve.token", "the shared secret has " + std::to_string(srv.token.size())
                          + " characters; at least " + std::to_string(min_token_chars)
                          + " are required");
  if (!srv.token_env.empty() && !is_env_name(srv.token_env))
    fail("serve.token_env", "'" + srv.token_env + "' is not an environment variable name");
  if (srv.world_size != 0 && srv.world_size != rt.tp_size)
    fail("serve.world_size", std::to_string(srv.world_size) + " trainer ranks, but runtime.tp_size is "
                               + std::to_string(rt.tp_size)
                               + " (one trainer rank per TP worker; 0 = runtime.tp_size)");
  if (srv.embedded && srv.port == 0)
    fail("serve.port", "must be set (not 0) when serve.embedded is true: the other trainer "
                       "processes connect to rank 0's process on it");
  check_range("serve.join_timeout_ms", srv.join_timeout_ms, timeout_min_ms, timeout_max_ms);
  check_range("serve.publish_barrier_ms", srv.publish_barrier_ms, timeout_min_ms, timeout_max_ms);
  check_range("serve.publish_timeout_ms", srv.publish_timeout_ms, timeout_min_ms, timeout_max_ms);
  const tls_config& tls = srv.tls;
  if (!tls.enabled) {
    for (const auto& [key, value] : {std::pair<const char*, const std::string*>{"certificate", &tls.certificate},
                                     {"key", &tls.key}, {"passphrase", &tls.passphrase},
                                     {"cafile", &tls.cafile}})
      if (!value->empty())
        fail(std::string("serve.tls.") + key, "is set but serve.tls.enabled is false");
  } else {
    if (tls.certificate.empty() != tls.key.empty())
      fail(tls.certificate.empty() ? "serve.tls.certificate" : "serve.tls.key",
           "serve.tls.certificate and serve.tls.key are set together (or neither: anonymous "
           "encryption)");
    if (!tls.certificate.empty() && tls.cafile.empty())
      fail("serve.tls.cafile", "required with a certificate: it verifies the peers' certificates");
    if (tls.certificate.empty() && (!tls.cafile.empty() || !tls.passphrase.empty()))
      fail(tls.cafile.empty() ? "serve.tls.passphrase" : "serve.tls.cafile",
           "needs serve.tls.certificate and serve.tls.key");
  }

  try {
    model::validate(cfg.model, rt.tp_size);
  } catch (const model::model_error& e) {
    fail(e.where, without_prefix(e.what(), e.where));
  }
}

} // namespace

// ---------------------------------------------------------------------------------------
// Public API
// ---------------------------------------------------------------------------------------

refit_config parse_yaml(const std::string& text, const std::string& origin) {
  const YAML::Node root = load_document(text, origin);
  yaml_reader r(origin);
  refit_config cfg;
  r.read_map(root, "", {
    {"model", [&](const YAML::Node& v, const std::string& p) { read_model(r, v, p, cfg.model); },
     true},
    {"runtime",
     [&](const YAML::Node& v, const std::string& p) { read_runtime(r, v, p, cfg.runtime); }},
    {"supervisor",
     [&](const YAML::Node& v, const std::string& p) { read_supervisor(r, v, p, cfg.supervisor); }},
    {"trainer",
     [&](const YAML::Node& v, const std::string& p) { read_trainer(r, v, p, cfg.trainer); }},
    {"publication", [&](const YAML::Node& v, const std::string& p) {
       read_publication(r, v, p, cfg.publication); }},
    {"job", [&](const YAML::Node& v, const std::string& p) { read_job(r, v, p, cfg.job); }},
    {"journal",
     [&](const YAML::Node& v, const std::string& p) { read_journal(r, v, p, cfg.journal); }},
    {"serve", [&](const YAML::Node& v, const std::string& p) { read_serve(r, v, p, cfg.serve); }},
  });
  const YAML::Node pub = root["publication"];
  if ((!pub || !pub.IsMap() || !pub["transport"]) && !cfg.runtime.devices.empty()
      && cfg.runtime.devices.front().rfind("cuda:", 0) == 0)
    cfg.publication.transport = "cuda_ipc";
  validate_config(cfg, [&r](const std::string& key) { return r.locate(key); });
  return cfg;
}

refit_config load_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw config_error("", "cannot read config file '" + path + "': it is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw config_error("", "cannot open config file '" + path + "': " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad())
    throw config_error("", "cannot read config file '" + path + "'");
  return parse_yaml(text.str(), path);
}

void validate(const refit_config& cfg) {
  validate_config(cfg, [](const std::string&) { return std::string(); });
}

std::string resolve_token(const serve_config& serve) {
  if (!serve.present)
    throw config_error("serve", "the recipe has no serve section (host, port, token_env, ...)");
  if (!serve.token.empty())
    return serve.token;
  if (serve.token_env.empty())
    throw config_error("serve.token_env", "no shared secret configured");
  const char* value = std::getenv(serve.token_env.c_str());
  if (value == nullptr || *value == '\0')
    throw config_error("serve.token_env", "the environment variable " + serve.token_env
                                            + " is not set or empty");
  std::string token = value;
  if (token.size() < min_token_chars)
    throw config_error("serve.token_env", "the shared secret in " + serve.token_env + " has "
                                            + std::to_string(token.size())
                                            + " characters; at least "
                                            + std::to_string(min_token_chars) + " are required");
  return token;
}

std::uint32_t serve_world(const refit_config& cfg) {
  return cfg.serve.world_size != 0 ? cfg.serve.world_size : cfg.runtime.tp_size;
}

model::model_config parse_model_yaml(const std::string& text, const std::string& origin) {
  const YAML::Node root = load_document(text, origin);
  yaml_reader r(origin);
  model::model_config m;
  read_model(r, root, "model", m);
  return m;
}

std::string model_to_yaml(const model::model_config& m) {
  auto u = [](std::uint32_t v) { return std::to_string(v); };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  const std::vector<std::pair<const char*, std::string>> entries = {
    {"model_type", quote_if_needed(m.model_type)},
    {"num_hidden_layers", u(m.num_hidden_layers)},
    {"hidden_size", u(m.hidden_size)},
    {"num_attention_heads", u(m.num_attention_heads)},
    {"num_key_value_heads", u(m.num_key_value_heads)},
    {"head_dim", u(m.head_dim)},
    {"num_experts", u(m.num_experts)},
    {"num_experts_per_tok", u(m.num_experts_per_tok)},
    {"moe_intermediate_size", u(m.moe_intermediate_size)},
    {"vocab_size", u(m.vocab_size)},
    {"tie_word_embeddings", b(m.tie_word_embeddings)},
    {"rms_norm_eps", format_double(m.rms_norm_eps)},
    {"rope_theta", format_double(m.rope_theta)},
    {"norm_topk_prob", b(m.norm_topk_prob)},
    {"torch_dtype", model::dtype_name(m.torch_dtype)},
    {"quantization", quote_if_needed(m.quantization)},
    {"lora", b(m.lora)},
  };
  std::string out = "{";
  for (const auto& [key, value] : entries)
    out += (out.size() > 1 ? ", " : "") + std::string(key) + ": " + value;
  return out + "}";
}

std::string to_yaml(const refit_config& cfg) {
  auto u = [](std::uint64_t v) { return std::to_string(v); };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  auto f = [](double v) { return format_double(v); };
  auto q = [](const std::string& v) { return quote_if_needed(v); };
  auto list = [&q](const std::vector<std::string>& xs) {
    std::string out = "[";
    for (const auto& x : xs)
      out += (out.size() > 1 ? ", " : "") + q(x);
    return out + "]";
  };
  std::string y;
  auto line = [&y](const std::string& text) { y += text + "\n"; };
  line("model: " + model_to_yaml(cfg.model));
  const auto& rt = cfg.runtime;
  line("runtime:");
  line("  executable: " + q(rt.executable));
  line("  tp_size: " + u(rt.tp_size));
  line("  devices: " + list(rt.devices));
  line("  kv_cache_bytes: " + u(rt.kv_cache_bytes));
  line("  max_frame_bytes: " + u(rt.max_frame_bytes));
  line("  kill_grace_ms: " + u(rt.kill_grace_ms));
  line("  timeouts_ms:");
  for (const auto& tf : timeout_fields())
    line(std::string("    ") + tf.name + ": " + u(rt.timeouts_ms.*tf.member));
  line("  faults: [" + std::string(rt.faults.empty() ? "]" : ""));
  for (std::size_t i = 0; i < rt.faults.size(); ++i) {
    const auto& x = rt.faults[i];
    line("    {command: " + q(x.command) + ", kind: " + q(x.kind) + ", after: " + u(x.after)
         + ", incarnation: " + u(x.incarnation) + "}" + (i + 1 < rt.faults.size() ? "," : "]"));
  }
  const auto& sv = cfg.supervisor;
  line("supervisor:");
  line("  max_restarts: " + u(sv.max_restarts));
  line("  backoff_initial_ms: " + u(sv.backoff_initial_ms));
  line("  backoff_max_ms: " + u(sv.backoff_max_ms));
  line("  restart_window_ms: " + u(sv.restart_window_ms));
  const auto& tr = cfg.trainer;
  line("trainer:");
  line("  devices: " + list(tr.devices));
  line("  lr: " + f(tr.lr));
  line("  init_scale: " + f(tr.init_scale));
  line("  faults: [" + std::string(tr.faults.empty() ? "]" : ""));
  for (std::size_t i = 0; i < tr.faults.size(); ++i) {
    const auto& x = tr.faults[i];
    line("    {rank: " + u(x.rank) + ", kind: " + q(x.kind) + ", tensor: " + q(x.tensor)
         + ", chunk: " + u(x.chunk) + ", repeat: " + b(x.repeat) + "}"
         + (i + 1 < tr.faults.size() ? "," : "]"));
  }
  const auto& pc = cfg.publication;
  line("publication:");
  line("  buffer_bytes: " + u(pc.buffer_bytes));
  line("  buffer_count: " + u(pc.buffer_count));
  line("  transport: " + q(pc.transport));
  line("  verify: " + b(pc.verify));
  line("  gate_deadline_ms: " + u(pc.gate_deadline_ms));
  line("  memory_headroom_bytes: " + u(pc.memory_headroom_bytes));
  line("  republish_attempts: " + u(pc.republish_attempts));
  const auto& jb = cfg.job;
  line("job:");
  line("  iterations: " + u(jb.iterations));
  line("  seed: " + u(jb.seed));
  line("  prompts: " + list(jb.prompts));
  line("  n: " + u(jb.n));
  line("  max_tokens: " + u(jb.max_tokens));
  line("  temperature: " + f(jb.temperature));
  line("  top_k: " + u(static_cast<std::uint64_t>(jb.top_k)));
  line("  top_p: " + f(jb.top_p));
  line("  max_prompt_length: " + u(jb.max_prompt_length));
  line("  parity_tolerance: " + f(jb.parity_tolerance));
  line("journal:");
  line("  enabled: " + b(cfg.journal.enabled));
  line("  path: " + q(cfg.journal.path));
  return y;
}

} // namespace refit::config
