#include "runtime/checkpoint/hf_config.hpp"

#include "runtime/checkpoint/json_strict.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <set>

namespace refit::checkpoint {

namespace {

using json = nlohmann::json;

// Keys HF configs carry that do not change the forward refit computes (bookkeeping, token
// ids, training-only knobs, generation defaults of old configs). Known and ignored.
const std::set<std::string> ignored_keys = {
  "architectures", "transformers_version", "_name_or_path", "auto_map",
  "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
  "initializer_range", "use_cache", "attention_dropout", "output_router_logits",
  "router_aux_loss_coef", "max_window_layers", "output_attentions", "output_hidden_states",
  "return_dict", "torchscript", "tokenizer_class", "chunk_size_feed_forward",
  "is_encoder_decoder", "is_decoder", "add_cross_attention", "id2label", "label2id",
  "problem_type", "pruned_heads", "tie_encoder_decoder", "finetuning_task", "prefix",
  "task_specific_params", "_attn_implementation_autoset", "use_bfloat16",
};

// Keys this file reads (or checks) for either model type.
const std::set<std::string> read_keys = {
  "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
  "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
  "tie_word_embeddings", "torch_dtype", "dtype", "max_position_embeddings", "rope_scaling",
  "rope_parameters", "use_sliding_window", "sliding_window", "layer_types", "attention_bias",
  "quantization_config", "hidden_act", "intermediate_size",
};
// Only for qwen3_moe.
const std::set<std::string> moe_keys = {
  "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
  "mlp_only_layers", "decoder_sparse_step",
};

struct reader {
  const json& j;
  const std::string& file;

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw checkpoint_error(file, "", key, what);
  }
  const json* get(const std::string& key) const {
    const auto it = j.find(key);
    return it == j.end() ? nullptr : &*it;
  }
  std::uint32_t u32(const std::string& key, const json& v) const {
    // Parsed text gives unsigned for non-negative integers; a json built in code may hold
    // a signed one.
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<std::int64_t>() < 0)
        || v.get<std::uint64_t>() > std::numeric_limits<std::uint32_t>::max())
      fail(key, "expected a non-negative 32-bit integer (got " + v.dump() + ")");
    return static_cast<std::uint32_t>(v.get<std::uint64_t>());
  }
  std::uint32_t required_u32(const std::string& key) const {
    const json* v = get(key);
    if (v == nullptr)
      fail(key, "missing (no default refit could assume)");
    const auto x = u32(key, *v);
    if (x == 0)
      fail(key, "must be > 0 (got 0)");
    return x;
  }
  std::uint32_t optional_u32(const std::string& key, std::uint32_t fallback) const {
    const json* v = get(key);
    return (v == nullptr || v->is_null()) ? fallback : u32(key, *v);
  }
  double number(const std::string& key, double fallback) const {
    const json* v = get(key);
    if (v == nullptr)
      return fallback;
    if (!v->is_number())
      fail(key, "expected a number (got " + v->dump() + ")");
    return v->get<double>();
  }
  bool boolean(const std::string& key, bool fallback) const {
    const json* v = get(key);
    if (v == nullptr)
      return fallback;
    if (!v->is_boolean())
      fail(key, "expected true or false (got " + v->dump() + ")");
    return v->get<bool>();
  }
};

