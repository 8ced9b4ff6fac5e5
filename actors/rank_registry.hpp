// RankRegistry: the actor `refit-coordinator serve` publishes on its port (the "join" actor)
// and rank 0's process hosts with serve.embedded. It admits trainer processes as ranks after
// checking the wire protocol version and the shared secret (a wrong one is refused with a typed
// error and logged), monitors every joined rank and host, and keeps the membership:
//   - complete (every rank 0..world-1 joined): a new epoch; one SyncCoordinator is spawned for
//     it over the ranks' (remote) handles, the ConsensusGate is attached to them, and every
//     trainer process gets the member table (which feeds its cross-process all-gather);
//   - a rank leaves (its process died, its connection was lost): the epoch ends, the table
//     without it goes to the survivors, and a publish waiting for or running in that epoch
//     fails with rank_lost (a running one after the coordinator poisoned the runtime, through
//     the gate; the epoch's coordinator then goes, so nothing is republished without the rank).
// A publication runs when every rank of the epoch asked to publish the same version: wait for
// an IDLE runtime, sleep(2) -> wake(weights) -> SyncCoordinator publish -> wake(kv_cache); every
// rank gets the same result or typed error. All waits are bounded.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/interfaces.hpp"
#include "actors/sync_coordinator.hpp"

namespace refit {

struct rank_registry_options {
  std::uint32_t world = 1;
  std::uint32_t protocol_version = 0;        // refused otherwise (protocol_mismatch)
  std::string token;                         // the shared secret (never logged)
  // Every remote peer proved the secret before it could send a message (the serve listener's
  // handshake): the token fields of hello / join / status are then not used (trainers leave
  // them empty, the secret never travels). False with TLS, where the hello carries it.
  bool peers_authenticated = false;
  // Refusals counted outside the registry (the listener's failed handshakes), added to status.
  std::function<std::uint64_t()> external_refusals;
  std::string manifest_fingerprint;          // the coordinator's model: a rank with another is refused
  std::string identity;                      // "pid <pid> on <host>", sent in the welcome
  sync_coordinator_options coordinator;      // for every epoch's SyncCoordinator
  std::uint32_t publish_barrier_ms = 60000;  // first rank's publish -> every rank's publish
  std::uint32_t publish_timeout_ms = 600000; // the SyncCoordinator's publish request
  std::uint32_t ready_wait_ms = 60000;       // a publish waiting for an IDLE runtime
  std::uint32_t generate_timeout_ms = 130000; // a trainer's generate (runtime timeout + margin)
  std::uint32_t sleep_wake_timeout_ms = 40000; // a trainer's sleep / wake
  std::function<void(const std::string&)> log; // one line per event (joins, refusals, results)
};

struct registry_member {
  member_info info;
  trainer_rank_actor rank;
  trainer_host_actor host;
};

// A collective publish: the barrier (every rank's request), then the run.
struct publish_run {
  std::uint64_t seq = 0;
  std::uint64_t version = 0;
  std::uint64_t epoch = 0;
  std::map<std::uint32_t, caf::typed_response_promise<publication_result>> waiting;
  bool running = false;        // every rank arrived; the schedule is under way
  bool publish_sent = false;   // the SyncCoordinator has the request
  sync_coordinator_actor coordinator; // the epoch's coordinator that runs it
  std::uint64_t failures_before = 0;  // that coordinator's failures when the request was sent
  std::optional<std::uint32_t> lost_rank; // a rank left meanwhile
  std::string lost_reason;
  std::chrono::steady_clock::time_point ready_deadline;
};

using rank_registry_impl = rank_registry_actor::extend<
  caf::reacts_to<deadline_atom, std::uint64_t>, // the barrier of run `seq` timed out
  caf::reacts_to<restart_atom, std::uint64_t>>; // poll for run `seq` (runtime ready / coordinator failed)

struct rank_registry_state {
  static inline const char* name = "RankRegistry";

  rank_registry_options opts;
  rollout_engine_actor engine;
  consensus_gate_actor gate;
  std::map<std::uint32_t, registry_member> members;
  std::uint64_t epoch = 0;
  bool complete = false;
  std::string last_change = "no rank joined yet";
  sync_coordinator_actor coordinator;   // of the current epoch (null while incomplete)
  std::uint64_t committed_version = 0;
  std::uint64_t publications = 0;
  std::uint64_t failures = 0;
  std::uint64_t rank_losses = 0;
  std::uint64_t refusals = 0;
  std::string last_error;
  std::optional<publish_run> run;
  std::uint64_t next_seq = 1;
  // GPUs: each publication's NCCL communicator id, offered by rank 0 (collective_id).
  struct collective_rendezvous {
    std::string id;
    std::uint64_t seq = 0;
    std::vector<caf::typed_response_promise<std::string>> waiting;
  };
  std::map<std::string, collective_rendezvous> collective_ids;
  std::uint64_t next_collective_seq = 1;

  // The epoch coordinators are not linked to the registry: they go with it.
  ~rank_registry_state();

  void log(const std::string& line) const {
    if (opts.log)
      opts.log(line);
  }
};

rank_registry_impl::behavior_type
rank_registry(rank_registry_impl::stateful_pointer<rank_registry_state> self,
              rank_registry_options opts, rollout_engine_actor engine, consensus_gate_actor gate);

} // namespace refit
