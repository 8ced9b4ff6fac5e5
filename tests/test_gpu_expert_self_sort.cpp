// The gate_up kernel sorting the routed copies itself (expert_mma_args::sort, label gpu)
// instead of the bucket kernel before it: bucket's counts, offsets and inverse (against the
// host's stable counting sort) and its expert-load counts, and the same activations, then the
// same down projection, bit for bit, as bucket + expert_mma; at each staging and k-split and
// with resident warps (persistent: the block's counts, each warp's list), over a skewed
// routing (an expert of three 32-copy passes, single copies, a quarter empty); the down
// projection waiting per expert on gate_up's counted tiles (the dataflow); then the refusals.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
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

struct staging {
  int chunks, stages;
};

// The routing, the bucket kernel's sort of it, x and both projections' weights.
struct pair_rig {
  std::vector<i64> ids = refit::testing::skewed_routing(tokens, top_k, experts, 41);
  refit::testing::sorted_copies want = refit::testing::host_bucket(ids, top_k, experts);
  device_vec<i64> d_ids{ids};
  refit::bench::device_bucket bucketed{0, copies, experts, {0}};
  device_vec<std::uint16_t> x{random_bf16(std::size_t(tokens) * hidden, 51, 1.0f)};
  device_vec<std::uint16_t> w13{
    random_bf16(std::size_t(experts) * 2 * inter * hidden, 52, 1.0f / std::sqrt(float(hidden)))};
  device_vec<std::uint16_t> w2{
    random_bf16(std::size_t(experts) * hidden * inter, 53, 1.0f / std::sqrt(float(inter)))};

  pair_rig() { kernels::bucket(d_ids.p, copies, top_k, experts, bucketed.out(), nullptr); }

  // gate_up into act, down from act into ys; lists: the counts and offsets they read (the
  // bucket kernel's, or the in-kernel sort's outputs with `self`).
  void plan(const staging& st, bool persistent, const refit::bench::device_bucket& lists,
            const refit::bench::device_bucket* self, std::uint16_t* act, std::uint16_t* ys,
            kernels::expert_mma_args& up, kernels::expert_mma_args& down) const {
    up = kernels::expert_mma_args{};
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
    up.y = act;
    down = up;
    down.x = act;
    down.x_rows = nullptr;
    down.w = w2.p;
    down.rows = hidden;
    down.k = inter;
    down.glu = false;
    down.y = ys;
    if (self != nullptr) {
      up.sort.ids = d_ids.p;
      up.sort.copies = copies;
      up.sort.top_k = top_k;
      up.sort.out = self->out();
    }
  }
};

TEST(GpuExpertSelfSort, GateUpSortsAsBucketDoesAndComputesTheSameBits) {
  REQUIRE_GPUS(1);
  const pair_rig rig;
  const refit::testing::sorted_copies& want = rig.want;
  ASSERT_GT(want.counts[0], 64);
  ASSERT_EQ(want.counts[std::size_t(experts - 1)], 0);
  i64 used = 0;
  for (i64 c : want.counts)
    used += c > 0 ? 1 : 0;
  int runs = 0;
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
      const auto run = [&](bool in_kernel) {
        device_vec<std::uint16_t> act(std::size_t(copies) * inter), ys(std::size_t(copies) * hidden);
        kernels::expert_mma_args up, down;
        rig.plan(st, persistent, in_kernel ? self : rig.bucketed, in_kernel ? &self : nullptr,
                 act.p, ys.p, up, down);
        const int ks = persistent ? 1 : ksplit;
        EXPECT_EQ(kernels::expert_mma_ksplit(up, copies, experts, ks), ks) << where;
        kernels::expert_mma(up, copies, experts, ks, nullptr);
        kernels::expert_mma(down, copies, experts, ks, nullptr);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << where;
        return outputs{act.host(), ys.host()};
      };
      const outputs by_bucket = run(false);
      const outputs in_kernel = run(true);
      ++runs;
      EXPECT_EQ(self.counts.host(), want.counts) << where;
      EXPECT_EQ(self.offsets.host(), want.offsets) << where;
      EXPECT_EQ(self.inverse.host(), want.inverse) << where;
      EXPECT_EQ(self.loads.host(), (std::vector<i64>{5 + used, 7 + used})) << where;
      EXPECT_TRUE(in_kernel.act == by_bucket.act) << "activations differ, " << where;
      EXPECT_TRUE(in_kernel.ys == by_bucket.ys) << "down's output differs, " << where;
    }
  EXPECT_EQ(runs, 12);
}

