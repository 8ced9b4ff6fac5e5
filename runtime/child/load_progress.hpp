// Loading version 0 (the checkpoint or the synthetic weights) in refit-runtime: what was
// loaded (describe reports it), a progress line on a TTY, and the summary log line.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/model/qwen3_moe.hpp"

namespace refit::child {

struct checkpoint_info {
  std::string path; // "" = synthetic weights
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;
  std::string fingerprint;
  double load_seconds = 0;
};

// Counts loaded canonical bytes; with `tty`, redraws one "loading ... NN%" line on stderr
// (at most every 1% of the bytes) and ends it with a newline in finish(). Thread-safe.
class load_progress {
public:
  load_progress(const std::vector<model::param_meta>& params, bool tty);
  void advance(const model::param_meta& p);
  void finish();

private:
  std::mutex mtx_;
  bool tty_;
  std::uint64_t total_ = 0;
  std::uint64_t done_ = 0;
  int shown_percent_ = -1;
};

// "loaded 123 tensors (4.5 GB) from DIR in 1.234 s (3.65 GB/s); peak host memory 56 MB"
std::string load_summary(const checkpoint_info& info);

// VmHWM of this process in bytes (0 if /proc is unreadable).
std::uint64_t peak_host_bytes();

} // namespace refit::child
