// The routing cases of the gpu-label MoE kernel tests (test_gpu_moe_kernels and its kin):
// skewed top-k routing and the counting sort by expert that bucket must produce (host side).
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace refit::testing {

// Routing of `tokens` tokens to `top_k` distinct experts each, skewed: expert 0 takes every
// token, experts 1..3 most, the last quarter none, the rest at random (some once).
inline std::vector<std::int64_t> skewed_routing(int tokens, int top_k, int experts,
                                                std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::int64_t> ids;
  for (int t = 0; t < tokens; ++t) {
    std::vector<int> pool;
    for (int e = 1; e < experts - experts / 4; ++e)
      pool.push_back(e);
    std::shuffle(pool.begin(), pool.end(), rng);
    std::vector<int> favoured; // experts 1..3, each for 3 tokens of 4
    for (int e = 1; e <= 3; ++e)
      if (rng() % 4 != 0)
        favoured.push_back(e);
    std::stable_partition(pool.begin(), pool.end(), [&](int e) {
      return std::find(favoured.begin(), favoured.end(), e) != favoured.end();
    });
    ids.push_back(0);
    for (int j = 1; j < top_k; ++j)
      ids.push_back(pool[static_cast<std::size_t>(j - 1)]);
  }
  return ids;
}

struct sorted_copies {
  std::vector<std::int64_t> counts, order, src_token, inverse;
  std::vector<int> offsets, active;
};

// What bucket must produce: a stable counting sort of the flat copies by expert.
inline sorted_copies host_bucket(const std::vector<std::int64_t>& ids, int top_k, int experts) {
  sorted_copies s;
  s.counts.assign(static_cast<std::size_t>(experts), 0);
  for (std::int64_t e : ids)
    ++s.counts[static_cast<std::size_t>(e)];
  int end = 0;
  for (int e = 0; e < experts; ++e) {
    end += static_cast<int>(s.counts[static_cast<std::size_t>(e)]);
    s.offsets.push_back(end);
    if (s.counts[static_cast<std::size_t>(e)] > 0)
      s.active.push_back(e);
  }
  s.inverse.assign(ids.size(), -1);
  for (int e = 0; e < experts; ++e)
    for (std::size_t f = 0; f < ids.size(); ++f)
      if (ids[f] == e) {
        s.inverse[f] = static_cast<std::int64_t>(s.order.size());
        s.order.push_back(static_cast<std::int64_t>(f));
        s.src_token.push_back(static_cast<std::int64_t>(f) / top_k);
      }
  return s;
}

} // namespace refit::testing
