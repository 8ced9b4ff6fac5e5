// Shared by the kernel-level gpu-label tests (test_gpu_moe_kernels, test_gpu_attention_kernels):
// bf16 conversions as the device rounds, typed device buffers, random bf16 data.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "runtime/cuda/cuda.hpp"

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

namespace refit::testing {

inline std::uint16_t to_bf16(float f) { // round to nearest even, as __float2bfloat16
  std::uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline float from_bf16(std::uint16_t b) {
  const std::uint32_t u = std::uint32_t{b} << 16;
  float f = 0;
  std::memcpy(&f, &u, 4);
  return f;
}

// `n` elements of T on cuda:0 (zeroed, freed with the object), or a copy of a host vector.
template <class T>
struct device_vec : refit::cuda::device_array<T> {
  using base = refit::cuda::device_array<T>;
  explicit device_vec(std::size_t count) : base(0, count, "test buffer") {}
  explicit device_vec(const std::vector<T>& host) : base(0, host, "test buffer") {}
};

inline std::vector<std::uint16_t> random_bf16(std::size_t n, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v)
    x = to_bf16(u(rng));
  return v;
}

} // namespace refit::testing
