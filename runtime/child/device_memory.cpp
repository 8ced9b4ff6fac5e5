#include "runtime/child/device_memory.hpp"

#include "runtime/model/digest.hpp"
#include "runtime/publication/host_buffer.hpp"
#include "runtime/publication/memfd.hpp"

#include <fcntl.h>

#include <cerrno>
#include <map>
#include <mutex>
#include <stdexcept>
#include <sys/mman.h>
#include <system_error>
#include <unistd.h>

namespace refit::child {

namespace {

[[noreturn]] void throw_errno(int err, const std::string& what) {
  throw std::system_error(err, std::generic_category(), what);
}

// MemAvailable from /proc/meminfo, in bytes (the same figure trainer ranks report).
std::uint64_t mem_available_bytes() {
  if (auto bytes = device::host_available_bytes())
    return bytes;
  throw std::runtime_error("cannot read MemAvailable from /proc/meminfo");
}

class cpu_memory final : public device_memory {
public:
  explicit cpu_memory(device::spec device)
    : device_memory(device), page_bytes_(static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE))) {}

  device_buffer alloc(std::uint64_t bytes, const std::string& what) override {
    if (bytes == 0)
      throw std::invalid_argument(device::to_string(device()) + ": zero-byte allocation for "
                                  + what);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw_errno(errno, device::to_string(device()) + ": cannot allocate "
                           + std::to_string(bytes) + " bytes for " + what);
    // Touch every page so the memory is resident now (fresh anonymous pages read as zero).
    auto* data = static_cast<std::byte*>(p);
    for (std::uint64_t offset = 0; offset < bytes; offset += page_bytes_)
      *static_cast<volatile std::byte*>(data + offset) = std::byte{0};
    return device_buffer(*this, data, bytes);
  }

  device_buffer alloc_exportable(std::uint64_t bytes, const std::string& what) override {
    if (bytes == 0)
      throw std::invalid_argument(device::to_string(device()) + ": zero-byte allocation for "
                                  + what);
    const std::string label = device::to_string(device()) + " " + what;
    int fd = publication::create_sealable_memfd("refit-resident", label);
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      ::close(fd);
      throw_errno(err, label + ": cannot size the memfd to " + std::to_string(bytes) + " bytes");
    }
    try {
      // Sealed before any handle exists: a writer's mapping can never turn into SIGBUS.
      publication::add_seals(fd, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, label);
    } catch (...) {
      ::close(fd);
      throw;
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      throw_errno(err, label + ": cannot map " + std::to_string(bytes) + " bytes");
    }
    auto* data = static_cast<std::byte*>(p);
    for (std::uint64_t offset = 0; offset < bytes; offset += page_bytes_)
      *static_cast<volatile std::byte*>(data + offset) = std::byte{0};
    {
      std::lock_guard<std::mutex> guard(mtx_);
      exported_fds_[data] = fd;
    }
    return device_buffer(*this, data, bytes);
  }

  std::string export_handle(const device_buffer& buffer) override {
    std::lock_guard<std::mutex> guard(mtx_);
    auto found = exported_fds_.find(buffer.data());
    if (found == exported_fds_.end())
      throw std::logic_error(device::to_string(device())
                             + ": this buffer is private memory, not exportable (refit-runtime "
                               "allocates exportable resident weights with --publication-mode "
                               "direct)");
    return "memfd:" + std::to_string(::getpid()) + ":" + std::to_string(found->second);
  }

  std::uint64_t free_bytes() const override { return mem_available_bytes(); }

  std::string uuid() const override { return device::cpu_uuid(device().index); }

  host_backup offload(const device_buffer& src, const std::string& what) override {
    auto backup = host_backup::create(device::to_string(device()) + " " + what, src.size());
    backup.write(0, src.data(), src.size());
    return backup;
  }

  void restore(const host_backup& src, const device_buffer& dst) override {
    check_restore_size(src, dst);
    src.read(0, dst.data(), dst.size());
  }

  std::unique_ptr<producer_view> open_producer(const std::string& handle, std::uint64_t size,
                                               int producer_pid) override {
    struct view final : producer_view {
      explicit view(publication::mapped_buffer m) : mapping(std::move(m)) {}
      const std::byte* data() const override { return mapping.data(); }
      std::uint64_t size() const override { return mapping.size(); }
      publication::mapped_buffer mapping;
    };
    return std::make_unique<view>(publication::mapped_buffer(handle, size, producer_pid));
  }

  void copy_rows(std::byte* dst, std::uint64_t dst_stride, const std::byte* src,
                 std::uint64_t src_stride, std::uint64_t row_bytes, std::uint64_t rows) override {
    // Resident weights are written once per publication and not read back by this thread,
    // so big copies stream past the cache instead of reading every destination line first.
    publication::bulk_copy_rows(dst, dst_stride, src, src_stride, row_bytes, rows);
  }

  void synchronize() override {}

  std::vector<std::uint64_t> digests(const std::vector<digest_input>& tensors) override {
    std::vector<std::uint64_t> out;
    out.reserve(tensors.size());
    for (const auto& t : tensors)
      out.push_back(model::element_digest(t.data, t.nbytes, t.element_size));
    return out;
  }

  const std::byte* synthetic_canonical(const model::param_meta& p,
                                       const model::synthetic_weights& w,
                                       std::uint64_t step) override {
    scratch_.resize(p.nbytes());
    model::fill_synthetic(p, w, step, 0, p.numel(), scratch_.data());
    return scratch_.data();
  }

