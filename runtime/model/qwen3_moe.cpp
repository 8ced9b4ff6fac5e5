#include "runtime/model/qwen3_moe.hpp"

#include "runtime/model/digest.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>


namespace refit::model {

// ---------------------------------------------------------------------------------------
// dtypes
// ---------------------------------------------------------------------------------------

std::size_t dtype_size(dtype dt) {
  switch (dt) {
    case dtype::bfloat16: return 2;
    case dtype::float16: return 2;
    case dtype::float32: return 4;
  }
  throw model_error("dtype", "unknown dtype code " + std::to_string(static_cast<int>(dt)));
}

const char* dtype_name(dtype dt) {
  switch (dt) {
    case dtype::bfloat16: return "bfloat16";
    case dtype::float16: return "float16";
    case dtype::float32: return "float32";
  }
  throw model_error("dtype", "unknown dtype code " + std::to_string(static_cast<int>(dt)));
}

dtype parse_dtype(const std::string& text, const std::string& where) {
  if (text == "bfloat16" || text == "bf16")
    return dtype::bfloat16;
  if (text == "float16" || text == "fp16" || text == "half")
    return dtype::float16;
  if (text == "float32" || text == "fp32" || text == "float")
    return dtype::float32;
  throw model_error(where, "unsupported dtype '" + text
                             + "' (expected bfloat16/bf16, float16/fp16/half or float32/fp32/float)");
}

namespace {

std::uint32_t float_bits(float f) {
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

float bits_float(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// IEEE binary16, round to nearest even; NaN stays (quiet) NaN, overflow gives infinity.
} // namespace

std::uint16_t float_to_half(float f) {
  const std::uint32_t x = float_bits(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t magnitude = x & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) { // inf or NaN
    if (magnitude == 0x7f800000u)
      return sign | 0x7c00u;
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  if (magnitude >= 0x477ff000u) // >= 65520: rounds (to even) up to infinity
    return sign | 0x7c00u;
  if (magnitude < 0x38800000u) { // below 2^-14: a half subnormal (or zero)
    // value * 2^24 is exact; rounding it to an integer (nearest even) gives the mantissa.
    // A result of 0x400 is the smallest normal, which is also its correct encoding.
    const float scaled = std::fabs(f) * 16777216.0f;
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::nearbyint(scaled)));
  }
  const std::uint32_t exponent = (magnitude >> 23) - 127 + 15;
  const std::uint32_t mantissa = magnitude & 0x7fffffu;
  std::uint32_t half = (exponent << 10) | (mantissa >> 13);
  const std::uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u)))
    ++half; // a carry into the exponent is the correct result
  return static_cast<std::uint16_t>(sign | half);
}

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) { // zero or subnormal: mantissa * 2^-24
    const float value = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -value : value;
  }
  if (exponent == 31)
    return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}


std::uint16_t float_to_bf16(float f) {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) // NaN: keep the sign and payload top, force quiet
    return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  const std::uint32_t round_bias = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>((x + round_bias) >> 16);
}

float bf16_to_float(std::uint16_t b) { return bits_float(static_cast<std::uint32_t>(b) << 16); }

// ---------------------------------------------------------------------------------------
// Config validation
// ---------------------------------------------------------------------------------------

void normalize_dense(model_config& cfg) {
  if (!cfg.dense())
    return;
  if (cfg.num_experts == 0)
    cfg.num_experts = 1;
  if (cfg.num_experts_per_tok == 0)
    cfg.num_experts_per_tok = 1;
  if (cfg.moe_intermediate_size == 0)
    cfg.moe_intermediate_size = cfg.intermediate_size;
}

