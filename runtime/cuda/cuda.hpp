// The CUDA layer of the GPU data plane (built with REFIT_CUDA=ON only; every caller guards its
// use with REFIT_HAVE_CUDA). Plain C++ interface: no CUDA, NCCL or LibTorch header leaks out,
// so actors and messages never see them.
//
// Device ordinals are CUDA's (after CUDA_VISIBLE_DEVICES); identities are physical UUIDs
// formatted as NVML and vLLM print them ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"), so a
// handle keyed by UUID finds the right worker however CUDA_VISIBLE_DEVICES permutes ordinals.
//
// Every function throws cuda::error (a std::runtime_error naming the CUDA call, the device and
// what it was for) instead of returning a status.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"

namespace refit::cuda {

struct error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int device_count();
// "GPU-..." of ordinal `ordinal`.
std::string device_uuid(int ordinal);
// cudaMemGetInfo: free bytes of the device as this process sees it.
std::uint64_t free_bytes(int ordinal);
std::uint64_t total_bytes(int ordinal);

// ---- device memory --------------------------------------------------------------------

// cudaMalloc'ed, zero-filled device memory (RAII, move-only).
class device_allocation {
public:
  device_allocation() = default;
  // Throws cuda::error naming `what` and the size when the device is out of memory.
  device_allocation(int ordinal, std::uint64_t bytes, const std::string& what);
  ~device_allocation();
  device_allocation(device_allocation&& other) noexcept;
  device_allocation& operator=(device_allocation&& other) noexcept;
  device_allocation(const device_allocation&) = delete;
  device_allocation& operator=(const device_allocation&) = delete;

  std::byte* data() const { return data_; }
  std::uint64_t size() const { return bytes_; }
  int ordinal() const { return ordinal_; }
  void reset() noexcept;

private:
  int ordinal_ = 0;
  std::byte* data_ = nullptr;
  std::uint64_t bytes_ = 0;
};

// Host <-> device copies (synchronous).
void copy_to_host(int ordinal, std::byte* dst, const std::byte* src, std::uint64_t bytes);
void copy_to_device(int ordinal, std::byte* dst, const std::byte* src, std::uint64_t bytes);

// `n` elements of T in a device_allocation of `ordinal` (zero-filled, at least one element's
// bytes), typed; for kernel tests and benchmarks that hand plain pointers to kernels.
template <class T>
struct device_array {
  device_allocation memory;
  std::size_t n = 0;
  T* p = nullptr;
  device_array(int ordinal, std::size_t count, const std::string& what)
    : memory(ordinal, (count > 0 ? count : 1) * sizeof(T), what), n(count),
      p(reinterpret_cast<T*>(memory.data())) {}
  device_array(int ordinal, const std::vector<T>& host, const std::string& what)
    : device_array(ordinal, host.size(), what) {
    copy_to_device(ordinal, memory.data(), reinterpret_cast<const std::byte*>(host.data()),
                   n * sizeof(T));
  }
  std::vector<T> host() const {
    std::vector<T> out(n);
    copy_to_host(memory.ordinal(), reinterpret_cast<std::byte*>(out.data()), memory.data(),
                 n * sizeof(T));
    return out;
  }
};

// ---- streams and batched copies --------------------------------------------------------

// One strided 2-D copy inside device memory (a TP slice, a fused-layout placement).
struct copy_desc {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  std::uint64_t src_stride = 0;
  std::uint64_t dst_stride = 0;
  std::uint64_t row_bytes = 0;
  std::uint64_t rows = 0;
};

// A tensor in device memory whose element digest (runtime/model/digest.hpp) is wanted.
struct digest_desc {
  const std::byte* data = nullptr;
  std::uint64_t elements = 0;
  std::uint32_t element_size = 2; // 2 or 4
};

// Elements of device memory placed into a resident tensor (rows of row_elements, strides in
// elements): their digest terms element_term(dst, bits) - element_term(dst, 0) go to slot
// `resident` (registered weights' partial digests, publication/registered.cpp).
struct placed_desc {
  const std::byte* src = nullptr;  // row 0's first element
  std::uint32_t resident = 0;
  std::uint32_t element_size = 2;  // 2 or 4
  std::uint64_t src_stride = 0;
  std::uint64_t dst_element = 0;   // resident element index of row 0's first element
  std::uint64_t dst_stride = 0;
  std::uint64_t row_elements = 0;
  std::uint64_t rows = 0;
};

class stream;

// Batches of copies planned once and uploaded to the device together (direct publication plans
// every chunk in prepare): launching a batch is one kernel, with no descriptor upload and no
// host wait before it. The copies' memory must outlive the plan's launches.
class copy_plan {
public:
  copy_plan(int ordinal, const std::vector<std::vector<copy_desc>>& batches);
  std::size_t batches() const { return batches_.size(); }
  std::size_t copies(std::size_t batch) const { return batches_.at(batch).block_start.size() - 1; }

private:
  friend class stream;
  struct batch {
    std::uint64_t desc_offset = 0;          // bytes into memory_
    std::uint64_t start_offset = 0;
    std::vector<std::uint64_t> block_start; // host copy: blocks of the first i copies
  };
  device_allocation memory_;
  std::vector<batch> batches_;
};

// A non-blocking stream on one device, with an event that orders completion.
class stream {
public:
  explicit stream(int ordinal);
  ~stream();
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  int ordinal() const { return ordinal_; }
  void* native() const { return stream_; } // cudaStream_t

