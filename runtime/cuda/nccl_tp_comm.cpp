#include "runtime/cuda/nccl_tp_comm.hpp"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>

#include <cuda_runtime.h>
#include <nccl.h>

#include "runtime/cuda/cuda.hpp"

namespace refit::cuda {

namespace {

using clock_type = std::chrono::steady_clock;
using inference::comm_error;
using inference::device_dtype;

std::string nccl_text(ncclResult_t r) { return ncclGetErrorString(r); }

ncclDataType_t nccl_type(device_dtype dt) {
  return dt == device_dtype::float32 ? ncclFloat32 : ncclBfloat16;
}

std::string device_list(const std::vector<int>& ordinals) {
  std::string out;
  for (int o : ordinals)
    out += (out.empty() ? "cuda:" : ",cuda:") + std::to_string(o);
  return out;
}

// Makes `ordinal` the calling thread's device for a scope (the engine's threads already are
// on it: then nothing is set), and restores the previous one.
class device_scope {
public:
  explicit device_scope(int ordinal) {
    if (cudaGetDevice(&previous_) != cudaSuccess)
      previous_ = -1;
    if (previous_ != ordinal) {
      if (cudaSetDevice(ordinal) != cudaSuccess)
        throw comm_error("cudaSetDevice(" + std::to_string(ordinal) + ") failed");
      changed_ = true;
    }
  }
  ~device_scope() {
    if (changed_ && previous_ >= 0)
      cudaSetDevice(previous_);
  }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

private:
  int previous_ = -1;
  bool changed_ = false;
};

// Per rank. `comm` and `dead` are touched by that rank's thread only, except in reset() and
// the destructor (no rank in a collective then).
struct rank_state {
  ncclComm_t comm = nullptr;
  bool dead = false;              // ncclCommAbort'ed; replaced by reset()
  cudaStream_t stream = nullptr;  // the host collectives' stream
  cudaEvent_t event = nullptr;    // wait_device's marker
  void* scratch = nullptr;        // the host collectives' device buffer
  std::size_t scratch_bytes = 0;
};

class nccl_tp_comm final : public inference::tp_comm {
public:
  nccl_tp_comm(std::vector<int> ordinals, std::chrono::milliseconds timeout)
    : ordinals_(std::move(ordinals)), timeout_(timeout), ranks_(ordinals_.size()) {
    if (ordinals_.size() < 2)
      throw error("NCCL TP communicator: needs at least 2 devices, got "
                  + std::to_string(ordinals_.size()));
    try {
      for (std::size_t r = 0; r < ordinals_.size(); ++r) {
        device_scope d(ordinals_[r]);
        if (cudaStreamCreateWithFlags(&ranks_[r].stream, cudaStreamNonBlocking) != cudaSuccess
            || cudaEventCreateWithFlags(&ranks_[r].event, cudaEventDisableTiming) != cudaSuccess)
          throw error("cannot create a stream and an event on cuda:"
                      + std::to_string(ordinals_[r]));
      }
      create_comms();
    } catch (const std::exception& e) {
      try {
        drop_comms();
      } catch (...) {
      }
      release_device_resources();
      throw error("creating the NCCL TP communicators over " + device_list(ordinals_) + ": "
                  + e.what());
    }
  }

  ~nccl_tp_comm() override {
    if (aborted_)
      drop_comms();
    else
      destroy_comms();
    release_device_resources();
  }

  std::uint32_t world_size() const override {
    return static_cast<std::uint32_t>(ordinals_.size());
  }

  bool on_device() const override { return true; }

  std::uint64_t device_epoch() const override { return epoch_; }

  // ---- host collectives: scratch copy, NCCL on the rank's stream, wait, copy back --------

  void all_reduce_sum(std::uint32_t rank, float* data, std::size_t n) override {
    rank_state& s = enter(rank, "all_reduce_sum");
    if (n == 0)
      return;
    device_scope d(ordinals_[rank]);
    auto* dev = static_cast<float*>(scratch(rank, n * sizeof(float)));
    cuda_check(rank, cudaMemcpyAsync(dev, data, n * sizeof(float), cudaMemcpyHostToDevice, s.stream),
               "all_reduce_sum: copying to the device");
    enqueued(rank, ncclAllReduce(dev, dev, n, ncclFloat32, ncclSum, s.comm, s.stream),
             "all_reduce_sum");
    wait_stream(rank, s.stream, "all_reduce_sum");
    copy_back(rank, data, dev, n * sizeof(float), "all_reduce_sum");
  }

