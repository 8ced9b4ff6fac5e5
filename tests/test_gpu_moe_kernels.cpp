// The bf16 engine's MoE kernels on a GPU (label gpu), alone: the counting sort by expert and
// the tensor-core expert projections (expert_mma) against a host fp32 reference over the same
// bf16 inputs, with empty experts, single copies and experts of more than one 32-copy pass,
// at every k-split the shape allows; the resident-warp variant (persistent) bitwise against it;
// and the same kernel's dense mode.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gpu_fixture.hpp"
#include "gpu_kernel_fixture.hpp"
#include "moe_routing_fixture.hpp"
#include "runtime/bench/device_bucket.hpp"
#include "runtime/cuda/cuda.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace {

namespace kernels = refit::inference::kernels;
using refit::testing::device_vec;
using refit::testing::from_bf16;
using refit::testing::host_bucket;
using refit::testing::random_bf16;
using refit::testing::skewed_routing;
using refit::testing::sorted_copies;
using refit::testing::to_bf16;
using i64 = std::int64_t;

// Shapes: one round of copies over 64 experts; three rounds (2,400 copies) over 128 (the
// per-warp tally); 200 experts (past the tally: the warps claim in order).
TEST(GpuMoeKernels, BucketSortsCopiesByExpertStablyAndListsTheNonEmptyExperts) {
  REQUIRE_GPUS(1);
  for (const auto& [tokens, top_k, experts] :
       {std::tuple{37, 4, 64}, std::tuple{300, 8, 128}, std::tuple{100, 4, 200}}) {
    SCOPED_TRACE(std::to_string(tokens) + " tokens, top " + std::to_string(top_k) + " of "
                 + std::to_string(experts));
    const auto ids = skewed_routing(tokens, top_k, experts, 3);
    const int copies = tokens * top_k;
    device_vec<i64> d_ids(ids);
    refit::bench::device_bucket d(0, copies, experts, {5, 7}); // expert loads start at 5 and 7
    kernels::bucket(d_ids.p, copies, top_k, experts, d.out(), nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const auto want = host_bucket(ids, top_k, experts);
    EXPECT_EQ(d.counts.host(), want.counts);
    EXPECT_EQ(d.offsets.host(), want.offsets);
    EXPECT_EQ(d.order.host(), want.order);
    EXPECT_EQ(d.src_token.host(), want.src_token);
    EXPECT_EQ(d.inverse.host(), want.inverse);
    auto active = d.active.host();
    const int used = active.back();
    ASSERT_EQ(used, static_cast<int>(want.active.size()));
    active.resize(static_cast<std::size_t>(used));
    EXPECT_EQ(active, want.active);
    EXPECT_EQ(d.loads.host(), (std::vector<i64>{5 + used, 7 + used}));
  }
}

// The expert ids by score, highest first, equal scores in id order (the routing's tie rule).
std::vector<int> ranked(const std::vector<double>& score) {
  std::vector<int> rank(score.size());
  std::iota(rank.begin(), rank.end(), 0);
  std::stable_sort(rank.begin(), rank.end(), [&](int a, int b) {
    return score[static_cast<std::size_t>(a)] > score[static_cast<std::size_t>(b)];
  });
  return rank;
}

// Routing: softmax over the experts, the top k by probability with ties to the lower id,
// renormalized or not, against the host; the logits are bf16 with whole runs of equal values.
// Top 6 of 40 (each choice kept in its lane) and top 40 of 80 (past 32, stored and divided in
// place).
TEST(GpuMoeKernels, RouteTakesTheTopKWithTiesToTheLowerIdAsTheHostDoes) {
  REQUIRE_GPUS(1);
  for (const auto& [experts, top_k] : {std::pair{40, 6}, std::pair{80, 40}}) {
    SCOPED_TRACE("top " + std::to_string(top_k) + " of " + std::to_string(experts));
    const int tokens = 5;
    std::vector<std::uint16_t> logits;
    for (int t = 0; t < tokens; ++t)
      for (int e = 0; e < experts; ++e) // token t: values repeat every 3 + t experts
        logits.push_back(to_bf16(0.25f * float((e * 7) % (3 + t))));
    device_vec<std::uint16_t> d_logits(logits);
    for (const bool renormalize : {false, true}) {
      device_vec<i64> ids(static_cast<std::size_t>(tokens * top_k));
      device_vec<float> weights(static_cast<std::size_t>(tokens * top_k));
      kernels::route(d_logits.p, tokens, experts, top_k, renormalize, ids.p, weights.p, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const auto got_ids = ids.host();
      const auto got_w = weights.host();
      for (int t = 0; t < tokens; ++t) {
        std::vector<double> p(static_cast<std::size_t>(experts));
        double mx = -1e30, sum = 0;
        for (int e = 0; e < experts; ++e)
          mx = std::max(mx, double(from_bf16(logits[static_cast<std::size_t>(t * experts + e)])));
        for (int e = 0; e < experts; ++e)
          sum += p[static_cast<std::size_t>(e)] =
            std::exp(double(from_bf16(logits[static_cast<std::size_t>(t * experts + e)])) - mx);
        const std::vector<int> rank = ranked(p);
        double kept = 0;
        for (int j = 0; j < top_k; ++j)
          kept += p[static_cast<std::size_t>(rank[static_cast<std::size_t>(j)])] / sum;
        for (int j = 0; j < top_k; ++j) {
          const std::size_t at = static_cast<std::size_t>(t * top_k + j);
          const int want = rank[static_cast<std::size_t>(j)];
          EXPECT_EQ(got_ids[at], want) << "token " << t << " choice " << j;
          const double prob = p[static_cast<std::size_t>(want)] / sum / (renormalize ? kept : 1.0);
          EXPECT_NEAR(got_w[at], prob, 1e-5) << "token " << t << " choice " << j;
        }
      }
    }
  }
}

// The fp32 router of a split input: logit = hi + lo in float, where the hi parts alone tie in
// runs and the lo parts break some ties and leave others (equal sums: the lower id).
TEST(GpuMoeKernels, RouteF32AddsTheLowPartAndBreaksTiesToTheLowerId) {
  REQUIRE_GPUS(1);
  const int tokens = 4, experts = 128, top_k = 8;
  std::vector<float> hi, lo;
  for (int t = 0; t < tokens; ++t)
    for (int e = 0; e < experts; ++e) {
      hi.push_back(0.5f * float((e * 5) % (4 + t)));     // runs of equal values
      lo.push_back(e % 3 == 0 ? 0.0f : 1e-4f * float(e % 7)); // breaks some of them
    }
  device_vec<float> d_hi(hi), d_lo(lo);
  for (const bool with_lo : {false, true}) {
    device_vec<i64> ids(static_cast<std::size_t>(tokens * top_k));
    device_vec<float> weights(static_cast<std::size_t>(tokens * top_k));
    kernels::route_f32(d_hi.p, with_lo ? d_lo.p : nullptr, tokens, experts, top_k, true, ids.p,
                       weights.p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const auto got_ids = ids.host();
    const auto got_w = weights.host();
    for (int t = 0; t < tokens; ++t) {
      std::vector<float> v(static_cast<std::size_t>(experts));
      for (int e = 0; e < experts; ++e) {
        const std::size_t at = static_cast<std::size_t>(t * experts + e);
        v[static_cast<std::size_t>(e)] = with_lo ? hi[at] + lo[at] : hi[at];
      }
      const std::vector<int> rank = ranked(std::vector<double>(v.begin(), v.end()));
      const double mx = v[static_cast<std::size_t>(rank[0])];
      double kept = 0;
      for (int j = 0; j < top_k; ++j)
        kept += std::exp(double(v[static_cast<std::size_t>(rank[static_cast<std::size_t>(j)])]) - mx);
      for (int j = 0; j < top_k; ++j) {
        const std::size_t at = static_cast<std::size_t>(t * top_k + j);
        const int want = rank[static_cast<std::size_t>(j)];
        EXPECT_EQ(got_ids[at], want) << "token " << t << " choice " << j << " lo " << with_lo;
        EXPECT_NEAR(got_w[at], std::exp(double(v[static_cast<std::size_t>(want)]) - mx) / kept,
                    1e-5);
      }
    }
  }
}

// Routing and the counting sort in one block (route_bucket_f32) against route_f32 then bucket:
// the same ids, weights and every bucket output bit for bit, with and without the low part,
// at 1, 64 (a decode step of Qwen3-30B-A3B's shape) and 256 tokens (the most it takes), the
// logits in runs of equal values so ties are broken the same way; then 257 tokens are refused.
TEST(GpuMoeKernels, RouteBucketInOneBlockEqualsRouteThenBucket) {
  REQUIRE_GPUS(1);
  const int experts = 128, top_k = 8;
  for (const int tokens : {1, 64, 256}) {
    std::mt19937 rng(static_cast<std::uint32_t>(tokens));
    std::vector<float> hi, lo;
    for (int t = 0; t < tokens; ++t)
      for (int e = 0; e < experts; ++e) {
        hi.push_back(0.25f * float(rng() % 9)); // runs of equal values
        lo.push_back(1e-4f * float(rng() % 5));
      }
    device_vec<float> d_hi(hi), d_lo(lo);
    for (const bool with_lo : {false, true}) {
      SCOPED_TRACE(std::to_string(tokens) + " tokens, lo " + std::to_string(with_lo));
      const int copies = tokens * top_k;
      const std::size_t n = static_cast<std::size_t>(copies);
      device_vec<i64> ids_a(n), ids_b(n);
      device_vec<float> w_a(n), w_b(n);
      refit::bench::device_bucket a(0, copies, experts, {3, 4}), b(0, copies, experts, {3, 4});
      kernels::route_f32(d_hi.p, with_lo ? d_lo.p : nullptr, tokens, experts, top_k, true,
                         ids_a.p, w_a.p, nullptr);
      kernels::bucket(ids_a.p, copies, top_k, experts, a.out(), nullptr);
      ASSERT_TRUE(kernels::route_bucket_supported(tokens, experts, top_k));
      kernels::route_bucket_f32(d_hi.p, with_lo ? d_lo.p : nullptr, tokens, experts, top_k, true,
                                ids_b.p, w_b.p, b.out(), nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      const auto ids = ids_b.host();
      EXPECT_EQ(ids, ids_a.host());
      EXPECT_EQ(w_b.host(), w_a.host());
      const auto want = host_bucket(ids, top_k, experts); // and both sorted what was chosen
      EXPECT_EQ(b.counts.host(), want.counts);
      EXPECT_EQ(b.order.host(), want.order);
      EXPECT_EQ(b.counts.host(), a.counts.host());
      EXPECT_EQ(b.offsets.host(), a.offsets.host());
      EXPECT_EQ(b.order.host(), a.order.host());
      EXPECT_EQ(b.src_token.host(), a.src_token.host());
      EXPECT_EQ(b.inverse.host(), a.inverse.host());
      auto active_a = a.active.host(), active_b = b.active.host(); // ids, then their number
      const int used = active_b.back();
      ASSERT_EQ(used, active_a.back());
      active_a.resize(static_cast<std::size_t>(used));
      active_b.resize(static_cast<std::size_t>(used));
      EXPECT_EQ(active_b, active_a);
      EXPECT_EQ(b.loads.host(), a.loads.host());
      EXPECT_GT(b.loads.host()[0], 3);
    }
  }
  EXPECT_FALSE(kernels::route_bucket_supported(257, experts, top_k));
  try {
    kernels::route_bucket_f32(nullptr, nullptr, 257, experts, top_k, true, nullptr, nullptr,
                              kernels::bucket_out{}, nullptr);
    ADD_FAILURE() << "257 tokens accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("257 tokens"), std::string::npos) << e.what();
  }
}

// The weight stagings (expert_mma_args::stages) and early starts (expert_mma_args::early: the
// blocks by expert id, the empty experts' leaving) the kernel tests run.
const std::pair<int, bool> stagings[] = {{0, false}, {4, false}, {8, false}, {4, true}, {0, true}};

// For every staging above, chunk count (4, 2, 1) and k-split (1..8) that `ksplit(ks)` takes
// (returns ks), with a's fields set: `launch(ks)` into a bf16 y of y_elems first set to NaN,
// every element written and within 0.02 (relative, +0.05) of `reference`; `runs` counts them.
template <class Reference, class KSplit, class Launch>
void check_every_staging(kernels::expert_mma_args& a, std::size_t y_elems,
                         const std::vector<Reference>& reference, const std::string& shape,
                         KSplit ksplit, Launch launch, int& runs) {
  runs = 0;
  for (const auto& [stages, early] : stagings)
    for (const int chunks : {4, 2, 1})
      for (int ks = 1; ks <= 8; ks *= 2) {
        a.max_chunks = chunks;
        a.stages = stages;
        a.early = early;
        if (ksplit(ks) != ks)
          continue;
        ++runs;
        const std::string where = shape + " ksplit " + std::to_string(ks) + " chunks "
                                  + std::to_string(chunks) + " stages " + std::to_string(stages)
                                  + " early " + std::to_string(early);
        device_vec<std::uint16_t> d_y(y_elems);
        CUDA_OK(cudaMemset(d_y.p, 0xff, d_y.n * 2)); // NaN: an element left unwritten shows
        a.y = d_y.p;
        launch(ks);
        CUDA_OK(cudaDeviceSynchronize());
        const auto y = d_y.host();
        double worst = 0;
        for (std::size_t i = 0; i < y.size(); ++i) {
          const double got = from_bf16(y[i]);
          const double ref = reference[i];
          ASSERT_TRUE(std::isfinite(got)) << "element " << i << " unwritten, " << where;
          worst = std::max(worst, std::abs(got - ref) / (std::abs(ref) + 0.05));
        }
        EXPECT_LT(worst, 0.02) << where;
      }
}

// x-row(p) . w[e]^T for the sorted copies, fp32 over the bf16 values; GLU: silu(gate) * up.
std::vector<float> host_projection(const std::vector<std::uint16_t>& x,
                                   const std::vector<i64>* x_rows,
                                   const std::vector<std::uint16_t>& w, const sorted_copies& s,
                                   const std::vector<i64>& ids, int rows, int k, bool glu) {
  const int cols = glu ? rows / 2 : rows;
  std::vector<float> y(s.order.size() * static_cast<std::size_t>(cols));
  for (std::size_t p = 0; p < s.order.size(); ++p) {
    const i64 e = ids[static_cast<std::size_t>(s.order[p])];
    const i64 xr = x_rows != nullptr ? (*x_rows)[p] : static_cast<i64>(p);
    std::vector<double> dot(static_cast<std::size_t>(rows));
    for (int r = 0; r < rows; ++r) {
      double acc = 0;
      for (int c = 0; c < k; ++c)
        acc += double(from_bf16(x[static_cast<std::size_t>(xr * k + c)]))
               * from_bf16(w[static_cast<std::size_t>((e * rows + r) * k + c)]);
      dot[static_cast<std::size_t>(r)] = acc;
    }
    for (int c = 0; c < cols; ++c) {
      const double v = glu ? dot[static_cast<std::size_t>(c)] / (1 + std::exp(-dot[static_cast<std::size_t>(c)]))
                               * dot[static_cast<std::size_t>(cols + c)]
                           : dot[static_cast<std::size_t>(c)];
      y[p * static_cast<std::size_t>(cols) + static_cast<std::size_t>(c)] = static_cast<float>(v);
    }
  }
  return y;
}

struct projection_case {
  int rows, k;
  bool glu;
};

// One projection case over the sorted routing `want` (gate_up: x of `tokens` rows gathered
// through src_token; down: x by sorted position), random x and w from `seed`: the host
// reference and the device inputs, `a` filled but for y (and the staging fields).
struct projection_inputs {
  std::vector<std::uint16_t> x, w;
  std::vector<float> reference;
  device_vec<std::uint16_t> d_x, d_w;
  kernels::expert_mma_args a;
  projection_inputs(const projection_case& pc, int tokens, int experts, const std::vector<i64>& ids,
                    const sorted_copies& want, const refit::bench::device_bucket& d,
                    std::uint32_t seed)
    : x(random_bf16(static_cast<std::size_t>(pc.glu ? tokens : static_cast<int>(ids.size())) * pc.k,
                    seed, 1.0f)),
      w(random_bf16(static_cast<std::size_t>(experts) * pc.rows * pc.k, seed + 4,
                    1.0f / std::sqrt(float(pc.k)))),
      reference(host_projection(x, pc.glu ? &want.src_token : nullptr, w, want, ids, pc.rows,
                                pc.k, pc.glu)),
      d_x(x), d_w(w) {
    a.x = d_x.p;
    a.x_rows = pc.glu ? d.src_token.p : nullptr;
    a.w = d_w.p;
    a.active = d.active.p;
    a.active_count = d.active.p + experts;
    a.counts = d.counts.p;
    a.offsets = d.offsets.p;
    a.rows = pc.rows;
    a.k = pc.k;
    a.glu = pc.glu;
  }
};

// 70 tokens routed top-4 over 32 experts, skewed (expert 0 takes all 70 copies: three passes of
// up to 32; some experts one copy, a quarter none), sorted on the device by bucket with the
// expert loads starting at `loads`.
struct routed_copies {
  static constexpr int tokens = 70, top_k = 4, experts = 32, copies = tokens * top_k;
  std::vector<i64> ids = skewed_routing(tokens, top_k, experts, 11);
  sorted_copies want = host_bucket(ids, top_k, experts);
  device_vec<i64> d_ids{ids};
  refit::bench::device_bucket d;
  explicit routed_copies(const std::vector<i64>& loads) : d(0, copies, experts, loads) {
    kernels::bucket(d_ids.p, copies, top_k, experts, d.out(), nullptr);
  }
};

// gate_up (GLU, x gathered through src_token) and down (x by sorted position), for 70 tokens
// routed over 32 experts: expert 0 takes all 70 copies (three passes of up to 32), some take
// one, a quarter none. Every k-split that divides the shape, at each staging (4, 2 and 1
// chunks; in registers, 4 or 8 cp.async stages; with and without the early start), each
// against the reference; 48 rows are 3 warp tiles (blocks with idle warps).
TEST(GpuMoeKernels, ExpertMmaMatchesTheHostReferenceAtEveryKSplit) {
  REQUIRE_GPUS(1);
  const routed_copies r({5, 7});
  constexpr int tokens = routed_copies::tokens, experts = routed_copies::experts;
  constexpr int copies = routed_copies::copies;
  const std::vector<i64>& ids = r.ids;
  const sorted_copies& want = r.want;
  const refit::bench::device_bucket& d = r.d;
  ASSERT_GT(want.counts[0], 64);
  for (const projection_case pc : {projection_case{256, 512, true}, projection_case{512, 256, false},
                                   projection_case{48, 128, false}}) {
    projection_inputs in(pc, tokens, experts, ids, want, d, 5);
    const auto& reference = in.reference;
    kernels::expert_mma_args& a = in.a;
    const int cols = pc.glu ? pc.rows / 2 : pc.rows;
    ASSERT_TRUE(kernels::expert_mma_supported(a)) << pc.rows << "x" << pc.k;
    const std::string shape = "rows " + std::to_string(pc.rows) + " k " + std::to_string(pc.k)
                              + " glu " + std::to_string(pc.glu);
    int splits_run = 0;
    check_every_staging(
      a, static_cast<std::size_t>(copies) * cols, reference, shape,
      [&](int ks) { return kernels::expert_mma_ksplit(a, copies, experts, ks); },
      [&](int ks) { kernels::expert_mma(a, copies, experts, ks, nullptr); }, splits_run);
    if (HasFatalFailure())
      return;
    EXPECT_GE(splits_run, 6) << "rows " << pc.rows << " k " << pc.k;
    const int automatic = kernels::expert_mma_ksplit(a, copies, experts, 0);
    EXPECT_TRUE(automatic == 1 || automatic == 2 || automatic == 4 || automatic == 8);
  }
}

// The resident-warp kernel (expert_mma_args::persistent) against the block-per-expert kernel
// at k-split 1 with the same staging: bitwise the same y, every element written, for the
// routing above (an expert of three 32-copy passes, single copies, a quarter of the experts
// empty, so warps whose first item is empty drop their early stages), with 1 and 3 blocks (each
// warp walks many items across experts and passes) and as many as fit; within the reference's
// tolerance too; with each copy instruction taking whole row segments (line_copies) as well.
// Then the refusals: a k-split other than 1, a negative block cap.
TEST(GpuMoeKernels, PersistentExpertMmaEqualsTheBlockPerExpertKernelBitwise) {
  REQUIRE_GPUS(1);
  const routed_copies r({0});
  constexpr int tokens = routed_copies::tokens, experts = routed_copies::experts;
  constexpr int copies = routed_copies::copies;
  const std::vector<i64>& ids = r.ids;
  const sorted_copies& want = r.want;
  const refit::bench::device_bucket& d = r.d;
  int compared = 0;
  for (const projection_case pc : {projection_case{256, 512, true}, projection_case{512, 256, false},
                                   projection_case{48, 128, false}}) {
    projection_inputs in(pc, tokens, experts, ids, want, d, 15);
    const auto& reference = in.reference;
    kernels::expert_mma_args& a = in.a;
    const std::size_t y_elems = static_cast<std::size_t>(copies) * (pc.glu ? pc.rows / 2 : pc.rows);
    const auto run = [&](const kernels::expert_mma_args& args) -> std::vector<std::uint16_t> {
      device_vec<std::uint16_t> d_y(y_elems);
      // NaN: an element left unwritten shows
      EXPECT_EQ(cudaMemset(d_y.p, 0xff, d_y.n * 2), cudaSuccess);
      kernels::expert_mma_args with_y = args;
      with_y.y = d_y.p;
      kernels::expert_mma(with_y, copies, experts, 1, nullptr);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      return d_y.host();
    };
    for (const int stages : {4, 8})
      for (const bool early : {false, true})
        for (const int chunks : {4, 2, 1}) {
          a.stages = stages;
          a.early = early;
          a.max_chunks = chunks;
          if (kernels::expert_mma_ksplit(a, copies, experts, 1) != 1 || (stages == 8 && chunks == 4))
            continue;
          a.persistent = false;
          const auto blockwise = run(a);
          a.persistent = true;
          for (const int cap : {1, 3, 0})
            for (const bool lines : {false, true}) {
              a.max_blocks = cap;
              a.line_copies = lines;
              const std::string where = "rows " + std::to_string(pc.rows) + " k "
                                        + std::to_string(pc.k) + " stages " + std::to_string(stages)
                                        + " early " + std::to_string(early) + " chunks "
                                        + std::to_string(chunks) + " max_blocks " + std::to_string(cap)
                                        + (lines ? " line copies" : "");
              const auto y = run(a);
              ++compared;
              double worst = 0;
              for (std::size_t i = 0; i < y.size(); ++i) {
                ASSERT_TRUE(std::isfinite(from_bf16(y[i]))) << "element " << i << " unwritten, " << where;
                worst = std::max(worst, std::abs(from_bf16(y[i]) - double(reference[i]))
                                          / (std::abs(double(reference[i])) + 0.05));
              }
              EXPECT_LT(worst, 0.02) << where;
              EXPECT_TRUE(y == blockwise) << "not bitwise the block-per-expert result, " << where;
            }
          a.max_blocks = 0;
          a.line_copies = false;
          a.persistent = false;
        }
  }
  // Every case ran: 3 shapes x (4 stages x 3 chunk counts + 8 stages x 2, each with and
  // without the early start) x 3 block caps x the two copy mappings.
  EXPECT_EQ(compared, 3 * 10 * 3 * 2);
  kernels::expert_mma_args a;
  a.rows = 64;
  a.k = 256;
  a.stages = 4;
  a.persistent = true;
  try {
    kernels::expert_mma(a, 8, 8, 2, nullptr);
    ADD_FAILURE() << "persistent ksplit 2 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("persistent with ksplit 2"), std::string::npos) << e.what();
  }
  a.max_blocks = -1;
  try {
    kernels::expert_mma(a, 8, 8, 1, nullptr);
    ADD_FAILURE() << "max_blocks -1 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_blocks -1"), std::string::npos) << e.what();
  }
  a.max_blocks = 0;
  a.stages = 0; // register stages: no ring to stream through
  try {
    kernels::expert_mma(a, 8, 8, 1, nullptr);
    ADD_FAILURE() << "persistent with register stages accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("stages 0"), std::string::npos) << e.what();
  }
}

// A k-split that does not divide the shape, or is not a power of two up to 8, is refused,
// naming it; nothing is launched.
TEST(GpuMoeKernels, AnExpertMmaSplitThatDoesNotDivideTheShapeIsRefused) {
  REQUIRE_GPUS(1);
  struct refused {
    int k, ksplit;
    const char* why;
  };
  for (const refused r : {refused{96, 8, "k slices of 12: not a multiple of 32"},
                          refused{192, 3, "slices of 64 divide, 3 is not a power of two"},
                          refused{512, 16, "more than 8 warps per tile"}}) {
    SCOPED_TRACE(r.why);
    kernels::expert_mma_args a;
    a.rows = 64;
    a.k = r.k;
    EXPECT_EQ(kernels::expert_mma_ksplit(a, 8, 8, r.ksplit), 0);
    try {
      kernels::expert_mma(a, 8, 8, r.ksplit, nullptr);
      ADD_FAILURE() << "ksplit " << r.ksplit << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("ksplit " + std::to_string(r.ksplit)),
                std::string::npos)
        << e.what();
    }
  }
  kernels::expert_mma_args a;
  a.rows = 24; // not a multiple of 16
  a.k = 128;
  EXPECT_FALSE(kernels::expert_mma_supported(a));
}

// The dense mode (qkv, o_proj, the router at 9..128 rows): y = x . w^T against a host fp32
// reference, at row counts on both sides of one 32-row tile set (4 token tiles, then 8) and of
// one 64-row pass (100 and 128: two), every staging and k-split the shape allows; 48 rows are
// 3 warp tiles (idle warps in the block).
TEST(GpuMoeKernels, DenseMmaMatchesTheHostReferenceAtEveryRowCountAndKSplit) {
  REQUIRE_GPUS(1);
  struct shape {
    int rows, k;
  };
  for (const shape sh : {shape{384, 512}, shape{48, 256}}) {
    for (const int m : {1, 9, 32, 33, 64, 100, 128}) {
      const auto x = random_bf16(static_cast<std::size_t>(m) * sh.k, 3 + m, 1.0f);
      const auto w = random_bf16(static_cast<std::size_t>(sh.rows) * sh.k, 17,
                                 1.0f / std::sqrt(float(sh.k)));
      std::vector<double> reference(static_cast<std::size_t>(m) * sh.rows);
      for (int i = 0; i < m; ++i)
        for (int r = 0; r < sh.rows; ++r) {
          double acc = 0;
          for (int c = 0; c < sh.k; ++c)
            acc += double(from_bf16(x[static_cast<std::size_t>(i * sh.k + c)]))
                   * from_bf16(w[static_cast<std::size_t>(r * sh.k + c)]);
          reference[static_cast<std::size_t>(i * sh.rows + r)] = acc;
        }
      device_vec<std::uint16_t> d_x(x), d_w(w);
      kernels::expert_mma_args a;
      a.x = d_x.p;
      a.w = d_w.p;
      a.rows = sh.rows;
      a.k = sh.k;
      const std::string shape = "rows " + std::to_string(sh.rows) + " k " + std::to_string(sh.k)
                                + " m " + std::to_string(m);
      int runs = 0;
      check_every_staging(
        a, static_cast<std::size_t>(m) * sh.rows, reference, shape,
        [&](int ks) { return kernels::dense_mma_ksplit(a, m, ks); },
        [&](int ks) { kernels::dense_mma(a, m, ks, nullptr); }, runs);
      if (HasFatalFailure())
        return;
      EXPECT_GE(runs, 6) << "rows " << sh.rows << " k " << sh.k << " m " << m;
      // fp32 output (the router's logits): the accumulators themselves, no bf16 rounding (that
      // alone would be ~4e-3 of a value).
      for (const int chunks : {2, 1}) {
        a.max_chunks = chunks;
        a.stages = 4;
        a.y_f32 = true;
        device_vec<float> d_yf(static_cast<std::size_t>(m) * sh.rows);
        CUDA_OK(cudaMemset(d_yf.p, 0xff, d_yf.n * 4));
        a.y = d_yf.p;
        kernels::dense_mma(a, m, kernels::dense_mma_ksplit(a, m, 0), nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        const auto yf = d_yf.host();
        double worst = 0;
        for (std::size_t i = 0; i < yf.size(); ++i) {
          ASSERT_TRUE(std::isfinite(yf[i])) << "fp32 element " << i << " unwritten, m " << m;
          worst = std::max(worst, std::abs(yf[i] - reference[i]) / (1.0 + std::abs(reference[i])));
        }
        EXPECT_LT(worst, 1e-4) << "fp32 output, rows " << sh.rows << " m " << m;
        a.y_f32 = false;
      }
      a.max_chunks = 4;
      const int automatic = kernels::dense_mma_ksplit(a, m, 0);
      EXPECT_TRUE(automatic == 1 || automatic == 2 || automatic == 4 || automatic == 8);
    }
  }
  // More rows than two passes hold, or a GLU projection: refused, naming the row count.
  kernels::expert_mma_args a;
  a.rows = 64;
  a.k = 256;
  EXPECT_EQ(kernels::dense_mma_ksplit(a, kernels::dense_mma_max_rows + 1, 0), 0);
  try {
    kernels::dense_mma(a, kernels::dense_mma_max_rows + 1, 1, nullptr);
    ADD_FAILURE() << "129 rows accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("129 rows"), std::string::npos) << e.what();
  }
  a.glu = true;
  EXPECT_EQ(kernels::dense_mma_ksplit(a, 16, 0), 0);
}

} // namespace
