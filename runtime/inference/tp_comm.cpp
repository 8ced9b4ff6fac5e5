#include "runtime/inference/tp_comm.hpp"

#include <cstring>

namespace refit::inference {

void single_rank_comm::all_reduce_sum(std::uint32_t rank, float*, std::size_t) {
  if (!aborted_.empty())
    throw comm_error(aborted_);
  if (rank != 0)
    throw comm_error("all_reduce_sum: rank " + std::to_string(rank) + " in a group of 1");
}

void single_rank_comm::all_gather(std::uint32_t rank, const float* in, std::size_t n,
                                  float* out) {
  if (!aborted_.empty())
    throw comm_error(aborted_);
  if (rank != 0)
    throw comm_error("all_gather: rank " + std::to_string(rank) + " in a group of 1");
  if (n != 0 && in != out)
    std::memmove(out, in, n * sizeof(float));
}

void single_rank_comm::abort(const std::string& reason) {
  aborted_ = reason.empty() ? "aborted" : reason;
}

inproc_comm::inproc_comm(std::uint32_t world_size, std::chrono::milliseconds timeout)
  : world_(world_size), timeout_(timeout), ptrs_(world_size), counts_(world_size), ops_(world_size),
    scratch_(world_size) {
  if (world_size == 0)
    throw std::invalid_argument("inproc_comm: world size must be >= 1");
}

void inproc_comm::check_rank(std::uint32_t rank, const char* what) const {
  if (rank >= world_)
    throw comm_error(std::string(what) + ": rank " + std::to_string(rank)
                     + " is out of range for a group of " + std::to_string(world_));
}

void inproc_comm::barrier(std::uint32_t rank, const char* what) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (aborted_)
    throw comm_error(abort_reason_);
  const std::uint64_t generation = generation_;
  if (++arrived_ == world_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  while (generation_ == generation && !aborted_) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation
        && !aborted_) {
      aborted_ = true;
      abort_reason_ = std::string(what) + ": TP rank " + std::to_string(rank) + " waited "
                      + std::to_string(timeout_.count()) + " ms for "
                      + std::to_string(world_ - arrived_) + " of " + std::to_string(world_)
                      + " ranks; the group is aborted";
      cv_.notify_all();
    }
  }
  if (generation_ == generation)
    throw comm_error(abort_reason_);
}

void inproc_comm::exchange(std::uint32_t rank, const void* ptr, std::size_t n, const char* what) {
  check_rank(rank, what);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ptrs_[rank] = ptr;
    counts_[rank] = n;
    ops_[rank] = what;
  }
  barrier(rank, what);
  // Every rank sees the same counts, so every rank reaches the same verdict.
  std::lock_guard<std::mutex> lock(mutex_);
  for (std::uint32_t r = 0; r < world_; ++r) {
    if (counts_[r] != counts_[0] || std::strcmp(ops_[r], ops_[0]) != 0) {
      const std::string reason = std::string("collective mismatch: TP rank ") + std::to_string(r)
                                 + " called " + ops_[r] + " with " + std::to_string(counts_[r])
                                 + " elements, rank 0 called " + ops_[0] + " with "
                                 + std::to_string(counts_[0]);
      if (!aborted_) {
        aborted_ = true;
        abort_reason_ = reason;
        cv_.notify_all();
      }
      throw comm_error(reason);
    }
  }
}

void inproc_comm::all_reduce_sum(std::uint32_t rank, float* data, std::size_t n) {
  if (world_ == 1) {
    check_rank(rank, "all_reduce_sum");
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_)
      throw comm_error(abort_reason_);
    return;
  }
  exchange(rank, data, n, "all_reduce_sum");
  std::vector<float>& sum = scratch_[rank];
  sum.assign(n, 0.0f);
  // Rank order on every rank: bitwise identical results everywhere.
  for (std::uint32_t r = 0; r < world_; ++r) {
    const float* src = static_cast<const float*>(ptrs_[r]);
    for (std::size_t i = 0; i < n; ++i)
      sum[i] += src[i];
  }
  barrier(rank, "all_reduce_sum"); // nobody writes its data while others still read it
  if (n != 0)
    std::memcpy(data, sum.data(), n * sizeof(float));
}

void inproc_comm::all_gather(std::uint32_t rank, const float* in, std::size_t n, float* out) {
  exchange(rank, in, n, "all_gather");
  for (std::uint32_t r = 0; r < world_; ++r)
    if (n != 0)
      std::memcpy(out + std::size_t{r} * n, ptrs_[r], n * sizeof(float));
  barrier(rank, "all_gather"); // inputs stay valid until every rank copied them
}

void inproc_comm::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = reason.empty() ? "aborted" : reason;
  }
  cv_.notify_all();
}

void inproc_comm::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  aborted_ = false;
  abort_reason_.clear();
  arrived_ = 0;
  ++generation_;
  for (auto& s : scratch_)
    std::vector<float>().swap(s);
}

bool inproc_comm::aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

std::uint64_t inproc_comm::barriers_completed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return generation_;
}

} // namespace refit::inference
