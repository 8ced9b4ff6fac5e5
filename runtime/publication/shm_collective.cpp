// Cross-process all-gather over shared memory (see shm_collective.hpp).
#include "runtime/publication/shm_collective.hpp"
#include "runtime/publication/host_buffer.hpp"
#include "runtime/publication/memfd.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <system_error>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace refit::publication {

namespace {

constexpr std::uint64_t header_bytes = 4096;
constexpr std::uint64_t shm_magic = 0x3143484D53544652ull; // "RFTSHMC1" little-endian
constexpr std::uint32_t shm_layout = 1;
constexpr std::size_t reason_bytes = 512;

} // namespace

// The control block at offset 0 of every endpoint. Only its owner writes it; peers read it
// through a read-only mapping. The atomics are lock-free and address-free, so they work across
// processes. A "word" is (publication tag << 32) | (round + 1).
struct shm_header {
  std::uint64_t magic = shm_magic;
  std::uint32_t layout = shm_layout;
  std::uint32_t rank = 0;
  std::int32_t pid = 0;
  std::uint32_t reserved = 0;
  std::atomic<std::uint64_t> capacity{0}; // staging bytes (the memfd is header + capacity)
  std::atomic<std::uint64_t> posted{0};   // this rank's shards of that round are staged
  std::atomic<std::uint64_t> pulled{0};   // this rank has read every peer's staging of that round
  std::atomic<std::uint64_t> failed{0};   // this rank gave up in that publication (`reason`)
  // What the posted round holds: rewritten only after every peer pulled the previous round.
  std::uint64_t item_count = 0;
  std::uint64_t total_bytes = 0;
  std::uint64_t sizes_hash = 0;
  char reason[reason_bytes] = {};
};
static_assert(sizeof(shm_header) <= header_bytes, "the control block fits its page");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "cross-process atomics must be lock-free");

namespace {

std::system_error errno_error(const std::string& what) {
  return std::system_error(errno, std::generic_category(), what);
}

std::uint64_t round_up(std::uint64_t bytes, std::uint64_t to) {
  return (bytes + to - 1) / to * to;
}

std::uint64_t word(std::uint32_t tag, std::uint64_t round) {
  return (std::uint64_t{tag} << 32) | ((round + 1) & 0xffffffffull);
}

bool reached(std::uint64_t w, std::uint32_t tag, std::uint64_t round) {
  return (w >> 32) == tag && (w & 0xffffffffull) >= ((round + 1) & 0xffffffffull);
}

std::uint32_t tag_of(const std::string& text) {
  std::uint32_t h = 2166136261u; // FNV-1a
  for (unsigned char c : text) {
    h ^= c;
    h *= 16777619u;
  }
  return h | 1u; // never 0: a fresh header's words are 0
}

std::uint64_t hash_sizes(const std::vector<gather_item>& items) {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& it : items) {
    // A variable layout's list is the same on every rank (its own shard_bytes differ).
    if (it.pieces.empty()) {
      h ^= it.shard_bytes;
      h *= 1099511628211ull;
    }
    for (const auto& piece : it.pieces) {
      h ^= piece.offset;
      h *= 1099511628211ull;
      h ^= piece.bytes;
      h *= 1099511628211ull;
    }
  }
  return h;
}

// Bytes rank `r` stages for `items` (its pieces, in item order).
std::uint64_t peer_total(const std::vector<gather_item>& items, std::uint32_t r) {
  std::uint64_t total = 0;
  for (const auto& it : items)
    total += piece_bytes(it, r);
  return total;
}

void pause_briefly() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

// Parses "memfd:<pid>:<fd>".
bool parse_handle(const std::string& handle, int& pid, int& fd) {
  static const std::string prefix = "memfd:";
  if (handle.compare(0, prefix.size(), prefix) != 0)
    return false;
  auto colon = handle.find(':', prefix.size());
  if (colon == std::string::npos)
    return false;
  auto number = [](const std::string& text, int& out) {
    if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos)
      return false;
    out = std::stoi(text);
    return true;
  };
  return number(handle.substr(prefix.size(), colon - prefix.size()), pid)
         && number(handle.substr(colon + 1), fd);
}

std::string bounded(const char* text, std::size_t max) {
  return std::string(text, ::strnlen(text, max));
}

} // namespace

