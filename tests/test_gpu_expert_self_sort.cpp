// The gate_up kernel sorting the routed copies itself (expert_mma_args::sort, label gpu)
// instead of the bucket kernel before it: bucket's counts, offsets and inverse (against the
// host's stable counting sort) and its expert-load counts, and the same activations, then the
// same down projection, bit for bit, as bucket + expert_mma; at each staging and k-split and
// with resident warps (persistent: the block's counts, each warp's list; also with the stage
// copies by whole row segments), over a skewed routing (an expert of three 32-copy passes,
// single copies, a quarter empty); then the refusals.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu_fixture.hpp"
#include "gpu_kernel_fixture.hpp"
#include "moe_routing_fixture.hpp"
#include "runtime/bench/device_bucket.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace {

namespace kernels = refit::inference::kernels;
using refit::testing::device_vec;
using refit::testing::random_bf16;
using i64 = std::int64_t;

constexpr int tokens = 70, top_k = 4, experts = 32, copies = tokens * top_k;
constexpr int hidden = 256, inter = 256;

struct outputs {
  std::vector<std::uint16_t> act, ys;
};

TEST(GpuExpertSelfSort, GateUpSortsAsBucketDoesAndComputesTheSameBits) {
  REQUIRE_GPUS(1);
  const std::vector<i64> ids = refit::testing::skewed_routing(tokens, top_k, experts, 41);
  const refit::testing::sorted_copies want = refit::testing::host_bucket(ids, top_k, experts);
  ASSERT_GT(want.counts[0], 64);
  ASSERT_EQ(want.counts[std::size_t(experts - 1)], 0);
  const device_vec<i64> d_ids(ids);
  const refit::bench::device_bucket bucketed(0, copies, experts, {0});
  kernels::bucket(d_ids.p, copies, top_k, experts, bucketed.out(), nullptr);
  const device_vec<std::uint16_t> x(random_bf16(std::size_t(tokens) * hidden, 51, 1.0f));
  const device_vec<std::uint16_t> w13(
    random_bf16(std::size_t(experts) * 2 * inter * hidden, 52, 1.0f / std::sqrt(float(hidden))));
  const device_vec<std::uint16_t> w2(
    random_bf16(std::size_t(experts) * hidden * inter, 53, 1.0f / std::sqrt(float(inter))));
  i64 used = 0;
  for (i64 c : want.counts)
    used += c > 0 ? 1 : 0;
  int runs = 0;
  struct staging {
    int chunks, stages;
  };
  for (const staging st : {staging{2, 4}, staging{1, 4}, staging{4, 4}, staging{2, 8}})
    for (const int ksplit : {1, 2, 0}) { // 0: k-split 1, resident warps (persistent)
      const bool persistent = ksplit == 0;
      const std::string where = "chunks " + std::to_string(st.chunks) + " stages "
                                + std::to_string(st.stages) + " ksplit " + std::to_string(ksplit)
                                + (persistent ? " (persistent)" : "");
      // self: the sort's outputs, poisoned; loads start at 5 and 7.
      refit::bench::device_bucket self(0, copies, experts, {5, 7});
      CUDA_OK(cudaMemset(self.counts.p, 0xff, self.counts.n * 8));
      CUDA_OK(cudaMemset(self.offsets.p, 0xff, self.offsets.n * 4));
      CUDA_OK(cudaMemset(self.inverse.p, 0xff, self.inverse.n * 8));
      const auto run = [&](bool in_kernel, bool lines) {
        const refit::bench::device_bucket& lists = in_kernel ? self : bucketed;
        device_vec<std::uint16_t> act(std::size_t(copies) * inter), ys(std::size_t(copies) * hidden);
        kernels::expert_mma_args up;
        up.x = x.p;
        up.x_rows = bucketed.src_token.p; // unused when sorting in the kernel
        up.w = w13.p;
        up.rows = 2 * inter;
        up.k = hidden;
        up.glu = true;
        up.max_chunks = st.chunks;
        up.stages = st.stages;
        up.early = true;
        up.persistent = persistent;
        up.active = bucketed.active.p;
        up.active_count = bucketed.active.p + experts;
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
        up.line_copies = down.line_copies = lines;
        if (in_kernel) {
          up.sort.ids = d_ids.p;
          up.sort.copies = copies;
          up.sort.top_k = top_k;
          up.sort.out = self.out();
        }
        const int ks = persistent ? 1 : ksplit;
        EXPECT_EQ(kernels::expert_mma_ksplit(up, copies, experts, ks), ks) << where;
        kernels::expert_mma(up, copies, experts, ks, nullptr);
        kernels::expert_mma(down, copies, experts, ks, nullptr);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << where;
        return outputs{act.host(), ys.host()};
      };
      const outputs by_bucket = run(false, false);
      const outputs in_kernel = run(true, false);
      ++runs;
      EXPECT_EQ(self.counts.host(), want.counts) << where;
      EXPECT_EQ(self.offsets.host(), want.offsets) << where;
      EXPECT_EQ(self.inverse.host(), want.inverse) << where;
      EXPECT_EQ(self.loads.host(), (std::vector<i64>{5 + used, 7 + used})) << where;
      EXPECT_TRUE(in_kernel.act == by_bucket.act) << "activations differ, " << where;
      EXPECT_TRUE(in_kernel.ys == by_bucket.ys) << "down's output differs, " << where;
      if (persistent) { // then with the stage copies by whole row segments (its
                        // sort adds to the loads again: checked above)
        const outputs lines = run(true, true);
        EXPECT_TRUE(lines.act == by_bucket.act) << "activations differ, line copies, " << where;
        EXPECT_TRUE(lines.ys == by_bucket.ys) << "down's output differs, line copies, " << where;
      }
    }
  EXPECT_EQ(runs, 12);
}