private:
  void free(std::byte* data, std::uint64_t bytes) noexcept override {
    ::munmap(data, bytes);
    std::lock_guard<std::mutex> guard(mtx_);
    if (auto found = exported_fds_.find(data); found != exported_fds_.end()) {
      ::close(found->second);
      exported_fds_.erase(found);
    }
  }

  std::uint64_t page_bytes_;
  std::mutex mtx_;
  std::map<std::byte*, int> exported_fds_; // alloc_exportable: mapping -> its memfd
  std::vector<std::byte> scratch_; // synthetic_canonical
};

} // namespace

device_buffer::device_buffer(device_buffer&& other) noexcept
  : owner_(other.owner_), data_(other.data_), bytes_(other.bytes_) {
  other.owner_ = nullptr;
  other.data_ = nullptr;
  other.bytes_ = 0;
}

device_buffer& device_buffer::operator=(device_buffer&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = other.owner_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.owner_ = nullptr;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void device_buffer::reset() {
  if (data_ != nullptr)
    owner_->free(data_, bytes_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

host_backup host_backup::create(const std::string& label, std::uint64_t bytes) {
  int fd = ::memfd_create("refit-host-backup", MFD_CLOEXEC);
  if (fd < 0)
    throw_errno(errno, "host backup for " + label + ": memfd_create");
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    ::close(fd);
    throw_errno(err, "host backup for " + label + ": cannot size it to "
                       + std::to_string(bytes) + " bytes");
  }
  return host_backup(fd, label, bytes);
}

host_backup::host_backup(host_backup&& other) noexcept
  : fd_(other.fd_), label_(std::move(other.label_)), bytes_(other.bytes_) {
  other.fd_ = -1;
  other.bytes_ = 0;
}

host_backup& host_backup::operator=(host_backup&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.fd_;
    label_ = std::move(other.label_);
    bytes_ = other.bytes_;
    other.fd_ = -1;
    other.bytes_ = 0;
  }
  return *this;
}

void host_backup::reset() {
  if (fd_ >= 0)
    ::close(fd_);
  fd_ = -1;
  label_.clear();
  bytes_ = 0;
}

void host_backup::write(std::uint64_t offset, const std::byte* src, std::uint64_t count) {
  if (offset + count > bytes_)
    throw std::out_of_range("host backup for " + label_ + ": write of " + std::to_string(count)
                            + " bytes at " + std::to_string(offset) + " exceeds its "
                            + std::to_string(bytes_) + " bytes");
  std::uint64_t done = 0;
  while (done < count) {
    ssize_t n = ::pwrite(fd_, src + done, count - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      throw_errno(n < 0 ? errno : EIO, "host backup for " + label_ + ": write at byte "
                                          + std::to_string(offset + done));
    done += static_cast<std::uint64_t>(n);
  }
}

void host_backup::read(std::uint64_t offset, std::byte* dst, std::uint64_t count) const {
  if (offset + count > bytes_)
    throw std::out_of_range("host backup for " + label_ + ": read of " + std::to_string(count)
                            + " bytes at " + std::to_string(offset) + " exceeds its "
                            + std::to_string(bytes_) + " bytes");
  std::uint64_t done = 0;
  while (done < count) {
    ssize_t n = ::pread(fd_, dst + done, count - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      throw_errno(n < 0 ? errno : EIO, "host backup for " + label_ + ": read at byte "
                                          + std::to_string(offset + done));
    done += static_cast<std::uint64_t>(n);
  }
}

#if REFIT_HAVE_CUDA
std::unique_ptr<device_memory> open_cuda_memory(const device::spec& device); // _cuda.cpp
#endif

void device_memory::check_restore_size(const host_backup& src, const device_buffer& dst) const {
  if (src.size() != dst.size())
    throw std::logic_error(device::to_string(device()) + ": host backup of "
                           + std::to_string(src.size()) + " bytes cannot restore a buffer of "
                           + std::to_string(dst.size()) + " bytes");
}

void require_supported(const device::spec& device) {
#if !REFIT_HAVE_CUDA
  if (device.k == device::kind::cuda)
    throw std::invalid_argument(device::to_string(device)
                                + ": CUDA devices need a build with REFIT_CUDA=ON");
#else
  (void) device;
#endif
}

std::unique_ptr<device_memory> open_device_memory(const device::spec& device) {
  require_supported(device);
#if REFIT_HAVE_CUDA
  if (device.k == device::kind::cuda)
    return open_cuda_memory(device);
#endif
  return std::make_unique<cpu_memory>(device);
}

} // namespace refit::child
