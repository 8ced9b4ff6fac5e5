// memfd-backed packed buffers (see host_buffer.hpp).
#include "runtime/publication/host_buffer.hpp"

#include "runtime/publication/memfd.hpp"

#include <fcntl.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

// ---- streaming copies

constexpr std::uint64_t stream_block = 128;        // bytes per loop iteration (2 cache lines)
constexpr std::uint64_t stream_min_row_bytes = 256; // shorter rows: plain memcpy

#if defined(__x86_64__)
// Copies `n` bytes (a multiple of stream_block) to a 64-byte aligned `dst` with streaming
// stores; `src` may be unaligned. No fence: callers fence once after the last block.
__attribute__((target("avx2"))) void stream_blocks_avx2(std::byte* dst, const std::byte* src,
                                                        std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; i += stream_block) {
    const auto* s = reinterpret_cast<const __m256i*>(src + i);
    auto* d = reinterpret_cast<__m256i*>(dst + i);
    const __m256i a = _mm256_loadu_si256(s);
    const __m256i b = _mm256_loadu_si256(s + 1);
    const __m256i c = _mm256_loadu_si256(s + 2);
    const __m256i e = _mm256_loadu_si256(s + 3);
    _mm256_stream_si256(d, a);
    _mm256_stream_si256(d + 1, b);
    _mm256_stream_si256(d + 2, c);
    _mm256_stream_si256(d + 3, e);
  }
}

void stream_blocks_sse2(std::byte* dst, const std::byte* src, std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; i += stream_block)
    for (std::uint64_t j = 0; j < stream_block; j += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + j),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + j)));
}

// The same for `count` destinations at once (all with dst's alignment), at `offset` bytes
// into each: every block of src is loaded once and stored to all of them.
__attribute__((target("avx2"))) void stream_blocks_to_all_avx2(std::byte* const* dsts,
                                                               std::size_t count,
                                                               std::uint64_t offset,
                                                               const std::byte* src,
                                                               std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; i += stream_block) {
    const auto* s = reinterpret_cast<const __m256i*>(src + i);
    const __m256i a = _mm256_loadu_si256(s);
    const __m256i b = _mm256_loadu_si256(s + 1);
    const __m256i c = _mm256_loadu_si256(s + 2);
    const __m256i e = _mm256_loadu_si256(s + 3);
    for (std::size_t k = 0; k < count; ++k) {
      auto* d = reinterpret_cast<__m256i*>(dsts[k] + offset + i);
      _mm256_stream_si256(d, a);
      _mm256_stream_si256(d + 1, b);
      _mm256_stream_si256(d + 2, c);
      _mm256_stream_si256(d + 3, e);
    }
  }
}

void stream_blocks_to_all_sse2(std::byte* const* dsts, std::size_t count, std::uint64_t offset,
                               const std::byte* src, std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; i += stream_block)
    for (std::uint64_t j = 0; j < stream_block; j += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + j));
      for (std::size_t k = 0; k < count; ++k)
        _mm_stream_si128(reinterpret_cast<__m128i*>(dsts[k] + offset + i + j), v);
    }
}

using stream_fn = void (*)(std::byte*, const std::byte*, std::uint64_t);
using stream_to_all_fn = void (*)(std::byte* const*, std::size_t, std::uint64_t,
                                  const std::byte*, std::uint64_t);

bool has_avx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}

stream_fn stream_blocks() { return has_avx2() ? stream_blocks_avx2 : stream_blocks_sse2; }

stream_to_all_fn stream_blocks_to_all() {
  return has_avx2() ? stream_blocks_to_all_avx2 : stream_blocks_to_all_sse2;
}

// One streamed range: a plain head up to 64-byte alignment of dst, streamed blocks, a plain
// tail. Not fenced.
void stream_range(std::byte* dst, const std::byte* src, std::uint64_t bytes, stream_fn fn) {
  std::uint64_t head = (64 - (reinterpret_cast<std::uintptr_t>(dst) & 63)) & 63;
  if (head > bytes)
    head = bytes;
  std::memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  const std::uint64_t body = bytes / stream_block * stream_block;
  fn(dst, src, body);
  std::memcpy(dst + body, src + body, bytes - body);
}
#endif

} // namespace

