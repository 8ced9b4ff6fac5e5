// Token sampling of refit-runtime generation (pure C++, no LibTorch).
//
// The processed distribution of one step is softmax(logits / T) restricted to the top-k
// tokens, then to the top-p nucleus of that (renormalized) top-k distribution, and
// renormalized again:
//   * top-k keeps the k most probable tokens (ties at the boundary: lower token id first);
//     top_k <= 0 or top_k >= vocab disables it.
//   * top-p walks the kept tokens in descending probability (ties: lower id first) and keeps
//     the shortest prefix whose cumulative (renormalized) probability reaches top_p;
//     top_p == 0 or top_p >= 1 disables it. At least one token is always kept.
//   * temperature == 0 is greedy: the sampled token is the argmax of the logits (lowest id on
//     ties) and its reported log-probability is taken under the distribution above with
//     T treated as 1 (softmax(logits) with top-k / top-p applied).
// The reported logprob of a sampled token is its log-probability under the processed
// distribution (so it is 0 when only one token survives the filters).
//
// Randomness is counter-based: the uniform of a draw is a pure function of
// (seed, prompt index, sample index, step), so results do not depend on batching, thread
// timing or any global state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace refit::inference {

struct sampling_config {
  std::uint32_t n = 1;              // samples per prompt
  std::uint32_t max_tokens = 16;    // generated tokens per sample (stop token included)
  float temperature = 1.0f;         // 0: greedy
  std::int32_t top_k = 0;           // <= 0: disabled
  float top_p = 1.0f;               // 0 or 1: disabled
  std::uint64_t seed = 0;
  std::vector<std::int32_t> stop_token_ids;
  std::uint32_t max_prompt_length = 0; // 0: no truncation; else keep the LAST tokens
};

// The tokens that survive the filters with their renormalized probabilities (sum 1) and
// log-probabilities. `tokens` is in descending probability order (ties: lower id first)
// when a filter was applied, in token id order otherwise.
struct processed_distribution {
  std::vector<std::int32_t> tokens;
  std::vector<double> probs;
  std::vector<double> logprobs;
  std::int32_t argmax = 0; // most probable token (lowest id on ties)

  // Log-probability of `token`; -infinity when the filters removed it.
  double logprob_of(std::int32_t token) const;
};

// `temperature` 0 is treated as 1 (greedy reporting). Requires vocab > 0, temperature >= 0
// and top_p in [0, 1] (throws std::invalid_argument otherwise).
processed_distribution process_logits(const float* logits, std::size_t vocab, float temperature,
                                      std::int32_t top_k, float top_p);

// The uniform in [0, 1) (53 random bits) of draw (seed, prompt_index, sample_index, step).
double sampling_uniform(std::uint64_t seed, std::uint64_t prompt_index,
                        std::uint64_t sample_index, std::uint64_t step);

struct sampled_token {
  std::int32_t token = 0;
  float logprob = 0.0f;
};

// Samples one token from `logits` (vocab floats) with `params` (greedy when temperature is 0)
// using draw (params.seed, prompt_index, sample_index, step).
sampled_token sample_token(const float* logits, std::size_t vocab, const sampling_config& params,
                           std::uint64_t prompt_index, std::uint64_t sample_index,
                           std::uint64_t step);

// Log-probability of `token` under the processed distribution of `params` (what
// sample_token reports for it); -infinity when the filters remove it.
float processed_logprob(const float* logits, std::size_t vocab, const sampling_config& params,
                        std::int32_t token);

} // namespace refit::inference
