#include "runtime/cuda/nccl_collective.hpp"

#include <atomic>
#include <mutex>
#include <thread>

#include <cuda_runtime.h>
#include <nccl.h>

#include "runtime/cuda/cuda.hpp"

namespace refit::cuda {

namespace {

using publication::collective_status;
using publication::gather_item;
using clock_type = std::chrono::steady_clock;

std::string nccl_text(ncclResult_t r) { return ncclGetErrorString(r); }

class nccl_collective final : public publication::collective {
public:
  explicit nccl_collective(std::vector<int> ordinals)
    : ordinals_(std::move(ordinals)), comms_(ordinals_.size(), nullptr),
      comm_dead_(ordinals_.size(), false) {}

  ~nccl_collective() override {
    for (std::size_t r = 0; r < comms_.size(); ++r) {
      if (comms_[r] == nullptr || comm_dead_[r])
        continue;
      cudaSetDevice(ordinals_[r]);
      // A communicator whose peer aborted cannot be destroyed collectively: abort it too.
      if (broken_)
        ncclCommAbort(comms_[r]);
      else
        ncclCommDestroy(comms_[r]);
    }
  }

  std::uint32_t world() const override { return static_cast<std::uint32_t>(ordinals_.size()); }

  bool broken() const { return broken_ || aborted_; }

  collective_status prepare(std::uint32_t rank, clock_type::time_point deadline) override {
    if (rank >= world())
      return {false, "rank " + std::to_string(rank) + " of a " + std::to_string(world())
                       + "-rank NCCL collective"};
    std::lock_guard<std::mutex> guard(init_mtx_);
    if (!init_error_.empty())
      return {false, init_error_};
    if (initialized_)
      return {};
    try {
      init(deadline);
      initialized_ = true;
      return {};
    } catch (const std::exception& e) {
      init_error_ = std::string("creating the NCCL communicators: ") + e.what();
      broken_ = true;
      return {false, init_error_};
    }
  }

  collective_status all_gather(std::uint32_t rank, const std::vector<gather_item>& items,
                               clock_type::time_point deadline) override {
    if (auto s = prepare(rank, deadline); !s.ok)
      return s;
    if (aborted_)
      return {false, "collective aborted: " + reason()};
    if (comm_dead_[rank])
      return {false, "this rank's NCCL communicator was aborted earlier"};
    for (const auto& item : items)
      if (!item.pieces.empty())
        return {false, "the NCCL all-gather takes uniform dim-0 shards only (registered tensors "
                       "with a variable layout are not supported on GPUs yet)"};
    try {
      if (cudaSetDevice(ordinals_[rank]) != cudaSuccess)
        return {false, "cudaSetDevice(" + std::to_string(ordinals_[rank]) + ") failed"};
      ncclComm_t comm = comms_[rank];
      auto* s = static_cast<cudaStream_t>(streams_[rank]->native());
      ncclResult_t r = ncclGroupStart();
      for (const auto& item : items)
        if (r == ncclSuccess || r == ncclInProgress)
          r = ncclAllGather(item.shard, item.out, item.shard_bytes, ncclUint8, comm, s);
      ncclResult_t end = ncclGroupEnd();
      if (r != ncclSuccess && r != ncclInProgress)
        return fail(rank, "ncclAllGather: " + nccl_text(r));
      if (end != ncclSuccess && end != ncclInProgress)
        return fail(rank, "ncclGroupEnd: " + nccl_text(end));
      if (auto st = wait_enqueued(rank, deadline); !st.ok)
        return st;
      streams_[rank]->record();
      while (!streams_[rank]->done()) {
        if (auto st = check_waiting(rank, deadline, "the all-gather to complete"); !st.ok)
          return st;
        std::this_thread::yield();
      }
      return {};
    } catch (const std::exception& e) {
      return fail(rank, e.what());
    }
  }

  void abort(const std::string& why) override {
    {
      std::lock_guard<std::mutex> guard(reason_mtx_);
      if (!aborted_)
        reason_ = why;
    }
    aborted_ = true;
  }

  // Communicators cannot be revived after ncclCommAbort; the registry hands out new ones.
  void reset() override {}

private:
  std::string reason() {
    std::lock_guard<std::mutex> guard(reason_mtx_);
    return reason_;
  }

