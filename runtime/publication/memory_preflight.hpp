// Memory preflight of the inference runtime: before anything is allocated (by the parent
// before it spawns refit-runtime, and by refit-runtime before its workers allocate), the
// resident weights and KV cache every TP worker will hold are checked against what each
// device has: MemAvailable for the CPU workers together (they share the host), the free bytes
// of each GPU (cudaMemGetInfo). A refusal names the recipe key and both numbers; it is a
// deterministic startup failure (errc::preflight_failed), never retried as a crash.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/device/device.hpp"
#include "runtime/model/qwen3_moe.hpp"

namespace refit::publication {

struct memory_refusal : std::runtime_error {
  memory_refusal(std::string key_, const std::string& message)
    : std::runtime_error(key_ + ": " + message), key(std::move(key_)) {}
  std::string key; // "runtime.kv_cache_bytes" or "model"
};

// Free bytes of a device (tests inject their own; the default is device_free_bytes).
using free_bytes_fn = std::function<std::uint64_t(const device::spec&)>;

// Throws memory_refusal when the runtime's workers on `devices` cannot hold their resident
// weights plus `kv_cache_bytes` each. Sums saturate: 2^62-byte asks do not wrap.
void preflight_runtime_memory(const model::model_config& model,
                              const std::vector<device::spec>& devices,
                              std::uint64_t kv_cache_bytes, const free_bytes_fn& free_bytes = {});

} // namespace refit::publication
