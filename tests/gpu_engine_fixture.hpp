// Shared by the gpu-label engine tests (test_gpu_engine, test_gpu_tp_comm): device memory for
// an engine_rig's residents and KV arena on one GPU, and the rig built over it.
#pragma once

#include <cstddef>
#include <deque>
#include <vector>

#include "engine_fixture.hpp"
#include "runtime/cuda/cuda.hpp"

namespace refit::testing {

// Residents copied to cuda:`dev`, KV arenas allocated there; freed with the object.
struct gpu_memory {
  int dev = 0;
  std::deque<cuda::device_allocation> allocations;
  const std::byte* place(const std::vector<std::byte>& b) {
    allocations.emplace_back(dev, b.size(), "resident");
    cuda::copy_to_device(dev, allocations.back().data(), b.data(), b.size());
    return allocations.back().data();
  }
  std::byte* alloc(std::size_t n) {
    allocations.emplace_back(dev, n, "KV arena");
    return allocations.back().data();
  }
};

// A TP-1 engine_rig on cuda:`mem.dev` over `mem`.
inline engine_rig gpu_rig(gpu_memory& mem, const model::model_config& cfg,
                          const engine_weights& w, model::dtype dt, std::uint32_t block_size,
                          std::uint32_t blocks, bool graphs = true, bool fused = true) {
  return engine_rig(cfg, w, dt, block_size, blocks, mem.dev,
                    [&](const std::vector<std::byte>& b) { return mem.place(b); },
                    [&](std::size_t n) { return mem.alloc(n); }, graphs, fused);
}

} // namespace refit::testing