void check_rope(const reader& r, hf_model& m) {
  if (const json* s = r.get("rope_scaling"); s != nullptr && !s->is_null()) {
    const bool is_default = s->is_object() && s->size() == 1
                            && ((s->contains("rope_type") && (*s)["rope_type"] == "default")
                                || (s->contains("type") && (*s)["type"] == "default"));
    if (!is_default)
      r.fail("rope_scaling", "RoPE scaling is not supported (got " + s->dump()
                               + "; refit implements null or {\"rope_type\": \"default\"})");
  }
  double theta = r.number("rope_theta", 10000.0);
  if (const json* p = r.get("rope_parameters"); p != nullptr && !p->is_null()) {
    if (!p->is_object())
      r.fail("rope_parameters", "expected an object (got " + p->dump() + ")");
    for (const auto& item : p->items()) {
      if (item.key() == "rope_type") {
        if (item.value() != "default")
          r.fail("rope_parameters.rope_type", "RoPE type " + item.value().dump()
                                                + " is not supported (refit implements \"default\")");
      } else if (item.key() == "rope_theta") {
        if (!item.value().is_number())
          r.fail("rope_parameters.rope_theta", "expected a number (got " + item.value().dump() + ")");
        const double t = item.value().get<double>();
        if (r.get("rope_theta") != nullptr && t != theta)
          r.fail("rope_parameters.rope_theta",
                 item.value().dump() + " disagrees with rope_theta " + std::to_string(theta));
        theta = t;
      } else {
        r.fail("rope_parameters." + item.key(),
               "not supported (got " + item.value().dump() + ")");
      }
    }
  }
  if (!(theta > 0))
    r.fail("rope_theta", "must be > 0 (got " + std::to_string(theta) + ")");
  m.cfg.rope_theta = theta;
}

void check_unsupported(const reader& r, bool moe) {
  if (r.boolean("use_sliding_window", false)) {
    const json* w = r.get("sliding_window");
    r.fail("use_sliding_window", "sliding-window attention is not supported (use_sliding_window: "
                                   "true, sliding_window: " + (w ? w->dump() : "absent") + ")");
  }
  if (const json* lt = r.get("layer_types"); lt != nullptr && !lt->is_null()) {
    if (!lt->is_array())
      r.fail("layer_types", "expected an array (got " + lt->dump() + ")");
    for (std::size_t i = 0; i < lt->size(); ++i)
      if ((*lt)[i] != "full_attention")
        r.fail("layer_types[" + std::to_string(i) + "]",
               (*lt)[i].dump() + " is not supported (refit implements \"full_attention\")");
  }
  if (r.boolean("attention_bias", false))
    r.fail("attention_bias", "attention biases are not supported (attention_bias: true)");
  if (const json* q = r.get("quantization_config"); q != nullptr && !q->is_null())
    r.fail("quantization_config", "quantized checkpoints are not supported (got " + q->dump() + ")");
  if (const json* a = r.get("hidden_act"); a != nullptr && *a != "silu")
    r.fail("hidden_act", "activation " + a->dump() + " is not supported (refit implements \"silu\")");
  if (!moe)
    return;
  if (const json* mo = r.get("mlp_only_layers"); mo != nullptr && !mo->is_null()) {
    if (!mo->is_array())
      r.fail("mlp_only_layers", "expected an array (got " + mo->dump() + ")");
    if (!mo->empty())
      r.fail("mlp_only_layers", "dense MLP layers in an MoE model are not supported (got "
                                  + mo->dump() + ")");
  }
  if (const json* s = r.get("decoder_sparse_step"); s != nullptr && r.u32("decoder_sparse_step", *s) != 1)
    r.fail("decoder_sparse_step", "only 1 (every layer MoE) is supported (got " + s->dump() + ")");
}

model::dtype read_dtype(const reader& r, bool& declared) {
  const json* a = r.get("torch_dtype");
  const json* b = r.get("dtype");
  if (a != nullptr && a->is_null())
    a = nullptr;
  if (b != nullptr && b->is_null())
    b = nullptr;
  declared = a != nullptr || b != nullptr;
  if (!declared)
    return model::dtype::bfloat16;
  if (a != nullptr && b != nullptr && *a != *b)
    r.fail("dtype", "dtype " + b->dump() + " disagrees with torch_dtype " + a->dump());
  const char* key = a != nullptr ? "torch_dtype" : "dtype";
  const json& v = a != nullptr ? *a : *b;
  if (!v.is_string())
    r.fail(key, "expected a string (got " + v.dump() + ")");
  const std::string s = v.get<std::string>();
  if (s != "bfloat16" && s != "float16" && s != "float32")
    r.fail(key, "dtype '" + s + "' is not supported (bfloat16, float16, float32)");
  return model::parse_dtype(s, key);
}

} // namespace