void validate(const model_config& cfg, std::uint32_t tp) {
  if (cfg.model_type != "qwen3_moe" && cfg.model_type != "qwen3")
    throw model_error("model.model_type", "unsupported model_type '" + cfg.model_type
                                            + "' (expected 'qwen3_moe' or 'qwen3')");
  if (cfg.dense()) {
    const auto str = [](std::uint32_t v) { return std::to_string(v); };
    if (cfg.intermediate_size == 0)
      throw model_error("model.intermediate_size",
                        "intermediate_size must be > 0 for model_type 'qwen3' (got 0)");
    if (cfg.num_experts != 1 || cfg.num_experts_per_tok != 1)
      throw model_error("model.num_experts",
                        "a dense qwen3 model has no experts (num_experts=" + str(cfg.num_experts)
                          + ", num_experts_per_tok=" + str(cfg.num_experts_per_tok)
                          + "; leave them out)");
    if (cfg.moe_intermediate_size != cfg.intermediate_size)
      throw model_error("model.moe_intermediate_size",
                        "a dense qwen3 model uses intermediate_size ("
                          + str(cfg.intermediate_size) + "), not moe_intermediate_size ("
                          + str(cfg.moe_intermediate_size) + "; leave it out)");
  }
  if (!cfg.quantization.empty())
    throw model_error("model.quantization",
                      "quantized weights are not supported (quantization: '" + cfg.quantization + "')");
  if (cfg.lora)
    throw model_error("model.lora", "LoRA is not supported (lora: true)");

  const std::pair<const char*, std::uint32_t> sizes[] = {
    {"num_hidden_layers", cfg.num_hidden_layers},
    {"hidden_size", cfg.hidden_size},
    {"num_attention_heads", cfg.num_attention_heads},
    {"num_key_value_heads", cfg.num_key_value_heads},
    {"head_dim", cfg.head_dim},
    {"num_experts", cfg.num_experts},
    {"num_experts_per_tok", cfg.num_experts_per_tok},
    {"moe_intermediate_size", cfg.moe_intermediate_size},
    {"vocab_size", cfg.vocab_size},
  };
  for (const auto& [key, value] : sizes)
    if (value == 0)
      throw model_error(std::string("model.") + key, std::string(key) + " must be > 0 (got 0)");

  const auto str = [](std::uint32_t v) { return std::to_string(v); };
  if (cfg.num_experts_per_tok > cfg.num_experts)
    throw model_error("model.num_experts_per_tok",
                      "num_experts_per_tok=" + str(cfg.num_experts_per_tok)
                        + " exceeds num_experts=" + str(cfg.num_experts));
  if (cfg.num_attention_heads % cfg.num_key_value_heads != 0)
    throw model_error("model.num_key_value_heads",
                      str(cfg.num_attention_heads) + " attention heads are not divisible by "
                        + str(cfg.num_key_value_heads) + " key-value heads");
  if (tp == 0)
    throw model_error("runtime.tp_size", "tp must be >= 1 (got 0)");
  if (cfg.num_attention_heads % tp != 0)
    throw model_error("model.num_attention_heads",
                      str(cfg.num_attention_heads) + " attention heads are not divisible by tp="
                        + str(tp));
  if (cfg.moe_intermediate_size % tp != 0)
    throw model_error("model.moe_intermediate_size",
                      "moe_intermediate_size " + str(cfg.moe_intermediate_size)
                        + " is not divisible by tp=" + str(tp));
  if (cfg.num_key_value_heads % tp != 0 && tp % cfg.num_key_value_heads != 0)
    throw model_error("model.num_key_value_heads",
                      str(cfg.num_key_value_heads) + " key-value heads and tp=" + str(tp)
                        + ": neither divides the other");
}

// ---------------------------------------------------------------------------------------
// Canonical key stream
// ---------------------------------------------------------------------------------------

std::uint64_t param_meta::numel() const {
  std::uint64_t n = 1;
  for (auto d : shape) {
    if (d < 0)
      throw model_error(name, "negative dimension " + std::to_string(d) + " in shape");
    n *= static_cast<std::uint64_t>(d);
  }
  return n;
}

std::uint64_t param_meta::nbytes() const { return numel() * dtype_size(dt); }

