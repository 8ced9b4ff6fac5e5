// The preloading GEMM of the bf16 engine's dense projections (kernels::preload_gemm: qkv, o_proj
// and the router's two parts past dense_mma's rows) on a GPU (label gpu), alone: every compiled
// block shape at every cluster size its k allows, token counts inside and across the 8-row
// tiles, bf16 and fp32 out, against a host fp64 reference over the same bf16 inputs; every
// element written and the same bits run to run; two launches chained through a CUDA graph
// (the second's early weight copies overlapping the first) equal to the same two launched
// eagerly; after a mix that lets it start before the mix's wait, it reads the mix's output;
// ragged tilings (the last tile of rows partly past n) writing nothing past n; the model shapes
// planned where the device holds their grid; bad shapes and plans refused by name.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iostream>
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

// y[i][r] = sum_c (x[i][c] (+ lo[i][c])) w[r][c], in double.
std::vector<double> host_gemm(const std::vector<std::uint16_t>& x,
                              const std::vector<std::uint16_t>* lo,
                              const std::vector<std::uint16_t>& w, int m, int n, int k) {
  std::vector<double> xs(static_cast<std::size_t>(m) * k);
  for (std::size_t i = 0; i < xs.size(); ++i)
    xs[i] = from_bf16(x[i]) + (lo != nullptr ? from_bf16((*lo)[i]) : 0.0);
  std::vector<double> wd(w.size());
  for (std::size_t i = 0; i < w.size(); ++i)
    wd[i] = from_bf16(w[i]);
  std::vector<double> y(static_cast<std::size_t>(m) * n);
  for (int i = 0; i < m; ++i)
    for (int r = 0; r < n; ++r) {
      const double* xr = xs.data() + static_cast<std::size_t>(i) * k;
      const double* wr = wd.data() + static_cast<std::size_t>(r) * k;
      double acc = 0;
      for (int c = 0; c < k; ++c)
        acc += xr[c] * wr[c];
      y[static_cast<std::size_t>(i) * n + r] = acc;
    }
  return y;
}

// The output as doubles and as raw bits (NaN where the kernel wrote nothing: the buffer starts
// all ones).
struct output {
  std::vector<double> values;
  std::vector<std::uint32_t> bits;
};

// The first `elements` of the output's bytes as copied to the host.
output read_output(const std::vector<std::uint8_t>& raw, std::size_t elements, bool f32) {
  output o;
  o.values.resize(elements);
  o.bits.resize(elements);
  for (std::size_t i = 0; i < elements; ++i) {
    if (f32) {
      float f;
      std::memcpy(&f, raw.data() + 4 * i, 4);
      std::memcpy(&o.bits[i], &f, 4);
      o.values[i] = f;
    } else {
      std::uint16_t h;
      std::memcpy(&h, raw.data() + 2 * i, 2);
      o.bits[i] = h;
      o.values[i] = from_bf16(h);
    }
  }
  return o;
}

// The worst error against the reference, relative (fp32: to 1 + |ref|; bf16: to |ref| + 0.05,
// one rounding of the output), failing on an element left unwritten.
double worst_error(const output& o, const std::vector<double>& reference, bool f32,
                   const std::string& where) {
  double worst = 0;
  for (std::size_t i = 0; i < reference.size(); ++i) {
    if (!std::isfinite(o.values[i])) {
      ADD_FAILURE() << "element " << i << " unwritten, " << where;
      return 1e9;
    }
    const double err = f32 ? std::abs(o.values[i] - reference[i]) / (1.0 + std::abs(reference[i]))
                           : std::abs(o.values[i] - reference[i]) / (std::abs(reference[i]) + 0.05);
    worst = std::max(worst, err);
  }
  return worst;
}

// The arguments of y [m, n] = (x (+ lo)) [m, k] . w [n, k]^T.
kernels::preload_gemm_args gemm_args(const void* x, const void* w, void* y, int m, int n, int k,
                                     bool y_f32 = false, const void* lo = nullptr) {
  kernels::preload_gemm_args a;
  a.x = x;
  a.x_lo = lo;
  a.w = w;
  a.y = y;
  a.m = m;
  a.n = n;
  a.k = k;
  a.y_f32 = y_f32;
  return a;
}

struct gemm_case {
  int shape, n, k;
  bool two_parts;
};