// ------------------------------------------------------------------------------- endpoint

shm_endpoint::shm_endpoint(std::uint32_t rank) : rank_(rank) {
  fd_ = create_sealable_memfd("refit-allgather", "all-gather endpoint");
  // The staging area grows (reserve), it never shrinks: sealed against shrinking before the
  // handle exists, so a peer's mapping can never lose pages (no SIGBUS).
  if (::ftruncate(fd_, static_cast<off_t>(header_bytes)) != 0
      || ::fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
    auto e = errno_error("all-gather endpoint: ftruncate / F_ADD_SEALS");
    ::close(fd_);
    throw e;
  }
  void* addr = ::mmap(nullptr, header_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (addr == MAP_FAILED) {
    auto e = errno_error("all-gather endpoint: mmap");
    ::close(fd_);
    throw e;
  }
  header_ = new (addr) shm_header{};
  header_->rank = rank;
  header_->pid = ::getpid();
}

shm_endpoint::~shm_endpoint() {
  if (staging_ != nullptr)
    ::munmap(staging_, capacity_);
  if (header_ != nullptr)
    ::munmap(header_, header_bytes);
  if (fd_ >= 0)
    ::close(fd_);
}

std::string shm_endpoint::handle() const {
  return "memfd:" + std::to_string(::getpid()) + ":" + std::to_string(fd_);
}

void shm_endpoint::reserve(std::uint64_t bytes) {
  if (bytes <= capacity_)
    return;
  auto page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  auto grown = round_up(std::max(bytes, capacity_ * 2), page);
  if (::ftruncate(fd_, static_cast<off_t>(header_bytes + grown)) != 0)
    throw errno_error("all-gather endpoint: growing the staging area to " + std::to_string(grown)
                      + " bytes");
  void* addr = ::mmap(nullptr, grown, PROT_READ | PROT_WRITE, MAP_SHARED, fd_,
                      static_cast<off_t>(header_bytes));
  if (addr == MAP_FAILED)
    throw errno_error("all-gather endpoint: mapping " + std::to_string(grown) + " staging bytes");
  if (staging_ != nullptr)
    ::munmap(staging_, capacity_);
  staging_ = static_cast<std::byte*>(addr);
  capacity_ = grown;
  header_->capacity.store(grown, std::memory_order_release);
}

// ------------------------------------------------------------------------------- collective

struct shm_collective::peer_map {
  std::uint32_t rank = 0;
  int pid = 0;
  int fd = -1;     // the peer's endpoint, reopened read-only through /proc
  int pidfd = -1;  // readable once the peer exited (-1: fall back to kill(pid, 0))
  const shm_header* header = nullptr;
  const std::byte* staging = nullptr;
  std::uint64_t staging_bytes = 0;

  bool alive() const {
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      return ::poll(&p, 1, 0) == 0;
    }
    return ::kill(pid, 0) == 0 || errno == EPERM;
  }

  // Maps at least `bytes` of the peer's staging area (it grows between rounds).
  bool map_staging(std::uint64_t bytes) {
    if (bytes <= staging_bytes)
      return true;
    auto capacity = header->capacity.load(std::memory_order_acquire);
    if (capacity < bytes)
      return false;
    void* addr = ::mmap(nullptr, capacity, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(header_bytes));
    if (addr == MAP_FAILED)
      return false;
    if (staging != nullptr)
      ::munmap(const_cast<std::byte*>(staging), staging_bytes);
    staging = static_cast<const std::byte*>(addr);
    staging_bytes = capacity;
    return true;
  }

  void unmap() {
    if (staging != nullptr)
      ::munmap(const_cast<std::byte*>(staging), staging_bytes);
    if (header != nullptr)
      ::munmap(const_cast<shm_header*>(header), header_bytes);
    if (fd >= 0)
      ::close(fd);
    if (pidfd >= 0)
      ::close(pidfd);
    staging = nullptr;
    header = nullptr;
    fd = pidfd = -1;
  }
};

