// Host (CPU) transport: packed buffers in anonymous shared memory (memfd). The producer (a
// trainer rank) owns a pool of buffers; each is exported as a handle string
// "memfd:<pid>:<fd>" that a consumer in another process opens through /proc/<pid>/fd/<fd>
// and maps read-only. Because a memfd has no name in /dev/shm, no segment can outlive the
// processes that use it, whatever way they die.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace refit::publication {

// Bulk copies of the host publication path (all-gather into packed buffers, the runtime's
// scatter into resident weights). The destination is written once and read later by another
// thread or process, so copies of at least `streaming_copy_min_bytes` use non-temporal
// (streaming) stores on x86-64: they skip the read-for-ownership of every destination cache
// line, which is most of a plain memcpy's cost at these sizes, and do not evict the cache.
// The result is identical to std::memcpy; the stores are fenced before returning, so the
// usual synchronization (a mutex, a message) publishes them like ordinary stores.
inline constexpr std::uint64_t streaming_copy_min_bytes = 64 * 1024;
void bulk_copy(std::byte* dst, const std::byte* src, std::uint64_t bytes);
// `rows` copies of `row_bytes`: src + r * src_stride -> dst + r * dst_stride (a strided 2-D
// copy, e.g. a TP column slice); streams when the rows total at least streaming_copy_min_bytes
// and each row spans at least a few cache lines.
void bulk_copy_rows(std::byte* dst, std::uint64_t dst_stride, const std::byte* src,
                    std::uint64_t src_stride, std::uint64_t row_bytes, std::uint64_t rows);
// One source to `count` destinations (an all-gather pushing a shard into every rank's
// output): the same as bulk_copy to each of them, but the source is read only once.
void bulk_copy_to_all(std::byte* const* dsts, std::size_t count, const std::byte* src,
                      std::uint64_t bytes);

class host_buffer_pool {
public:
  // Creates `count` buffers of `bytes` each (memfd + shared mapping, pages touched), each
  // sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) before its handle exists.
  // Throws std::system_error on failure.
  host_buffer_pool(std::uint32_t count, std::uint64_t bytes);
  ~host_buffer_pool();
  host_buffer_pool(const host_buffer_pool&) = delete;
  host_buffer_pool& operator=(const host_buffer_pool&) = delete;

  std::uint32_t count() const { return static_cast<std::uint32_t>(buffers_.size()); }
  std::uint64_t bytes() const { return bytes_; }
  std::byte* data(std::uint32_t i) const;
  // "memfd:<pid>:<fd>" of buffer i.
  std::string handle(std::uint32_t i) const;

private:
  struct buffer {
    int fd = -1;
    std::byte* addr = nullptr;
  };
  std::vector<buffer> buffers_;
  std::uint64_t bytes_ = 0;
};

// Consumer side: one read-only mapping of a producer's buffer; unmapped on destruction.
class mapped_buffer {
public:
  // Opens `handle` and maps `size` bytes. Throws std::runtime_error naming the handle if it
  // is malformed, names another pid than `producer_pid` (the process of the rank that
  // publishes it), the producer or fd is gone (checked through a pidfd, so a reused pid is
  // noticed), the file is not a memfd sealed against shrinking and growing, or the buffer is
  // smaller than `size`.
  // `writable`: mapped read-write (direct publication: a trainer rank writing the runtime's
  // resident arena, which the runtime sealed like a producer buffer).
  mapped_buffer(const std::string& handle, std::uint64_t size, int producer_pid,
                bool writable = false);
  ~mapped_buffer();
  mapped_buffer(mapped_buffer&& other) noexcept;
  mapped_buffer& operator=(mapped_buffer&& other) noexcept;
  mapped_buffer(const mapped_buffer&) = delete;
  mapped_buffer& operator=(const mapped_buffer&) = delete;

  const std::byte* data() const { return addr_; }
  // Only for a writable mapping.
  std::byte* mutable_data() const { return const_cast<std::byte*>(addr_); }
  std::uint64_t size() const { return size_; }

private:
  const std::byte* addr_ = nullptr;
  std::uint64_t size_ = 0;
};

} // namespace refit::publication
