// One trainer rank's own tensors the way an FSDP2 trainer holds them, for refit-bench publish
// --source registered: per parameter an unpadded Shard(0) row range (transformers 5 fused
// experts: <layer>.mlp.experts.gate_up_proj / down_proj, sharded over experts), filled with the
// synthetic weights at a step so the bytes are those of the synthetic source.
//
// The memory is one arena per rank on the rank's device (host memory for cpu:N, one cudaMalloc
// for cuda:N in REFIT_CUDA builds), each parameter at its own 256-byte aligned offset, as an
// FSDP flat parameter holds its shards: one allocation, no per-tensor allocator state. Filled
// on the device (cuda::fill_synthetic) or on the host (model::fill_synthetic).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/device/device.hpp"
#include "runtime/model/synthetic.hpp"
#include "runtime/publication/registered.hpp"

namespace refit::bench {

class fsdp_memory {
public:
  // Allocates and fills this rank's rows of every parameter (fused experts) on `device`.
  // Throws std::invalid_argument for a CUDA device in a build without REFIT_CUDA, and
  // cuda::error when the device is out of memory.
  fsdp_memory(const model::model_config& cfg, std::uint32_t world, std::uint32_t rank,
              const model::synthetic_weights& w, std::uint64_t step,
              device::spec device = {device::kind::cpu, 0});
  ~fsdp_memory();
  fsdp_memory(const fsdp_memory&) = delete;
  fsdp_memory& operator=(const fsdp_memory&) = delete;

  // The registered set over this memory, sealed (valid while this object lives).
  std::shared_ptr<const publication::registered_weights> registered() const { return reg_; }
  // Bytes of the registered tensors (the model's share of this rank).
  std::uint64_t bytes() const { return bytes_; }
  // Bytes of the arena (bytes() plus the alignment padding): what this rank allocated.
  std::uint64_t allocated_bytes() const { return arena_bytes_; }
  std::size_t allocations() const { return 1; }
  const device::spec& device() const { return device_; }

private:
  struct arena; // host or device memory
  device::spec device_;
  std::unique_ptr<arena> arena_;
  std::shared_ptr<publication::registered_weights> reg_;
  std::uint64_t bytes_ = 0;
  std::uint64_t arena_bytes_ = 0;
};

} // namespace refit::bench
