// Measurements the benchmarks share: a process's memory from /proc (and its peak-RSS reset),
// a sampler of the peak, the device free-memory probe (CUDA builds) and the memcpy bound.
#pragma once

// RSS at the reset. Both processes map the same memfd pages, so the sum counts those twice.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <atomic>
#include <thread>

#include <sys/mman.h>
#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <nlohmann/json.hpp>

#include "runtime/bench/publish_bench.hpp"
#include "runtime/device/device.hpp"
#include "runtime/control/process.hpp"
#if REFIT_HAVE_CUDA
#include "runtime/cuda/cuda.hpp"
#endif

namespace refit::bench {

// ------------------------------------------------------------------------ /proc memory

struct proc_memory {
  bool ok = false;
  std::uint64_t rss = 0;       // VmRSS
  std::uint64_t hwm = 0;       // VmHWM (peak RSS since start or the last clear_refs 5)
  std::uint64_t rss_anon = 0;  // RssAnon
  std::uint64_t rss_shmem = 0; // RssShmem (memfd pages mapped by the process)
};

inline proc_memory read_memory(pid_t pid) {
  proc_memory m;
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  auto field = [&](const char* key, std::uint64_t& out) {
    const std::size_t n = std::strlen(key);
    if (line.compare(0, n, key) != 0)
      return false;
    std::istringstream fields(line.substr(n));
    std::uint64_t kb = 0;
    if (fields >> kb)
      out = kb * 1024;
    return true;
  };
  while (std::getline(in, line)) {
    if (field("VmRSS:", m.rss))
      m.ok = true;
    field("VmHWM:", m.hwm);
    field("RssAnon:", m.rss_anon);
    field("RssShmem:", m.rss_shmem);
  }
  return m;
}

// Resets the process's VmHWM to its current RSS; false if the kernel refuses.
inline bool reset_peak_rss(pid_t pid) {
  std::ofstream out("/proc/" + std::to_string(pid) + "/clear_refs");
  if (!out)
    return false;
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

// Peak RSS growth of one process across a window: reset the watermark, note the RSS, and at
// the end read the watermark.
struct peak_probe {
  pid_t pid = 0;
  bool armed = false;
  std::uint64_t base = 0;

  void arm(pid_t p) {
    pid = p;
    armed = p > 0 && reset_peak_rss(p);
    if (armed) {
      auto m = read_memory(p);
      armed = m.ok;
      base = m.rss;
    }
  }
  // Bytes above the RSS at arm(), or nullopt when it could not be measured.
  std::optional<std::uint64_t> peak_extra() const {
    if (!armed)
      return std::nullopt;
    auto m = read_memory(pid);
    if (!m.ok)
      return std::nullopt;
    return m.hwm > base ? m.hwm - base : 0;
  }
};

// Largest drop of free device memory on any of `ordinals` while it runs (GPU builds).
class device_memory_probe {
public:
  explicit device_memory_probe(std::vector<int> ordinals) : ordinals_(std::move(ordinals)) {
#if REFIT_HAVE_CUDA
    for (int d : ordinals_)
      base_.push_back(refit::cuda::free_bytes(d));
    peak_.assign(ordinals_.size(), 0);
    thread_ = std::thread([this] {
      while (!stop_) {
        for (std::size_t i = 0; i < ordinals_.size(); ++i) {
          const std::uint64_t free = refit::cuda::free_bytes(ordinals_[i]);
          if (free < base_[i])
            peak_[i] = std::max(peak_[i], base_[i] - free);
        }
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    });
#endif
  }
  ~device_memory_probe() { finish(); }
  std::uint64_t finish() {
    stop_ = true;
    if (thread_.joinable())
      thread_.join();
    std::uint64_t worst = 0;
    for (auto p : peak_)
      worst = std::max(worst, p);
    return worst;
  }

private:
  std::vector<int> ordinals_;
  std::vector<std::uint64_t> base_;
  std::vector<std::uint64_t> peak_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// ------------------------------------------------------------------------ memcpy bound

struct mapping {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
  explicit mapping(std::size_t n) : bytes(n) {
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw bench_error("memcpy bound: cannot allocate " + std::to_string(n) + " bytes: "
                        + std::strerror(errno));
    data = static_cast<std::byte*>(p);
  }
  ~mapping() { ::munmap(data, bytes); }
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;
};

// The bound: a plain single-threaded std::memcpy of `bytes` between two buffers that were
// written (faulted in) and copied once before any timing. Sampled right after every timed
// publication, so that the bound and the publications see the same machine (other tenants'
// memory traffic varies over time on shared hosts).
class memcpy_bound {
public:
  explicit memcpy_bound(std::uint64_t bytes) : src_(bytes), dst_(bytes) {
    for (std::uint64_t i = 0; i < bytes; ++i)
      src_.data[i] = static_cast<std::byte>((i * 131) >> 7);
    std::memset(dst_.data, 0, bytes);
    std::memcpy(dst_.data, src_.data, bytes); // warm-up
  }

  void sample(unsigned reps) {
    const std::size_t bytes = src_.bytes;
    for (unsigned r = 0; r < reps; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      std::memcpy(dst_.data, src_.data, bytes);
      asm volatile("" : : "r"(dst_.data) : "memory"); // the copy is observable
      auto t1 = std::chrono::steady_clock::now();
      seconds_.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
    if (std::memcmp(dst_.data + bytes / 2, src_.data + bytes / 2, bytes - bytes / 2) != 0)
      throw bench_error("memcpy bound: the copy differs from its source");
  }

  const std::vector<double>& seconds() const { return seconds_; }

private:
  mapping src_, dst_;
  std::vector<double> seconds_;
};

inline double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  const std::size_t n = xs.size();
  return n % 2 ? xs[n / 2] : (xs[n / 2 - 1] + xs[n / 2]) / 2;
}


} // namespace refit::bench