// Each shape at each cluster size (k / the shape's k a block) it can take with a few tiles of
// rows: 0 (160 x 512), 1 (128 x 512), 2 (16 x 256, two parts), 3 (32 x 128), 4 (16 x 128, two
// parts), 5 (320 x 256), 6 (352 x 256); and ragged, n not a multiple of the tile's rows (the
// last tile 16 to 176 rows short, at every cluster size). The output buffer runs on past m x n,
// and nothing may be written there.
TEST(GpuPreloadGemm, MatchesTheHostReferenceForEveryShapeClusterSizeAndTokenCount) {
  REQUIRE_GPUS(1);
  int runs = 0;
  for (const gemm_case c :
       {gemm_case{0, 320, 1024, false}, gemm_case{0, 160, 2048, false},
        gemm_case{0, 480, 4096, false}, gemm_case{1, 256, 1024, false},
        gemm_case{1, 128, 2048, false}, gemm_case{1, 384, 4096, false},
        gemm_case{2, 32, 512, true}, gemm_case{2, 16, 1024, true}, gemm_case{2, 128, 2048, true},
        gemm_case{3, 96, 256, false}, gemm_case{3, 64, 512, false},
        gemm_case{3, 32, 1024, false}, gemm_case{4, 16, 256, true}, gemm_case{4, 48, 512, true},
        gemm_case{4, 16, 1024, true}, gemm_case{5, 320, 512, false},
        gemm_case{5, 640, 1024, false}, gemm_case{5, 320, 2048, false},
        gemm_case{6, 352, 512, false}, gemm_case{6, 704, 1024, false},
        gemm_case{6, 368, 2048, false}, gemm_case{6, 528, 512, false},
        gemm_case{0, 176, 1024, false}, gemm_case{0, 336, 4096, false},
        gemm_case{1, 272, 2048, false}, gemm_case{3, 80, 512, false}}) {
    const auto w = random_bf16(static_cast<std::size_t>(c.n) * c.k, 17 + c.n + c.k,
                               1.0f / std::sqrt(float(c.k)));
    device_vec<std::uint16_t> d_w(w);
    for (const int m : {1, 7, 16, 17, 33, 64}) {
      const std::string where = "shape " + std::to_string(c.shape) + " n " + std::to_string(c.n)
                                + " k " + std::to_string(c.k) + " m " + std::to_string(m)
                                + (c.two_parts ? " two parts" : "");
      const kernels::preload_gemm_plan plan =
        kernels::plan_preload_gemm(m, c.n, c.k, c.two_parts, c.shape);
      ASSERT_EQ(plan.shape, c.shape)
        << "no plan for " << where << ": " << kernels::preload_gemm_candidates(m, c.n, c.k, c.two_parts);
      EXPECT_EQ(plan.tiles * plan.split > 0, true) << where;
      EXPECT_GE(plan.token_tiles * 8, m) << where;
      const auto x = random_bf16(static_cast<std::size_t>(m) * c.k, 3 + m, 1.0f);
      const auto lo = random_bf16(static_cast<std::size_t>(m) * c.k, 5 + m, 1.0f / 256);
      const auto reference = host_gemm(x, c.two_parts ? &lo : nullptr, w, m, c.n, c.k);
      device_vec<std::uint16_t> d_x(x), d_lo(lo);
      for (const bool f32 : {false, true}) {
        ++runs;
        kernels::preload_gemm_args a = gemm_args(d_x.p, d_w.p, nullptr, m, c.n, c.k, f32,
                                                 c.two_parts ? d_lo.p : nullptr);
        std::vector<std::uint32_t> first;
        for (int rep = 0; rep < 2; ++rep) {
          const std::size_t bytes = reference.size() * (f32 ? 4 : 2);
          constexpr std::size_t guard = 4096; // past m x n: a ragged tile's rows must not land
          device_vec<std::uint8_t> d_y(bytes + guard);
          CUDA_OK(cudaMemset(d_y.p, 0xff, bytes + guard));
          a.y = d_y.p;
          kernels::preload_gemm(a, plan, nullptr);
          CUDA_OK(cudaDeviceSynchronize()) << where;
          const auto raw = d_y.host();
          const output o = read_output(raw, reference.size(), f32);
          EXPECT_TRUE(std::all_of(raw.begin() + static_cast<std::ptrdiff_t>(bytes), raw.end(),
                                  [](std::uint8_t b) { return b == 0xff; }))
            << "written past m x n, " << where;
          EXPECT_LT(worst_error(o, reference, f32, where), f32 ? 1e-4 : 0.02)
            << where << (f32 ? " fp32" : " bf16");
          if (rep == 0)
            first = o.bits;
          else
            EXPECT_EQ(o.bits, first) << "a second run differs, " << where;
        }
      }
    }
  }
  EXPECT_EQ(runs, 26 * 6 * 2);
}

