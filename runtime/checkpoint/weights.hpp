// A loaded checkpoint mapped onto refit's canonical key stream (model::expected_key_stream):
// every canonical tensor gets a zero-copy source, a list of contiguous byte ranges in the
// mapped files, in canonical element order.
//
// Expert layouts: per-expert keys (model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight)
// or the fused layout transformers 5 writes (mlp.experts.gate_up_proj [E, 2I, H], gate rows
// [0, I) then up rows [I, 2I); mlp.experts.down_proj [E, H, I]). One layout per layer.
//
// Dtypes: a checkpoint tensor of BF16, F16 or F32 is accepted for any config dtype of these
// three; read_canonical converts on the fly (widening exact, narrowing round-to-nearest-even),
// as HF's from_pretrained(torch_dtype=...) casts. Same dtype is a plain memcpy.
//
// Extra checkpoint tensors are an error, except the ones HF drops on load (ignored()):
//   lm_head.weight when tie_word_embeddings is true (HF ties it to embed_tokens: the
//     embedding wins), and
//   *.rotary_emb.inv_freq (a non-persistent RoPE buffer old checkpoints saved).
#pragma once

#include "runtime/checkpoint/hf_config.hpp"
#include "runtime/checkpoint/index.hpp"

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace refit::checkpoint {

struct byte_range {
  const std::byte* data = nullptr;
  std::uint64_t nbytes = 0;
  std::string file;
  std::uint64_t file_offset = 0;
};

struct canonical_source {
  model::param_meta meta;   // canonical name, shape, dtype (the config's)
  model::dtype source_dt{}; // the checkpoint's dtype
  std::string source_name;  // the checkpoint tensor it comes from
  std::vector<byte_range> ranges; // in canonical element order, source_dt bytes
};

class model_weights {
public:
  // The sources point into `files`' mappings: `files` must outlive this object.
  // Maps `files` onto the key stream of `m` (qwen3_moe, or dense qwen3 with its
  // mlp.{gate,up,down}_proj keys). When m.dtype_declared is false the config dtype is taken from
  // model.embed_tokens.weight. Throws checkpoint_error (or model::model_error for a config
  // model::validate refuses).
  model_weights(const checkpoint_files& files, const hf_model& m);

  const model::model_config& config() const { return cfg_; }
  const std::vector<canonical_source>& tensors() const { return sources_; }
  std::vector<model::param_meta> key_stream() const;
  // model::structural_manifest of the key stream.
  std::string fingerprint() const;
  // Checkpoint tensors accepted and not used (see the list above).
  const std::vector<std::string>& ignored() const { return ignored_; }
  const canonical_source& source(const std::string& canonical_name) const;

  // Copies elements [elem_begin, elem_begin + count) of canonical tensor `p` (row-major, in
  // p.dt) to `out` (count * dtype_size bytes). `p` must equal the planned meta. Throws
  // checkpoint_error for an unknown tensor, a meta mismatch or a range past the end.
  void read_canonical(const model::param_meta& p, std::uint64_t elem_begin, std::uint64_t count,
                      std::byte* out) const;

private:
  model::model_config cfg_;
  std::string dir_;
  std::vector<canonical_source> sources_;
  std::unordered_map<std::string, std::size_t> by_name_;
  std::vector<std::string> ignored_;
};

} // namespace refit::checkpoint
