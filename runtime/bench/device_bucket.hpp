// The bucket kernel's outputs on one GPU (kernels::bucket_out over device arrays), shared by
// refit-expert-bench and the gpu-label MoE kernel test (CUDA builds).
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/cuda/cuda.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace refit::bench {

struct device_bucket {
  cuda::device_array<std::int64_t> counts, order, src_token, inverse, loads;
  cuda::device_array<int> offsets, active; // active: the ids, then their number
  // `loads`: the expert-load counters the kernel adds to, their values before.
  device_bucket(int ordinal, int copies, int experts, const std::vector<std::int64_t>& loads)
    : counts(ordinal, static_cast<std::size_t>(experts), "bucket counts"),
      order(ordinal, static_cast<std::size_t>(copies), "bucket order"),
      src_token(ordinal, static_cast<std::size_t>(copies), "bucket src_token"),
      inverse(ordinal, static_cast<std::size_t>(copies), "bucket inverse"),
      loads(ordinal, loads, "bucket loads"),
      offsets(ordinal, static_cast<std::size_t>(experts), "bucket offsets"),
      active(ordinal, static_cast<std::size_t>(experts) + 1, "bucket active") {}
  inference::kernels::bucket_out out() const {
    inference::kernels::bucket_out b;
    b.counts = counts.p;
    b.offsets = offsets.p;
    b.order = order.p;
    b.src_token = src_token.p;
    b.inverse = inverse.p;
    b.active = active.p;
    b.active_count = active.p + (active.n - 1);
    b.loads = loads.p;
    b.loads_n = static_cast<int>(loads.n);
    return b;
  }
};

} // namespace refit::bench
