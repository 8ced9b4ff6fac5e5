// YAML emit: the model section and whole recipes as YAML that parses back to the same config
// (the journal header stores the recipe this way).
#include "runtime/config/config.hpp"
#include "runtime/config/common.hpp"

#include <string>
#include <utility>
#include <vector>

namespace refit::config {

using namespace detail;

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
    {"intermediate_size", u(m.intermediate_size)},
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
  if (cfg.model_path.empty()) {
    line("model: " + model_to_yaml(cfg.model));
  } else { // the fields, and the directory they came from (parse checks they still agree)
    const std::string fields = model_to_yaml(cfg.model);
    line("model: {path: " + quote_if_needed(cfg.model_path) + ", " + fields.substr(1));
  }
  const auto& rt = cfg.runtime;
  line("runtime:");
  line("  executable: " + q(rt.executable));
  line("  tp_size: " + u(rt.tp_size));
  line("  devices: " + list(rt.devices));
  line("  kv_cache_bytes: " + u(rt.kv_cache_bytes));
  line("  compute_dtype: " + q(rt.compute_dtype));
  line("  max_batch: " + u(rt.max_batch));
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
  line("  mode: " + q(pc.mode));
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
