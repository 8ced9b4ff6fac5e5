// Qwen3-MoE (`qwen3_moe`) model schema: config, the expected canonical HF key stream
// (planned from the config alone), the structural manifest, the TP resident layout of the
// rollout runtime (the synthetic weights are in synthetic.hpp).
//
// Pure C++ (no LibTorch, no CAF): shared by trainer ranks, the coordinator and refit-runtime.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace refit::model {

enum class dtype : std::uint8_t { bfloat16 = 1, float16 = 2, float32 = 3 };

std::size_t dtype_size(dtype dt);
const char* dtype_name(dtype dt); // "bfloat16", "float16", "float32"
// Parses "bfloat16"/"bf16", "float16"/"fp16"/"half", "float32"/"fp32"/"float".
// Throws model_error (where = `where`) for anything else.
dtype parse_dtype(const std::string& text, const std::string& where);

// An error about the model schema or a tensor. `where` names the config key or tensor.
struct model_error : std::runtime_error {
  model_error(std::string where, const std::string& what)
    : std::runtime_error(where + ": " + what), where(std::move(where)) {}
  std::string where;
};

// The HF config.json fields refit needs (names follow config.json).
struct model_config {
  std::string model_type = "qwen3_moe";
  std::uint32_t num_hidden_layers = 0;
  std::uint32_t hidden_size = 0;
  std::uint32_t num_attention_heads = 0;
  std::uint32_t num_key_value_heads = 0;
  std::uint32_t head_dim = 0;
  std::uint32_t num_experts = 0;
  std::uint32_t num_experts_per_tok = 0;
  std::uint32_t moe_intermediate_size = 0;
  // Dense qwen3 only: the MLP width. A dense model is held as one always-chosen expert
  // (num_experts = num_experts_per_tok = 1, moe_intermediate_size = intermediate_size, set by
  // normalize_dense) whose router row stays zero, so the softmax weight is exactly 1.0.
  std::uint32_t intermediate_size = 0;
  std::uint32_t vocab_size = 0;
  bool tie_word_embeddings = false;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
  bool norm_topk_prob = true;
  dtype torch_dtype = dtype::bfloat16;
  // Unsupported features: present so that a config asking for them is rejected clearly.
  std::string quantization;      // non-empty => rejected
  bool lora = false;             // true => rejected

  bool dense() const { return model_type == "qwen3"; }
};

// For model_type "qwen3" (dense): fills the one-expert fields (num_experts,
// num_experts_per_tok, moe_intermediate_size) from intermediate_size where they are 0.
// Other model types are left unchanged. validate() checks the result.
void normalize_dense(model_config& cfg);

// Checks that the config describes a supported qwen3_moe or (dense) qwen3 model and that `tp` divides what
// it must (attention heads, moe_intermediate_size; KV heads divide tp or tp divides them).
// Throws model_error naming the offending key (e.g. "model.num_attention_heads").
void validate(const model_config& cfg, std::uint32_t tp);

struct param_meta {
  std::string name;
  std::vector<std::int64_t> shape;
  dtype dt = dtype::bfloat16;
  std::uint64_t numel() const;
  std::uint64_t nbytes() const;
  bool operator==(const param_meta& other) const {
    return name == other.name && shape == other.shape && dt == other.dt;
  }
};

// The expected canonical key stream in HF order, planned from the config alone:
// model.embed_tokens.weight; per layer i: self_attn.{q,k,v,o}_proj.weight,
// self_attn.{q,k}_norm.weight, mlp.gate.weight, mlp.experts.{e}.{gate,up,down}_proj.weight
// for every expert, input_layernorm.weight, post_attention_layernorm.weight;
// model.norm.weight; lm_head.weight (omitted when tie_word_embeddings). Dense qwen3 has
// mlp.{gate,up,down}_proj.weight in place of the router and the experts.
std::vector<param_meta> expected_key_stream(const model_config& cfg);

// Hex SHA-256 over the ordered (name, shape, dtype, numel, nbytes) of `params` (manifest.cpp;
// manifest.hpp computes it as tensors arrive).
// Never hashes payload bytes.
std::string structural_manifest(const std::vector<param_meta>& params);

// ---------------------------------------------------------------------------------------
// TP resident layout (what a refit-runtime TP worker holds), vLLM-style:
//   <layer>.self_attn.qkv_proj.weight  [(q_heads/tp + 2*kv_per_rank) * head_dim, hidden]
//       (KV heads replicated when tp > num_key_value_heads: rank r holds kv head r*kv/tp)
//   <layer>.self_attn.o_proj.weight    [hidden, q_heads/tp * head_dim]   (row-parallel)
//   <layer>.self_attn.{q,k}_norm.weight, <layer>.mlp.gate.weight, layer norms: replicated
//   <layer>.mlp.experts.w13_weight     [E, 2*I/tp, hidden]  (gate rows then up rows)
//   <layer>.mlp.experts.w2_weight      [E, hidden, I/tp]
//   model.embed_tokens.weight, lm_head.weight: vocab split, padded to a multiple of tp
//       (rows past vocab_size are zero)
//   model.norm.weight: replicated
// ---------------------------------------------------------------------------------------
struct resident_spec {
  std::string name;
  std::vector<std::int64_t> shape;
  dtype dt = dtype::bfloat16;
  std::uint64_t nbytes = 0;
};

// A strided 2-D byte copy: for r in [0, rows): copy row_bytes from
// src[src_offset + r*src_stride] to resident[resident_index][dst_offset + r*dst_stride].
struct placement {
  std::size_t resident_index = 0;
  std::uint64_t src_offset = 0;
  std::uint64_t src_stride = 0;
  std::uint64_t dst_offset = 0;
  std::uint64_t dst_stride = 0;
  std::uint64_t row_bytes = 0;
  std::uint64_t rows = 0;
};

class tp_layout {
public:
  tp_layout(const model_config& cfg, std::uint32_t tp); // validates; throws model_error
  std::uint32_t tp() const { return tp_; }
  // Resident tensors of one worker (same names and shapes on every rank).
  const std::vector<resident_spec>& residents() const { return residents_; }
  std::uint64_t resident_bytes() const { return resident_bytes_; }
  // How canonical tensor `p` lands in worker `rank`'s residents. Throws model_error if `p`
  // is not part of the model or its shape/dtype differ from the plan.
  std::vector<placement> place(const param_meta& p, std::uint32_t rank) const;
  // Applies placements: copies canonical bytes `src` (p.nbytes() bytes) into `resident`
  // (one pointer per resident tensor of `rank`).
  void scatter(const param_meta& p, const std::byte* src, std::uint32_t rank,
               const std::vector<std::byte*>& resident) const;
  // Index of a resident tensor by name, or throws model_error.
  std::size_t resident_index(const std::string& name) const;

private:
  model_config cfg_;
  std::uint32_t tp_;
  std::vector<resident_spec> residents_;
  std::uint64_t resident_bytes_ = 0;
};

// bf16 <-> fp32 and fp16 <-> fp32 (round to nearest even).
std::uint16_t float_to_bf16(float f);
float bf16_to_float(std::uint16_t b);
std::uint16_t float_to_half(float f);
float half_to_float(std::uint16_t h);

} // namespace refit::model