shm_collective::shm_collective(std::shared_ptr<shm_endpoint> self, std::vector<shm_peer> members,
                               const std::string& tag, std::string unavailable)
  : self_(std::move(self)), members_(std::move(members)), unavailable_(std::move(unavailable)),
    world_(static_cast<std::uint32_t>(members_.size())), tag_(tag_of(tag)) {
  if (!self_)
    throw std::invalid_argument("shm_collective: no endpoint");
  if (members_.empty() && unavailable_.empty())
    unavailable_ = "no members";
}

shm_collective::~shm_collective() {
  for (auto& p : peers_)
    p.unmap();
}

collective_status shm_collective::failure(const std::string& what) const {
  return {false, "all_gather rank " + std::to_string(self_->rank()) + ": " + what};
}

collective_status shm_collective::map_peers() {
  std::vector<bool> seen(world_, false);
  for (const auto& m : members_) {
    if (m.rank >= world_ || seen[m.rank])
      return failure("the member table lists rank " + std::to_string(m.rank) + " of "
                     + std::to_string(world_) + " twice or out of range");
    seen[m.rank] = true;
  }
  if (self_->rank() >= world_)
    return failure("this rank is not in the member table");
  for (const auto& m : members_) {
    if (m.rank == self_->rank())
      continue;
    peer_map p;
    p.rank = m.rank;
    int fd_no = -1;
    if (!parse_handle(m.handle, p.pid, fd_no))
      return failure("rank " + std::to_string(m.rank) + "'s endpoint '" + m.handle
                     + "' is not memfd:<pid>:<fd>");
    if (p.pid != m.pid)
      return failure("rank " + std::to_string(m.rank) + "'s endpoint '" + m.handle
                     + "' belongs to pid " + std::to_string(p.pid) + ", the member is pid "
                     + std::to_string(m.pid));
    // The pidfd first: if the peer dies later, its endpoint stays readable but pidfd tells.
    p.pidfd = open_pidfd(p.pid);
    if (p.pidfd < 0 && errno == ESRCH)
      return failure("rank " + std::to_string(m.rank) + " (pid " + std::to_string(p.pid)
                     + ") is not running");
    std::string path = "/proc/" + std::to_string(p.pid) + "/fd/" + std::to_string(fd_no);
    std::string why;
    p.fd = open_peer_fd(p.pid, fd_no, why);
    struct stat st {};
    if (p.fd >= 0 && why.empty())
      why = check_seals(p.fd, F_SEAL_SHRINK);
    if (p.fd < 0 || !why.empty() || ::fstat(p.fd, &st) != 0 || !S_ISREG(st.st_mode)
        || static_cast<std::uint64_t>(st.st_size) < header_bytes) {
      if (why.empty())
        why = "not an endpoint";
      bool gone = !p.alive();
      p.unmap();
      if (gone)
        return failure("rank " + std::to_string(m.rank) + " (pid " + std::to_string(p.pid)
                       + ") exited before this rank could reach its endpoint");
      return failure("cannot open rank " + std::to_string(m.rank) + "'s endpoint " + path + ": "
                     + why);
    }
    void* addr = ::mmap(nullptr, header_bytes, PROT_READ, MAP_SHARED, p.fd, 0);
    if (addr == MAP_FAILED) {
      p.unmap();
      return failure("cannot map rank " + std::to_string(m.rank) + "'s endpoint: "
                     + std::strerror(errno));
    }
    p.header = static_cast<const shm_header*>(addr);
    if (p.header->magic != shm_magic || p.header->layout != shm_layout
        || p.header->rank != m.rank || p.header->pid != p.pid) {
      auto rank = p.header->rank;
      p.unmap();
      return failure("rank " + std::to_string(m.rank) + "'s endpoint " + path
                     + " is not an all-gather endpoint of that rank (it says rank "
                     + std::to_string(rank) + ")");
    }
    peers_.push_back(p);
  }
  mapped_ = true;
  return {};
}

// This rank gives up: later calls fail, and the peers see why instead of waiting for it.
collective_status shm_collective::abandon(const std::string& why) {
  {
    std::lock_guard<std::mutex> guard(abort_mtx_);
    if (!aborted_.load())
      abort_reason_ = why;
    aborted_.store(true);
    if (!published_failure_) {
      published_failure_ = true;
      auto* h = self_->header();
      std::string text = "rank " + std::to_string(self_->rank()) + ": " + why;
      std::memset(h->reason, 0, reason_bytes);
      std::memcpy(h->reason, text.data(), std::min(text.size(), reason_bytes - 1));
      h->failed.store(word(tag_, round_), std::memory_order_release);
    }
  }
  return failure(why);
}