  void all_gather(std::uint32_t rank, const float* in, std::size_t n, float* out) override {
    rank_state& s = enter(rank, "all_gather");
    if (n == 0)
      return;
    device_scope d(ordinals_[rank]);
    const std::size_t world = ordinals_.size();
    auto* dev_out = static_cast<float*>(scratch(rank, (world + 1) * n * sizeof(float)));
    float* dev_in = dev_out + world * n;
    cuda_check(rank, cudaMemcpyAsync(dev_in, in, n * sizeof(float), cudaMemcpyHostToDevice, s.stream),
               "all_gather: copying to the device");
    enqueued(rank, ncclAllGather(dev_in, dev_out, n, ncclFloat32, s.comm, s.stream), "all_gather");
    wait_stream(rank, s.stream, "all_gather");
    copy_back(rank, out, dev_out, world * n * sizeof(float), "all_gather");
  }

  // ---- device collectives: enqueue only ----------------------------------------------------

  void all_reduce_sum_device(std::uint32_t rank, void* data, std::size_t n, device_dtype dt,
                             void* cuda_stream) override {
    rank_state& s = enter(rank, "all_reduce_sum_device");
    device_scope d(ordinals_[rank]);
    enqueued(rank, ncclAllReduce(data, data, n, nccl_type(dt), ncclSum, s.comm,
                                 static_cast<cudaStream_t>(cuda_stream)),
             "all_reduce_sum_device");
  }

  void all_gather_device(std::uint32_t rank, const void* in, std::size_t n, device_dtype dt,
                         void* out, void* cuda_stream) override {
    rank_state& s = enter(rank, "all_gather_device");
    device_scope d(ordinals_[rank]);
    enqueued(rank, ncclAllGather(in, out, n, nccl_type(dt), s.comm,
                                 static_cast<cudaStream_t>(cuda_stream)),
             "all_gather_device");
  }

  void wait_device(std::uint32_t rank, void* cuda_stream) override {
    enter(rank, "wait_device");
    device_scope d(ordinals_[rank]);
    auto* stream = static_cast<cudaStream_t>(cuda_stream);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    cuda_check(rank, cudaStreamIsCapturing(stream, &capturing), "wait_device");
    if (capturing != cudaStreamCaptureStatusNone)
      return; // nothing runs during a capture
    wait_stream(rank, stream, "wait_device");
  }

  // ---- failure ---------------------------------------------------------------------------

  void abort(const std::string& reason) override { abort_group(reason.empty() ? "aborted" : reason); }

  void reset() override {
    if (!aborted_)
      return;
    drop_comms();
    try {
      create_comms();
    } catch (const std::exception& e) {
      // Stays aborted: every later collective names the cause.
      drop_comms();
      std::lock_guard<std::mutex> guard(reason_mtx_);
      reason_ = "the NCCL TP communicators over " + device_list(ordinals_)
                + " could not be re-created after an abort: " + e.what();
      return;
    }
    ++epoch_;
    std::lock_guard<std::mutex> guard(reason_mtx_);
    reason_.clear();
    aborted_ = false;
  }

private:
  std::string reason() {
    std::lock_guard<std::mutex> guard(reason_mtx_);
    return reason_;
  }

  void abort_group(const std::string& why) {
    std::lock_guard<std::mutex> guard(reason_mtx_);
    if (!aborted_) {
      reason_ = why;
      aborted_ = true;
    }
  }

  // ncclCommAbort of rank's communicator (ends its kernels); the rank's thread or reset().
  void kill(std::uint32_t rank) {
    rank_state& s = ranks_[rank];
    if (s.comm == nullptr || s.dead)
      return;
    device_scope d(ordinals_[rank]);
    ncclCommAbort(s.comm);
    s.dead = true;
  }

  // The group failed because of this rank (`why`): abort everyone, throw.
  [[noreturn]] void fail(std::uint32_t rank, const std::string& why) {
    const std::string message = why + " (TP rank " + std::to_string(rank) + " on cuda:"
                                + std::to_string(ordinals_[rank]) + "); the group is aborted";
    abort_group(message);
    kill(rank);
    throw comm_error(message);
  }

  // The group was aborted by someone else: end this rank's communicator too, throw.
  [[noreturn]] void aborted_elsewhere(std::uint32_t rank) {
    kill(rank);
    throw comm_error(reason());
  }

  rank_state& enter(std::uint32_t rank, const char* what) {
    if (rank >= ordinals_.size())
      throw comm_error(std::string(what) + ": rank " + std::to_string(rank)
                       + " is out of range for a group of " + std::to_string(ordinals_.size()));
    // Aborted: refuse without ncclCommAbort here (this may be inside a graph capture, where
    // NCCL's teardown is not allowed); reset() or the destructor aborts the communicator.
    if (aborted_)
      throw comm_error(reason());
    rank_state& s = ranks_[rank];
    if (s.comm == nullptr || s.dead)
      throw comm_error(std::string(what) + ": the NCCL communicator of TP rank "
                       + std::to_string(rank) + " was aborted");
    return s;
  }

