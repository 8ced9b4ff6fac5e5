// TrainerHost: one per trainer process of a multi-process deployment (the embedding API spawns
// it next to the process's TrainerRank). It keeps the member table the coordinator's
// RankRegistry pushes and hands it to the process's cross-process all-gather (shm_group); a
// table that is no longer complete aborts a collective that waits for a departed peer. A
// publish(v) from the local caller waits (bounded) until every rank joined, then goes to the
// registry as this rank's share of the collective publish. The registry is monitored: if the
// coordinator goes away, the waiting publish and every later one fail with coordinator_lost.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "actors/interfaces.hpp"
#include "runtime/publication/shm_collective.hpp"

namespace refit {

struct trainer_host_options {
  std::uint32_t rank = 0;
  std::uint32_t world = 1;
  rank_registry_actor registry;
  std::shared_ptr<publication::shm_group> group; // this process's all-gather membership
  std::string coordinator;                       // "host:port" (for messages)
  std::uint32_t membership_wait_ms = 60000;      // publish: every rank joined by then
  std::uint32_t publish_timeout_ms = 660000;     // the registry's answer to a publish
};

using trainer_host_impl =
  trainer_host_actor::extend<caf::reacts_to<deadline_atom, std::uint64_t>>; // membership wait

struct trainer_host_state {
  static inline const char* name = "TrainerHost";

  struct pending_publish {
    std::uint64_t seq = 0;
    std::uint64_t version = 0;
    caf::typed_response_promise<publication_result> rp;
    bool sent = false; // forwarded to the registry
  };

  trainer_host_options opts;
  membership current;                // the last table the registry pushed
  bool lost = false;                 // the coordinator went away
  std::string lost_reason;
  std::optional<pending_publish> pending;
  std::uint64_t next_seq = 1;
  std::string last_error;

  host_status status() const;
};

trainer_host_impl::behavior_type
trainer_host(trainer_host_impl::stateful_pointer<trainer_host_state> self, trainer_host_options opts);

} // namespace refit