  // All of `copies` as one kernel launch (not one cudaMemcpy per placement); asynchronous.
  void copy_batch(const std::vector<copy_desc>& copies);
  // The first `limit` copies of `plan`'s batch `batch` as one kernel launch; asynchronous.
  void copy_batch(const copy_plan& plan, std::size_t batch, std::size_t limit);
  // Records the event after everything issued so far and waits for it on the host.
  void synchronize();
  // Records the event after everything issued so far; done() polls it without blocking.
  void record();
  bool done();
  // Element digests of `tensors` (one reduction kernel); waits for the result.
  std::vector<std::uint64_t> digests(const std::vector<digest_desc>& tensors);
  // Sums of the placements' digest terms per slot (`slots` of them); waits for the result.
  std::vector<std::uint64_t> placed_digests(const std::vector<placed_desc>& placements,
                                            std::size_t slots);

private:
  int ordinal_;
  void* stream_ = nullptr;  // cudaStream_t
  void* event_ = nullptr;   // cudaEvent_t
  device_allocation scratch_; // descriptor upload area, grown on demand
  std::vector<std::byte> staging_;
  std::byte* upload(const void* data, std::uint64_t bytes);
};

// ---- CUDA IPC ---------------------------------------------------------------------------

// "cudaipc:<GPU uuid>:<bytes>:<128 hex digits of cudaIpcMemHandle_t>" of an allocation made
// by device_allocation (exported once per buffer).
std::string export_ipc_handle(const device_allocation& allocation);
// True if `handle` has the cudaipc: prefix.
bool is_ipc_handle(const std::string& handle);

// A producer's buffer opened in this process with cudaIpcOpenMemHandle on `ordinal`, whose
// UUID must be the one in the handle; closed (cudaIpcCloseMemHandle) on destruction.
class ipc_view {
public:
  // Throws cuda::error naming the handle when it is malformed, keyed by another GPU, smaller
  // than `size`, or cannot be opened.
  ipc_view(const std::string& handle, std::uint64_t size, int ordinal);
  ~ipc_view();
  ipc_view(const ipc_view&) = delete;
  ipc_view& operator=(const ipc_view&) = delete;

  const std::byte* data() const { return data_; }
  std::uint64_t size() const { return size_; }
  // IPC handles this process holds open right now (all devices).
  static std::uint64_t open_count();

private:
  int ordinal_;
  std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
};

// ---- synthetic weights on the device -----------------------------------------------------

// Device twins of model::fill_synthetic / apply_synthetic_step (bit-identical results) for
// elements [begin, begin + count) of `p`, written at `out` in device memory of `ordinal`.
// bfloat16 and float32 tensors; float16 throws. Synchronous.
void fill_synthetic(int ordinal, const model::param_meta& p, const model::synthetic_weights& w,
                    std::uint64_t step, std::uint64_t begin, std::uint64_t count,
                    std::byte* out);
void apply_synthetic_step(int ordinal, const model::param_meta& p,
                          const model::synthetic_weights& w, std::uint64_t step,
                          std::uint64_t begin, std::uint64_t count, std::byte* inout);

// The element digests every TP rank's resident tensors must have after a publication of the
// synthetic weights at `step`: out[rank][resident index]. Computed on `ordinal` from the
// layout's placements, without building any tensor (digest.hpp explains the sum).
std::vector<std::vector<std::uint64_t>> expected_resident_digests(
  int ordinal, const model::model_config& cfg, std::uint32_t tp,
  const model::synthetic_weights& w, std::uint64_t step);

// ---- bound for benchmarks ------------------------------------------------------------------

// Seconds NCCL needs to all-gather `total_out_bytes` of output on each of `ordinals` (one
// communicator per device in this process), as `calls` all-gathers of equal size into one
// buffer per device, after one warm-up call.
double allgather_seconds(const std::vector<int>& ordinals, std::uint64_t total_out_bytes,
                         std::uint32_t calls);

// Seconds of each of `reps` device-to-device copies of `bytes` between two buffers on
// `ordinal` (cudaMemcpyAsync on one stream, timed one copy at a time on the host after one
// warm-up copy). A copy reads and writes `bytes` each.
std::vector<double> device_copy_seconds(int ordinal, std::uint64_t bytes, unsigned reps);
// Seconds one device-to-device copy of `total_bytes` takes on `ordinal` (cudaMemcpyAsync
// between two scratch buffers of at most `piece_bytes`, issued back to back until
// total_bytes are copied, after one warm-up copy): the single-copy bound of direct
// publication at world 1.
double copy_seconds(int ordinal, std::uint64_t total_bytes,
                    std::uint64_t piece_bytes = 1ull << 30);

} // namespace refit::cuda