  void cuda_check(std::uint32_t rank, cudaError_t e, const std::string& what) {
    if (e != cudaSuccess)
      fail(rank, what + ": " + cudaGetErrorString(e));
  }

  // The result of an enqueueing NCCL call on a non-blocking communicator: ncclInProgress
  // means "not enqueued yet" (e.g. connections being set up): poll until it is.
  void enqueued(std::uint32_t rank, ncclResult_t r, const std::string& what) {
    if (r == ncclSuccess)
      return;
    ncclComm_t comm = ranks_[rank].comm;
    if (r != ncclInProgress)
      fail(rank, what + ": " + nccl_text(r) + " (" + ncclGetLastError(comm) + ")");
    const auto deadline = clock_type::now() + timeout_;
    for (;;) {
      ncclResult_t st = ncclSuccess;
      if (ncclResult_t q = ncclCommGetAsyncError(comm, &st); q != ncclSuccess)
        fail(rank, what + ": ncclCommGetAsyncError: " + nccl_text(q));
      if (st == ncclSuccess)
        return;
      if (st != ncclInProgress)
        fail(rank, what + ": " + nccl_text(st) + " (" + ncclGetLastError(comm) + ")");
      if (aborted_)
        aborted_elsewhere(rank);
      if (clock_type::now() > deadline)
        fail(rank, what + ": NCCL did not enqueue the collective within "
                     + std::to_string(timeout_.count()) + " ms");
      std::this_thread::yield();
    }
  }

