#include "runtime/publication/direct_backend.hpp"

#include <algorithm>
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
  void plan(const std::vector<std::vector<direct_copy>>& chunks) override { chunks_ = chunks; }
  void start(std::size_t chunk, std::size_t limit) override {
    const auto& copies = chunks_.at(chunk);
    limit = std::min(limit, copies.size());
    for (std::size_t i = 0; i < limit; ++i) {
      const auto& c = copies[i];
      bulk_copy_rows(c.dst, c.dst_stride, c.src, c.src_stride, c.row_bytes, c.rows);
    }
  }
  void finish() override {} // bulk copies are fenced when they return

private:
  std::vector<std::vector<direct_copy>> chunks_;
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
  void plan(const std::vector<std::vector<direct_copy>>& chunks) override {
    std::vector<std::vector<cuda::copy_desc>> batches(chunks.size());
    for (std::size_t k = 0; k < chunks.size(); ++k)
      for (const auto& c : chunks[k])
        batches[k].push_back({c.src, c.dst, c.src_stride, c.dst_stride, c.row_bytes, c.rows});
    plan_ = std::make_unique<cuda::copy_plan>(stream_.ordinal(), batches);
  }
  void start(std::size_t chunk, std::size_t limit) override {
    if (!plan_)
      throw std::logic_error("direct writer: a chunk started before the copies were planned");
    stream_.copy_batch(*plan_, chunk, limit);
  }
  void finish() override { stream_.synchronize(); }

private:
  std::unique_ptr<cuda::copy_plan> plan_; // freed after stream_ waited for its launches
  cuda::stream stream_;
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
