// The decode MoE layer as one kernel (kernels::expert_fused, label gpu): gate_up and down in
// one launch whose blocks take groups from a queue and whose down groups wait for their
// expert's gate_up groups. Against a host fp32 reference and, bit for bit, against the two
// block-per-expert launches it replaces (expert_mma at k-split 1), over a skewed routing (an
// expert of three 32-copy passes, single copies, a quarter of the experts empty, so some
// blocks' first group, taken before the wait, is dropped), at each staging, with 1, 3 and as
// many blocks as fit (one block runs every group, its own gate_up before its down); the
// counters back at zero after every launch; launches back to back on a stream; the refusals.
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
#include "moe_routing_fixture.hpp"
#include "runtime/bench/device_bucket.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace {

namespace kernels = refit::inference::kernels;
using refit::testing::device_vec;
using refit::testing::from_bf16;
using refit::testing::random_bf16;
using i64 = std::int64_t;

constexpr int tokens = 70, top_k = 4, experts = 32, copies = tokens * top_k;
constexpr int hidden = 512, inter = 512; // gate_up: 1024 rows (8 groups), down: 512 (4)

double silu(double g) { return g / (1.0 + std::exp(-g)); }

// Relative error with a floor, as test_gpu_moe_kernels measures it.
double rel(double got, double want) { return std::abs(got - want) / (std::abs(want) + 0.05); }

// One layer's inputs: the routing sorted on the device, x [tokens, hidden], w13 [experts,
// 2 inter, hidden] (gate rows, then up rows), w2 [experts, hidden, inter].
struct layer_case {
  std::vector<i64> ids = refit::testing::skewed_routing(tokens, top_k, experts, 21);
  refit::testing::sorted_copies want = refit::testing::host_bucket(ids, top_k, experts);
  std::vector<std::uint16_t> x = random_bf16(std::size_t(tokens) * hidden, 31, 1.0f);
  std::vector<std::uint16_t> w13 =
    random_bf16(std::size_t(experts) * 2 * inter * hidden, 32, 1.0f / std::sqrt(float(hidden)));
  std::vector<std::uint16_t> w2 =
    random_bf16(std::size_t(experts) * hidden * inter, 33, 1.0f / std::sqrt(float(inter)));
  device_vec<i64> d_ids{ids};
  refit::bench::device_bucket d{0, copies, experts, {0}};
  device_vec<std::uint16_t> d_x{x}, d_w13{w13}, d_w2{w2};
  layer_case() { kernels::bucket(d_ids.p, copies, top_k, experts, d.out(), nullptr); }

  // The two projections' arguments at a staging; y pointers left to the caller.
  void args(int chunks, int stages, bool y_f32, kernels::expert_mma_args& up,
            kernels::expert_mma_args& down) const {
    up = kernels::expert_mma_args{};
    up.x = d_x.p;
    up.x_rows = d.src_token.p;
    up.w = d_w13.p;
    up.rows = 2 * inter;
    up.k = hidden;
    up.glu = true;
    up.max_chunks = chunks;
    up.stages = stages;
    up.early = true;
    up.active = d.active.p;
    up.active_count = d.active.p + experts;
    up.counts = d.counts.p;
    up.offsets = d.offsets.p;
    down = up;
    down.x_rows = nullptr;
    down.w = d_w2.p;
    down.rows = hidden;
    down.k = inter;
    down.glu = false;
    down.y_f32 = y_f32;
  }

  // The expert of sorted copy p.
  int expert_of(int p) const {
    int e = 0;
    while (want.offsets[std::size_t(e)] <= p)
      ++e;
    return e;
  }

  // Host fp32 sums over the bf16 inputs: the activations of every sorted copy.
  std::vector<float> act_reference() const {
    std::vector<float> act(std::size_t(copies) * inter);
    for (int p = 0; p < copies; ++p) {
      const std::size_t e = std::size_t(expert_of(p));
      const std::uint16_t* xr = &x[std::size_t(want.src_token[std::size_t(p)]) * hidden];
      for (int j = 0; j < inter; ++j) {
        const std::uint16_t* g = &w13[(e * 2 * inter + std::size_t(j)) * hidden];
        const std::uint16_t* u = &w13[(e * 2 * inter + inter + std::size_t(j)) * hidden];
        double sg = 0, su = 0;
        for (int k = 0; k < hidden; ++k) {
          sg += double(from_bf16(g[k])) * from_bf16(xr[k]);
          su += double(from_bf16(u[k])) * from_bf16(xr[k]);
        }
        act[std::size_t(p) * inter + std::size_t(j)] = float(silu(sg) * su);
      }
    }
    return act;
  }

