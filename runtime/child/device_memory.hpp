// Device memory of one refit-runtime worker: a small allocator interface (alloc / free /
// free_bytes, plus the host offload copies sleep level 1 needs) and its CPU implementation.
//
// CPU devices: memory is mmap(MAP_PRIVATE | MAP_ANONYMOUS) with every page touched on
// allocation, so it is really resident (RssAnon) and really returned by munmap. CPU device
// memory is host-addressable, so workers write weights into it directly (tp_layout::scatter).
// The host backup of sleep level 1 lives in a memfd (shared memory outside the process's
// anonymous memory), so RssAnon keeps measuring exactly what the "device" holds.
//
// CUDA devices (REFIT_CUDA builds, runtime/child/device_memory_cuda.cpp): cudaMalloc'ed memory,
// zero-filled; free_bytes from cudaMemGetInfo; producer buffers are CUDA IPC handles opened
// with cudaIpcOpenMemHandle; copies and digests run on one stream per worker. open_device_memory
// picks the implementation by device kind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/device/device.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"

namespace refit::child {

class device_memory;

// One allocation on a device; frees itself (RAII, move-only).
class device_buffer {
public:
  device_buffer() = default;
  device_buffer(device_memory& owner, std::byte* data, std::uint64_t bytes)
    : owner_(&owner), data_(data), bytes_(bytes) {}
  device_buffer(device_buffer&& other) noexcept;
  device_buffer& operator=(device_buffer&& other) noexcept;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() { reset(); }

  void reset();
  std::byte* data() const { return data_; }
  std::uint64_t size() const { return bytes_; }
  explicit operator bool() const { return data_ != nullptr; }

private:
  device_memory* owner_ = nullptr;
  std::byte* data_ = nullptr;
  std::uint64_t bytes_ = 0;
};

// Host memory that holds offloaded device bytes: an anonymous memfd (move-only, closes
// itself). Reads and writes are positioned copies (pread / pwrite); nothing is mapped.
class host_backup {
public:
  // Throws std::system_error naming `label` when the memfd cannot be created.
  static host_backup create(const std::string& label, std::uint64_t bytes);

  host_backup() = default;
  host_backup(host_backup&& other) noexcept;
  host_backup& operator=(host_backup&& other) noexcept;
  host_backup(const host_backup&) = delete;
  host_backup& operator=(const host_backup&) = delete;
  ~host_backup() { reset(); }

  void reset();
  std::uint64_t size() const { return bytes_; }
  explicit operator bool() const { return fd_ >= 0; }

  // Copies `count` bytes at `offset`; throws std::system_error on a short or failed copy.
  void write(std::uint64_t offset, const std::byte* src, std::uint64_t count);
  void read(std::uint64_t offset, std::byte* dst, std::uint64_t count) const;

private:
  host_backup(int fd, std::string label, std::uint64_t bytes)
    : fd_(fd), label_(std::move(label)), bytes_(bytes) {}
  int fd_ = -1;
  std::string label_;
  std::uint64_t bytes_ = 0;
};

// A producer's packed buffer opened read-only by a worker; closed (unmapped / IPC handle
// closed) on destruction.
class producer_view {
public:
  virtual ~producer_view() = default;
  virtual const std::byte* data() const = 0;
  virtual std::uint64_t size() const = 0;
};

// A tensor in device memory whose element digest is wanted.
struct digest_input {
  const std::byte* data = nullptr;
  std::uint64_t nbytes = 0;
  std::size_t element_size = 2;
};

class device_memory {
public:
  virtual ~device_memory() = default;

  // Allocates `bytes` (> 0) of zero-filled, resident device memory for `what` (used in
  // error messages). Throws std::system_error naming the device, size and purpose.
  virtual device_buffer alloc(std::uint64_t bytes, const std::string& what) = 0;
  // Like alloc, but memory another process can open through export_handle (direct
  // publication: trainer ranks write resident weights in place). CPU devices: a sealed memfd
  // (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) mapped MAP_SHARED, pages touched (it counts
  // as RssShmem, not RssAnon); CUDA devices: cudaMalloc, as alloc.
  virtual device_buffer alloc_exportable(std::uint64_t bytes, const std::string& what) = 0;
  // The handle of `buffer` ("memfd:<pid>:<fd>" / "cudaipc:<uuid>:<bytes>:<hex>"). Throws
  // std::logic_error if it was not allocated by alloc_exportable (CPU).
  virtual std::string export_handle(const device_buffer& buffer) = 0;
  // Free memory on the device as this process sees it.
  virtual std::uint64_t free_bytes() const = 0;
  // Physical identity of the device ("CPU-..." / "GPU-..."), as trainer ranks report it.
  virtual std::string uuid() const = 0;
  // Copies a device buffer into a new host backup.
  virtual host_backup offload(const device_buffer& src, const std::string& what) = 0;
  // Copies a host backup back into a device buffer of the same size.
  virtual void restore(const host_backup& src, const device_buffer& dst) = 0;

  // Opens producer buffer `handle` ("memfd:<pid>:<fd>" on CPU devices, "cudaipc:<uuid>:<hex>"
  // on CUDA devices) for reading `size` bytes. Throws std::runtime_error naming the handle if
  // it is malformed, of the wrong kind for this device, gone, or smaller than `size`. On CPU
  // the handle must name `producer_pid` (the publishing rank's process) and a sealed memfd.
  virtual std::unique_ptr<producer_view> open_producer(const std::string& handle,
                                                       std::uint64_t size, int producer_pid) = 0;
  // Strided 2-D copy (rows of `row_bytes`) from a producer view into this device's memory.
  // May be asynchronous (CUDA: the worker's stream); synchronize() waits for it.
  virtual void copy_rows(std::byte* dst, std::uint64_t dst_stride, const std::byte* src,
                         std::uint64_t src_stride, std::uint64_t row_bytes,
                         std::uint64_t rows) = 0;
  // Returns once every copy issued so far has finished (the producer may then reuse the
  // buffers they read).
  virtual void synchronize() = 0;
  // Element digests (runtime/model/digest.hpp) of `tensors`, computed where they live.
  virtual std::vector<std::uint64_t> digests(const std::vector<digest_input>& tensors) = 0;
  // The canonical tensor `p` of synthetic weights `w` at `step`, generated where copy_rows
  // reads from (host scratch on CPU devices, device scratch filled by a kernel on GPUs);
  // valid until the next call.
  virtual const std::byte* synthetic_canonical(const model::param_meta& p,
                                               const model::synthetic_weights& w,
                                               std::uint64_t step) = 0;

  const device::spec& device() const { return device_; }

protected:
  explicit device_memory(device::spec device) : device_(device) {}
  // Throws std::logic_error unless `src` and `dst` have the same size (restore).
  void check_restore_size(const host_backup& src, const device_buffer& dst) const;

private:
  friend class device_buffer;
  // Returns memory obtained from alloc; called by device_buffer only.
  virtual void free(std::byte* data, std::uint64_t bytes) noexcept = 0;

  device::spec device_;
};

// Throws std::invalid_argument when this build cannot drive `device` (CUDA devices without
// REFIT_CUDA).
void require_supported(const device::spec& device);

// The allocator for `device`; throws like require_supported.
std::unique_ptr<device_memory> open_device_memory(const device::spec& device);

} // namespace refit::child