namespace {

enum class tensor_kind {
  embed,
  q_proj,
  k_proj,
  v_proj,
  o_proj,
  q_norm,
  k_norm,
  router,
  expert_gate,
  expert_up,
  expert_down,
  input_norm,
  post_attention_norm,
  final_norm,
  lm_head,
};

// Suffixes after "model.layers.{i}." of the per-layer tensors that are not per expert, in
// canonical order: the attention block, then the router (experts follow), then layer norms.
struct layer_tensor {
  const char* suffix;
  tensor_kind kind;
};
constexpr layer_tensor attention_tensors[] = {
  {"self_attn.q_proj.weight", tensor_kind::q_proj},
  {"self_attn.k_proj.weight", tensor_kind::k_proj},
  {"self_attn.v_proj.weight", tensor_kind::v_proj},
  {"self_attn.o_proj.weight", tensor_kind::o_proj},
  {"self_attn.q_norm.weight", tensor_kind::q_norm},
  {"self_attn.k_norm.weight", tensor_kind::k_norm},
  {"mlp.gate.weight", tensor_kind::router},
};
constexpr layer_tensor expert_tensors[] = {
  {"gate_proj.weight", tensor_kind::expert_gate},
  {"up_proj.weight", tensor_kind::expert_up},
  {"down_proj.weight", tensor_kind::expert_down},
};
// Dense qwen3: the MLP of a layer, held as expert 0 of a one-expert MoE.
constexpr layer_tensor dense_mlp_tensors[] = {
  {"mlp.gate_proj.weight", tensor_kind::expert_gate},
  {"mlp.up_proj.weight", tensor_kind::expert_up},
  {"mlp.down_proj.weight", tensor_kind::expert_down},
};
constexpr layer_tensor layer_norm_tensors[] = {
  {"input_layernorm.weight", tensor_kind::input_norm},
  {"post_attention_layernorm.weight", tensor_kind::post_attention_norm},
};

const std::string embed_name = "model.embed_tokens.weight";
const std::string final_norm_name = "model.norm.weight";
const std::string lm_head_name = "lm_head.weight";
const std::string layer_prefix = "model.layers.";
const std::string experts_infix = "mlp.experts.";

std::string layer_name(std::uint32_t layer, const std::string& suffix) {
  return layer_prefix + std::to_string(layer) + "." + suffix;
}

std::vector<std::int64_t> canonical_shape(const model_config& c, tensor_kind kind) {
  const std::int64_t hidden = c.hidden_size;
  const std::int64_t q_rows = std::int64_t{c.num_attention_heads} * c.head_dim;
  const std::int64_t kv_rows = std::int64_t{c.num_key_value_heads} * c.head_dim;
  const std::int64_t inter = c.moe_intermediate_size;
  switch (kind) {
    case tensor_kind::embed:
    case tensor_kind::lm_head: return {c.vocab_size, hidden};
    case tensor_kind::q_proj: return {q_rows, hidden};
    case tensor_kind::k_proj:
    case tensor_kind::v_proj: return {kv_rows, hidden};
    case tensor_kind::o_proj: return {hidden, q_rows};
    case tensor_kind::q_norm:
    case tensor_kind::k_norm: return {c.head_dim};
    case tensor_kind::router: return {c.num_experts, hidden};
    case tensor_kind::expert_gate:
    case tensor_kind::expert_up: return {inter, hidden};
    case tensor_kind::expert_down: return {hidden, inter};
    case tensor_kind::input_norm:
    case tensor_kind::post_attention_norm:
    case tensor_kind::final_norm: return {hidden};
  }
  return {};
}

struct parsed_name {
  tensor_kind kind;
  std::uint32_t layer = 0;
  std::uint32_t expert = 0;
};

// Reads a decimal index (no sign, no leading zeros) below `limit` at `pos`, then a '.'.
std::optional<std::uint32_t> read_index(const std::string& s, std::size_t& pos,
                                        std::uint32_t limit) {
  const std::size_t start = pos;
  std::uint64_t value = 0;
  while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9' && pos - start < 10)
    value = value * 10 + static_cast<std::uint64_t>(s[pos++] - '0');
  const std::size_t digits = pos - start;
  if (digits == 0 || (digits > 1 && s[start] == '0') || value >= limit || pos >= s.size()
      || s[pos] != '.')
    return std::nullopt;
  ++pos;
  return static_cast<std::uint32_t>(value);
}

// Identifies a canonical tensor name of this config; nullopt if it is not part of the model.
std::optional<parsed_name> parse_name(const model_config& c, const std::string& name) {
  if (name == embed_name)
    return parsed_name{tensor_kind::embed};
  if (name == final_norm_name)
    return parsed_name{tensor_kind::final_norm};
  if (name == lm_head_name) {
    if (c.tie_word_embeddings)
      return std::nullopt;
    return parsed_name{tensor_kind::lm_head};
  }
  if (name.compare(0, layer_prefix.size(), layer_prefix) != 0)
    return std::nullopt;
  std::size_t pos = layer_prefix.size();
  const auto layer = read_index(name, pos, c.num_hidden_layers);
  if (!layer)
    return std::nullopt;
  const std::string rest = name.substr(pos);
  for (const auto& t : attention_tensors)
    if (rest == t.suffix && !(c.dense() && t.kind == tensor_kind::router))
      return parsed_name{t.kind, *layer};
  if (c.dense()) {
    for (const auto& t : dense_mlp_tensors)
      if (rest == t.suffix)
        return parsed_name{t.kind, *layer, 0};
  }
  for (const auto& t : layer_norm_tensors)
    if (rest == t.suffix)
      return parsed_name{t.kind, *layer};
  if (c.dense() || rest.compare(0, experts_infix.size(), experts_infix) != 0)
    return std::nullopt;
  pos += experts_infix.size();
  const auto expert = read_index(name, pos, c.num_experts);
  if (!expert)
    return std::nullopt;
  const std::string leaf = name.substr(pos);
  for (const auto& t : expert_tensors)
    if (leaf == t.suffix)
      return parsed_name{t.kind, *layer, *expert};
  return std::nullopt;
}

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

} // namespace

