// The bf16 engine's dense projections of a decode step (kernels::skinny_gemm: qkv, o_proj and
// the router at up to 64 token rows) on a GPU (label gpu), alone: against a host fp64
// reference over the same bf16 inputs at token counts inside and across the 16-row tile pairs,
// every k-split the shape allows, bf16 and fp32 out, the router's two input parts summed; the
// same bits run to run and the tile counters left at zero; bad shapes refused by name.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// y[i][r] = sum_c (x[i][c] (+ lo[i][c])) w[r][c], in double.
std::vector<double> host_gemm(const std::vector<std::uint16_t>& x,
                              const std::vector<std::uint16_t>* lo,
                              const std::vector<std::uint16_t>& w, int m, int n, int k) {
  std::vector<double> y(static_cast<std::size_t>(m) * n);
  for (int i = 0; i < m; ++i)
    for (int r = 0; r < n; ++r) {
      double acc = 0;
      for (int c = 0; c < k; ++c) {
        const auto xi = static_cast<std::size_t>(i) * k + c;
        double xv = from_bf16(x[xi]);
        if (lo != nullptr)
          xv += from_bf16((*lo)[xi]);
        acc += xv * from_bf16(w[static_cast<std::size_t>(r) * k + c]);
      }
      y[static_cast<std::size_t>(i) * n + r] = acc;
    }
  return y;
}

struct gemm_shape {
  int n, k;
};

// Every token count class (one row, inside a tile pair, one past a pair, a full 64), the
// router's shape (128 x 2048) with and without its low part, qkv- and o_proj-like shapes
// scaled down; every k-split from 1 to 16 that divides k into 64-wide stages.
TEST(GpuSkinnyGemm, MatchesTheHostReferenceAtEveryTokenCountAndKSplit) {
  REQUIRE_GPUS(1);
  int runs = 0;
  for (const gemm_shape sh : {gemm_shape{128, 2048}, gemm_shape{384, 512}, gemm_shape{64, 1024}}) {
    const auto w = random_bf16(static_cast<std::size_t>(sh.n) * sh.k, 17 + sh.n,
                               1.0f / std::sqrt(float(sh.k)));
    device_vec<std::uint16_t> d_w(w);
    const std::size_t ws_floats = kernels::skinny_gemm_workspace_floats(sh.n, 16);
    device_vec<float> d_ws(ws_floats);
    device_vec<int> d_counters(static_cast<std::size_t>(sh.n / 64));
    for (const int m : {1, 9, 16, 17, 33, 64}) {
      for (const bool two_parts : {false, true}) {
        if (two_parts && sh.n != 128)
          continue;
        const auto x = random_bf16(static_cast<std::size_t>(m) * sh.k, 3 + m, 1.0f);
        const auto lo = random_bf16(static_cast<std::size_t>(m) * sh.k, 5 + m, 1.0f / 256);
        const auto reference = host_gemm(x, two_parts ? &lo : nullptr, w, m, sh.n, sh.k);
        device_vec<std::uint16_t> d_x(x), d_lo(lo);
        ASSERT_TRUE(kernels::skinny_gemm_supported(m, sh.n, sh.k));
        const int automatic = kernels::skinny_gemm_ksplit(m, sh.n, sh.k, 0);
        EXPECT_TRUE(automatic >= 1 && automatic <= 16 && (automatic & (automatic - 1)) == 0)
          << automatic;
        for (int ks = 1; ks <= 16; ks *= 2) {
          if (kernels::skinny_gemm_ksplit(m, sh.n, sh.k, ks) != ks)
            continue;
          for (const bool f32 : {false, true}) {
            ++runs;
            const std::string where = "n " + std::to_string(sh.n) + " k " + std::to_string(sh.k)
                                      + " m " + std::to_string(m) + " ksplit "
                                      + std::to_string(ks) + (f32 ? " fp32" : " bf16")
                                      + (two_parts ? " two parts" : "");
            kernels::skinny_gemm_args a;
            a.x = d_x.p;
            a.x_lo = two_parts ? d_lo.p : nullptr;
            a.w = d_w.p;
            a.m = m;
            a.n = sh.n;
            a.k = sh.k;
            a.y_f32 = f32;
            a.workspace = d_ws.p;
            a.workspace_floats = ws_floats;
            a.counters = d_counters.p;
            // Twice into NaN-filled outputs: every element written, the same bits both times.
            std::vector<std::uint32_t> first;
            for (int rep = 0; rep < 2; ++rep) {
              const std::size_t bytes = reference.size() * (f32 ? 4 : 2);
              device_vec<std::uint8_t> d_y(bytes);
              CUDA_OK(cudaMemset(d_y.p, 0xff, bytes));
              a.y = d_y.p;
              kernels::skinny_gemm(a, ks, nullptr);
              CUDA_OK(cudaDeviceSynchronize()) << where;
              const auto raw = d_y.host();
              std::vector<std::uint32_t> bits(reference.size());
              double worst = 0;
              for (std::size_t i = 0; i < reference.size(); ++i) {
                double got;
                if (f32) {
                  float f;
                  std::memcpy(&f, raw.data() + 4 * i, 4);
                  std::memcpy(&bits[i], &f, 4);
                  got = f;
                } else {
                  std::uint16_t h;
                  std::memcpy(&h, raw.data() + 2 * i, 2);
                  bits[i] = h;
                  got = from_bf16(h);
                }
                ASSERT_TRUE(std::isfinite(got)) << "element " << i << " unwritten, " << where;
                const double err = f32 ? std::abs(got - reference[i]) / (1.0 + std::abs(reference[i]))
                                       : std::abs(got - reference[i]) / (std::abs(reference[i]) + 0.05);
                worst = std::max(worst, err);
              }
              EXPECT_LT(worst, f32 ? 1e-4 : 0.02) << where;
              if (rep == 0)
                first = bits;
              else
                EXPECT_EQ(bits, first) << "a second run differs, " << where;
            }
            const auto counters = d_counters.host();
            EXPECT_TRUE(std::all_of(counters.begin(), counters.end(), [](int c) { return c == 0; }))
              << "tile counters left non-zero, " << where;
          }
        }
      }
    }
  }
  EXPECT_GE(runs, 100);
}

// Shapes the kernel does not take, splits that do not divide k, and a split without its
// workspace are refused, naming what was wrong.
TEST(GpuSkinnyGemm, UnsupportedShapesAndSplitsAreRefused) {
  REQUIRE_GPUS(1);
  EXPECT_FALSE(kernels::skinny_gemm_supported(65, 128, 256));
  EXPECT_FALSE(kernels::skinny_gemm_supported(8, 100, 256));
  EXPECT_FALSE(kernels::skinny_gemm_supported(8, 128, 200));
  EXPECT_EQ(kernels::skinny_gemm_ksplit(65, 128, 256, 0), 0);
  EXPECT_EQ(kernels::skinny_gemm_ksplit(8, 128, 256, 8), 0); // 256 / 8 is not a 64-wide stage
  EXPECT_EQ(kernels::skinny_gemm_ksplit(8, 128, 256, 3), 0);
  kernels::skinny_gemm_args a;
  a.m = 65;
  a.n = 128;
  a.k = 256;
  try {
    kernels::skinny_gemm(a, 1, nullptr);
    ADD_FAILURE() << "65 rows accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("m 65"), std::string::npos) << e.what();
  }
  a.m = 8;
  try {
    kernels::skinny_gemm(a, 2, nullptr);
    ADD_FAILURE() << "ksplit 2 without a workspace accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("needs a workspace"), std::string::npos) << e.what();
  }
}

} // namespace