// Qwen3-30B-A3B's decode projections at batch 64: qkv in 32 clusters of 4 (shape 0), or where the
// device does not hold 32 of those, 16 clusters of 8 (shape 5), or else 15 of 8 with the last
// tile ragged (shape 6); o_proj in 16 clusters of 8 (shape 1), or else 13 ragged clusters of 8
// of shape 0; the router's two parts in 8 clusters of 8 (shape 2). Each only where the device
// holds its grid in one wave by CUDA's count (cudaOccupancyMaxActiveClusters), and no plan
// otherwise (the engine takes cuBLAS): how the SMs are spread over GPCs decides, not their number
// (measured on 132-SM parts: an H200 held 30 clusters of 4 and 15 of 8, an H100 no more, both 45
// of the router's). More than 64 rows has no plan.
TEST(GpuPreloadGemm, TheModelShapesArePlannedWhereTheDeviceHoldsOneWave) {
  REQUIRE_GPUS(1);
  const int qkv_by_4 = kernels::preload_gemm_resident_clusters(0, 64, false, 4);
  const int qkv_by_8 = kernels::preload_gemm_resident_clusters(5, 64, false, 8);
  const int o_proj_by_8 = kernels::preload_gemm_resident_clusters(1, 64, false, 8);
  const int qkv_ragged_by_8 = kernels::preload_gemm_resident_clusters(6, 64, false, 8);
  const int o_proj_ragged_by_8 = kernels::preload_gemm_resident_clusters(0, 64, false, 8);
  const int router_by_8 = kernels::preload_gemm_resident_clusters(2, 64, true, 8);
  std::cout << "[ measured ] resident clusters: qkv shape 0 of 4 " << qkv_by_4
            << ", qkv shape 5 of 8 " << qkv_by_8 << ", o_proj shape 1 of 8 " << o_proj_by_8
            << ", router shape 2 of 8 " << router_by_8 << ", qkv shape 6 of 8 " << qkv_ragged_by_8
            << ", o_proj shape 0 of 8 " << o_proj_ragged_by_8
            << "\n[ measured ] qkv: " << kernels::preload_gemm_candidates(64, 5120, 2048, false)
            << "\n[ measured ] o_proj: " << kernels::preload_gemm_candidates(64, 2048, 4096, false)
            << "\n[ measured ] router: " << kernels::preload_gemm_candidates(64, 128, 2048, true)
            << "\n";
  // Every compiled kernel of one block an SM: at least one cluster of each size fits a device.
  EXPECT_GT(qkv_by_4, 0);
  EXPECT_GT(qkv_by_8, 0);
  EXPECT_GT(o_proj_by_8, 0);
  EXPECT_GT(router_by_8, 0);
  EXPECT_GT(qkv_ragged_by_8, 0);
  EXPECT_GT(o_proj_ragged_by_8, 0);
  // Shapes or splits that were not compiled have no count.
  EXPECT_EQ(kernels::preload_gemm_resident_clusters(0, 64, true, 4), 0);  // no two-part shape 0
  EXPECT_EQ(kernels::preload_gemm_resident_clusters(2, 64, false, 8), 0); // no one-part shape 2
  EXPECT_EQ(kernels::preload_gemm_resident_clusters(0, 64, false, 3), 0);
  EXPECT_EQ(kernels::preload_gemm_resident_clusters(0, 65, false, 4), 0);
  EXPECT_EQ(kernels::preload_gemm_resident_clusters(7, 64, false, 4), 0); // no shape 7

  // A projection's tilings in the planner's order of preference, each with the clusters the
  // device holds of it: the plan is the first whose tiles (one cluster each) fit, or none.
  struct tiling {
    int held, shape, split, tiles;
  };
  const auto expect_first_fit = [](const std::string& name, int n, int k, bool two_parts,
                                   std::initializer_list<tiling> preferred) {
    const auto p = kernels::plan_preload_gemm(64, n, k, two_parts);
    const std::string what = name + ", " + kernels::preload_gemm_candidates(64, n, k, two_parts);
    for (const tiling& t : preferred)
      if (t.held >= t.tiles) {
        EXPECT_EQ(p.shape, t.shape) << what;
        EXPECT_EQ(p.split, t.split) << what;
        EXPECT_EQ(p.tiles, t.tiles) << what;
        EXPECT_EQ(p.token_tiles, 8) << what;
        return;
      }
    EXPECT_EQ(p.shape, -1) << what;
  };
  expect_first_fit("qkv", 5120, 2048, false,
                   {{qkv_by_4, 0, 4, 32}, {qkv_by_8, 5, 8, 16}, {qkv_ragged_by_8, 6, 8, 15}});
  // Each shape asked for alone: a plan exactly where its grid fits.
  EXPECT_EQ(kernels::plan_preload_gemm(64, 5120, 2048, false, 0).shape, qkv_by_4 >= 32 ? 0 : -1);
  EXPECT_EQ(kernels::plan_preload_gemm(64, 5120, 2048, false, 5).shape, qkv_by_8 >= 16 ? 5 : -1);
  EXPECT_EQ(kernels::plan_preload_gemm(64, 5120, 2048, false, 6).shape,
            qkv_ragged_by_8 >= 15 ? 6 : -1);
  expect_first_fit("o_proj", 2048, 4096, false,
                   {{o_proj_by_8, 1, 8, 16}, {o_proj_ragged_by_8, 0, 8, 13}});
  expect_first_fit("router", 128, 2048, true, {{router_by_8, 2, 8, 8}});
  EXPECT_EQ(kernels::plan_preload_gemm(65, 5120, 2048, false).shape, -1);
  EXPECT_EQ(kernels::plan_preload_gemm(64, 5120, 2048, true).shape, -1); // no two-part qkv shape
  EXPECT_EQ(kernels::plan_preload_gemm(64, 5000, 2048, false).shape, -1); // n not a multiple of 16
}