std::vector<param_meta> expected_key_stream(const model_config& cfg) {
  validate(cfg, 1);
  std::vector<param_meta> out;
  out.reserve(3 + std::size_t{cfg.num_hidden_layers}
                    * (std::size(attention_tensors) + std::size(layer_norm_tensors)
                       + std::size_t{cfg.num_experts} * std::size(expert_tensors)));
  const auto add = [&](std::string name, tensor_kind kind) {
    out.push_back(param_meta{std::move(name), canonical_shape(cfg, kind), cfg.torch_dtype});
  };
  add(embed_name, tensor_kind::embed);
  for (std::uint32_t layer = 0; layer < cfg.num_hidden_layers; ++layer) {
    for (const auto& t : attention_tensors)
      if (!(cfg.dense() && t.kind == tensor_kind::router)) // dense: the router row stays 0
        add(layer_name(layer, t.suffix), t.kind);
    if (cfg.dense()) {
      for (const auto& t : dense_mlp_tensors)
        add(layer_name(layer, t.suffix), t.kind);
    } else {
      for (std::uint32_t e = 0; e < cfg.num_experts; ++e)
        for (const auto& t : expert_tensors)
          add(layer_name(layer, experts_infix + std::to_string(e) + "." + t.suffix), t.kind);
    }
    for (const auto& t : layer_norm_tensors)
      add(layer_name(layer, t.suffix), t.kind);
  }
  add(final_norm_name, tensor_kind::final_norm);
  if (!cfg.tie_word_embeddings)
    add(lm_head_name, tensor_kind::lm_head);
  return out;
}

// ---------------------------------------------------------------------------------------
// TP resident layout
// ---------------------------------------------------------------------------------------

