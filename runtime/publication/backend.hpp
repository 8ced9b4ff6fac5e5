// What depends on a trainer rank's device kind, in one place: the device's identity and free
// memory, the producer's packed buffers (memfd on CPU devices, cudaMalloc'ed and exported
// once through CUDA IPC on GPUs), the collective between ranks (in-process rank push on CPU,
// NCCL on GPUs) and the verifier's expected resident digests. CUDA devices need a build with
// REFIT_CUDA=ON; without it every cuda:N request throws std::invalid_argument naming it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/device/device.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"
#include "runtime/publication/collective_registry.hpp"

namespace refit::publication {

// "CPU-..." (a stable host hash) or "GPU-..." (the physical UUID, as NVML prints it).
std::string device_uuid(const device::spec& device);
// MemAvailable of the host, or cudaMemGetInfo's free bytes of the GPU.
std::uint64_t device_free_bytes(const device::spec& device);

// A trainer rank's packed buffers; each is exported once as a handle string the runtime's
// worker on the same device opens ("memfd:<pid>:<fd>" / "cudaipc:<uuid>:<bytes>:<hex>").
class buffer_pool {
public:
  virtual ~buffer_pool() = default;
  virtual std::uint32_t count() const = 0;
  virtual std::uint64_t bytes() const = 0;
  // Buffer i in the device's memory (a device pointer on GPUs).
  virtual std::byte* data(std::uint32_t i) const = 0;
  virtual std::string handle(std::uint32_t i) const = 0;
};

std::unique_ptr<buffer_pool> make_buffer_pool(const device::spec& device, std::uint32_t count,
                                              std::uint64_t bytes);

// One collective registry for ranks that are threads of this process; rank r is on
// `rank_devices[r]` (all CPU, or all CUDA).
std::shared_ptr<collective_registry> make_collective_registry(
  const std::vector<device::spec>& rank_devices);

// Element digests (runtime/model/digest.hpp) every TP worker's resident tensors must have
// after publishing the synthetic weights at `step`: out[tp rank][resident index]. Computed
// on `on`: on a CPU, one canonical tensor at a time in host memory; on a GPU, by a kernel
// that generates each placed element where it is summed (no tensor is built).
std::vector<std::vector<std::uint64_t>> expected_resident_digests(
  const model::model_config& cfg, std::uint32_t tp, const model::synthetic_weights& weights,
  std::uint64_t step, const device::spec& on = {});

} // namespace refit::publication
