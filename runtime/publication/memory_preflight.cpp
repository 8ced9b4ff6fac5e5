#include "runtime/publication/memory_preflight.hpp"

#include <limits>
#include <map>

#include "runtime/publication/backend.hpp"

namespace refit::publication {

namespace {

constexpr std::uint64_t max_u64 = std::numeric_limits<std::uint64_t>::max();

std::uint64_t sat_add(std::uint64_t a, std::uint64_t b) {
  return a > max_u64 - b ? max_u64 : a + b;
}

std::string bytes_text(std::uint64_t b) {
  if (b == max_u64)
    return "more than 2^64 bytes";
  std::string out = std::to_string(b) + " bytes";
  if (b >= (1ull << 30))
    out += " (" + std::to_string(b >> 30) + " GiB)";
  else if (b >= (1ull << 20))
    out += " (" + std::to_string(b >> 20) + " MiB)";
  return out;
}

struct need {
  std::string where;          // "the host (CPU workers 0, 1)" / "cuda:1"
  std::uint32_t workers = 0;
  std::uint64_t resident = 0; // resident weights of those workers
  std::uint64_t kv = 0;       // their KV caches
  device::spec device;        // one device of the group, for free_bytes
};

} // namespace

void preflight_runtime_memory(const model::model_config& model,
                              const std::vector<device::spec>& devices,
                              std::uint64_t kv_cache_bytes, const free_bytes_fn& free_bytes) {
  if (devices.empty())
    return;
  const model::tp_layout layout(model, static_cast<std::uint32_t>(devices.size()));
  const std::uint64_t resident = layout.resident_bytes();
  // CPU workers share the host's memory; each GPU is its own pool.
  std::map<std::string, need> groups;
  for (std::size_t r = 0; r < devices.size(); ++r) {
    const auto& d = devices[r];
    const std::string key = d.k == device::kind::cpu ? "host" : device::to_string(d);
    auto& g = groups[key];
    if (g.workers == 0) {
      g.device = d;
      g.where = d.k == device::kind::cpu ? "the host" : device::to_string(d);
    }
    ++g.workers;
    g.resident = sat_add(g.resident, resident);
    g.kv = sat_add(g.kv, kv_cache_bytes);
  }
  for (const auto& [key, g] : groups) {
    const std::uint64_t have = free_bytes ? free_bytes(g.device) : device_free_bytes(g.device);
    if (have == 0)
      continue; // unknown (no /proc/meminfo): nothing to compare against
    const std::uint64_t total = sat_add(g.resident, g.kv);
    if (total <= have)
      continue;
    const std::string what = std::to_string(g.workers) + " TP worker(s) on " + g.where + " need "
                             + bytes_text(g.kv) + " of KV cache ("
                             + std::to_string(kv_cache_bytes) + " bytes each) + "
                             + bytes_text(g.resident) + " of resident weights = "
                             + bytes_text(total) + ", but " + g.where + " has "
                             + bytes_text(have)
                             + (g.device.k == device::kind::cpu ? " available (MemAvailable)"
                                                                : " free (cudaMemGetInfo)")
                             + "; nothing was allocated";
    // The key to change: the KV cache unless the weights alone do not fit.
    throw memory_refusal(g.resident > have ? "model" : "runtime.kv_cache_bytes", what);
  }
}

} // namespace refit::publication