void bulk_copy(std::byte* dst, const std::byte* src, std::uint64_t bytes) {
#if defined(__x86_64__)
  if (bytes >= streaming_copy_min_bytes) {
    stream_range(dst, src, bytes, stream_blocks());
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

void bulk_copy_to_all(std::byte* const* dsts, std::size_t count, const std::byte* src,
                      std::uint64_t bytes) {
  if (count == 0)
    return;
#if defined(__x86_64__)
  if (bytes >= streaming_copy_min_bytes) {
    // One pass needs every destination at the same offset from a cache line.
    const std::uintptr_t misalign = reinterpret_cast<std::uintptr_t>(dsts[0]) & 63;
    bool same = true;
    for (std::size_t k = 1; k < count; ++k)
      same = same && (reinterpret_cast<std::uintptr_t>(dsts[k]) & 63) == misalign;
    if (same) {
      const std::uint64_t head = std::min<std::uint64_t>((64 - misalign) & 63, bytes);
      const std::uint64_t body = (bytes - head) / stream_block * stream_block;
      const std::uint64_t tail = head + body;
      for (std::size_t k = 0; k < count; ++k)
        std::memcpy(dsts[k], src, head);
      stream_blocks_to_all()(dsts, count, head, src + head, body);
      for (std::size_t k = 0; k < count; ++k)
        std::memcpy(dsts[k] + tail, src + tail, bytes - tail);
      _mm_sfence();
      return;
    }
  }
#endif
  for (std::size_t k = 0; k < count; ++k)
    bulk_copy(dsts[k], src, bytes);
}

void bulk_copy_rows(std::byte* dst, std::uint64_t dst_stride, const std::byte* src,
                    std::uint64_t src_stride, std::uint64_t row_bytes, std::uint64_t rows) {
#if defined(__x86_64__)
  if (row_bytes >= stream_min_row_bytes && row_bytes * rows >= streaming_copy_min_bytes) {
    const stream_fn fn = stream_blocks();
    for (std::uint64_t r = 0; r < rows; ++r)
      stream_range(dst + r * dst_stride, src + r * src_stride, row_bytes, fn);
    _mm_sfence();
    return;
  }
#endif
  for (std::uint64_t r = 0; r < rows; ++r)
    std::memcpy(dst + r * dst_stride, src + r * src_stride, row_bytes);
}

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
      b.fd = create_sealable_memfd("refit-buffer", what);
      buffers_.push_back(b); // owned from here on, released by the catch below
      if (ftruncate(b.fd, static_cast<off_t>(bytes)) != 0)
        throw errno_error(what + "ftruncate");
      // Sealed before any handle leaves the process: the size is fixed for good, so no
      // consumer's mapping can lose pages (the contents stay writable: buffers are reused).
      add_seals(b.fd, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL, what);
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

mapped_buffer::mapped_buffer(const std::string& handle, std::uint64_t size, int producer_pid,
                             bool writable) {
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
  if (pid != producer_pid)
    throw fail("names pid " + std::to_string(pid) + ", but the rank that publishes it is pid "
               + std::to_string(producer_pid));

  std::string why;
  const int local_fd = open_peer_fd(pid, fd, why, writable);
  if (local_fd < 0)
    throw fail(why);
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
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
  // Only a memfd sealed against shrinking and growing is mapped: nothing the producer does
  // later can turn a read of this mapping into SIGBUS.
  if (auto bad = check_seals(local_fd, F_SEAL_SHRINK | F_SEAL_GROW); !bad.empty()) {
    close(local_fd);
    throw fail(path + " " + bad);
  }
  if (static_cast<std::uint64_t>(st.st_size) < size) {
    close(local_fd);
    throw fail("buffer has " + std::to_string(st.st_size) + " bytes, " + std::to_string(size)
               + " bytes requested");
  }
  // MAP_POPULATE: the producer has touched every page, so this only fills the page tables,
  // in one pass here instead of one read fault per page while the scatter reads the buffer.
  void* addr = mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                    MAP_SHARED | MAP_POPULATE, local_fd, 0);
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
