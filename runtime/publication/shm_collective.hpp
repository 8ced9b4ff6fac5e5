// Cross-process all-gather for trainer ranks that live in different processes of one host
// (one rank per trainer process, torchrun-style). It implements publication::collective with
// shared memory and atomics only; the membership (who is rank r, its pid and endpoint handle)
// comes from the coordinator over CAF, never from a socket of its own.
//
// Every process owns one endpoint: a memfd ("memfd:<pid>:<fd>", like the packed buffers) that
// holds a 4 KiB control header and a staging area. A peer opens it through /proc/<pid>/fd and
// maps it read-only; only the owner writes its endpoint. One round (one all_gather call):
//   1. wait until every peer finished reading this rank's staging of the previous round;
//   2. copy this rank's shards into its staging (grown on demand) and straight into slot
//      `rank` of its own outputs, then post (tag, round) with a release store;
//   3. wait until every peer posted the same round; every rank checks that all posted the same
//      item count and shard sizes (else every rank fails with the same message);
//   4. pull every peer's shards from its staging into slot `peer` of its own outputs, then mark
//      the round pulled.
// Every wait polls, with backoff up to 1 ms, the caller's deadline, the local abort flag, the
// peer's "failed" word (a rank that gives up publishes why) and the peer's liveness (pidfd):
// a dead or silent peer is an error naming it, never a hang. A failed or aborted collective
// fails every later call (one collective per publication: the registry hands out a fresh one).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/publication/collective.hpp"
#include "runtime/publication/collective_registry.hpp"

namespace refit::publication {

struct shm_header; // the shared control block (shm_collective.cpp)

// This process's end of the all-gather. Created once per trainer process; reused by every
// publication's collective (one at a time: a rank's collective runs on its worker thread).
class shm_endpoint {
public:
  // Creates the memfd with its header. Throws std::system_error on failure.
  explicit shm_endpoint(std::uint32_t rank);
  ~shm_endpoint();
  shm_endpoint(const shm_endpoint&) = delete;
  shm_endpoint& operator=(const shm_endpoint&) = delete;

  std::uint32_t rank() const { return rank_; }
  // "memfd:<pid>:<fd>": what the coordinator hands to the peers.
  std::string handle() const;

  shm_header* header() const { return header_; }
  std::byte* staging() const { return staging_; }
  std::uint64_t capacity() const { return capacity_; }
  // Grows the staging area to at least `bytes` (owner only, while no peer reads it).
  void reserve(std::uint64_t bytes);
  // The last round this endpoint posted (publication tag, round): the next collective on it
  // waits until the peers are done reading it.
  std::uint64_t last_posted() const { return last_posted_; }
  void set_last_posted(std::uint64_t word) { last_posted_ = word; }

private:
  std::uint32_t rank_;
  int fd_ = -1;
  shm_header* header_ = nullptr;
  std::byte* staging_ = nullptr;
  std::uint64_t capacity_ = 0;
  std::uint64_t last_posted_ = 0;
};

// One member of the current membership.
struct shm_peer {
  std::uint32_t rank = 0;
  std::int32_t pid = 0;
  std::string handle; // its endpoint
};

class shm_collective final : public collective {
public:
  // `members` lists every rank 0..world-1 once (this process's own entry included); `tag` is
  // the publication id, so rounds of different publications never match. Empty `members`:
  // every call fails with `unavailable` (no complete membership).
  shm_collective(std::shared_ptr<shm_endpoint> self, std::vector<shm_peer> members,
                 const std::string& tag, std::string unavailable = {});
  ~shm_collective() override;

  std::uint32_t world() const override { return world_; }
  collective_status all_gather(std::uint32_t rank, const std::vector<gather_item>& items,
                               std::chrono::steady_clock::time_point deadline) override;
  // Wakes the waiting call; also publishes the failure so the peers stop waiting for this rank.
  void abort(const std::string& reason) override;
  void reset() override;

private:
  struct peer_map;
  collective_status map_peers();
  collective_status abandon(const std::string& why);
  template <class Ready>
  collective_status wait_for(peer_map& p, Ready ready, const std::string& what,
                             std::chrono::steady_clock::time_point deadline);
  collective_status failure(const std::string& what) const;

  std::shared_ptr<shm_endpoint> self_;
  std::vector<shm_peer> members_;
  std::string unavailable_;
  std::uint32_t world_ = 0;
  std::uint32_t tag_ = 0;
  std::uint64_t round_ = 0;              // rounds started by this rank
  std::vector<peer_map> peers_;          // every member except this rank, mapped on first use
  bool mapped_ = false;
  std::atomic<bool> aborted_{false};
  std::mutex abort_mtx_;                 // abort() (actor thread) vs. the worker's own failure
  std::string abort_reason_;
  bool published_failure_ = false;
};

// The trainer process's view of the membership, and the collective registry of its
// TrainerRank: the TrainerHost sets the member table whenever the coordinator pushes one; each
// publication gets a fresh collective over the current table. Losing the membership (a rank
// left, the coordinator went away) aborts every live collective, so a rank stuck waiting for a
// peer wakes at once.
class shm_group final : public collective_registry {
public:
  explicit shm_group(std::shared_ptr<shm_endpoint> self) : self_(std::move(self)) {}

  const std::shared_ptr<shm_endpoint>& endpoint() const { return self_; }
  void set_members(std::vector<shm_peer> members);
  void clear_members(const std::string& reason); // also aborts every live collective
  void abort_all(const std::string& reason);
  std::shared_ptr<collective> for_publication(const std::string& publication_id) override;

private:
  std::shared_ptr<shm_endpoint> self_;
  std::mutex mtx_;
  std::vector<shm_peer> members_;
  std::string unavailable_ = "no complete membership yet: not every trainer rank has joined";
  std::vector<std::weak_ptr<shm_collective>> live_;
};

} // namespace refit::publication