namespace {

// Residents of one layer, in resident order. Resident index of (layer, slot) is
// 1 + layer * layer_slot_count + slot (index 0 is the embedding).
enum layer_slot : std::size_t {
  slot_qkv,
  slot_o,
  slot_q_norm,
  slot_k_norm,
  slot_router,
  slot_w13,
  slot_w2,
  slot_input_norm,
  slot_post_attention_norm,
  layer_slot_count,
};
constexpr const char* layer_slot_suffix[layer_slot_count] = {
  "self_attn.qkv_proj.weight",
  "self_attn.o_proj.weight",
  "self_attn.q_norm.weight",
  "self_attn.k_norm.weight",
  "mlp.gate.weight",
  "mlp.experts.w13_weight",
  "mlp.experts.w2_weight",
  "input_layernorm.weight",
  "post_attention_layernorm.weight",
};

std::size_t layer_resident(std::uint32_t layer, layer_slot slot) {
  return 1 + std::size_t{layer} * layer_slot_count + slot;
}

// model.norm.weight follows the last layer; lm_head (untied only) is the last resident.
std::size_t final_norm_resident(const model_config& c) {
  return 1 + std::size_t{c.num_hidden_layers} * layer_slot_count;
}

// Per-rank sizes of the TP split (identical on every rank).
struct tp_geometry {
  std::uint64_t q_heads;     // attention heads per rank
  std::uint64_t kv_heads;    // kv heads per rank (1 when replicated)
  std::uint64_t inter;       // moe_intermediate_size / tp
  std::uint64_t vocab_rows;  // padded vocab rows per rank
};

tp_geometry geometry(const model_config& c, std::uint32_t tp) {
  const std::uint64_t padded_vocab = (std::uint64_t{c.vocab_size} + tp - 1) / tp * tp;
  return {c.num_attention_heads / tp, std::max<std::uint64_t>(1, c.num_key_value_heads / tp),
          c.moe_intermediate_size / tp, padded_vocab / tp};
}

// First kv head of `rank` (tp <= kv: a block of kv/tp heads; tp > kv: replicated head).
std::uint64_t first_kv_head(const model_config& c, std::uint32_t tp, std::uint32_t rank) {
  if (tp <= c.num_key_value_heads)
    return std::uint64_t{rank} * (c.num_key_value_heads / tp);
  return std::uint64_t{rank} * c.num_key_value_heads / tp;
}

std::vector<std::int64_t> layer_resident_shape(const model_config& c, const tp_geometry& g,
                                               layer_slot slot) {
  const std::int64_t hidden = c.hidden_size;
  const std::int64_t head_dim = c.head_dim;
  const std::int64_t experts = c.num_experts;
  const auto q_heads = static_cast<std::int64_t>(g.q_heads);
  const auto kv_heads = static_cast<std::int64_t>(g.kv_heads);
  const auto inter = static_cast<std::int64_t>(g.inter);
  switch (slot) {
    case slot_qkv: return {(q_heads + 2 * kv_heads) * head_dim, hidden};
    case slot_o: return {hidden, q_heads * head_dim};
    case slot_q_norm:
    case slot_k_norm: return {head_dim};
    case slot_router: return {experts, hidden};
    case slot_w13: return {experts, 2 * inter, hidden};
    case slot_w2: return {experts, hidden, inter};
    case slot_input_norm:
    case slot_post_attention_norm: return {hidden};
    case layer_slot_count: break;
  }
  throw std::logic_error("layer_resident_shape: invalid layer slot " + std::to_string(slot));
}

// A (possibly strided) copy; rows that are contiguous in source and destination collapse
// into a single row.
placement strided_copy(std::size_t resident, std::uint64_t src_offset, std::uint64_t src_stride,
                       std::uint64_t dst_offset, std::uint64_t dst_stride,
                       std::uint64_t row_bytes, std::uint64_t rows) {
  if (rows > 1 && src_stride == row_bytes && dst_stride == row_bytes)
    return {resident, src_offset, row_bytes * rows, dst_offset, row_bytes * rows,
            row_bytes * rows, 1};
  return {resident, src_offset, src_stride, dst_offset, dst_stride, row_bytes, rows};
}

placement contiguous_copy(std::size_t resident, std::uint64_t src_offset,
                          std::uint64_t dst_offset, std::uint64_t bytes) {
  return {resident, src_offset, bytes, dst_offset, bytes, bytes, 1};
}

} // namespace

