// Model shapes shared by the unit tests: the tiny test model and the real Qwen3-30B-A3B.
#pragma once

#include <cstdint>

#include "runtime/model/qwen3_moe.hpp"

namespace refit::testing {

// 2 layers, hidden 64, 4 heads / 2 KV heads of 16, 4 experts (top-2) of 32, bf16.
inline model::model_config tiny_model(std::uint32_t vocab = 256, bool tied = false) {
  model::model_config c;
  c.num_hidden_layers = 2;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 32;
  c.vocab_size = vocab;
  c.tie_word_embeddings = tied;
  c.torch_dtype = model::dtype::bfloat16;
  return c;
}

// A dense qwen3 of the same attention shape: MLP width 96, tied embeddings.
inline model::model_config tiny_dense_model(std::uint32_t vocab = 256) {
  model::model_config c = tiny_model(vocab, true);
  c.model_type = "qwen3";
  c.num_experts = 0;
  c.num_experts_per_tok = 0;
  c.moe_intermediate_size = 0;
  c.intermediate_size = 96;
  model::normalize_dense(c);
  return c;
}

// The real Qwen3-30B-A3B shape (field-notes.md).
inline model::model_config qwen3_30b_a3b() {
  model::model_config c;
  c.num_hidden_layers = 48;
  c.hidden_size = 2048;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.moe_intermediate_size = 768;
  c.vocab_size = 151936;
  c.tie_word_embeddings = false;
  c.torch_dtype = model::dtype::bfloat16;
  return c;
}

} // namespace refit::testing
