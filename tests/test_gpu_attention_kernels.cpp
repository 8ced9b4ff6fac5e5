// The bf16 engine's paged decode attention on a GPU (label gpu), alone: its three kernels (mode
// 0 on CUDA cores, 1 and 2 on the tensor cores) against a host reference (fp64 over the same
// bf16 q / K / V) over shuffled block tables, lengths inside one block, across block boundaries
// and one past a tile of 32, one and several splits, at head_dim 64 and 128 and groups 1 to 16
// (group 16 always on CUDA cores), mode 2 at 4, 6 and 8 warps a block, the cache of the second
// of two layers.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
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

struct attention_case {
  int d, group;
};

// Batch of four sequences: lengths 1, 16 (one whole block), 33 (a tile and one) and 200
// (13 blocks); hkv 2, block size 16, two layers (the second one's K/V read).
TEST(GpuAttentionKernels, DecodeAttentionMatchesTheHostReferenceOnEveryKernel) {
  REQUIRE_GPUS(1);
  const int hkv = 2, block = 16, layers = 2, layer = 1;
  const std::vector<i64> lengths = {1, 16, 33, 200};
  const int b = static_cast<int>(lengths.size());
  const int width = 13;
  for (const attention_case c : {attention_case{128, 8}, attention_case{128, 4},
                                 attention_case{128, 1}, attention_case{64, 8},
                                 attention_case{64, 2}, attention_case{128, 16}}) {
    const int d = c.d, hq = hkv * c.group;
    const i64 part = i64{block} * hkv * d; // one (layer, k|v) part of a block
    const i64 block_elems = 2 * layers * part;
    const int blocks = b * width + 3;
    // Shuffled tables: sequence i's blocks anywhere in the arena.
    std::vector<i64> order(static_cast<std::size_t>(blocks));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(7 + d + c.group));
    std::vector<i64> table(order.begin(), order.begin() + b * width);
    const auto arena = random_bf16(static_cast<std::size_t>(blocks * block_elems), 11 + d, 1.0f);
    const auto q = random_bf16(static_cast<std::size_t>(b) * hq * d, 5 + c.group, 3.0f);
    const auto at = [&](int s, i64 p, int h, bool v) { // element of position p of sequence s
      return static_cast<std::size_t>(
        table[static_cast<std::size_t>(s * width + p / block)] * block_elems
        + layer * 2 * part + (v ? part : 0) + ((p % block) * hkv + h) * i64{d});
    };
    std::vector<double> reference(static_cast<std::size_t>(b) * hq * d);
    const double scale = 1.0 / std::sqrt(double(d));
    for (int s = 0; s < b; ++s)
      for (int head = 0; head < hq; ++head) {
        const int h = head / c.group;
        const i64 len = lengths[static_cast<std::size_t>(s)];
        std::vector<double> w(static_cast<std::size_t>(len));
        double mx = -1e300, sum = 0;
        for (i64 p = 0; p < len; ++p) {
          double dot = 0;
          for (int e = 0; e < d; ++e)
            dot += double(from_bf16(q[static_cast<std::size_t>((s * hq + head) * d + e)]))
                   * from_bf16(arena[at(s, p, h, false) + static_cast<std::size_t>(e)]);
          w[static_cast<std::size_t>(p)] = dot * scale;
          mx = std::max(mx, dot * scale);
        }
        for (auto& x : w)
          sum += x = std::exp(x - mx);
        for (int e = 0; e < d; ++e) {
          double o = 0;
          for (i64 p = 0; p < len; ++p)
            o += w[static_cast<std::size_t>(p)]
                 * from_bf16(arena[at(s, p, h, true) + static_cast<std::size_t>(e)]);
          reference[static_cast<std::size_t>((s * hq + head) * d + e)] = o / sum;
        }
      }
    device_vec<std::uint16_t> d_arena(arena), d_q(q);
    device_vec<i64> d_table(table), d_lengths(lengths);
    kernels::kv_target kv;
    kv.base = d_arena.p;
    kv.block_elems = block_elems;
    kv.part_elems = part;
    kv.layer_offset = layer * 2 * part;
    kv.block_size = block;
    struct kernel_choice {
      int mode, warps;
    };
    for (const kernel_choice k : {kernel_choice{0, 4}, kernel_choice{1, 4}, kernel_choice{2, 4},
                                  kernel_choice{2, 6}, kernel_choice{2, 8}})
      for (const int splits : {1, 3, 16}) {
        const int mode = k.mode, warps = k.warps;
        if (c.group > 8 && warps != 4)
          continue; // group 16 runs on CUDA cores at 4 warps; more are refused (below)
        device_vec<std::uint16_t> out(reference.size());
        CUDA_OK(cudaMemset(out.p, 0xff, out.n * 2)); // NaN: an element left unwritten shows
        device_vec<float> partial(static_cast<std::size_t>(b) * hq * splits * (d + 2));
        kernels::decode_attention(d_q.p, kv, d_table.p, width, d_lengths.p, out.p,
                                  splits > 1 ? partial.p : nullptr, splits, b, hq, hkv, d,
                                  nullptr, mode, nullptr, warps);
        CUDA_OK(cudaDeviceSynchronize());
        const auto got = out.host();
        double worst = 0;
        for (std::size_t i = 0; i < got.size(); ++i) {
          const double g = from_bf16(got[i]);
          ASSERT_TRUE(std::isfinite(g)) << "element " << i << " unwritten or NaN";
          worst = std::max(worst, std::abs(g - reference[i]) / (std::abs(reference[i]) + 0.05));
        }
        EXPECT_LT(worst, 0.02) << "d " << d << " group " << c.group << " splits " << splits
                               << " mode " << mode << " warps " << warps;
      }
  }
}