tp_layout::tp_layout(const model_config& cfg, std::uint32_t tp) : cfg_(cfg), tp_(tp) {
  validate(cfg, tp);
  const tp_geometry g = geometry(cfg, tp);
  const std::int64_t hidden = cfg.hidden_size;
  const auto add = [&](std::string name, std::vector<std::int64_t> shape) {
    param_meta meta{std::move(name), std::move(shape), cfg.torch_dtype};
    const std::uint64_t nbytes = meta.nbytes();
    resident_bytes_ += nbytes;
    residents_.push_back({std::move(meta.name), std::move(meta.shape), meta.dt, nbytes});
  };
  const auto vocab_rows = static_cast<std::int64_t>(g.vocab_rows);

  residents_.reserve(2 + std::size_t{cfg.num_hidden_layers} * layer_slot_count + 1);
  add(embed_name, {vocab_rows, hidden});
  for (std::uint32_t layer = 0; layer < cfg.num_hidden_layers; ++layer)
    for (std::size_t slot = 0; slot < layer_slot_count; ++slot)
      add(layer_name(layer, layer_slot_suffix[slot]),
          layer_resident_shape(cfg, g, static_cast<layer_slot>(slot)));
  add(final_norm_name, {hidden});
  if (!cfg.tie_word_embeddings)
    add(lm_head_name, {vocab_rows, hidden});
}

std::size_t tp_layout::resident_index(const std::string& name) const {
  for (std::size_t i = 0; i < residents_.size(); ++i)
    if (residents_[i].name == name)
      return i;
  throw model_error(name, "no such resident tensor in the tp=" + std::to_string(tp_)
                            + " layout (" + std::to_string(residents_.size()) + " residents)");
}

