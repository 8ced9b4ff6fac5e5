#include "runtime/publication/direct_backend.hpp"

#include <atomic>
#include <stdexcept>
#include <vector>

#include "runtime/publication/host_buffer.hpp"

#if REFIT_HAVE_CUDA
#include "runtime/cuda/cuda.hpp"
#endif

namespace refit::publication {

namespace {

std::atomic<std::uint64_t> open_targets{0};

class host_target final : public resident_target {
public:
  host_target(const std::string& handle, std::uint64_t size, int pid)
    : mapping_(handle, size, pid, /*writable=*/true) {
    ++open_targets;
  }
  ~host_target() override { --open_targets; }
  std::byte* data() const override { return mapping_.mutable_data(); }
  std::uint64_t size() const override { return mapping_.size(); }

private:
  mapped_buffer mapping_;
};

class host_writer final : public direct_writer {
public:
  void add(std::byte* dst, std::uint64_t dst_stride, const std::byte* src,
           std::uint64_t src_stride, std::uint64_t row_bytes, std::uint64_t rows) override {
    bulk_copy_rows(dst, dst_stride, src, src_stride, row_bytes, rows);
  }
  void finish() override {} // bulk copies are fenced when they return
};

#if REFIT_HAVE_CUDA
class cuda_target final : public resident_target {
public:
  cuda_target(const std::string& handle, std::uint64_t size, int ordinal)
    : view_(handle, size, ordinal) {
    ++open_targets;
  }
  ~cuda_target() override { --open_targets; }
  std::byte* data() const override { return const_cast<std::byte*>(view_.data()); }
  std::uint64_t size() const override { return view_.size(); }

private:
  cuda::ipc_view view_;
};

class cuda_writer final : public direct_writer {
public:
  explicit cuda_writer(int ordinal) : stream_(ordinal) {}
  void add(std::byte* dst, std::uint64_t dst_stride, const std::byte* src,
           std::uint64_t src_stride, std::uint64_t row_bytes, std::uint64_t rows) override {
    pending_.push_back({src, dst, src_stride, dst_stride, row_bytes, rows});
    if (pending_.size() >= 4096)
      flush();
  }
  void finish() override {
    flush();
    stream_.synchronize();
  }

private:
  void flush() {
    if (pending_.empty())
      return;
    stream_.copy_batch(pending_);
    pending_.clear();
  }
  cuda::stream stream_;
  std::vector<cuda::copy_desc> pending_;
};
#endif

} // namespace

std::unique_ptr<resident_target> open_resident_target(const device::spec& rank_device,
                                                      const std::string& handle,
                                                      std::uint64_t size, int runtime_pid) {
#if REFIT_HAVE_CUDA
  if (rank_device.k == device::kind::cuda) {
    if (!cuda::is_ipc_handle(handle))
      throw std::runtime_error("resident arena handle '" + handle.substr(0, 48)
                               + "' is not a CUDA IPC handle, but this rank is on "
                               + device::to_string(rank_device));
    return std::make_unique<cuda_target>(handle, size, rank_device.index);
  }
#else
  if (rank_device.k == device::kind::cuda)
    throw std::invalid_argument(device::to_string(rank_device)
                                + ": direct publication from CUDA devices needs a build with "
                                  "REFIT_CUDA=ON");
#endif
  return std::make_unique<host_target>(handle, size, runtime_pid);
}

std::unique_ptr<direct_writer> make_direct_writer(const device::spec& rank_device) {
#if REFIT_HAVE_CUDA
  if (rank_device.k == device::kind::cuda)
    return std::make_unique<cuda_writer>(rank_device.index);
#endif
  return std::make_unique<host_writer>();
}

std::uint64_t open_resident_targets() { return open_targets.load(); }

} // namespace refit::publication