// y1 = x . w1^T (bf16), y2 = y1 . w2^T (fp32): the second launch reads the first's output after
// its wait while its weight copies may run beside the first. Captured in a CUDA graph and
// replayed, the same bits as launched eagerly, and the reference's values.
TEST(GpuPreloadGemm, TwoChainedLaunchesInACudaGraphEqualTheEagerOnes) {
  REQUIRE_GPUS(1);
  const int m = 64, k1 = 1024, n1 = 1024, n2 = 256;
  const auto x = random_bf16(static_cast<std::size_t>(m) * k1, 31, 1.0f);
  const auto w1 = random_bf16(static_cast<std::size_t>(n1) * k1, 32, 1.0f / 32);
  const auto w2 = random_bf16(static_cast<std::size_t>(n2) * n1, 33, 1.0f / 32);
  device_vec<std::uint16_t> d_x(x), d_w1(w1), d_w2(w2);
  device_vec<std::uint16_t> d_y1(static_cast<std::size_t>(m) * n1);
  const auto p1 = kernels::plan_preload_gemm(m, n1, k1, false);
  const auto p2 = kernels::plan_preload_gemm(m, n2, n1, false);
  ASSERT_GE(p1.shape, 0);
  ASSERT_GE(p2.shape, 0);
  const kernels::preload_gemm_args a1 = gemm_args(d_x.p, d_w1.p, d_y1.p, m, n1, k1);
  kernels::preload_gemm_args a2 = gemm_args(d_y1.p, d_w2.p, nullptr, m, n2, n1, true);
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::size_t bytes = static_cast<std::size_t>(m) * n2 * 4;
  device_vec<std::uint8_t> eager(bytes), replayed(bytes);
  CUDA_OK(cudaMemset(eager.p, 0xff, bytes));
  CUDA_OK(cudaMemset(replayed.p, 0xff, bytes));
  CUDA_OK(cudaDeviceSynchronize()); // the memsets ran on the legacy stream
  a2.y = eager.p;
  kernels::preload_gemm(a1, p1, s);
  kernels::preload_gemm(a2, p2, s);
  CUDA_OK(cudaStreamSynchronize(s));
  const auto y1_eager = d_y1.host();
  CUDA_OK(cudaMemset(d_y1.p, 0xff, d_y1.n * 2));
  CUDA_OK(cudaDeviceSynchronize());
  a2.y = replayed.p;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  kernels::preload_gemm(a1, p1, s);
  kernels::preload_gemm(a2, p2, s);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i)
    CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  const output e = read_output(eager.host(), static_cast<std::size_t>(m) * n2, true);
  const output r = read_output(replayed.host(), static_cast<std::size_t>(m) * n2, true);
  EXPECT_EQ(d_y1.host(), y1_eager) << "the first projection differs in the graph";
  EXPECT_EQ(r.bits, e.bits) << "the graph's chained launches differ from the eager ones";
  // The second against a host reference over the first's bf16 output.
  EXPECT_LT(worst_error(e, host_gemm(y1_eager, nullptr, w2, m, n2, n1), true, "chained"), 1e-4);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(s));
}

