// The routed experts' projections with the weights brought in whole tiles by cp.async.bulk
// (expert_mma_args::bulk, label gpu): against the host fp32 reference over a skewed routing (an
// expert of three 32-copy passes over one tile in shared memory, single copies, a quarter of
// the experts empty), by the non-empty list and by expert id (early: empty experts' stages are
// dropped), at the test shapes (up to 8 tiles a stage; a 96 KiB tile, two stages, its token
// rows reloaded per stage) and at Qwen3-30B-A3B's (gate_up 1536 x 2048: one 64 KiB tile a
// stage; down 2048 x 768: two tiles a stage); every element written, the same bits run to run;
// with the in-kernel sort, bucket's outputs and the same bits as bucket + bulk; refusals.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "expert_projection_fixture.hpp"
#include "gpu_fixture.hpp"
#include "gpu_kernel_fixture.hpp"
#include "moe_routing_fixture.hpp"
#include "runtime/bench/device_bucket.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace {

namespace kernels = refit::inference::kernels;
using refit::testing::device_vec;
using refit::testing::from_bf16;
using refit::testing::projection_case;
using refit::testing::projection_inputs;
using refit::testing::routed_copies;
using i64 = std::int64_t;

// y of one launch of `a` (bf16 [copies, cols], first set to NaN so an unwritten element shows).
std::vector<std::uint16_t> run(const kernels::expert_mma_args& a, std::size_t y_elems, int copies,
                               int experts) {
  device_vec<std::uint16_t> d_y(y_elems);
  EXPECT_EQ(cudaMemset(d_y.p, 0xff, d_y.n * 2), cudaSuccess);
  kernels::expert_mma_args with_y = a;
  with_y.y = d_y.p;
  kernels::expert_mma(with_y, copies, experts, kernels::expert_mma_ksplit(a, copies, experts, 0),
                      nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d_y.host();
}

TEST(GpuExpertBulk, MatchesTheHostReferenceByListAndById) {
  REQUIRE_GPUS(1);
  const routed_copies r({0});
  constexpr int tokens = routed_copies::tokens, experts = routed_copies::experts;
  constexpr int copies = routed_copies::copies;
  ASSERT_GT(r.want.counts[0], 64); // three passes over expert 0's tiles
  int compared = 0;
  for (const projection_case pc :
       {projection_case{256, 512, true}, projection_case{512, 256, false},
        projection_case{48, 128, false}, projection_case{32, 3072, false},
        projection_case{1536, 2048, true}, projection_case{2048, 768, false}}) {
    projection_inputs in(pc, tokens, experts, r.ids, r.want, r.d, 25);
    kernels::expert_mma_args& a = in.a;
    a.stages = 4;
    a.max_chunks = 2;
    a.bulk = true;
    ASSERT_TRUE(kernels::expert_bulk_fits(a)) << pc.rows << " x " << pc.k;
    const std::size_t y_elems = std::size_t(copies) * (pc.glu ? pc.rows / 2 : pc.rows);
    for (const bool early : {false, true}) {
      a.early = early;
      const std::string where = "rows " + std::to_string(pc.rows) + " k " + std::to_string(pc.k)
                                + " glu " + std::to_string(pc.glu) + " early "
                                + std::to_string(early);
      const auto y = run(a, y_elems, copies, experts);
      double worst = 0;
      for (std::size_t i = 0; i < y.size(); ++i) {
        const double got = from_bf16(y[i]);
        ASSERT_TRUE(std::isfinite(got)) << "element " << i << " unwritten, " << where;
        worst = std::max(worst, std::abs(got - in.reference[i]) / (std::abs(in.reference[i]) + 0.05));
      }
      EXPECT_LT(worst, 0.02) << where;
      EXPECT_TRUE(run(a, y_elems, copies, experts) == y) << "not the same bits again, " << where;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 12);
}

// gate_up sorting the copies itself (by id), then down, all bulk: bucket's counts, offsets,
// inverse and loads, and bitwise the activations and outputs of bucket + the same kernels.
TEST(GpuExpertBulk, TheInKernelSortGivesBucketsListsAndTheSameBits) {
  REQUIRE_GPUS(1);
  const routed_copies r({0});
  constexpr int tokens = routed_copies::tokens, experts = routed_copies::experts;
  constexpr int copies = routed_copies::copies, top_k = routed_copies::top_k;
  constexpr int hidden = 256, inter = 256;
  const device_vec<std::uint16_t> x(refit::testing::random_bf16(std::size_t(tokens) * hidden, 61, 1.0f));
  const device_vec<std::uint16_t> w13(refit::testing::random_bf16(
    std::size_t(experts) * 2 * inter * hidden, 62, 1.0f / std::sqrt(float(hidden))));
  const device_vec<std::uint16_t> w2(refit::testing::random_bf16(
    std::size_t(experts) * hidden * inter, 63, 1.0f / std::sqrt(float(inter))));
  refit::bench::device_bucket self(0, copies, experts, {5, 7});
  CUDA_OK(cudaMemset(self.counts.p, 0xff, self.counts.n * 8));
  CUDA_OK(cudaMemset(self.offsets.p, 0xff, self.offsets.n * 4));
  CUDA_OK(cudaMemset(self.inverse.p, 0xff, self.inverse.n * 8));
  const auto both = [&](bool in_kernel) {
    const refit::bench::device_bucket& lists = in_kernel ? self : r.d;
    device_vec<std::uint16_t> act(std::size_t(copies) * inter), ys(std::size_t(copies) * hidden);
    kernels::expert_mma_args up;
    up.x = x.p;
    up.x_rows = r.d.src_token.p;
    up.w = w13.p;
    up.rows = 2 * inter;
    up.k = hidden;
    up.glu = true;
    up.max_chunks = 2;
    up.stages = 4;
    up.early = true;
    up.bulk = true;
    up.active = r.d.active.p;
    up.active_count = r.d.active.p + experts;
    up.counts = lists.counts.p;
    up.offsets = lists.offsets.p;
    up.y = act.p;
    kernels::expert_mma_args down = up;
    down.x = act.p;
    down.x_rows = nullptr;
    down.w = w2.p;
    down.rows = hidden;
    down.k = inter;
    down.glu = false;
    down.y = ys.p;
    if (in_kernel) {
      up.sort.ids = r.d_ids.p;
      up.sort.copies = copies;
      up.sort.top_k = top_k;
      up.sort.out = self.out();
    }
    kernels::expert_mma(up, copies, experts, 1, nullptr);
    kernels::expert_mma(down, copies, experts, 1, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return std::make_pair(act.host(), ys.host());
  };
  const auto by_bucket = both(false);
  const auto in_kernel = both(true);
  i64 used = 0;
  for (i64 c : r.want.counts)
    used += c > 0 ? 1 : 0;
  EXPECT_EQ(self.counts.host(), r.want.counts);
  EXPECT_EQ(self.offsets.host(), r.want.offsets);
  EXPECT_EQ(self.inverse.host(), r.want.inverse);
  EXPECT_EQ(self.loads.host(), (std::vector<i64>{5 + used, 7 + used}));
  EXPECT_TRUE(in_kernel.first == by_bucket.first) << "activations differ";
  EXPECT_TRUE(in_kernel.second == by_bucket.second) << "down's output differs";
}

TEST(GpuExpertBulk, WhatItCannotTakeIsRefusedByName) {
  REQUIRE_GPUS(1);
  kernels::expert_mma_args a;
  a.rows = 64;
  a.k = 256;
  a.stages = 4;
  a.max_chunks = 2;
  a.bulk = true;
  a.persistent = true;
  try {
    kernels::expert_mma(a, 8, 8, 1, nullptr);
    ADD_FAILURE() << "bulk and persistent accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("bulk and persistent"), std::string::npos) << e.what();
  }
  a.persistent = false;
  a.k = 4096 + 1024; // a 160 KiB tile: no ring of two stages
  EXPECT_FALSE(kernels::expert_bulk_fits(a));
  try {
    kernels::expert_mma(a, 8, 8, 1, nullptr);
    ADD_FAILURE() << "k 5120 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("k 5120 do not fit"), std::string::npos) << e.what();
  }
  a.k = 256;
  EXPECT_TRUE(kernels::expert_bulk_fits(a));
  CUDA_OK(cudaDeviceSynchronize());
}

} // namespace