TEST(GpuExpertSelfSort, WhatTheInKernelSortCannotDoIsRefusedByName) {
  REQUIRE_GPUS(1);
  const std::vector<i64> ids(std::size_t(copies), 0);
  const device_vec<i64> d_ids(ids);
  const refit::bench::device_bucket self(0, copies, experts, {0});
  struct refused {
    std::string what, message;
    void (*change)(kernels::expert_mma_args& a);
    int experts_given = experts;
  };
  const std::vector<refused> cases = {
    {"not early", "needs the early gate_up", [](kernels::expert_mma_args& a) { a.early = false; }},
    {"down", "needs the early gate_up", [](kernels::expert_mma_args& a) { a.glu = false; }},
    {"too many tokens", "at most 256 tokens",
     [](kernels::expert_mma_args& a) { a.sort.copies = 257 * a.sort.top_k; }},
    {"no inverse", "outputs (counts, offsets, inverse, loads) are missing",
     [](kernels::expert_mma_args& a) { a.sort.out.inverse = nullptr; }},
    // The resident-warp kernel keeps every expert's count in shared memory: at most 512.
    {"persistent over 513 experts", "sort of 513 experts (at most 512)",
     [](kernels::expert_mma_args& a) { a.persistent = true; }, 513},
  };
  for (const refused& r : cases) {
    kernels::expert_mma_args a;
    a.rows = 2 * inter;
    a.k = hidden;
    a.glu = true;
    a.max_chunks = 2;
    a.stages = 4;
    a.early = true;
    a.sort.ids = d_ids.p;
    a.sort.copies = copies;
    a.sort.top_k = top_k;
    a.sort.out = self.out();
    r.change(a);
    try {
      kernels::expert_mma(a, copies, r.experts_given, 1, nullptr);
      ADD_FAILURE() << r.what << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(r.message), std::string::npos) << r.what << ": " << e.what();
    }
  }
  CUDA_OK(cudaDeviceSynchronize());
}

} // namespace
