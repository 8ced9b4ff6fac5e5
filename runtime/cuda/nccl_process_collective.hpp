// The GPU collective of the multi-process deployment: one trainer process per GPU, one NCCL
// communicator per process (rank r of world W), created by refit. Rank 0 creates the
// communicator's unique id (ncclGetUniqueId) and offers it for each publication through
// `exchange` (the RankRegistry's collective_id, over the coordinator connection); the other
// ranks get it from there. The id is kept across publications while the communicator is
// healthy (rank 0 offers the same one again); after an abort or a failure rank 0 offers a
// fresh id and every rank replaces its communicator. A rank whose communicator broke while
// rank 0 still offers the old id fails that publication (the gate then aborts rank 0 too,
// and the next publication agrees on a fresh one). Communicators are non-blocking: init and
// every gather poll the deadline and the abort flag, and end in ncclCommAbort and an error,
// never a hang.
//
// Gathers: the uniform layout (synthetic dim-0 shards) is one ncclAllGather per tensor; the
// variable layout (registered tensors, world > 1) one ncclBroadcast per rank's non-empty
// piece, rooted at that rank, into its offset of every rank's slot. All of a chunk in one
// ncclGroupStart/End.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "runtime/publication/collective_registry.hpp"

namespace refit::cuda {

// (publication id, offered id or "" for ranks > 0, deadline) -> the id rank 0 offered for that
// publication. Throws std::runtime_error naming what failed (timeout, refusal).
using id_exchange = std::function<std::string(
  const std::string& publication_id, const std::string& offered,
  std::chrono::steady_clock::time_point deadline)>;

// This process's rank `rank` of `world`, on CUDA device `ordinal`.
std::shared_ptr<publication::collective_registry> make_nccl_process_registry(
  int ordinal, std::uint32_t rank, std::uint32_t world, id_exchange exchange);

// "nccl:<256 hex digits>" of a fresh ncclUniqueId (creates NCCL's bootstrap root in this
// process); decode_unique_id throws cuda::error naming a malformed text.
std::string new_unique_id_text();

} // namespace refit::cuda
