// Tensor-parallel collectives of one TP group, behind one interface: the in-process
// implementation here connects the worker threads of refit-runtime through host memory; a
// GPU build backs the same interface with NCCL (runtime/cuda/nccl_tp_comm.hpp), which also
// has the device collectives below (on_device()).
//
// Contract (SPMD): every rank calls the same collectives in the same order with the same
// element counts. Results are bitwise identical on every rank (the in-process all-reduce sums
// in rank order on each rank), so ranks that feed identical gathered logits into sampling pick
// identical tokens.
//
// Failure: a rank that fails calls abort(); every rank waiting in (or later entering) a
// collective then throws comm_error instead of hanging. A rank that waits longer than the
// deadline aborts the group itself. Mismatched element counts abort the group too (the
// in-process implementation checks them; NCCL cannot, so there they are the caller's bug).
//
// Device collectives (on_device() true): the *_device calls only enqueue the collective on
// the rank's CUDA stream (legal inside a CUDA-graph capture; every rank must capture and
// replay the same sequence) and return; nothing waits for it. wait_device() is where a rank
// waits for its stream, against the timeout and the abort flag: a rank calls it before any
// host synchronization with that stream, so a dead peer ends in comm_error, never a hang.
// This header stays free of CUDA, NCCL and LibTorch: streams are cudaStream_t as void*.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace refit::inference {

// A collective failed or the group was aborted.
struct comm_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Element type of a device collective.
enum class device_dtype : std::uint8_t { float32, bfloat16 };

inline const char* to_string(device_dtype dt) {
  return dt == device_dtype::float32 ? "float32" : "bfloat16";
}

class tp_comm {
public:
  virtual ~tp_comm() = default;
  virtual std::uint32_t world_size() const = 0;
  // data[0..n) = sum over ranks of their data[0..n), on every rank.
  virtual void all_reduce_sum(std::uint32_t rank, float* data, std::size_t n) = 0;
  // out[r*n .. (r+1)*n) = rank r's in[0..n), on every rank (out holds world_size()*n).
  virtual void all_gather(std::uint32_t rank, const float* in, std::size_t n, float* out) = 0;
  // Fails every pending and later collective of the group with comm_error(reason).
  virtual void abort(const std::string& reason) = 0;
  // Re-arms the group after an abort; only while no rank is in a collective (the server
  // calls it after every request). Default: nothing to re-arm.
  virtual void reset() {}

  // True: the *_device collectives below work (data in the memory of the rank's device).
  virtual bool on_device() const { return false; }
  // In place: data[0..n) = sum over ranks, enqueued on `cuda_stream` (a cudaStream_t).
  virtual void all_reduce_sum_device(std::uint32_t /*rank*/, void* /*data*/, std::size_t /*n*/,
                                     device_dtype /*dt*/, void* /*cuda_stream*/) {
    throw not_on_device("all_reduce_sum_device");
  }
  // out[r*n .. (r+1)*n) = rank r's in[0..n) (out holds world_size()*n), enqueued on
  // `cuda_stream`.
  virtual void all_gather_device(std::uint32_t /*rank*/, const void* /*in*/, std::size_t /*n*/,
                                 device_dtype /*dt*/, void* /*out*/, void* /*cuda_stream*/) {
    throw not_on_device("all_gather_device");
  }
  // Returns once everything enqueued on `cuda_stream` so far is done. Throws comm_error (and
  // aborts the group) when that takes longer than the timeout, when the group is aborted
  // meanwhile or when a collective failed. A no-op on a stream that is being captured.
  virtual void wait_device(std::uint32_t /*rank*/, void* /*cuda_stream*/) {
    throw not_on_device("wait_device");
  }
  // Changes whenever the device communicators are re-created (after an abort): CUDA graphs
  // captured with device collectives of an older epoch must not be replayed.
  virtual std::uint64_t device_epoch() const { return 0; }

protected:
  static comm_error not_on_device(const char* what) {
    return comm_error(std::string(what)
                      + ": not a device communicator (this TP group's collectives go through "
                        "host memory)");
  }
};

// World size 1: all-reduce is the identity, all-gather a copy.
class single_rank_comm final : public tp_comm {
public:
  std::uint32_t world_size() const override { return 1; }
  void all_reduce_sum(std::uint32_t rank, float* data, std::size_t n) override;
  void all_gather(std::uint32_t rank, const float* in, std::size_t n, float* out) override;
  void abort(const std::string& reason) override;
  void reset() override { aborted_.clear(); }

private:
  std::string aborted_;
};

// Threads of one process, one per rank. Reusable: after a failed (aborted) round, reset()
// re-arms it once no rank is inside a collective any more.
class inproc_comm final : public tp_comm {
public:
  // `timeout`: how long a rank waits for the others at one synchronization point.
  inproc_comm(std::uint32_t world_size, std::chrono::milliseconds timeout);

  std::uint32_t world_size() const override { return world_; }
  void all_reduce_sum(std::uint32_t rank, float* data, std::size_t n) override;
  void all_gather(std::uint32_t rank, const float* in, std::size_t n, float* out) override;
  void abort(const std::string& reason) override;

  // Clears an abort and the synchronization state. Only while no rank is in a collective.
  void reset() override;
  bool aborted() const;
  // Completed synchronization points (for tests and diagnostics).
  std::uint64_t barriers_completed() const;

private:
  // Publishes (pointer, n) of `rank`, waits for every rank, checks that the counts match.
  void exchange(std::uint32_t rank, const void* ptr, std::size_t n, const char* what);
  void barrier(std::uint32_t rank, const char* what);
  void check_rank(std::uint32_t rank, const char* what) const;

  const std::uint32_t world_;
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::uint32_t arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string abort_reason_;
  std::vector<const void*> ptrs_;
  std::vector<std::size_t> counts_;
  std::vector<const char*> ops_;
  std::vector<std::vector<float>> scratch_; // per rank: all-reduce result before copy-out
};

} // namespace refit::inference