// Unsupported shapes, split counts and modes, and the kernel's own q/k outside mode 2, are
// refused, naming them.
TEST(GpuAttentionKernels, UnsupportedShapesAndSplitsAreRefused) {
  REQUIRE_GPUS(1);
  EXPECT_FALSE(kernels::decode_attention_supported(96, 8));
  EXPECT_FALSE(kernels::decode_attention_supported(128, 3));
  EXPECT_TRUE(kernels::decode_attention_supported(128, 16));
  kernels::kv_target kv;
  try {
    kernels::decode_attention(nullptr, kv, nullptr, 1, nullptr, nullptr, nullptr, 2, 1, 8, 1,
                              128, nullptr);
    ADD_FAILURE() << "two splits without a partial buffer accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("2 splits"), std::string::npos) << e.what();
  }
  try {
    kernels::decode_attention(nullptr, kv, nullptr, 1, nullptr, nullptr, nullptr, 1, 1, 8, 1,
                              128, nullptr, 3);
    ADD_FAILURE() << "mode 3 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("mode 3"), std::string::npos) << e.what();
  }
  const kernels::attention_qk qk; // the kernel's own q/k: mode 2 only
  try {
    kernels::decode_attention(nullptr, kv, nullptr, 1, nullptr, nullptr, nullptr, 1, 1, 8, 1,
                              128, nullptr, 1, &qk);
    ADD_FAILURE() << "the fused q/k accepted in mode 1";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("fused q/k of mode 1"), std::string::npos) << e.what();
  }
  try { // no KV heads: a group of 0, refused by name rather than divided by
    kernels::decode_attention(nullptr, kv, nullptr, 1, nullptr, nullptr, nullptr, 1, 1, 8, 0,
                              128, nullptr, 2);
    ADD_FAILURE() << "0 KV heads accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("unsupported group 0"), std::string::npos) << e.what();
  }
  struct refused_warps {
    int mode, hq, warps;
    const char* message;
  };
  for (const refused_warps r : {refused_warps{2, 8, 5, "5 warps a block in mode 2, group 8"},
                                refused_warps{1, 8, 6, "6 warps a block in mode 1, group 8"},
                                refused_warps{2, 16, 8, "8 warps a block in mode 2, group 16"}}) {
    try {
      kernels::decode_attention(nullptr, kv, nullptr, 1, nullptr, nullptr, nullptr, 1, 1, r.hq, 1,
                                128, nullptr, r.mode, nullptr, r.warps);
      ADD_FAILURE() << r.message << " accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(r.message), std::string::npos) << e.what();
    }
  }
  // Mode 2 up to group 8: the wanted count, else six while two blocks an SM hold the grid, else
  // four; four wherever the kernel has no choice.
  int sms = 0;
  CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  EXPECT_EQ(kernels::decode_attention_warps(2 * sms, 2, 8), 6);
  EXPECT_EQ(kernels::decode_attention_warps(2 * sms + 1, 2, 8), 4);
  EXPECT_EQ(kernels::decode_attention_warps(2 * sms + 1, 2, 8, 8), 8);
  EXPECT_EQ(kernels::decode_attention_warps(1, 1, 8), 4);
  EXPECT_EQ(kernels::decode_attention_warps(1, 2, 16, 6), 4);
  EXPECT_GE(kernels::decode_attention_splits(1, 4), 1);
  EXPECT_LE(kernels::decode_attention_splits(1, 4), kernels::max_attention_splits);
}

} // namespace
