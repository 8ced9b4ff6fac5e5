#include "runtime/child/load_progress.hpp"

#include <cstdio>
#include <fstream>
#include <unistd.h>

namespace refit::child {

load_progress::load_progress(const std::vector<model::param_meta>& params, bool tty) : tty_(tty) {
  for (const auto& p : params)
    total_ += p.nbytes();
}

void load_progress::advance(const model::param_meta& p) {
  std::lock_guard<std::mutex> guard(mtx_);
  done_ += p.nbytes();
  if (!tty_ || total_ == 0)
    return;
  const int percent = static_cast<int>(done_ * 100 / total_);
  if (percent == shown_percent_)
    return;
  shown_percent_ = percent;
  char line[96];
  const int n = std::snprintf(line, sizeof(line), "\rrefit-runtime: loading weights %3d%% (%.2f GB)",
                              percent, static_cast<double>(done_) / 1e9);
  (void)!::write(STDERR_FILENO, line, static_cast<std::size_t>(n));
}

void load_progress::finish() {
  std::lock_guard<std::mutex> guard(mtx_);
  if (tty_ && shown_percent_ >= 0)
    (void)!::write(STDERR_FILENO, "\n", 1);
}

std::uint64_t peak_host_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0)
      return std::stoull(line.substr(6)) * 1024; // "VmHWM:   1234 kB"
  return 0;
}

std::string load_summary(const checkpoint_info& info) {
  char buf[512];
  const double gb = static_cast<double>(info.bytes) / 1e9;
  std::snprintf(buf, sizeof(buf),
                "loaded %llu tensors (%.3f GB) from %s in %.3f s (%.2f GB/s); peak host memory "
                "%.1f MB; fingerprint %.16s",
                static_cast<unsigned long long>(info.tensors), gb, info.path.c_str(),
                info.load_seconds, info.load_seconds > 0 ? gb / info.load_seconds : 0.0,
                static_cast<double>(peak_host_bytes()) / 1e6, info.fingerprint.c_str());
  return buf;
}

} // namespace refit::child