  // down over given activations (bf16 bits, as the kernel stored them).
  std::vector<float> down_reference(const std::vector<std::uint16_t>& act) const {
    std::vector<float> ys(std::size_t(copies) * hidden);
    for (int p = 0; p < copies; ++p) {
      const std::size_t e = std::size_t(expert_of(p));
      for (int r = 0; r < hidden; ++r) {
        const std::uint16_t* w = &w2[(e * hidden + std::size_t(r)) * inter];
        double s = 0;
        for (int j = 0; j < inter; ++j)
          s += double(from_bf16(w[j])) * from_bf16(act[std::size_t(p) * inter + std::size_t(j)]);
        ys[std::size_t(p) * hidden + std::size_t(r)] = float(s);
      }
    }
    return ys;
  }
};

// One launch's outputs: the activations (bf16 bits) and down's y (fp32, or bf16 widened).
struct outputs {
  std::vector<std::uint16_t> act;
  std::vector<float> ys;
  bool operator==(const outputs& o) const {
    return act == o.act
           && std::equal(ys.begin(), ys.end(), o.ys.begin(), o.ys.end(), [](float a, float b) {
                return std::memcmp(&a, &b, 4) == 0;
              });
  }
};

struct output_buffers {
  device_vec<std::uint16_t> act{std::size_t(copies) * inter};
  device_vec<float> ys{std::size_t(copies) * hidden}; // bf16 y uses its first half
  // NaN everywhere: an element left unwritten shows.
  void poison() {
    EXPECT_EQ(cudaMemset(act.p, 0xff, act.n * 2), cudaSuccess);
    EXPECT_EQ(cudaMemset(ys.p, 0xff, ys.n * 4), cudaSuccess);
  }
  void into(kernels::expert_mma_args& up, kernels::expert_mma_args& down) const {
    up.y = act.p;
    down.x = act.p;
    down.y = ys.p;
  }
  outputs host(bool y_f32) const {
    outputs o{act.host(), {}};
    const std::vector<float> raw = ys.host();
    if (y_f32) {
      o.ys = raw;
    } else {
      std::vector<std::uint16_t> bits(std::size_t(copies) * hidden);
      std::memcpy(bits.data(), raw.data(), bits.size() * 2);
      for (std::uint16_t b : bits)
        o.ys.push_back(from_bf16(b));
    }
    return o;
  }
};

void expect_zero(const device_vec<int>& sync, const std::string& where) {
  const std::vector<int> v = sync.host();
  EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](int c) { return c == 0; }))
    << "counters not back at zero, " << where;
}

