// kernels::add_norm_route (label gpu): the residual add + post-attention norm + routing in one
// kernel writes x and h bit for bit as add_rms_norm does, and routes as a host double reference
// of the router over the fp32 norm routes (ids wherever the k-th and k+1-th logits are not a
// near tie, weights to 1e-5); at cluster sizes 1, 2 (a partial block of experts) and 4, token
// counts off the cluster's 4, bf16 and fp32 residual inputs; then the refusals.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <stdexcept>
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

struct shape {
  int n, hidden, experts, top_k;
  bool y_f32, renormalize;
};

std::vector<float> random_f32(std::size_t n, std::uint32_t seed, float scale) {
  const auto b = random_bf16(n, seed, scale);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = from_bf16(b[i]) + scale * 1e-3f * static_cast<float>(i % 7); // off the bf16 grid
  return v;
}

// The host's routing of one token from double logits: ids by descending probability (ties:
// lower id), their probabilities (renormalized when asked), and the k-th / k+1-th logit gap.
struct host_route {
  std::vector<std::int64_t> ids;
  std::vector<double> weights;
  double gap = 0;
};

host_route route_host(const std::vector<double>& logits, int top_k, bool renormalize) {
  const int e = static_cast<int>(logits.size());
  std::vector<int> order(static_cast<std::size_t>(e));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return logits[std::size_t(a)] > logits[std::size_t(b)]; });
  const double mx = logits[std::size_t(order[0])];
  double sum = 0;
  for (double l : logits)
    sum += std::exp(l - mx);
  host_route r;
  double total = 0;
  for (int k = 0; k < top_k; ++k) {
    r.ids.push_back(order[std::size_t(k)]);
    r.weights.push_back(std::exp(logits[std::size_t(order[std::size_t(k)])] - mx) / sum);
    total += r.weights.back();
  }
  if (renormalize)
    for (double& w : r.weights)
      w /= total;
  r.gap = top_k < e ? logits[std::size_t(order[std::size_t(top_k - 1)])]
                        - logits[std::size_t(order[std::size_t(top_k)])]
                    : 1.0;
  return r;
}

