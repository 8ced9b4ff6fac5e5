// In-process all-gather (see collective.hpp). One round = two rendezvous:
//   1. arrival: every rank posts its items; when the last one arrives the round is committed.
//      A rank that reaches its deadline before that abandons the round for everyone (the
//      collective stays aborted until reset()), naming the ranks that did not arrive.
//   2. copy: every rank pushes its own shards into every rank's outputs (in parallel, outside
//      the lock; each shard is read once and streamed to all outputs, see bulk_copy_to_all),
//      then waits until all copies are done, because other ranks are still writing into its
//      outputs. Once committed a round always runs to completion: every rank copies (or skips
//      copying after a validation failure) and counts itself done, so this wait is bounded by
//      the memcpy time and needs no deadline; an abort() that comes meanwhile is reported when
//      the round ends.
#include "runtime/publication/collective.hpp"
#include "runtime/publication/host_buffer.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace refit::publication {

namespace {

collective_status failure(std::uint32_t rank, const std::string& what) {
  return {false, "all_gather rank " + std::to_string(rank) + ": " + what};
}

// Returns "" if every rank posted the same number of items with the same shard sizes and
// usable pointers, else what differs. Every rank computes the same answer.
std::string validate_posted(const std::vector<const std::vector<gather_item>*>& posted) {
  const auto& reference = *posted[0];
  for (std::size_t r = 0; r < posted.size(); ++r) {
    const auto& items = *posted[r];
    if (items.size() != reference.size())
      return "rank 0 posted " + std::to_string(reference.size()) + " items, rank "
             + std::to_string(r) + " posted " + std::to_string(items.size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (auto bad = check_item_layout(items[i], static_cast<std::uint32_t>(posted.size()),
                                       static_cast<std::uint32_t>(r));
          !bad.empty())
        return "item " + std::to_string(i) + ": rank " + std::to_string(r) + ": " + bad;
      if (items[i].pieces != reference[i].pieces)
        return "item " + std::to_string(i) + ": rank 0 and rank " + std::to_string(r)
               + " posted different piece layouts";
      if (items[i].pieces.empty() && items[i].shard_bytes != reference[i].shard_bytes)
        return "item " + std::to_string(i) + ": rank 0 posted " + std::to_string(reference[i].shard_bytes)
               + " shard bytes, rank " + std::to_string(r) + " posted "
               + std::to_string(items[i].shard_bytes);
      if (items[i].shard_bytes > 0 && (items[i].shard == nullptr || items[i].out == nullptr))
        return "item " + std::to_string(i) + ": rank " + std::to_string(r)
               + " posted a null shard or output pointer";
    }
  }
  return {};
}

std::string missing_ranks_message(const std::vector<const std::vector<gather_item>*>& posted) {
  std::string ranks;
  std::size_t missing = 0;
  for (std::size_t r = 0; r < posted.size(); ++r) {
    if (posted[r] != nullptr)
      continue;
    ranks += (missing++ == 0 ? "" : ", ") + std::to_string(r);
  }
  return (missing == 1 ? "rank " : "ranks ") + ranks + " did not arrive within the deadline";
}

// Pieces whose sizes differ by at most a quarter of the largest (an FSDP2 Shard(0) split:
// equal rows but for the trailing ranks').
bool balanced(const std::vector<gather_piece>& pieces) {
  std::uint64_t largest = 0, smallest = UINT64_MAX;
  for (const auto& p : pieces) {
    largest = std::max(largest, p.bytes);
    smallest = std::min(smallest, p.bytes);
  }
  return largest - smallest <= largest / 4;
}

// Whether the bytes each rank would push over all of `items` (its own pieces of the
// variable-layout ones, its shard of the uniform ones) are within a quarter of the largest.
bool balanced_pushes(const std::vector<gather_item>& items, std::uint32_t world) {
  std::vector<gather_piece> per_rank(world);
  for (const auto& it : items)
    for (std::uint32_t r = 0; r < world; ++r)
      per_rank[r].bytes += it.pieces.empty() ? it.shard_bytes : it.pieces[r].bytes;
  return balanced(per_rank);
}

} // namespace

std::string check_item_layout(const gather_item& it, std::uint32_t world, std::uint32_t rank) {
  if (it.pieces.empty())
    return {};
  if (it.pieces.size() != world)
    return std::to_string(it.pieces.size()) + " pieces for " + std::to_string(world) + " ranks";
  if (it.pieces[rank].bytes != it.shard_bytes)
    return "own piece of " + std::to_string(it.pieces[rank].bytes) + " bytes, shard of "
           + std::to_string(it.shard_bytes);
  return {};
}

local_collective::local_collective(std::uint32_t world) : world_(world), posted_(world, nullptr) {
  if (world == 0)
    throw std::invalid_argument("local_collective: world must be >= 1");
}