template <class Ready>
collective_status shm_collective::wait_for(peer_map& p, Ready ready, const std::string& what,
                                           std::chrono::steady_clock::time_point deadline) {
  auto sleep = std::chrono::microseconds(10);
  for (unsigned spin = 0;; ++spin) {
    // A peer that gave up on this publication stops every rank, even one it already served.
    auto failed = p.header->failed.load(std::memory_order_acquire);
    if ((failed >> 32) == tag_)
      return abandon("rank " + std::to_string(p.rank) + " gave up (" + bounded(p.header->reason, reason_bytes)
                     + ") while this rank waited for it to " + what);
    if (ready())
      return {};
    if (aborted_.load()) {
      std::lock_guard<std::mutex> guard(abort_mtx_);
      return failure("collective aborted: " + abort_reason_);
    }
    if (spin < 256) {
      pause_briefly();
      continue;
    }
    if (!p.alive()) {
      if (ready())
        return {};
      return abandon("rank " + std::to_string(p.rank) + " (pid " + std::to_string(p.pid)
                     + ") exited while this rank waited for it to " + what);
    }
    if (std::chrono::steady_clock::now() >= deadline)
      return abandon("rank " + std::to_string(p.rank) + " did not " + what
                     + " within the deadline (pid " + std::to_string(p.pid) + " still running)");
    std::this_thread::sleep_for(sleep);
    sleep = std::min<std::chrono::microseconds>(sleep * 2, std::chrono::milliseconds(1));
  }
}

collective_status shm_collective::all_gather(std::uint32_t rank,
                                             const std::vector<gather_item>& items,
                                             std::chrono::steady_clock::time_point deadline) {
  if (rank != self_->rank())
    return failure("called as rank " + std::to_string(rank) + " on the endpoint of rank "
                   + std::to_string(self_->rank()));
  if (aborted_.load()) {
    std::lock_guard<std::mutex> guard(abort_mtx_);
    return failure("collective aborted: " + abort_reason_);
  }
  if (!unavailable_.empty())
    return abandon(unavailable_);
  if (!mapped_) {
    auto mapped = map_peers();
    if (!mapped.ok) {
      abandon(mapped.error);
      return mapped;
    }
  }
  const std::uint64_t round = round_++;
  std::uint64_t total = 0;
  for (const auto& it : items) {
    if (it.shard_bytes > 0 && (it.shard == nullptr || it.out == nullptr))
      return abandon("an item has a null shard or output pointer");
    if (auto bad = check_item_layout(it, world(), rank);
        !bad.empty())
      return abandon("an item's layout is malformed: " + bad);
    total += it.shard_bytes;
  }
  const auto sizes = hash_sizes(items);

  // 1. Every peer has read this rank's staging of the previous round, which may belong to the
  //    previous publication: then a peer that gave up on it or moved on is not reading either.
  const auto previous = self_->last_posted();
  const auto prev_tag = static_cast<std::uint32_t>(previous >> 32);
  const auto prev_round = (previous & 0xffffffffull) - 1;
  if (previous != 0)
    for (auto& p : peers_) {
      auto st = wait_for(
        p,
        [&] {
          if (reached(p.header->pulled.load(std::memory_order_acquire), prev_tag, prev_round))
            return true;
          return prev_tag != tag_
                 && ((p.header->failed.load(std::memory_order_acquire) >> 32) == prev_tag
                     || (p.header->posted.load(std::memory_order_acquire) >> 32) != prev_tag);
        },
        "read this rank's previous round", deadline);
      if (!st.ok)
        return st;
    }

  // 2. Stage this rank's shards (and place its own slot directly).
  try {
    self_->reserve(total);
  } catch (const std::exception& e) {
    return abandon(e.what());
  }
  std::uint64_t offset = 0;
  for (const auto& it : items) {
    if (it.shard_bytes == 0)
      continue;
    bulk_copy(self_->staging() + offset, it.shard, it.shard_bytes);
    std::byte* own = it.out + piece_offset(it, rank);
    if (own != it.shard)
      bulk_copy(own, it.shard, it.shard_bytes);
    offset += it.shard_bytes;
  }
  auto* h = self_->header();
  h->item_count = items.size();
  h->total_bytes = total;
  h->sizes_hash = sizes;
  h->posted.store(word(tag_, round), std::memory_order_release);
  self_->set_last_posted(word(tag_, round));

  // 3. Every peer staged the same round with the same items.
  for (auto& p : peers_) {
    auto st = wait_for(
      p, [&] { return reached(p.header->posted.load(std::memory_order_acquire), tag_, round); },
      "stage its shards of round " + std::to_string(round), deadline);
    if (!st.ok)
      return st;
  }
  for (auto& p : peers_)
    if (p.header->item_count != items.size() || p.header->total_bytes != peer_total(items, p.rank)
        || p.header->sizes_hash != sizes)
      return abandon("ranks disagree on the items of round " + std::to_string(round) + ": rank "
                     + std::to_string(rank) + " posted " + std::to_string(items.size())
                     + " items / " + std::to_string(total) + " bytes, rank "
                     + std::to_string(p.rank) + " posted " + std::to_string(p.header->item_count)
                     + " items / " + std::to_string(p.header->total_bytes) + " bytes");

  // 4. Pull every peer's shards into this rank's outputs.
  for (auto& p : peers_) {
    const std::uint64_t peer_bytes = peer_total(items, p.rank);
    if (!p.map_staging(peer_bytes))
      return abandon("cannot map rank " + std::to_string(p.rank) + "'s staging area ("
                     + std::to_string(peer_bytes) + " bytes)");
    std::uint64_t from = 0;
    for (const auto& it : items) {
      const std::uint64_t bytes = piece_bytes(it, p.rank);
      if (bytes == 0)
        continue;
      bulk_copy(it.out + piece_offset(it, p.rank), p.staging + from, bytes);
      from += bytes;
    }
  }
  h->pulled.store(word(tag_, round), std::memory_order_release);
  if (aborted_.load()) {
    std::lock_guard<std::mutex> guard(abort_mtx_);
    return failure("collective aborted: " + abort_reason_);
  }
  return {};
}

