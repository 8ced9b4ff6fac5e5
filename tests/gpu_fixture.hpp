// Shared by the gpu-label tests: how many CUDA devices this process sees, and the skip macro.
#pragma once

#include <exception>

#include <gtest/gtest.h>

#include "runtime/cuda/cuda.hpp"

namespace refit::testing {

// CUDA devices this process sees; 0 when CUDA sees none (e.g. CUDA_VISIBLE_DEVICES=1,0 on a
// one-GPU machine, where cudaGetDeviceCount fails): the test then skips instead of failing.
inline int visible_gpus() {
  try {
    return cuda::device_count();
  } catch (const std::exception&) {
    return 0;
  }
}

} // namespace refit::testing

#define REQUIRE_GPUS(n)                                                                      \
  if (refit::testing::visible_gpus() < (n))                                                  \
  GTEST_SKIP() << "needs " << (n) << " CUDA devices, this process sees "                     \
               << refit::testing::visible_gpus()