collective_status local_collective::all_gather(std::uint32_t rank,
                                               const std::vector<gather_item>& items,
                                               std::chrono::steady_clock::time_point deadline) {
  std::unique_lock lock(mtx_);
  if (rank >= world_)
    return failure(rank, "rank is out of range for world " + std::to_string(world_));
  if (aborted_)
    return failure(rank, "collective aborted: " + abort_reason_);
  if (posted_[rank] != nullptr)
    return failure(rank, "rank is already inside all_gather round " + std::to_string(generation_));

  const std::uint64_t round = generation_;
  posted_[rank] = &items;
  if (++arrived_ == world_) {
    cv_.notify_all();
  } else if (!cv_.wait_until(lock, deadline, [&] { return arrived_ == world_ || aborted_; })) {
    aborted_ = true;
    abort_reason_ = missing_ranks_message(posted_) + " (round " + std::to_string(round) + ")";
    cv_.notify_all();
    return failure(rank, abort_reason_);
  }
  if (arrived_ != world_) // aborted before the round was committed: abandoned
    return failure(rank, "collective aborted: " + abort_reason_);

  // Committed: posted_ stays unchanged until every rank has counted itself done below.
  const auto posted = posted_;
  const std::string mismatch = validate_posted(posted);
  lock.unlock();
  if (mismatch.empty()) {
    // Uniform layout, push: this rank writes its own shard of every item into every rank's
    // output (slot `rank`), reading each shard once for all of them. Every rank moves the
    // same bytes.
    // Variable layout (registered tensors): pull instead, every rank copies every rank's piece
    // into its own output. Pieces are unequal there (a fused expert's canonical tensors come
    // whole from the one rank holding the expert), so pushing would leave that rank copying
    // into every buffer while the others wait; pulling gives each rank one tensor's bytes.
    // A variable-layout item whose pieces are balanced (an FSDP2 Shard(0) tensor: ranks hold
    // ceil(N / W) rows, the last ones fewer or none) is pushed like the uniform layout: each
    // piece is read once. Only unbalanced items (a fused expert held whole by one rank) are
    // pulled.
    // Unbalanced items are pushed too when, over the whole call, every rank pushes about the
    // same bytes (fused experts alternate between owners within a chunk).
    const bool push_all = balanced_pushes(items, world_);
    std::vector<std::byte*> outs(world_);
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (!items[i].pieces.empty() && (push_all || balanced(items[i].pieces))) {
        const auto& own = items[i].pieces[rank];
        if (own.bytes == 0)
          continue;
        std::size_t count = 0;
        for (std::uint32_t dst = 0; dst < world_; ++dst) {
          std::byte* to = (*posted[dst])[i].out + own.offset;
          if (to != items[i].shard)
            outs[count++] = to;
        }
        bulk_copy_to_all(outs.data(), count, items[i].shard, own.bytes);
        continue;
      }
      if (!items[i].pieces.empty()) {
        for (std::uint32_t q = 0; q < world_; ++q) {
          const auto& piece = items[i].pieces[q];
          const std::byte* from = (*posted[q])[i].shard;
          std::byte* to = items[i].out + piece.offset;
          if (piece.bytes != 0 && to != from)
            bulk_copy_to_all(&to, 1, from, piece.bytes);
        }
        continue;
      }
      const std::uint64_t shard_bytes = items[i].shard_bytes;
      if (shard_bytes == 0)
        continue;
      const std::byte* from = items[i].shard;
      const std::uint64_t at = piece_offset(items[i], rank);
      std::size_t count = 0;
      for (std::uint32_t dst = 0; dst < world_; ++dst) {
        std::byte* to = (*posted[dst])[i].out + at;
        if (to != from) // an in-place shard already sits at its output
          outs[count++] = to;
      }
      bulk_copy_to_all(outs.data(), count, from, shard_bytes);
    }
  }
  lock.lock();

  if (++copied_ == world_) {
    ++generation_;
    arrived_ = 0;
    copied_ = 0;
    std::fill(posted_.begin(), posted_.end(), nullptr);
    cv_.notify_all();
  } else {
    cv_.wait(lock, [&] { return generation_ != round; });
  }
  if (!mismatch.empty())
    return failure(rank, "ranks disagree on the items of round " + std::to_string(round) + ": "
                             + mismatch);
  if (aborted_)
    return failure(rank, "collective aborted: " + abort_reason_);
  return {};
}

void local_collective::abort(const std::string& reason) {
  std::lock_guard lock(mtx_);
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = reason;
  }
  cv_.notify_all();
}

void local_collective::reset() {
  std::lock_guard lock(mtx_);
  aborted_ = false;
  abort_reason_.clear();
  arrived_ = 0;
  copied_ = 0;
  std::fill(posted_.begin(), posted_.end(), nullptr);
}

} // namespace refit::publication
