// Hands every trainer rank of a publication the same collective. The in-process CPU registry
// creates a fresh local_collective per publication, so a failed publication's aborted
// collective can never leak into the next one; the NCCL registry (runtime/cuda) keeps its
// communicators across publications and replaces them only after an abort.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "runtime/publication/collective.hpp"

namespace refit::publication {

class collective_registry {
public:
  virtual ~collective_registry() = default;
  // The collective of `publication_id` (the same object for every rank that asks).
  virtual std::shared_ptr<collective> for_publication(const std::string& publication_id) = 0;
};

// Ranks that are threads of one process, on CPU devices.
class local_collective_registry final : public collective_registry {
public:
  explicit local_collective_registry(std::uint32_t world) : world_(world) {}

  std::shared_ptr<collective> for_publication(const std::string& publication_id) override {
    std::lock_guard<std::mutex> guard(mtx_);
    for (auto it = live_.begin(); it != live_.end();)
      it = it->second.expired() ? live_.erase(it) : std::next(it);
    if (auto existing = live_[publication_id].lock())
      return existing;
    auto fresh = std::make_shared<local_collective>(world_);
    live_[publication_id] = fresh;
    return fresh;
  }

private:
  std::uint32_t world_;
  std::mutex mtx_;
  std::map<std::string, std::weak_ptr<collective>> live_;
};

} // namespace refit::publication