std::vector<placement> tp_layout::place(const param_meta& p, std::uint32_t rank) const {
  if (rank >= tp_)
    throw model_error(p.name, "rank " + std::to_string(rank) + " is out of range for tp="
                                + std::to_string(tp_));
  const auto parsed = parse_name(cfg_, p.name);
  if (!parsed)
    throw model_error(p.name, "not a tensor of this " + cfg_.model_type + " model ("
                                + std::to_string(cfg_.num_hidden_layers) + " layers, "
                                + std::to_string(cfg_.num_experts) + " experts, tie_word_embeddings="
                                + (cfg_.tie_word_embeddings ? "true" : "false") + ")");
  const auto planned = canonical_shape(cfg_, parsed->kind);
  if (p.shape != planned || p.dt != cfg_.torch_dtype)
    throw model_error(p.name, "shape " + shape_string(p.shape) + " " + dtype_name(p.dt)
                                + " does not match the planned " + shape_string(planned) + " "
                                + dtype_name(cfg_.torch_dtype));

  const tp_geometry g = geometry(cfg_, tp_);
  const std::uint64_t es = dtype_size(cfg_.torch_dtype);
  const std::uint64_t hidden = cfg_.hidden_size;
  const std::uint64_t head_dim = cfg_.head_dim;
  const std::uint64_t row = hidden * es; // bytes of one row of a [*, hidden] tensor
  const std::uint32_t layer = parsed->layer;
  const std::uint64_t q_rows = g.q_heads * head_dim;
  const std::uint64_t kv_rows = g.kv_heads * head_dim;
  const std::uint64_t inter = cfg_.moe_intermediate_size;

  switch (parsed->kind) {
    case tensor_kind::embed:
    case tensor_kind::lm_head: {
      const std::size_t resident = parsed->kind == tensor_kind::embed ? 0 : residents_.size() - 1;
      const std::uint64_t first = std::uint64_t{rank} * g.vocab_rows;
      if (first >= cfg_.vocab_size)
        return {}; // this rank holds padding rows only
      const std::uint64_t real = std::min<std::uint64_t>(g.vocab_rows, cfg_.vocab_size - first);
      return {contiguous_copy(resident, first * row, 0, real * row)};
    }
    case tensor_kind::q_proj:
      return {contiguous_copy(layer_resident(layer, slot_qkv), rank * q_rows * row, 0,
                              q_rows * row)};
    case tensor_kind::k_proj:
    case tensor_kind::v_proj: {
      const std::uint64_t dst_rows = q_rows + (parsed->kind == tensor_kind::v_proj ? kv_rows : 0);
      const std::uint64_t src_row = first_kv_head(cfg_, tp_, rank) * head_dim;
      return {contiguous_copy(layer_resident(layer, slot_qkv), src_row * row, dst_rows * row,
                              kv_rows * row)};
    }
    case tensor_kind::o_proj: {
      const std::uint64_t cols = q_rows * es; // bytes of this rank's columns, per row
      return {strided_copy(layer_resident(layer, slot_o), rank * cols,
                           std::uint64_t{cfg_.num_attention_heads} * head_dim * es, 0, cols, cols,
                           hidden)};
    }
    case tensor_kind::q_norm:
      return {contiguous_copy(layer_resident(layer, slot_q_norm), 0, 0, p.nbytes())};
    case tensor_kind::k_norm:
      return {contiguous_copy(layer_resident(layer, slot_k_norm), 0, 0, p.nbytes())};
    case tensor_kind::router:
      return {contiguous_copy(layer_resident(layer, slot_router), 0, 0, p.nbytes())};
    case tensor_kind::input_norm:
      return {contiguous_copy(layer_resident(layer, slot_input_norm), 0, 0, p.nbytes())};
    case tensor_kind::post_attention_norm:
      return {contiguous_copy(layer_resident(layer, slot_post_attention_norm), 0, 0, p.nbytes())};
    case tensor_kind::final_norm:
      return {contiguous_copy(final_norm_resident(cfg_), 0, 0, p.nbytes())};
    case tensor_kind::expert_gate:
    case tensor_kind::expert_up: {
      const std::uint64_t slice = g.inter * row; // I/tp rows of [I, hidden]
      const std::uint64_t dst = parsed->expert * 2 * slice
                                + (parsed->kind == tensor_kind::expert_up ? slice : 0);
      return {contiguous_copy(layer_resident(layer, slot_w13), rank * slice, dst, slice)};
    }
    case tensor_kind::expert_down: {
      const std::uint64_t cols = g.inter * es; // bytes of this rank's columns, per row
      return {strided_copy(layer_resident(layer, slot_w2), rank * cols, inter * es,
                           parsed->expert * hidden * cols, cols, cols, hidden)};
    }
  }
  return {};
}

void tp_layout::scatter(const param_meta& p, const std::byte* src, std::uint32_t rank,
                        const std::vector<std::byte*>& resident) const {
  if (resident.size() != residents_.size())
    throw model_error(p.name, "scatter got " + std::to_string(resident.size())
                                + " resident pointers for rank " + std::to_string(rank)
                                + ", expected " + std::to_string(residents_.size()));
  for (const placement& pl : place(p, rank)) {
    std::byte* dst = resident[pl.resident_index];
    if (dst == nullptr)
      throw model_error(p.name, "resident pointer for '" + residents_[pl.resident_index].name
                                  + "' of rank " + std::to_string(rank) + " is null");
    for (std::uint64_t r = 0; r < pl.rows; ++r)
      std::memcpy(dst + pl.dst_offset + r * pl.dst_stride, src + pl.src_offset + r * pl.src_stride,
                  pl.row_bytes);
  }
}

} // namespace refit::model