TEST(GpuExpertFused, TheFusedLayerEqualsTheTwoLaunchesBitwiseAndTheHostReference) {
  REQUIRE_GPUS(1);
  const layer_case c;
  ASSERT_GT(c.want.counts[0], 64);                 // three passes of up to 32 copies
  ASSERT_EQ(c.want.counts[std::size_t(experts - 1)], 0); // empty experts
  const std::vector<float> act_ref = c.act_reference();
  const std::size_t sync_n = std::size_t(kernels::expert_fused_sync_ints(experts));
  const device_vec<int> sync_a(sync_n), sync_b(sync_n);
  std::vector<float> ys_ref;
  int compared = 0;
  struct staging {
    int chunks, stages;
  };
  for (const staging st : {staging{2, 4}, staging{1, 4}, staging{4, 4}, staging{2, 8},
                           staging{1, 8}})
    for (const bool y_f32 : {false, true}) {
      kernels::expert_mma_args up, down;
      c.args(st.chunks, st.stages, y_f32, up, down);
      const std::string staged = "chunks " + std::to_string(st.chunks) + " stages "
                                 + std::to_string(st.stages) + " y_f32 " + std::to_string(y_f32);
      ASSERT_TRUE(kernels::expert_fused_supported(up, down)) << staged;
      ASSERT_EQ(kernels::expert_mma_ksplit(up, copies, experts, 1), 1);
      ASSERT_EQ(kernels::expert_mma_ksplit(down, copies, experts, 1), 1);
      output_buffers two;
      two.poison();
      two.into(up, down);
      kernels::expert_mma(up, copies, experts, 1, nullptr);
      kernels::expert_mma(down, copies, experts, 1, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const outputs blockwise = two.host(y_f32);
      if (ys_ref.empty())
        ys_ref = c.down_reference(blockwise.act);
      for (const int cap : {1, 3, 0})
        for (const bool per_warp : {false, true}) {
          const std::string where = staged + " max_blocks " + std::to_string(cap)
                                    + (per_warp ? " per warp" : " queue");
          output_buffers one;
          one.poison();
          one.into(up, down);
          up.max_blocks = cap;
          up.persistent = per_warp;
          const device_vec<int>& sync = compared % 2 == 0 ? sync_a : sync_b;
          kernels::expert_fused(up, down, experts, sync.p, nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << where;
          const outputs fused = one.host(y_f32);
          ++compared;
          expect_zero(sync, where);
          double worst_act = 0, worst_ys = 0;
          for (std::size_t i = 0; i < fused.act.size(); ++i) {
            ASSERT_TRUE(std::isfinite(from_bf16(fused.act[i]))) << "act " << i << " unwritten, " << where;
            worst_act = std::max(worst_act, rel(from_bf16(fused.act[i]), act_ref[i]));
          }
          for (std::size_t i = 0; i < fused.ys.size(); ++i) {
            ASSERT_TRUE(std::isfinite(fused.ys[i])) << "y " << i << " unwritten, " << where;
            worst_ys = std::max(worst_ys, rel(fused.ys[i], ys_ref[i]));
          }
          EXPECT_LT(worst_act, 0.02) << where;
          EXPECT_LT(worst_ys, y_f32 ? 1e-3 : 0.02) << where;
          EXPECT_TRUE(fused == blockwise) << "not bitwise the two launches' result, " << where;
        }
    }
  EXPECT_EQ(compared, 5 * 2 * 3 * 2); // every staging, y type, block cap and mode
}

// Launches next to each other on one stream, with no host wait between: the queue (each takes
// its first groups before it waits for the one before) alternating two syncs, then the per-warp
// kernel sharing one; every result the same.
TEST(GpuExpertFused, LaunchesBackToBackWithAlternatingSyncsAgree) {
  REQUIRE_GPUS(1);
  const layer_case c;
  const std::size_t sync_n = std::size_t(kernels::expert_fused_sync_ints(experts));
  const device_vec<int> sync_a(sync_n), sync_b(sync_n);
  kernels::expert_mma_args up, down;
  c.args(2, 4, true, up, down);
  constexpr int launches = 8;
  std::vector<output_buffers> out(launches);
  for (auto& o : out)
    o.poison();
  CUDA_OK(cudaDeviceSynchronize());
  for (int i = 0; i < launches; ++i) {
    out[std::size_t(i)].into(up, down);
    // The queue: two syncs in turn; per warp (nothing touched before the wait): one shared.
    up.persistent = i >= launches / 2;
    kernels::expert_fused(up, down, experts, (i % 2 == 0 || up.persistent ? sync_a : sync_b).p,
                          nullptr);
  }
  CUDA_OK(cudaDeviceSynchronize());
  expect_zero(sync_a, "after the back-to-back launches");
  expect_zero(sync_b, "after the back-to-back launches");
  const outputs first = out[0].host(true);
  ASSERT_TRUE(std::all_of(first.ys.begin(), first.ys.end(), [](float v) { return std::isfinite(v); }));
  for (int i = 1; i < launches; ++i)
    EXPECT_TRUE(out[std::size_t(i)].host(true) == first) << "launch " << i;
}

// What does not fit is refused, naming it, and nothing is launched.
TEST(GpuExpertFused, ShapesAndArgumentsThatDoNotFitAreRefusedByName) {
  REQUIRE_GPUS(1);
  const layer_case c;
  const device_vec<int> sync(std::size_t(kernels::expert_fused_sync_ints(experts)));
  struct refused {
    std::string what, message;
    void (*change)(kernels::expert_mma_args& up, kernels::expert_mma_args& down);
  };
  const std::vector<refused> cases = {
    {"down as up", "up must be the GLU projection",
     [](kernels::expert_mma_args& up, kernels::expert_mma_args&) { up.glu = false; }},
    {"rows not in groups", "rows must be multiples of 128",
     [](kernels::expert_mma_args&, kernels::expert_mma_args& down) { down.rows = 496; }},
    {"down k", "down's k 256 is not up's rows / 2 (512)",
     [](kernels::expert_mma_args&, kernels::expert_mma_args& down) { down.k = 256; }},
    {"register stages", "stages 0",
     [](kernels::expert_mma_args& up, kernels::expert_mma_args&) { up.stages = 0; }},
    {"negative cap", "max_blocks -1",
     [](kernels::expert_mma_args& up, kernels::expert_mma_args&) { up.max_blocks = -1; }},
    {"short passes", "shorter than the 8 stages",
     [](kernels::expert_mma_args& up, kernels::expert_mma_args&) {
       up.stages = 8; // 2 chunks: 512 / 64 = 8 k-iterations fit; 4 chunks are cut to 2
       up.max_chunks = 2;
       up.k = 256; // 4 k-iterations
     }},
  };
  for (const refused& r : cases) {
    kernels::expert_mma_args up, down;
    c.args(2, 4, false, up, down);
    r.change(up, down);
    EXPECT_FALSE(kernels::expert_fused_supported(up, down)) << r.what;
    try {
      kernels::expert_fused(up, down, experts, sync.p, nullptr);
      ADD_FAILURE() << r.what << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(r.message), std::string::npos) << r.what << ": " << e.what();
    }
  }
  kernels::expert_mma_args up, down;
  c.args(2, 4, false, up, down);
  try {
    kernels::expert_fused(up, down, experts, nullptr, nullptr);
    ADD_FAILURE() << "no sync accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no sync counters"), std::string::npos) << e.what();
  }
  CUDA_OK(cudaDeviceSynchronize());
  expect_zero(sync, "after the refusals");
}

} // namespace