  // Records the rank's event on `stream` and polls it against the deadline, the abort flag
  // and the communicator's asynchronous errors.
  void wait_stream(std::uint32_t rank, cudaStream_t stream, const std::string& what) {
    rank_state& s = ranks_[rank];
    cuda_check(rank, cudaEventRecord(s.event, stream), what + ": cudaEventRecord");
    const auto start = clock_type::now();
    const auto deadline = start + timeout_;
    for (std::uint64_t spins = 0;; ++spins) {
      const cudaError_t e = cudaEventQuery(s.event);
      if (e == cudaSuccess)
        return;
      if (e != cudaErrorNotReady)
        fail(rank, what + ": cudaEventQuery: " + cudaGetErrorString(e));
      if (aborted_)
        aborted_elsewhere(rank);
      if (spins % 256 == 255) {
        ncclResult_t st = ncclSuccess;
        if (ncclCommGetAsyncError(s.comm, &st) == ncclSuccess && st != ncclSuccess
            && st != ncclInProgress)
          fail(rank, what + ": NCCL: " + nccl_text(st) + " (" + ncclGetLastError(s.comm) + ")");
        if (clock_type::now() > deadline)
          fail(rank, what + ": waited " + std::to_string(timeout_.count())
                       + " ms for the TP collectives to complete (a peer rank did not arrive "
                         "or is stuck)");
      }
      // Spin (as a blocking CUDA synchronization would) through a step's usual length, then
      // poll gently.
      if (spins < 4096 || clock_type::now() - start < std::chrono::milliseconds(100))
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // The device scratch of `rank`, at least `bytes` (grown, never shrunk).
  void* scratch(std::uint32_t rank, std::size_t bytes) {
    rank_state& s = ranks_[rank];
    if (s.scratch_bytes >= bytes)
      return s.scratch;
    if (s.scratch != nullptr) {
      cudaFree(s.scratch);
      s.scratch = nullptr;
      s.scratch_bytes = 0;
    }
    cuda_check(rank, cudaMalloc(&s.scratch, bytes),
               "allocating " + std::to_string(bytes) + " bytes of collective scratch");
    s.scratch_bytes = bytes;
    return s.scratch;
  }

  // The rank's stream is idle (waited for): the copy cannot block on a peer.
  void copy_back(std::uint32_t rank, void* dst, const void* src, std::size_t bytes,
                 const std::string& what) {
    rank_state& s = ranks_[rank];
    cuda_check(rank, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s.stream),
               what + ": copying to the host");
    cuda_check(rank, cudaStreamSynchronize(s.stream), what + ": copying to the host");
  }

  // One non-blocking communicator per rank in one group, waited for against the timeout.
  void create_comms() {
    ncclUniqueId id;
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      throw error("ncclGetUniqueId: " + nccl_text(r));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const int world = static_cast<int>(ordinals_.size());
    std::vector<ncclComm_t> comms(ordinals_.size(), nullptr);
    ncclResult_t r = ncclGroupStart();
    for (int i = 0; i < world && (r == ncclSuccess || r == ncclInProgress); ++i) {
      device_scope d(ordinals_[static_cast<std::size_t>(i)]);
      r = ncclCommInitRankConfig(&comms[static_cast<std::size_t>(i)], world, id, i, &config);
    }
    const ncclResult_t end = ncclGroupEnd();
    for (std::size_t i = 0; i < comms.size(); ++i)
      ranks_[i] = rank_state{comms[i], false, ranks_[i].stream, ranks_[i].event,
                             ranks_[i].scratch, ranks_[i].scratch_bytes};
    if (r != ncclSuccess && r != ncclInProgress)
      throw error("ncclCommInitRankConfig: " + nccl_text(r));
    if (end != ncclSuccess && end != ncclInProgress)
      throw error("ncclGroupEnd: " + nccl_text(end));
    // Creation (topology, connections, buffers) gets at least a minute even when the
    // collectives' timeout is short.
    const auto limit = std::max<std::chrono::milliseconds>(timeout_, std::chrono::minutes(1));
    const auto deadline = clock_type::now() + limit;
    for (std::size_t i = 0; i < comms.size(); ++i) {
      if (comms[i] == nullptr)
        throw error("no communicator for cuda:" + std::to_string(ordinals_[i]));
      ncclResult_t st = ncclInProgress;
      while (st == ncclInProgress) {
        if (ncclCommGetAsyncError(comms[i], &st) != ncclSuccess)
          throw error("ncclCommGetAsyncError failed while creating the communicator of cuda:"
                      + std::to_string(ordinals_[i]));
        if (st == ncclInProgress && clock_type::now() > deadline)
          throw error("the communicator of cuda:" + std::to_string(ordinals_[i])
                      + " was not ready within " + std::to_string(limit.count()) + " ms");
        std::this_thread::yield();
      }
      if (st != ncclSuccess)
        throw error("the communicator of cuda:" + std::to_string(ordinals_[i]) + ": "
                    + nccl_text(st));
    }
  }

  // ncclCommAbort of every live communicator (after a failure; local, never waits on peers).
  void drop_comms() {
    for (std::uint32_t r = 0; r < ranks_.size(); ++r) {
      kill(r);
      ranks_[r].comm = nullptr;
      ranks_[r].dead = false;
    }
  }

  // A healthy shutdown: finalize all (non-blocking: polled, bounded), then destroy; anything
  // that does not finalize cleanly is aborted instead.
  void destroy_comms() {
    bool clean = true;
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      if (ranks_[r].comm == nullptr || ranks_[r].dead)
        continue;
      device_scope d(ordinals_[r]);
      const ncclResult_t f = ncclCommFinalize(ranks_[r].comm);
      clean = clean && (f == ncclSuccess || f == ncclInProgress);
    }
    const auto deadline = clock_type::now() + std::chrono::seconds(10);
    for (std::size_t r = 0; r < ranks_.size() && clean; ++r) {
      if (ranks_[r].comm == nullptr || ranks_[r].dead)
        continue;
      ncclResult_t st = ncclInProgress;
      while (clean && st == ncclInProgress) {
        if (ncclCommGetAsyncError(ranks_[r].comm, &st) != ncclSuccess
            || clock_type::now() > deadline)
          clean = false;
        std::this_thread::yield();
      }
      clean = clean && st == ncclSuccess;
    }
    for (std::uint32_t r = 0; r < ranks_.size(); ++r) {
      if (ranks_[r].comm == nullptr || ranks_[r].dead)
        continue;
      device_scope d(ordinals_[r]);
      if (clean)
        ncclCommDestroy(ranks_[r].comm);
      else
        ncclCommAbort(ranks_[r].comm);
      ranks_[r].comm = nullptr;
    }
  }

  void release_device_resources() noexcept {
    for (std::size_t r = 0; r < ranks_.size(); ++r) {
      rank_state& s = ranks_[r];
      if (cudaSetDevice(ordinals_[r]) != cudaSuccess)
        continue;
      if (s.scratch != nullptr)
        cudaFree(s.scratch);
      if (s.event != nullptr)
        cudaEventDestroy(s.event);
      if (s.stream != nullptr)
        cudaStreamDestroy(s.stream);
      s.scratch = nullptr;
      s.event = nullptr;
      s.stream = nullptr;
      s.scratch_bytes = 0;
    }
  }

  const std::vector<int> ordinals_;
  const std::chrono::milliseconds timeout_;
  std::vector<rank_state> ranks_;
  std::atomic<bool> aborted_{false};
  std::atomic<std::uint64_t> epoch_{1};
  std::mutex reason_mtx_;
  std::string reason_;
};

} // namespace

std::unique_ptr<inference::tp_comm> make_nccl_tp_comm(std::vector<int> ordinals,
                                                      std::chrono::milliseconds timeout) {
  return std::make_unique<nccl_tp_comm>(std::move(ordinals), timeout);
}

} // namespace refit::cuda
