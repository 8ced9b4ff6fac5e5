#include "runtime/inference/sampling.hpp"

#include "runtime/model/digest.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace refit::inference {

using model::golden_gamma;
using model::mix64;

double processed_distribution::logprob_of(std::int32_t token) const {
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] == token)
      return logprobs[i];
  return -std::numeric_limits<double>::infinity();
}

processed_distribution process_logits(const float* logits, std::size_t vocab, float temperature,
                                      std::int32_t top_k, float top_p) {
  if (vocab == 0)
    throw std::invalid_argument("process_logits: empty vocabulary");
  if (!(temperature >= 0.0f))
    throw std::invalid_argument("process_logits: temperature " + std::to_string(temperature)
                                + " is negative or NaN");
  if (!(top_p >= 0.0f && top_p <= 1.0f))
    throw std::invalid_argument("process_logits: top_p " + std::to_string(top_p)
                                + " is outside [0, 1]");
  const double inv_t = temperature == 0.0f ? 1.0 : 1.0 / static_cast<double>(temperature);

  // z - max(z) in double; exp of it is the unnormalized probability.
  std::vector<double> z(vocab);
  double max_z = -std::numeric_limits<double>::infinity();
  std::size_t argmax = 0;
  for (std::size_t i = 0; i < vocab; ++i) {
    z[i] = static_cast<double>(logits[i]) * inv_t;
    if (z[i] > max_z) {
      max_z = z[i];
      argmax = i;
    }
  }
  if (!std::isfinite(max_z))
    throw std::invalid_argument("process_logits: logits are not finite");
  std::vector<double> e(vocab);
  for (std::size_t i = 0; i < vocab; ++i) {
    z[i] -= max_z;
    e[i] = std::exp(z[i]);
  }

  const bool use_top_k = top_k > 0 && static_cast<std::size_t>(top_k) < vocab;
  const bool use_top_p = top_p > 0.0f && top_p < 1.0f;

  processed_distribution out;
  out.argmax = static_cast<std::int32_t>(argmax);
  std::vector<std::int32_t> kept;
  if (use_top_k || use_top_p) {
    std::vector<std::int32_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    const auto before = [&z](std::int32_t a, std::int32_t b) {
      return z[a] > z[b] || (z[a] == z[b] && a < b);
    };
    std::size_t keep = vocab;
    if (use_top_k) {
      keep = static_cast<std::size_t>(top_k);
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep),
                        order.end(), before);
    } else {
      std::sort(order.begin(), order.end(), before);
    }
    order.resize(keep);
    if (use_top_p) {
      double mass = 0.0;
      for (std::int32_t t : order)
        mass += e[t];
      double cumulative = 0.0;
      std::size_t nucleus = 0;
      while (nucleus < order.size()) {
        cumulative += e[order[nucleus]] / mass;
        ++nucleus;
        if (cumulative >= static_cast<double>(top_p))
          break;
      }
      order.resize(nucleus);
    }
    kept = std::move(order);
  } else {
    kept.resize(vocab);
    std::iota(kept.begin(), kept.end(), 0);
  }

  double total = 0.0;
  for (std::int32_t t : kept)
    total += e[t];
  const double log_total = std::log(total);
  out.tokens = kept;
  out.probs.reserve(kept.size());
  out.logprobs.reserve(kept.size());
  for (std::int32_t t : kept) {
    out.probs.push_back(e[t] / total);
    out.logprobs.push_back(z[t] - log_total);
  }
  return out;
}

double sampling_uniform(std::uint64_t seed, std::uint64_t prompt_index,
                        std::uint64_t sample_index, std::uint64_t step) {
  std::uint64_t h = mix64(seed + golden_gamma);
  h = mix64(h ^ (prompt_index * 0xd1b54a32d192ed03ull + 1));
  h = mix64(h ^ (sample_index * 0xabc98388fb8fac03ull + 2));
  h = mix64(h ^ (step * 0x8cb92ba72f3d8dd7ull + 3));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0); // 2^-53
}

sampled_token sample_token(const float* logits, std::size_t vocab, const sampling_config& params,
                           std::uint64_t prompt_index, std::uint64_t sample_index,
                           std::uint64_t step) {
  const processed_distribution d =
    process_logits(logits, vocab, params.temperature, params.top_k, params.top_p);
  sampled_token out;
  if (params.temperature == 0.0f) {
    out.token = d.argmax;
    out.logprob = static_cast<float>(d.logprob_of(d.argmax));
    return out;
  }
  const double u = sampling_uniform(params.seed, prompt_index, sample_index, step);
  std::size_t pick = d.tokens.size() - 1;
  double cumulative = 0.0;
  for (std::size_t i = 0; i < d.tokens.size(); ++i) {
    cumulative += d.probs[i];
    if (u < cumulative) {
      pick = i;
      break;
    }
  }
  out.token = d.tokens[pick];
  out.logprob = static_cast<float>(d.logprobs[pick]);
  return out;
}

float processed_logprob(const float* logits, std::size_t vocab, const sampling_config& params,
                        std::int32_t token) {
  const processed_distribution d =
    process_logits(logits, vocab, params.temperature, params.top_k, params.top_p);
  return static_cast<float>(d.logprob_of(token));
}

} // namespace refit::inference