void shm_collective::abort(const std::string& reason) {
  std::lock_guard<std::mutex> guard(abort_mtx_);
  if (!aborted_.load())
    abort_reason_ = reason;
  aborted_.store(true);
  if (!published_failure_) {
    published_failure_ = true;
    auto* h = self_->header();
    std::string text = "rank " + std::to_string(self_->rank()) + " aborted: " + reason;
    std::memset(h->reason, 0, reason_bytes);
    std::memcpy(h->reason, text.data(), std::min(text.size(), reason_bytes - 1));
    h->failed.store(word(tag_, round_), std::memory_order_release);
  }
}

void shm_collective::reset() {
  std::lock_guard<std::mutex> guard(abort_mtx_);
  aborted_.store(false);
  abort_reason_.clear();
}

// ------------------------------------------------------------------------------- group

void shm_group::set_members(std::vector<shm_peer> members) {
  std::lock_guard<std::mutex> guard(mtx_);
  members_ = std::move(members);
}

void shm_group::clear_members(const std::string& reason) {
  {
    std::lock_guard<std::mutex> guard(mtx_);
    members_.clear();
    unavailable_ = "no complete membership: " + reason;
  }
  abort_all(reason);
}

void shm_group::abort_all(const std::string& reason) {
  std::vector<std::shared_ptr<shm_collective>> live;
  {
    std::lock_guard<std::mutex> guard(mtx_);
    for (auto& w : live_)
      if (auto c = w.lock())
        live.push_back(std::move(c));
    live_.clear();
  }
  for (auto& c : live)
    c->abort(reason);
}

std::shared_ptr<collective> shm_group::for_publication(const std::string& publication_id) {
  std::lock_guard<std::mutex> guard(mtx_);
  auto c = std::make_shared<shm_collective>(self_, members_, publication_id,
                                            members_.empty() ? unavailable_ : std::string{});
  live_.erase(std::remove_if(live_.begin(), live_.end(), [](auto& w) { return w.expired(); }),
              live_.end());
  live_.push_back(c);
  return c;
}

} // namespace refit::publication
