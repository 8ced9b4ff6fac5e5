// The trainer-side, unsharded reference (TP = 1, the same model code as the runtime): usable
// outside refit-runtime, e.g. by the coordinator's parity check of rollout logprobs.
//
// Teacher forcing: for every sequence, one forward over prompt + generated tokens; the
// logprob of generated token i is read from the logits at the position before it, processed
// exactly as sampling does (softmax(logits / T), top-k, top-p, renormalized; temperature 0
// reports under T = 1). fp32 on the CPU.
//
// Tolerance: the runtime computes the same numbers incrementally (batched prefill, cached
// decode steps, TP all-reduces in rank order), so results differ only by fp32 rounding.
// Measured on the tiny test model (2 layers, hidden 64, bf16 weights, init scale 0.1):
// logits vs an independent double-precision implementation <= 9e-7; TP 2/4 logits vs this
// reference <= 7.2e-7; runtime logprobs (greedy and sampled, TP 1/2/4, in-process and through
// refit-runtime) vs reference_logprobs <= 1e-6. parity_tolerance = 1e-3 leaves three orders
// of magnitude for deeper/wider models and other BLAS kernels; a real divergence (wrong
// weights, stale KV) moves logprobs by far more (>= 1e-2 in the tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/inference/sampling.hpp"
#include "runtime/model/qwen3_moe.hpp"

namespace refit::inference {

constexpr float parity_tolerance = 1e-3f; // max |runtime logprob - reference logprob|

struct scored_sequence {
  std::vector<std::int32_t> prompt_token_ids; // what the runtime saw (after truncation)
  std::vector<std::int32_t> token_ids;        // generated tokens to score
};

// Owned resident tensors of one rank (e.g. the tp=1 residents of full canonical weights).
struct resident_set {
  std::vector<std::vector<std::byte>> storage;
  std::vector<const std::byte*> pointers() const;
};

// Scatters full canonical tensors (`params` with their bytes, e.g. expected_key_stream order)
// into the residents of `rank` of a tp layout. Tensors of the model missing from `params`
// stay zero.
resident_set scatter_residents(const model::model_config& cfg, std::uint32_t tp,
                               std::uint32_t rank, const std::vector<model::param_meta>& params,
                               const std::vector<const std::byte*>& canonical);

// Processed logprobs of every sequence's token_ids (one vector per sequence).
std::vector<std::vector<float>> reference_logprobs(
  const model::model_config& cfg, const std::vector<const std::byte*>& tp1_residents,
  const std::vector<scored_sequence>& sequences, const sampling_config& params);

// Same from full canonical tensors.
std::vector<std::vector<float>> reference_logprobs(const model::model_config& cfg,
                                                   const std::vector<model::param_meta>& params,
                                                   const std::vector<const std::byte*>& canonical,
                                                   const std::vector<scored_sequence>& sequences,
                                                   const sampling_config& sampling);

// Raw logits of every position of `tokens` (tokens.size() rows of vocab_size floats).
std::vector<float> reference_logits(const model::model_config& cfg,
                                    const std::vector<const std::byte*>& tp1_residents,
                                    const std::vector<std::int32_t>& tokens);

} // namespace refit::inference