// The gate_up -> down dataflow (expert_mma_args::flow): down waits per expert on gate_up's
// counted tiles instead of on gate_up's grid. Started after gate_up on one stream (programmatic
// launch: down's blocks take the SMs gate_up leaves free, here most of them, while gate_up
// runs) and before gate_up on another stream (every down block waits on the counters until
// gate_up, launched after it, counts its tiles), twice each without a reset in between, it gives
// the resident-warp pair's bits and leaves its counters at zero.
TEST(GpuExpertSelfSort, DownWaitingPerExpertOnGateUpComputesTheSameBitsAndResetsItsCounters) {
  REQUIRE_GPUS(1);
  const pair_rig rig;
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t first = nullptr, second = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&first, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking));
  const device_vec<int> counters(std::size_t(experts) + 2);
  const std::vector<int> zeros(std::size_t(experts) + 2, 0);
  int runs = 0;
  for (const staging st : {staging{2, 4}, staging{1, 4}, staging{4, 4}, staging{2, 8}}) {
    const std::string at = "chunks " + std::to_string(st.chunks) + " stages "
                            + std::to_string(st.stages);
    const auto run = [&](bool flow, bool down_first) {
      refit::bench::device_bucket self(0, copies, experts, {0});
      device_vec<std::uint16_t> act(std::size_t(copies) * inter), ys(std::size_t(copies) * hidden);
      kernels::expert_mma_args up, down;
      rig.plan(st, true, self, &self, act.p, ys.p, up, down);
      if (flow) {
        up.flow.counters = down.flow.counters = counters.p;
        down.flow.ids = rig.d_ids.p;
        down.flow.copies = copies;
        down.flow.gate_tiles = up.rows / 16;
      }
      if (down_first) { // both grids resident at once: 64 + 128 blocks at two an SM
        kernels::expert_mma(down, copies, experts, 1, second);
        kernels::expert_mma(up, copies, experts, 1, first);
      } else {
        kernels::expert_mma(up, copies, experts, 1, first);
        kernels::expert_mma(down, copies, experts, 1, first);
      }
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << at;
      return outputs{act.host(), ys.host()};
    };
    const outputs want = run(false, false);
    for (const bool down_first : {false, true}) {
      if (down_first && sms * 2 < 192) {
        std::cout << "[ skipped ] down before gate_up: " << sms << " SMs hold fewer than both grids\n";
        continue;
      }
      for (int again = 0; again < 2; ++again) {
        const std::string where = at + (down_first ? ", down launched first" : ", one stream")
                                  + ", run " + std::to_string(again + 1);
        const outputs got = run(true, down_first);
        ++runs;
        EXPECT_TRUE(got.act == want.act) << "activations differ, " << where;
        EXPECT_TRUE(got.ys == want.ys) << "down's output differs, " << where;
        EXPECT_EQ(counters.host(), zeros) << "counters left set, " << where;
      }
    }
  }
  EXPECT_GE(runs, 8);
  CUDA_OK(cudaStreamDestroy(first));
  CUDA_OK(cudaStreamDestroy(second));
}

int* flow_counters_never_read() {
  static int unused[experts + 2];
  return unused;
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
    // The dataflow (refused before anything is launched: its counters are never read here).
    {"dataflow, block per expert", "needs the early resident-warp kernels",
     [](kernels::expert_mma_args& a) { a.flow.counters = flow_counters_never_read(); }},
    {"dataflow down without the ids", "down needs the routed ids",
     [](kernels::expert_mma_args& a) {
       a.persistent = true;
       a.glu = false;
       a.sort = kernels::expert_sort_args{};
       a.flow.counters = flow_counters_never_read();
       a.flow.gate_tiles = 2;
     }},
    {"dataflow gate_up not sorting", "gate_up must sort in the kernel",
     [](kernels::expert_mma_args& a) {
       a.persistent = true;
       a.sort = kernels::expert_sort_args{};
       a.flow.counters = flow_counters_never_read();
     }},
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
