// memfd-backed packed buffers (see host_buffer.hpp).
#include "runtime/publication/host_buffer.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace refit::publication {

namespace {

std::system_error errno_error(const std::string& what) {
  return std::system_error(errno, std::generic_category(), what);
}

// Parses a non-empty run of decimal digits that fits in an int; nothing else is accepted.
bool parse_decimal(const std::string& text, int& value) {
  if (text.empty() || text.size() > 9)
    return false;
  value = 0;
  for (char c : text) {
    if (c < '0' || c > '9')
      return false;
    value = value * 10 + (c - '0');
  }
  return true;
}

// Unmaps and closes every buffer (the pool's private buffer type is deduced, not named).
template <class Buffers>
void release_buffers(Buffers& buffers, std::uint64_t bytes) {
  for (auto& b : buffers) {
    if (b.addr != nullptr)
      munmap(b.addr, bytes);
    if (b.fd >= 0)
      close(b.fd);
  }
  buffers.clear();
}

} // namespace

host_buffer_pool::host_buffer_pool(std::uint32_t count, std::uint64_t bytes) : bytes_(bytes) {
  if (bytes == 0)
    throw std::system_error(EINVAL, std::generic_category(),
                            "host_buffer_pool: buffer size must be > 0 bytes");
  const long page = sysconf(_SC_PAGESIZE);
  buffers_.reserve(count);
  try {
    for (std::uint32_t i = 0; i < count; ++i) {
      const std::string what = "host_buffer_pool: buffer " + std::to_string(i) + " of "
                               + std::to_string(count) + " (" + std::to_string(bytes) + " bytes): ";
      buffer b;
      b.fd = memfd_create("refit-buffer", MFD_CLOEXEC);
      if (b.fd < 0)
        throw errno_error(what + "memfd_create");
      buffers_.push_back(b); // owned from here on, released by the catch below
      if (ftruncate(b.fd, static_cast<off_t>(bytes)) != 0)
        throw errno_error(what + "ftruncate");
      void* addr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, b.fd, 0);
      if (addr == MAP_FAILED)
        throw errno_error(what + "mmap");
      buffers_.back().addr = static_cast<std::byte*>(addr);
      // Touch every page now so that publication never faults in fresh memory.
      for (std::uint64_t offset = 0; offset < bytes; offset += static_cast<std::uint64_t>(page))
        static_cast<volatile std::byte*>(addr)[offset] = std::byte{0};
    }
  } catch (...) {
    release_buffers(buffers_, bytes_);
    throw;
  }
}

host_buffer_pool::~host_buffer_pool() { release_buffers(buffers_, bytes_); }

std::byte* host_buffer_pool::data(std::uint32_t i) const {
  if (i >= buffers_.size())
    throw std::out_of_range("host_buffer_pool: buffer " + std::to_string(i) + " does not exist ("
                            + std::to_string(buffers_.size()) + " buffers)");
  return buffers_[i].addr;
}

std::string host_buffer_pool::handle(std::uint32_t i) const {
  if (i >= buffers_.size())
    throw std::out_of_range("host_buffer_pool: buffer " + std::to_string(i) + " does not exist ("
                            + std::to_string(buffers_.size()) + " buffers)");
  return "memfd:" + std::to_string(getpid()) + ":" + std::to_string(buffers_[i].fd);
}

mapped_buffer::mapped_buffer(const std::string& handle, std::uint64_t size) {
  const auto fail = [&](const std::string& what) {
    return std::runtime_error("buffer handle '" + handle + "': " + what);
  };
  static const std::string prefix = "memfd:";
  const auto colon = handle.find(':', prefix.size());
  int pid = 0;
  int fd = 0;
  if (handle.compare(0, prefix.size(), prefix) != 0 || colon == std::string::npos
      || !parse_decimal(handle.substr(prefix.size(), colon - prefix.size()), pid)
      || !parse_decimal(handle.substr(colon + 1), fd))
    throw std::runtime_error("malformed buffer handle '" + handle
                             + "' (expected memfd:<pid>:<fd>)");
  if (size == 0)
    throw fail("cannot map 0 bytes");

  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  // O_NONBLOCK: a handle naming a FIFO must fail below, not block in open().
  const int local_fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (local_fd < 0)
    throw fail("cannot open " + path + " (" + std::strerror(errno)
               + "): the producer process or its buffer fd is gone");
  struct stat st {};
  if (fstat(local_fd, &st) != 0) {
    const int err = errno;
    close(local_fd);
    throw fail("fstat of " + path + " failed: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    close(local_fd);
    throw fail(path + " is not a memory buffer");
  }
  if (static_cast<std::uint64_t>(st.st_size) < size) {
    close(local_fd);
    throw fail("buffer has " + std::to_string(st.st_size) + " bytes, " + std::to_string(size)
               + " bytes requested");
  }
  void* addr = mmap(nullptr, size, PROT_READ, MAP_SHARED, local_fd, 0);
  const int map_errno = errno;
  close(local_fd); // the mapping keeps the memory alive
  if (addr == MAP_FAILED)
    throw fail("mmap of " + std::to_string(size) + " bytes failed: " + std::strerror(map_errno));
  addr_ = static_cast<const std::byte*>(addr);
  size_ = size;
}

mapped_buffer::~mapped_buffer() {
  if (addr_ != nullptr)
    munmap(const_cast<std::byte*>(addr_), size_);
}

mapped_buffer::mapped_buffer(mapped_buffer&& other) noexcept
  : addr_(std::exchange(other.addr_, nullptr)), size_(std::exchange(other.size_, 0)) {}

mapped_buffer& mapped_buffer::operator=(mapped_buffer&& other) noexcept {
  if (this != &other) {
    if (addr_ != nullptr)
      munmap(const_cast<std::byte*>(addr_), size_);
    addr_ = std::exchange(other.addr_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

} // namespace refit::publication
