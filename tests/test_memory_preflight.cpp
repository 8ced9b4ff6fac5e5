// The runtime's memory preflight (runtime/publication/memory_preflight.hpp) with injected free
// memory: asks beyond the machine name the key and both numbers, sums saturate instead of
// wrapping, CPU workers share the host while each GPU is its own pool.
#include <gtest/gtest.h>

#include "runtime/config/config.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/publication/memory_preflight.hpp"

namespace {

using namespace refit;
using publication::memory_refusal;

const model::model_config& tiny() {
  static const auto cfg = config::load_file(std::string(REFIT_SOURCE_DIR) + "/configs/tiny-synthetic.yaml").model;
  return cfg;
}

std::vector<device::spec> cpus(int n) {
  std::vector<device::spec> out;
  for (int i = 0; i < n; ++i)
    out.push_back({device::kind::cpu, i});
  return out;
}

memory_refusal refusal(const std::vector<device::spec>& devices, std::uint64_t kv,
                       const publication::free_bytes_fn& free) {
  try {
    publication::preflight_runtime_memory(tiny(), devices, kv, free);
  } catch (const memory_refusal& e) {
    return e;
  }
  ADD_FAILURE() << "no refusal";
  return memory_refusal("", "");
}

TEST(MemoryPreflight, AKvCacheBeyondTheHostNamesTheKeyAndBothNumbersWithoutWrapping) {
  const std::uint64_t kv = std::uint64_t{1} << 62; // 4 workers x 2^62 = 2^64: would wrap to 0
  auto e = refusal(cpus(4), kv, [](const device::spec&) { return std::uint64_t{64} << 30; });
  EXPECT_EQ(e.key, "runtime.kv_cache_bytes");
  const std::string msg = e.what();
  EXPECT_NE(msg.find("4 TP worker(s) on the host"), std::string::npos) << msg;
  EXPECT_NE(msg.find("more than 2^64 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("68719476736 bytes (64 GiB) available (MemAvailable)"), std::string::npos) << msg;
}

TEST(MemoryPreflight, AModelTooLargeForTheHostNamesTheModel) {
  auto e = refusal(cpus(2), 4096, [](const device::spec&) { return std::uint64_t{1000}; });
  EXPECT_EQ(e.key, "model");
  const model::tp_layout layout(tiny(), 2);
  EXPECT_NE(std::string(e.what()).find(std::to_string(2 * layout.resident_bytes()) + " bytes of resident weights"),
            std::string::npos) << e.what();
}

TEST(MemoryPreflight, EachGpuIsItsOwnPool) {
  std::vector<device::spec> gpus{{device::kind::cuda, 0}, {device::kind::cuda, 1}};
  const std::uint64_t kv = 1 << 20;
  auto free = [](const device::spec& d) {
    return d.index == 0 ? std::uint64_t{1} << 30 : std::uint64_t{1} << 19;
  };
  auto e = refusal(gpus, kv, free);
  EXPECT_EQ(e.key, "runtime.kv_cache_bytes");
  EXPECT_NE(std::string(e.what()).find("1 TP worker(s) on cuda:1"), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("free (cudaMemGetInfo)"), std::string::npos) << e.what();
}

TEST(MemoryPreflight, WhatFitsPasses) {
  EXPECT_NO_THROW(publication::preflight_runtime_memory(
    tiny(), cpus(2), 4 << 20, [](const device::spec&) { return std::uint64_t{1} << 30; }));
  // Exactly enough is enough.
  const model::tp_layout layout(tiny(), 2);
  const std::uint64_t need = 2 * (layout.resident_bytes() + 4096);
  EXPECT_NO_THROW(publication::preflight_runtime_memory(
    tiny(), cpus(2), 4096, [need](const device::spec&) { return need; }));
  EXPECT_THROW(publication::preflight_runtime_memory(
                 tiny(), cpus(2), 4096, [need](const device::spec&) { return need - 1; }),
               memory_refusal);
}

} // namespace
