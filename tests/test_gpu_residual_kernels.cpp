// The bf16 engine's residual kernels on a GPU (label gpu), alone: the experts' weighted mix
// into the fp32 residual with the next layer's RMSNorm (mix_experts), its early variant (the
// routing, the residual row and the norm weights read before the programmatic wait) and its
// early trigger (the next kernel scheduled before its wait) bit for bit against the plain one,
// all against a host fp64 reference.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_fixture.hpp"
#include "gpu_kernel_fixture.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace {

namespace kernels = refit::inference::kernels;
using refit::testing::device_vec;
using refit::testing::from_bf16;
using refit::testing::random_bf16;
using i64 = std::int64_t;

std::vector<float> random_f32(std::size_t n, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (auto& x : v)
    x = u(rng);
  return v;
}

// RMSNorm of a row to what bf16 holds, in fp64 (the device rounds once, at the end).
std::vector<double> host_norm(const std::vector<double>& row, const std::vector<std::uint16_t>& w,
                              double eps) {
  double ss = 0;
  for (const double v : row)
    ss += v * v;
  const double r = 1.0 / std::sqrt(ss / static_cast<double>(row.size()) + eps);
  std::vector<double> out(row.size());
  for (std::size_t c = 0; c < row.size(); ++c)
    out[c] = row[c] * r * from_bf16(w[c]);
  return out;
}

// One mix of n tokens' top_k expert rows (fp32 y) into x, with and without the norm.
struct mix_case {
  int n, top_k, h;
  bool y_f32, with_norm;
};

struct mix_result {
  std::vector<float> x;
  std::vector<std::uint16_t> normed;
};

TEST(GpuResidualKernels, EarlyMixEqualsThePlainMixBitwiseAndTheHostReference) {
  REQUIRE_GPUS(1);
  const float eps = 1e-6f;
  for (const mix_case m : {mix_case{64, 8, 2048, true, true}, mix_case{5, 8, 2048, false, true},
                           mix_case{7, 4, 256, true, false}, mix_case{3, 2, 1024, true, true}}) {
    SCOPED_TRACE(std::to_string(m.n) + " tokens, top " + std::to_string(m.top_k) + ", h "
                 + std::to_string(m.h) + (m.y_f32 ? ", fp32 y" : ", bf16 y")
                 + (m.with_norm ? ", normed" : ""));
    const int copies = m.n * m.top_k;
    const auto y32 = random_f32(static_cast<std::size_t>(copies) * m.h, 11, 0.5f);
    const auto y16 = random_bf16(static_cast<std::size_t>(copies) * m.h, 11, 0.5f);
    const auto x0 = random_f32(static_cast<std::size_t>(m.n) * m.h, 12, 2.0f);
    const auto nw = random_bf16(static_cast<std::size_t>(m.h), 13, 1.5f);
    std::vector<i64> inverse(static_cast<std::size_t>(copies));
    std::iota(inverse.begin(), inverse.end(), i64{0});
    std::shuffle(inverse.begin(), inverse.end(), std::mt19937(14)); // any row of y per copy
    const auto weights = random_f32(static_cast<std::size_t>(copies), 15, 1.0f);
    device_vec<float> d_y32(m.y_f32 ? y32 : std::vector<float>(1));
    device_vec<std::uint16_t> d_y16(m.y_f32 ? std::vector<std::uint16_t>(1) : y16);
    device_vec<i64> d_inv(inverse);
    device_vec<float> d_wt(weights);
    device_vec<std::uint16_t> d_nw(nw);
    const auto run = [&](bool early, bool trigger_early = false) {
      device_vec<float> d_x(x0);
      device_vec<std::uint16_t> d_out(static_cast<std::size_t>(m.n) * m.h);
      kernels::mix_experts(m.y_f32 ? static_cast<const void*>(d_y32.p) : d_y16.p, d_inv.p,
                           d_wt.p, d_x.p, m.n, m.top_k, m.h, m.with_norm ? d_nw.p : nullptr,
                           m.with_norm ? d_out.p : nullptr, eps, nullptr, m.y_f32, early,
                           trigger_early);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return mix_result{d_x.host(), d_out.host()};
    };
    const mix_result plain = run(false), early = run(true), triggering = run(true, true);
    EXPECT_EQ(early.x, plain.x);
    EXPECT_EQ(early.normed, plain.normed);
    EXPECT_EQ(triggering.x, plain.x) << "the early trigger changes no sum";
    EXPECT_EQ(triggering.normed, plain.normed);
    double worst_x = 0, worst_norm = 0;
    for (int t = 0; t < m.n; ++t) {
      std::vector<double> row(static_cast<std::size_t>(m.h));
      for (int c = 0; c < m.h; ++c) {
        double v = x0[static_cast<std::size_t>(t) * m.h + c];
        for (int j = 0; j < m.top_k; ++j) {
          const std::size_t copy = static_cast<std::size_t>(t) * m.top_k + j;
          const std::size_t at = static_cast<std::size_t>(inverse[copy]) * m.h + c;
          v += double(weights[copy]) * (m.y_f32 ? double(y32[at]) : double(from_bf16(y16[at])));
        }
        row[c] = v;
        const double got = plain.x[static_cast<std::size_t>(t) * m.h + c];
        worst_x = std::max(worst_x, std::abs(got - v) / (1.0 + std::abs(v)));
      }
      if (!m.with_norm)
        continue;
      const auto want = host_norm(row, nw, eps);
      for (int c = 0; c < m.h; ++c) {
        const double got = from_bf16(plain.normed[static_cast<std::size_t>(t) * m.h + c]);
        worst_norm = std::max(worst_norm, std::abs(got - want[c]) / (1.0 + std::abs(want[c])));
      }
    }
    EXPECT_LT(worst_x, 1e-5) << "the mix into the residual";
    if (m.with_norm) {
      EXPECT_LT(worst_norm, 1.0 / 128) << "the normed row (one bf16 rounding)";
      EXPECT_GT(worst_norm, 0.0) << "bf16 rounds somewhere";
    }
  }
}

} // namespace
