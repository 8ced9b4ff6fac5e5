// device_memory for cuda:N (REFIT_CUDA builds): see device_memory.hpp. Every call runs on the
// owning worker's thread; each worker has its own stream, so TP workers load in parallel.
#include "runtime/child/device_memory.hpp"

#include <map>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "runtime/cuda/cuda.hpp"

namespace refit::child {

namespace {

class cuda_memory final : public device_memory {
public:
  explicit cuda_memory(device::spec device)
    : device_memory(device), uuid_(cuda::device_uuid(device.index)), stream_(device.index) {}

  device_buffer alloc(std::uint64_t bytes, const std::string& what) override {
    if (bytes == 0)
      throw std::invalid_argument(device::to_string(device()) + ": zero-byte allocation for "
                                  + what);
    cuda::device_allocation a(device().index, bytes, what);
    std::byte* data = a.data();
    {
      std::lock_guard<std::mutex> guard(mtx_);
      live_.emplace(data, std::move(a));
    }
    return device_buffer(*this, data, bytes);
  }

  device_buffer alloc_exportable(std::uint64_t bytes, const std::string& what) override {
    return alloc(bytes, what); // cudaMalloc'ed memory is exportable through CUDA IPC
  }

  std::string export_handle(const device_buffer& buffer) override {
    std::lock_guard<std::mutex> guard(mtx_);
    auto found = live_.find(buffer.data());
    if (found == live_.end())
      throw std::logic_error(device::to_string(device()) + ": unknown buffer to export");
    // Writers open it on their own device: every copy queued here must be done first.
    return cuda::export_ipc_handle(found->second);
  }

  std::uint64_t free_bytes() const override { return cuda::free_bytes(device().index); }

  std::string uuid() const override { return uuid_; }

  host_backup offload(const device_buffer& src, const std::string& what) override {
    auto backup = host_backup::create(device::to_string(device()) + " " + what, src.size());
    std::vector<std::byte> staging(std::min<std::uint64_t>(src.size(), staging_bytes));
    for (std::uint64_t off = 0; off < src.size(); off += staging.size()) {
      const std::uint64_t n = std::min<std::uint64_t>(staging.size(), src.size() - off);
      cuda::copy_to_host(device().index, staging.data(), src.data() + off, n);
      backup.write(off, staging.data(), n);
    }
    return backup;
  }

  void restore(const host_backup& src, const device_buffer& dst) override {
    check_restore_size(src, dst);
    std::vector<std::byte> staging(std::min<std::uint64_t>(src.size(), staging_bytes));
    for (std::uint64_t off = 0; off < src.size(); off += staging.size()) {
      const std::uint64_t n = std::min<std::uint64_t>(staging.size(), src.size() - off);
      src.read(off, staging.data(), n);
      cuda::copy_to_device(device().index, dst.data() + off, staging.data(), n);
    }
  }

  std::unique_ptr<producer_view> open_producer(const std::string& handle, std::uint64_t size,
                                               int /*producer_pid: CUDA IPC handles name no process*/) override {
    struct view final : producer_view {
      view(const std::string& h, std::uint64_t s, int ordinal) : ipc(h, s, ordinal) {}
      const std::byte* data() const override { return ipc.data(); }
      std::uint64_t size() const override { return ipc.size(); }
      cuda::ipc_view ipc;
    };
    if (!cuda::is_ipc_handle(handle))
      throw std::runtime_error("buffer handle '" + handle.substr(0, 48) + "' is not a CUDA IPC "
                               "handle, but TP worker memory is on " + device::to_string(device())
                               + " (publish with transport cuda_ipc from CUDA trainer ranks)");
    // Copies already queued may still read an earlier buffer; opening is independent of them.
    return std::make_unique<view>(handle, size, device().index);
  }

  void copy_rows(std::byte* dst, std::uint64_t dst_stride, const std::byte* src,
                 std::uint64_t src_stride, std::uint64_t row_bytes, std::uint64_t rows) override {
    pending_.push_back({src, dst, src_stride, dst_stride, row_bytes, rows});
    // Bounded batches: descriptors are tiny, but one launch should not wait for thousands.
    if (pending_.size() >= 4096)
      flush();
  }

  void synchronize() override {
    flush();
    stream_.synchronize();
  }

  std::vector<std::uint64_t> digests(const std::vector<digest_input>& tensors) override {
    synchronize();
    std::vector<cuda::digest_desc> descs;
    descs.reserve(tensors.size());
    for (const auto& t : tensors) {
      if (t.element_size != 2 && t.element_size != 4)
        throw std::invalid_argument("element digest of " + std::to_string(t.element_size)
                                    + "-byte elements");
      descs.push_back({t.data, t.nbytes / t.element_size,
                       static_cast<std::uint32_t>(t.element_size)});
    }
    return stream_.digests(descs);
  }

  const std::byte* synthetic_canonical(const model::param_meta& p,
                                       const model::synthetic_weights& w,
                                       std::uint64_t step) override {
    synchronize(); // queued copies may still read the previous tensor from the scratch
    if (scratch_.size() < p.nbytes())
      scratch_ = cuda::device_allocation(device().index, std::max<std::uint64_t>(p.nbytes(), 1 << 20),
                                         "synthetic checkpoint scratch");
    cuda::fill_synthetic(device().index, p, w, step, 0, p.numel(), scratch_.data());
    return scratch_.data();
  }

private:
  static constexpr std::uint64_t staging_bytes = 64ull << 20;

  void flush() {
    if (pending_.empty())
      return;
    stream_.copy_batch(pending_);
    pending_.clear();
  }

  void free(std::byte* data, std::uint64_t) noexcept override {
    // Queued copies may target this memory: finish them before it goes back to the device.
    try {
      synchronize();
    } catch (...) {
    }
    std::lock_guard<std::mutex> guard(mtx_);
    live_.erase(data);
  }

  const std::string uuid_;
  cuda::stream stream_;
  std::vector<cuda::copy_desc> pending_; // copy_rows since the last flush
  cuda::device_allocation scratch_;      // synthetic_canonical
  std::mutex mtx_;
  std::map<std::byte*, cuda::device_allocation> live_;
};

} // namespace

std::unique_ptr<device_memory> open_cuda_memory(const device::spec& device) {
  return std::make_unique<cuda_memory>(device);
}

} // namespace refit::child
