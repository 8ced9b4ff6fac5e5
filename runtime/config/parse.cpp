// Strict YAML recipe parsing: every key is typed, unknown keys are errors naming the full key
// path, the offending value and where in the source it was.
#include "runtime/config/config.hpp"
#include "runtime/fileio/read_file.hpp"
#include "runtime/config/common.hpp"
#include "runtime/checkpoint/source.hpp"

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

#include "runtime/device/device.hpp"

namespace refit::config {
namespace {

using namespace detail;

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

// The model section: HF config.json field names, or `path` (a Hugging Face model directory
// whose config.json gives them; fields given next to it must agree with it). `base_dir`
// resolves a relative path.
void read_model(yaml_reader& r, const YAML::Node& node, const std::string& path,
                model::model_config& m, std::string* model_path = nullptr,
                const std::string& base_dir = "") {
  std::set<std::string> seen;
  auto u32_field = [&](const char* name, std::uint32_t& target) {
    return field{name, [&r, &target, &seen, name](const YAML::Node& v, const std::string& p) {
                   target = r.u32(v, p);
                   seen.insert(name);
                 }};
  };
  auto bool_field = [&](const char* name, bool& target) {
    return field{name, [&r, &target, &seen, name](const YAML::Node& v, const std::string& p) {
                   target = r.boolean(v, p);
                   seen.insert(name);
                 }};
  };
  auto double_field = [&](const char* name, double& target) {
    return field{name, [&r, &target, &seen, name](const YAML::Node& v, const std::string& p) {
                   target = r.number(v, p);
                   seen.insert(name);
                 }};
  };
  auto string_field = [&](const char* name, std::string& target) {
    return field{name, [&r, &target, &seen, name](const YAML::Node& v, const std::string& p) {
                   target = r.string(v, p);
                   seen.insert(name);
                 }};
  };
  std::string dir;
  std::vector<field> fields = {
    string_field("model_type", m.model_type),
    u32_field("num_hidden_layers", m.num_hidden_layers),
    u32_field("hidden_size", m.hidden_size),
    u32_field("num_attention_heads", m.num_attention_heads),
    u32_field("num_key_value_heads", m.num_key_value_heads),
    u32_field("head_dim", m.head_dim),
    u32_field("num_experts", m.num_experts),
    u32_field("num_experts_per_tok", m.num_experts_per_tok),
    u32_field("moe_intermediate_size", m.moe_intermediate_size),
    u32_field("intermediate_size", m.intermediate_size),
    u32_field("vocab_size", m.vocab_size),
    bool_field("tie_word_embeddings", m.tie_word_embeddings),
    double_field("rms_norm_eps", m.rms_norm_eps),
    double_field("rope_theta", m.rope_theta),
    bool_field("norm_topk_prob", m.norm_topk_prob),
    field{"torch_dtype",
          [&r, &m, &seen](const YAML::Node& v, const std::string& p) {
            const std::string text = r.string(v, p);
            try {
              m.torch_dtype = model::parse_dtype(text, p);
            } catch (const model::model_error& e) {
              r.fail(p, v, without_prefix(e.what(), e.where));
            }
            seen.insert("torch_dtype");
          }},
    string_field("quantization", m.quantization),
    bool_field("lora", m.lora),
  };
  if (model_path != nullptr)
    fields.push_back(field{"path", [&r, &dir](const YAML::Node& v, const std::string& p) {
                             dir = r.string(v, p);
                             if (dir.empty())
                               r.fail(p, v, "is empty (a Hugging Face model directory)");
                           }});
  r.read_map(node, path, fields);

  if (!dir.empty()) {
    std::filesystem::path resolved(dir);
    if (resolved.is_relative() && !base_dir.empty())
      resolved = std::filesystem::path(base_dir) / resolved;
    resolved = resolved.lexically_normal();
    model::model_config hf;
    try {
      hf = checkpoint::read_model_config(resolved.string());
    } catch (const std::exception& e) {
      r.fail(child_path(path, "path"), node["path"], e.what());
    }
    // Fields given next to the path must say what config.json says (compared as the text
    // model_to_yaml renders for both, so 1e6 and 1000000.0 are the same value).
    const YAML::Node ours = YAML::Load(model_to_yaml(m)), theirs = YAML::Load(model_to_yaml(hf));
    for (const auto& key : seen) {
      const auto given = ours[key].as<std::string>(), wanted = theirs[key].as<std::string>();
      if (given != wanted)
        r.fail(child_path(path, key), node[key],
               given + " differs from " + (resolved / "config.json").string() + " (" + wanted
                 + "); leave it out");
    }
    m = hf;
    *model_path = resolved.string();
    return;
  }
  if (seen.count("model_type") == 0)
    m.model_type = "qwen3_moe";
  for (const char* key : {"num_hidden_layers", "hidden_size", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "vocab_size"})
    if (seen.count(key) == 0)
      r.fail(child_path(path, key), node, "required key is missing");
  if (m.dense()) {
    if (seen.count("intermediate_size") == 0)
      r.fail(child_path(path, "intermediate_size"), node, "required key is missing");
    model::normalize_dense(m);
  } else {
    for (const char* key : {"num_experts", "num_experts_per_tok", "moe_intermediate_size"})
      if (seen.count(key) == 0)
        r.fail(child_path(path, key), node, "required key is missing");
  }
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
    {"compute_dtype",
     [&](const YAML::Node& v, const std::string& p) { rt.compute_dtype = r.string(v, p); }},
    {"max_batch", [&](const YAML::Node& v, const std::string& p) { rt.max_batch = r.u32(v, p); }},
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
    {"mode", [&](const YAML::Node& v, const std::string& p) { pc.mode = r.string(v, p); }},
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
    {"handshake_timeout_ms",
     [&](const YAML::Node& v, const std::string& p) { s.handshake_timeout_ms = r.u32(v, p); }},
    {"max_pending_handshakes",
     [&](const YAML::Node& v, const std::string& p) { s.max_pending_handshakes = r.u32(v, p); }},
    {"tls", [&](const YAML::Node& v, const std::string& p) { read_tls(r, v, p, s.tls); }},
  });
}

} // namespace

refit_config parse_yaml(const std::string& text, const std::string& origin,
                        const std::string& base_dir) {
  const YAML::Node root = load_document(text, origin);
  yaml_reader r(origin);
  refit_config cfg;
  r.read_map(root, "", {
    {"model", [&](const YAML::Node& v, const std::string& p) {
       read_model(r, v, p, cfg.model, &cfg.model_path, base_dir); },
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
  std::string text;
  try {
    text = fileio::read_regular_file(path, fileio::max_config_bytes, "config file");
  } catch (const fileio::file_error& e) {
    throw config_error("", e.what());
  }
  return parse_yaml(text, path,
                    std::filesystem::absolute(std::filesystem::path(path)).parent_path().string());
}


model::model_config parse_model_yaml(const std::string& text, const std::string& origin) {
  const YAML::Node root = load_document(text, origin);
  yaml_reader r(origin);
  model::model_config m;
  read_model(r, root, "model", m);
  return m;
}

} // namespace refit::config