hf_model parse_hf_config(const json& j, const std::string& file) {
  if (!j.is_object())
    throw checkpoint_error(file, "", "", "must be a JSON object");
  const reader r{j, file};
  hf_model m;
  const json* type = r.get("model_type");
  if (type == nullptr || !type->is_string())
    r.fail("model_type", "missing or not a string");
  m.model_type = type->get<std::string>();
  if (m.model_type != "qwen3_moe" && m.model_type != "qwen3")
    r.fail("model_type", "'" + m.model_type + "' is not supported (qwen3_moe, qwen3)");
  const bool moe = m.model_type == "qwen3_moe";
  check_unsupported(r, moe);

  auto& c = m.cfg;
  c.model_type = m.model_type;
  c.num_hidden_layers = r.required_u32("num_hidden_layers");
  c.hidden_size = r.required_u32("hidden_size");
  c.num_attention_heads = r.required_u32("num_attention_heads");
  c.num_key_value_heads = r.optional_u32("num_key_value_heads", c.num_attention_heads);
  if (r.get("head_dim") == nullptr || r.get("head_dim")->is_null()) {
    if (c.hidden_size % c.num_attention_heads != 0)
      r.fail("head_dim", "absent, and hidden_size " + std::to_string(c.hidden_size)
                           + " is not divisible by num_attention_heads "
                           + std::to_string(c.num_attention_heads));
    c.head_dim = c.hidden_size / c.num_attention_heads;
  } else {
    c.head_dim = r.required_u32("head_dim");
  }
  c.vocab_size = r.required_u32("vocab_size");
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-6);
  if (!(c.rms_norm_eps > 0))
    r.fail("rms_norm_eps", "must be > 0 (got " + std::to_string(c.rms_norm_eps) + ")");
  check_rope(r, m);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  c.torch_dtype = read_dtype(r, m.dtype_declared);
  m.max_position_embeddings = r.optional_u32("max_position_embeddings", 32768);
  if (moe) {
    // transformers 5 writes num_local_experts (4.x: num_experts); both present must agree.
    const bool local = r.get("num_local_experts") != nullptr;
    c.num_experts = r.required_u32(local ? "num_local_experts" : "num_experts");
    if (local && r.get("num_experts") != nullptr && r.required_u32("num_experts") != c.num_experts)
      r.fail("num_experts", "disagrees with num_local_experts " + std::to_string(c.num_experts));
    c.num_experts_per_tok = r.required_u32("num_experts_per_tok");
    c.moe_intermediate_size = r.required_u32("moe_intermediate_size");
    c.norm_topk_prob = r.boolean("norm_topk_prob", false);
    m.intermediate_size = r.optional_u32("intermediate_size", 0);
  } else {
    c.num_experts = c.num_experts_per_tok = c.moe_intermediate_size = 0;
    c.norm_topk_prob = false;
    m.intermediate_size = r.required_u32("intermediate_size");
    // refit holds a dense MLP as one always-chosen expert (model::normalize_dense).
    c.intermediate_size = m.intermediate_size;
    model::normalize_dense(c);
  }
  if (c.num_key_value_heads == 0 || c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_key_value_heads", std::to_string(c.num_attention_heads)
                                    + " attention heads are not divisible by "
                                    + std::to_string(c.num_key_value_heads) + " key-value heads");

  for (const auto& item : j.items()) {
    const auto& k = item.key();
    if (read_keys.count(k) || ignored_keys.count(k) || (moe && moe_keys.count(k)))
      continue;
    m.warnings.push_back(file + ": unknown key '" + k + "' (" + item.value().dump() + ") ignored");
  }
  if (!m.dtype_declared)
    m.warnings.push_back(file + ": no torch_dtype or dtype: the checkpoint's dtype is used");
  return m;
}

hf_model read_hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  return parse_hf_config(read_json_file(path, 8), path);
}

} // namespace refit::checkpoint
