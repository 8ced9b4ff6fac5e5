// HF `config.json` -> refit's model_config (runtime/model/qwen3_moe.hpp).
//
// model_type `qwen3_moe` and `qwen3` (dense: intermediate_size, held as one always-chosen
// expert) map fully. Every field refit does
// not implement is an error naming field and value when it asks for something other than
// HF's default (rope scaling, sliding window, attention bias, quantization, dense MLP layers
// in an MoE model, decoder_sparse_step != 1, an activation other than silu). Keys HF configs
// commonly carry that do not change the forward are known and ignored; any other key is
// returned as a warning (HF itself tolerates unknown keys).
//
// transformers 5 spellings are read too: `dtype` (for torch_dtype), `num_local_experts` (for
// num_experts), `rope_parameters` {rope_type, rope_theta}.
//
// Defaults for absent fields follow HF: num_key_value_heads = num_attention_heads, head_dim =
// hidden_size / num_attention_heads, rms_norm_eps 1e-6, rope_theta 10000, norm_topk_prob
// false, tie_word_embeddings false, max_position_embeddings 32768. The sizes (layers, hidden,
// heads, vocab, experts, intermediate sizes) have no default: an absent one is an error.
#pragma once

#include "runtime/checkpoint/safetensors.hpp"
#include "runtime/model/qwen3_moe.hpp"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace refit::checkpoint {

struct hf_model {
  std::string model_type; // "qwen3_moe" or "qwen3"
  // The refit config. For qwen3 (dense) model_type is "qwen3", intermediate_size is set and
  // the expert fields hold the one always-chosen expert (model::normalize_dense).
  model::model_config cfg;
  std::uint32_t intermediate_size = 0; // the dense MLP width (qwen3); 0 if absent (qwen3_moe)
  std::uint32_t max_position_embeddings = 32768;
  // False when config.json names no torch_dtype / dtype: cfg.torch_dtype is then a guess
  // (bfloat16) and the weights loader takes the checkpoint's dtype instead.
  bool dtype_declared = true;
  std::vector<std::string> warnings; // unknown keys, one line each
  bool dense() const { return model_type == "qwen3"; }
};

// Maps a parsed config.json; `file` names it in errors. Throws checkpoint_error.
hf_model parse_hf_config(const nlohmann::json& config, const std::string& file);
// Reads `<dir>/config.json`. Throws checkpoint_error.
hf_model read_hf_config(const std::string& dir);

} // namespace refit::checkpoint