  void init(clock_type::time_point deadline) {
    ncclUniqueId id;
    if (auto r = ncclGetUniqueId(&id); r != ncclSuccess)
      throw error("ncclGetUniqueId: " + nccl_text(r));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclGroupStart();
    for (std::size_t i = 0; i < ordinals_.size() && (r == ncclSuccess || r == ncclInProgress); ++i) {
      if (cudaSetDevice(ordinals_[i]) != cudaSuccess)
        throw error("cudaSetDevice(" + std::to_string(ordinals_[i]) + ") failed");
      r = ncclCommInitRankConfig(&comms_[i], static_cast<int>(ordinals_.size()), id,
                                 static_cast<int>(i), &config);
    }
    ncclResult_t end = ncclGroupEnd();
    if (r != ncclSuccess && r != ncclInProgress)
      throw error("ncclCommInitRankConfig: " + nccl_text(r));
    if (end != ncclSuccess && end != ncclInProgress)
      throw error("ncclGroupEnd: " + nccl_text(end));
    for (std::size_t i = 0; i < comms_.size(); ++i) {
      ncclResult_t st = ncclInProgress;
      while (st == ncclInProgress) {
        if (ncclCommGetAsyncError(comms_[i], &st) != ncclSuccess)
          throw error("ncclCommGetAsyncError failed during init");
        if (st == ncclInProgress && clock_type::now() > deadline)
          throw error("communicator of rank " + std::to_string(i) + " not ready before the deadline");
        std::this_thread::yield();
      }
      if (st != ncclSuccess)
        throw error("communicator of rank " + std::to_string(i) + ": " + nccl_text(st));
    }
    for (int ordinal : ordinals_)
      streams_.push_back(std::make_unique<stream>(ordinal));
  }

  collective_status check_waiting(std::uint32_t rank, clock_type::time_point deadline,
                                  const std::string& what) {
    if (aborted_)
      return fail(rank, "aborted while waiting for " + what + ": " + reason());
    if (clock_type::now() > deadline)
      return fail(rank, "deadline passed while waiting for " + what
                          + " (a peer rank did not arrive)");
    return {};
  }

  // Non-blocking communicators: the group's operations are enqueued once the async state
  // leaves ncclInProgress.
  collective_status wait_enqueued(std::uint32_t rank, clock_type::time_point deadline) {
    for (;;) {
      ncclResult_t st = ncclSuccess;
      if (auto r = ncclCommGetAsyncError(comms_[rank], &st); r != ncclSuccess)
        return fail(rank, "ncclCommGetAsyncError: " + nccl_text(r));
      if (st == ncclSuccess)
        return {};
      if (st != ncclInProgress)
        return fail(rank, "NCCL: " + nccl_text(st));
      if (auto s = check_waiting(rank, deadline, "NCCL to enqueue the all-gather"); !s.ok)
        return s;
      std::this_thread::yield();
    }
  }

  // Aborts this rank's communicator (wakes its kernels) and reports `what`.
  collective_status fail(std::uint32_t rank, const std::string& what) {
    broken_ = true;
    if (!comm_dead_[rank] && comms_[rank] != nullptr) {
      cudaSetDevice(ordinals_[rank]);
      ncclCommAbort(comms_[rank]);
      comm_dead_[rank] = true;
    }
    return {false, "NCCL all-gather on cuda:" + std::to_string(ordinals_[rank]) + ": " + what};
  }

  const std::vector<int> ordinals_;
  std::mutex init_mtx_;
  bool initialized_ = false;
  std::string init_error_;
  std::vector<ncclComm_t> comms_;
  std::vector<char> comm_dead_;   // per rank; touched only by that rank's thread after init
  std::vector<std::unique_ptr<stream>> streams_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> broken_{false};
  std::mutex reason_mtx_;
  std::string reason_;
};

class nccl_registry final : public publication::collective_registry {
public:
  explicit nccl_registry(std::vector<int> ordinals) : ordinals_(std::move(ordinals)) {}

  std::shared_ptr<publication::collective> for_publication(const std::string& id) override {
    std::lock_guard<std::mutex> guard(mtx_);
    for (auto it = live_.begin(); it != live_.end();)
      it = it->second.expired() ? live_.erase(it) : std::next(it);
    if (auto existing = live_[id].lock())
      return existing;
    if (!current_ || current_->broken())
      current_ = std::make_shared<nccl_collective>(ordinals_);
    live_[id] = current_;
    return current_;
  }

private:
  const std::vector<int> ordinals_;
  std::mutex mtx_;
  std::shared_ptr<nccl_collective> current_; // healthy communicators, kept across publications
  std::map<std::string, std::weak_ptr<nccl_collective>> live_;
};

} // namespace

std::shared_ptr<publication::collective_registry> make_nccl_registry(std::vector<int> ordinals) {
  return std::make_shared<nccl_registry>(std::move(ordinals));
}

} // namespace refit::cuda
