// kernels::l2_prefetch (label gpu): bulk L2 prefetches over ranges of every size, from empty
// to past one chunk's tail and one range larger than the grid covers in one pass, leave the
// memory as it was and the stream without error; the refusals name what was wrong. (Whether
// the bytes land in L2 is a matter of timing: bench/results/*-generate-*.json measures it.)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu_fixture.hpp"
#include "gpu_kernel_fixture.hpp"
#include "runtime/inference/torch_kernels.hpp"

namespace {

namespace kernels = refit::inference::kernels;
using refit::testing::device_vec;
using refit::testing::random_bf16;

TEST(GpuL2Prefetch, RangesOfEverySizeRunAndLeaveTheMemoryAsItWas) {
  REQUIRE_GPUS(1);
  // 72 MiB: past the H200's L2 and past one pass of the grid (132 blocks x 32 threads x 16 KiB).
  const std::size_t elems = std::size_t{36} << 20;
  const std::vector<std::uint16_t> host = random_bf16(elems, 7, 1.0f);
  const device_vec<std::uint16_t> buf(host);
  const char* base = reinterpret_cast<const char*>(buf.p);
  const std::int64_t total = static_cast<std::int64_t>(elems * 2);
  const std::vector<std::vector<kernels::l2_range>> calls = {
    {},
    {{base, 0}},
    {{base, 15}},
    {{base, 16}},
    {{base + 16, 16 * 1024 + 48}, {base + 1024, 17}},
    {{base, total}},
    {{base, 1 << 20}, {base + 4096, 3 << 20}, {base + total / 2, total / 2}, {base, 48}},
  };
  for (const auto& ranges : calls) {
    kernels::l2_prefetch(ranges.data(), static_cast<int>(ranges.size()), nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << ranges.size() << " ranges";
  }
  EXPECT_TRUE(buf.host() == host) << "the prefetch wrote device memory";
}

TEST(GpuL2Prefetch, RefusesMisalignedRangesNegativeSizesAndTooManyRanges) {
  REQUIRE_GPUS(1);
  const device_vec<std::uint16_t> buf(std::size_t{4096});
  const char* base = reinterpret_cast<const char*>(buf.p);
  const auto refused = [](const std::vector<kernels::l2_range>& r, const std::string& says) {
    try {
      kernels::l2_prefetch(r.data(), static_cast<int>(r.size()), nullptr);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused({{base, 64}, {base + 8, 64}}, "range 1 is not 16-byte aligned");
  refused({{base, -16}}, "range 0 is not 16-byte aligned or has a negative size");
  refused(std::vector<kernels::l2_range>(kernels::max_l2_ranges + 1, {base, 64}), "5 ranges");
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

} // namespace