void expect_routes(const shape& s) {
  SCOPED_TRACE("n " + std::to_string(s.n) + " hidden " + std::to_string(s.hidden) + " experts "
               + std::to_string(s.experts) + " top " + std::to_string(s.top_k)
               + (s.y_f32 ? " fp32 y" : " bf16 y"));
  ASSERT_TRUE(kernels::add_norm_route_supported(s.n, s.hidden, s.experts, s.top_k));
  const std::size_t rows = std::size_t(s.n) * std::size_t(s.hidden);
  const std::vector<float> x = random_f32(rows, 3, 2.0f);
  const std::vector<float> y32 = random_f32(rows, 4, 1.0f);
  const std::vector<std::uint16_t> y16 = random_bf16(rows, 4, 1.0f);
  std::vector<std::uint16_t> norm_w = random_bf16(std::size_t(s.hidden), 5, 0.5f);
  for (auto& w : norm_w) // around 1, as trained norms are
    w = refit::testing::to_bf16(1.0f + from_bf16(w));
  const std::vector<std::uint16_t> router =
    random_bf16(std::size_t(s.experts) * std::size_t(s.hidden), 6,
                3.0f / std::sqrt(static_cast<float>(s.hidden)));
  const device_vec<float> d_y32(y32);
  const device_vec<std::uint16_t> d_y16(y16), d_norm(norm_w), d_router(router);
  const void* y = s.y_f32 ? static_cast<const void*>(d_y32.p) : d_y16.p;

  device_vec<float> x_fused(x), x_ref(x);
  device_vec<std::uint16_t> h_fused(rows), h_ref(rows);
  device_vec<std::int64_t> ids(std::size_t(s.n) * std::size_t(s.top_k));
  device_vec<float> weights(std::size_t(s.n) * std::size_t(s.top_k));
  kernels::add_norm_route_args a;
  a.x = x_fused.p;
  a.y = y;
  a.y_f32 = s.y_f32;
  a.norm_w = d_norm.p;
  a.router_w = d_router.p;
  a.h = h_fused.p;
  a.ids = ids.p;
  a.weights = weights.p;
  a.n = s.n;
  a.hidden = s.hidden;
  a.experts = s.experts;
  a.top_k = s.top_k;
  a.renormalize = s.renormalize;
  a.eps = 1e-6f;
  kernels::add_norm_route(a, nullptr);
  kernels::add_rms_norm(x_ref.p, y, d_norm.p, h_ref.p, s.n, s.hidden, 1e-6f, nullptr, nullptr,
                        s.y_f32);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> xf = x_fused.host(), xr = x_ref.host();
  EXPECT_EQ(0, std::memcmp(xf.data(), xr.data(), rows * sizeof(float)))
    << "x differs from add_rms_norm's";
  EXPECT_TRUE(h_fused.host() == h_ref.host()) << "h differs from add_rms_norm's";

  const std::vector<std::int64_t> got_ids = ids.host();
  const std::vector<float> got_w = weights.host();
  int near_ties = 0;
  for (int t = 0; t < s.n; ++t) {
    // The fp32 norm as the device computes it (x + y in fp32), the rest in double.
    std::vector<double> f(std::size_t(s.hidden));
    double ss = 0;
    for (int c = 0; c < s.hidden; ++c) {
      const std::size_t at = std::size_t(t) * std::size_t(s.hidden) + std::size_t(c);
      const float v = x[at] + (s.y_f32 ? y32[at] : from_bf16(y16[at]));
      ASSERT_EQ(v, xr[at]);
      f[std::size_t(c)] = v;
      ss += double(v) * double(v);
    }
    const double r = 1.0 / std::sqrt(ss / s.hidden + 1e-6);
    std::vector<double> logits(std::size_t(s.experts), 0.0);
    for (int e = 0; e < s.experts; ++e)
      for (int c = 0; c < s.hidden; ++c)
        logits[std::size_t(e)] += f[std::size_t(c)] * r * from_bf16(norm_w[std::size_t(c)])
                                  * from_bf16(router[std::size_t(e) * s.hidden + std::size_t(c)]);
    const host_route want = route_host(logits, s.top_k, s.renormalize);
    if (want.gap < 1e-4) {
      ++near_ties;
      continue;
    }
    for (int k = 0; k < s.top_k; ++k) {
      const std::size_t at = std::size_t(t) * std::size_t(s.top_k) + std::size_t(k);
      EXPECT_EQ(got_ids[at], want.ids[std::size_t(k)]) << "token " << t << " choice " << k;
      EXPECT_NEAR(got_w[at], want.weights[std::size_t(k)], 1e-5) << "token " << t << " choice "
                                                                  << k;
    }
  }
  EXPECT_LE(near_ties, 1 + s.n / 16) << "the test's routing should rarely be a near tie";
}

TEST(GpuRouterKernels, AddNormRouteWritesAddRmsNormsBitsAndRoutesAsTheHostReference) {
  REQUIRE_GPUS(1);
  for (const shape& s : {shape{64, 2048, 128, 8, true, true}, shape{70, 2048, 128, 8, false, true},
                         shape{1, 2048, 128, 8, true, false}, shape{7, 256, 16, 4, true, true},
                         shape{13, 264, 40, 3, false, false}})
    expect_routes(s);
}

TEST(GpuRouterKernels, AddNormRouteRefusesShapesItCannotTake) {
  REQUIRE_GPUS(1);
  EXPECT_FALSE(kernels::add_norm_route_supported(4, 12, 16, 2));   // hidden % 8
  EXPECT_FALSE(kernels::add_norm_route_supported(4, 16384, 16, 2)); // hidden > 8192
  EXPECT_FALSE(kernels::add_norm_route_supported(4, 256, 300, 2));  // experts > 256
  EXPECT_FALSE(kernels::add_norm_route_supported(0, 256, 16, 2));   // no tokens
  EXPECT_FALSE(kernels::add_norm_route_supported(4, 256, 16, 17));  // top_k > experts
  kernels::add_norm_route_args a;
  a.n = 4;
  a.hidden = 12;
  a.experts = 16;
  a.top_k = 2;
  try {
    kernels::add_norm_route(a, nullptr);
    ADD_FAILURE() << "hidden 12 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("hidden 12"), std::string::npos) << e.what();
  }
}

} // namespace
