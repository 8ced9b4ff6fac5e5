// The expert-projection cases of the gpu-label MoE kernel tests (test_gpu_moe_kernels,
// test_gpu_expert_bulk): a host fp32 reference of the routed experts' projections over the
// same bf16 inputs, the device inputs of one projection, and a skewed routing sorted on the
// device by bucket.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "gpu_kernel_fixture.hpp"
#include "moe_routing_fixture.hpp"
#include "runtime/bench/device_bucket.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace refit::testing {

// x-row(p) . w[e]^T for the sorted copies, fp32 over the bf16 values; GLU: silu(gate) * up.
inline std::vector<float> host_projection(const std::vector<std::uint16_t>& x,
                                   const std::vector<std::int64_t>* x_rows,
                                   const std::vector<std::uint16_t>& w, const sorted_copies& s,
                                   const std::vector<std::int64_t>& ids, int rows, int k, bool glu) {
  const int cols = glu ? rows / 2 : rows;
  std::vector<float> y(s.order.size() * static_cast<std::size_t>(cols));
  for (std::size_t p = 0; p < s.order.size(); ++p) {
    const std::int64_t e = ids[static_cast<std::size_t>(s.order[p])];
    const std::int64_t xr = x_rows != nullptr ? (*x_rows)[p] : static_cast<std::int64_t>(p);
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
  refit::inference::kernels::expert_mma_args a;
  projection_inputs(const projection_case& pc, int tokens, int experts, const std::vector<std::int64_t>& ids,
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
  std::vector<std::int64_t> ids = skewed_routing(tokens, top_k, experts, 11);
  sorted_copies want = host_bucket(ids, top_k, experts);
  device_vec<std::int64_t> d_ids{ids};
  refit::bench::device_bucket d;
  explicit routed_copies(const std::vector<std::int64_t>& loads) : d(0, copies, experts, loads) {
    refit::inference::kernels::bucket(d_ids.p, copies, top_k, experts, d.out(), nullptr);
  }
};

} // namespace refit::testing