// The engine's layer boundary with the mix's early trigger (REFIT_MIX_TRIGGER_EARLY): the mix
// of 64 tokens' 8 expert rows into the residual with the next norm, then qkv on this GEMM over
// the normed rows, captured in a CUDA graph. The GEMM's blocks may start before the mix waits;
// they must still read the mix's output, not what the buffer held before (NaN here): the result
// equals a host product over the normed rows read back, replay after replay.
TEST(GpuPreloadGemm, AfterAMixThatTriggersEarlyItReadsTheMixOutput) {
  REQUIRE_GPUS(1);
  const int n = 64, top_k = 8, h = 2048, rows = 640;
  const float eps = 1e-6f;
  std::mt19937 rng(41);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<float> y(static_cast<std::size_t>(n) * top_k * h), x0(static_cast<std::size_t>(n) * h),
    weights(static_cast<std::size_t>(n) * top_k);
  for (auto& v : y)
    v = u(rng);
  for (auto& v : x0)
    v = 4 * u(rng);
  for (auto& v : weights)
    v = u(rng) + 0.5f;
  std::vector<std::int64_t> inverse(static_cast<std::size_t>(n) * top_k);
  std::iota(inverse.begin(), inverse.end(), std::int64_t{0});
  std::shuffle(inverse.begin(), inverse.end(), rng);
  const auto norm_w = random_bf16(static_cast<std::size_t>(h), 42, 1.5f);
  const auto w = random_bf16(static_cast<std::size_t>(rows) * h, 43, 1.0f / 45);
  device_vec<float> d_y(y), d_x(x0), d_weights(weights);
  device_vec<std::int64_t> d_inv(inverse);
  device_vec<std::uint16_t> d_nw(norm_w), d_w(w), d_normed(static_cast<std::size_t>(n) * h);
  device_vec<std::uint8_t> d_out(static_cast<std::size_t>(n) * rows * 2);
  const auto plan = kernels::plan_preload_gemm(n, rows, h, false);
  ASSERT_GE(plan.shape, 0) << kernels::preload_gemm_candidates(n, rows, h, false);
  const kernels::preload_gemm_args a = gemm_args(d_normed.p, d_w.p, d_out.p, n, rows, h);
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const auto layer = [&] {
    kernels::mix_experts(d_y.p, d_inv.p, d_weights.p, d_x.p, n, top_k, h, d_nw.p, d_normed.p,
                         eps, s, /*y_f32=*/true, /*early=*/true, /*trigger_early=*/true);
    kernels::preload_gemm(a, plan, s);
  };
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  layer();
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<std::uint32_t> first;
  for (int rep = 0; rep < 3; ++rep) {
    const std::string where = "replay " + std::to_string(rep);
    CUDA_OK(cudaMemcpy(d_x.p, x0.data(), x0.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_normed.p, 0xff, d_normed.n * 2)); // NaN until the mix writes it
    CUDA_OK(cudaMemset(d_out.p, 0xff, d_out.n));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    const auto normed = d_normed.host();
    const output o = read_output(d_out.host(), static_cast<std::size_t>(n) * rows, false);
    EXPECT_LT(worst_error(o, host_gemm(normed, nullptr, w, n, rows, h), false, where), 0.02)
      << where;
    if (rep == 0)
      first = o.bits;
    else
      EXPECT_EQ(o.bits, first) << "a replay differs, " << where;
  }
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(s));
}

// Shapes past the kernel and launches that do not match their plan are refused, naming what
// was wrong.
TEST(GpuPreloadGemm, BadShapesAndPlansAreRefusedByName) {
  REQUIRE_GPUS(1);
  EXPECT_EQ(kernels::plan_preload_gemm(0, 320, 1024, false).shape, -1);
  EXPECT_EQ(kernels::plan_preload_gemm(8, 320, 1000, false).shape, -1);
  EXPECT_EQ(kernels::plan_preload_gemm(8, 320, 1024, false, 7).shape, -1); // no shape 7
  EXPECT_EQ(kernels::plan_preload_gemm(8, 320, 1024, true, 0).shape, -1);  // shape 0: one part
  const auto plan = kernels::plan_preload_gemm(8, 320, 1024, false, 0);
  ASSERT_EQ(plan.shape, 0);
  device_vec<std::uint16_t> buf(static_cast<std::size_t>(64) * 1024);
  kernels::preload_gemm_args a = gemm_args(buf.p, buf.p, buf.p, 8, 320, 2048); // not the plan's k
  const auto refused = [&](const std::string& needle) {
    try {
      kernels::preload_gemm(a, plan, nullptr);
      ADD_FAILURE() << "accepted; expected a refusal naming '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused("not the plan's shape");
  a.k = 1024;
  a.m = 17; // past the plan's 16 rows
  refused("rows outside the plan's 1..16");
  a.m = 8;
  a.x_lo = buf.p; // a second part for a one-part plan
  refused("x_lo exactly for a two-part plan");
}

} // namespace
