// The collective a trainer rank uses to materialize full tensors from dim-0 shards. One call
// per chunk (grouped, never one per tensor): every rank passes the same items in the same
// order; item i's output (world * shard_bytes) receives rank 0's shard, then rank 1's, ...
// The CPU implementation (local_collective) connects ranks that live in one process; the
// GPU build backs the same interface with NCCL.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace refit::publication {

// Where one rank's piece of an item lands in every rank's output.
struct gather_piece {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  bool operator==(const gather_piece& o) const { return offset == o.offset && bytes == o.bytes; }
};

// Uniform layout (`pieces` empty, the synthetic dim-0 shards): every rank's shard has
// shard_bytes and rank r's lands at out + r * shard_bytes. Variable layout (`pieces` has one
// entry per rank, the same list on every rank; registered tensors, whose ranks hold unequal
// row ranges or, for fused experts, whole canonical tensors): rank r's piece of
// pieces[r].bytes lands at out + pieces[r].offset, and shard_bytes == pieces[this rank].bytes.
struct gather_item {
  gather_item() = default;
  gather_item(const std::byte* shard_, std::uint64_t bytes_, std::byte* out_,
              std::vector<gather_piece> pieces_ = {})
    : shard(shard_), shard_bytes(bytes_), out(out_), pieces(std::move(pieces_)) {}
  const std::byte* shard = nullptr;
  std::uint64_t shard_bytes = 0; // this rank's bytes (uniform layout: identical on every rank)
  std::byte* out = nullptr;      // uniform: world * shard_bytes
  std::vector<gather_piece> pieces;
};

inline std::uint64_t piece_bytes(const gather_item& it, std::uint32_t rank) {
  return it.pieces.empty() ? it.shard_bytes : it.pieces[rank].bytes;
}
inline std::uint64_t piece_offset(const gather_item& it, std::uint32_t rank) {
  return it.pieces.empty() ? std::uint64_t{rank} * it.shard_bytes : it.pieces[rank].offset;
}
// "" if `it` is well formed for `world` ranks when posted by `rank`, else what is wrong.
std::string check_item_layout(const gather_item& it, std::uint32_t world, std::uint32_t rank);

struct collective_status {
  bool ok = true;
  std::string error; // which rank / what failed
};

class collective {
public:
  virtual ~collective() = default;
  virtual std::uint32_t world() const = 0;
  // Called by each rank before its first all_gather of a publication, on the thread that
  // will gather (NCCL: creates the communicators once). Same error rules as all_gather.
  virtual collective_status prepare(std::uint32_t rank,
                                    std::chrono::steady_clock::time_point deadline) {
    return {};
  }
  // Blocking; returns an error (never hangs) when a rank does not arrive before `deadline`,
  // when ranks disagree on the items' sizes, or after abort().
  virtual collective_status all_gather(std::uint32_t rank, const std::vector<gather_item>& items,
                                       std::chrono::steady_clock::time_point deadline) = 0;
  // Wakes every waiting rank with `reason`; later calls fail until reset().
  virtual void abort(const std::string& reason) = 0;
  virtual void reset() = 0;
};

// In-process all-gather for ranks that share an address space (threads).
class local_collective final : public collective {
public:
  explicit local_collective(std::uint32_t world);
  std::uint32_t world() const override { return world_; }
  collective_status all_gather(std::uint32_t rank, const std::vector<gather_item>& items,
                               std::chrono::steady_clock::time_point deadline) override;
  void abort(const std::string& reason) override;
  void reset() override;

private:
  std::uint32_t world_;
  std::mutex mtx_;
  std::condition_variable cv_;
  std::uint64_t generation_ = 0;        // completed rounds
  std::uint32_t arrived_ = 0;           // ranks in the current round's first barrier
  std::uint32_t copied_ = 0;            // ranks done copying in the current round
  std::vector<const std::vector<gather_item>*> posted_;
  bool aborted_ = false;
  std::string abort_reason_;
};

} // namespace refit::publication
