// Rotary position embedding tables as HF transformers computes them, shared by both forwards
// of the LibTorch module (torch-free and header-only: the module links nothing of the host).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace refit::inference {

// 1 / theta^(2i / head_dim) for i < head_dim / 2, in fp32.
inline std::vector<float> rope_inverse_frequencies(double rope_theta, std::int64_t head_dim) {
  const std::int64_t half = head_dim / 2;
  std::vector<float> inv(static_cast<std::size_t>(half));
  const float theta = static_cast<float>(rope_theta);
  for (std::int64_t i = 0; i < half; ++i)
    inv[static_cast<std::size_t>(i)] =
      1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  return inv;
}

// Row t of cos / sin (inv.size() floats each) = cos / sin of positions[t] * inv (fp32 angle).
inline void rope_cos_sin(const std::vector<float>& inv, const std::int64_t* positions,
                         std::int64_t n, float* cos, float* sin) {
  const auto half = static_cast<std::int64_t>(inv.size());
  for (std::int64_t t = 0; t < n; ++t) {
    const float pos = static_cast<float>(positions[t]);
    for (std::int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv[static_cast<std::size_t>(i)];
      cos[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
}

} // namespace refit::inference
