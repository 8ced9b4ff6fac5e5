// All typed actor interfaces of refit, in one place. Actors receive their peers as these
// handles, so tests substitute any peer with a scripted actor of the same interface.
#pragma once

#include <cstdint>
#include <string>

#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include "messages/net_type_ids.hpp"
#include "messages/type_ids.hpp"

namespace refit {

// vLLMRuntimeProxy: owns one spawned runtime process and its control channel. One request
// is on the wire at a time (later ones wait in order). Any timeout, EOF, invalid frame or
// mismatched response makes it BROKEN: it kills and reaps the whole process group, fails
// every pending request with the typed error, and quits with that error.
using runtime_proxy_actor = caf::typed_actor<
  caf::replies_to<describe_atom>::with<runtime_description>,
  caf::replies_to<generate_atom, generate_request>::with<generate_result>,
  caf::replies_to<score_atom, score_request>::with<score_result>,
  caf::replies_to<sleep_atom, std::uint32_t>::with<runtime_description>,
  caf::replies_to<wake_atom, wake_tags>::with<runtime_description>,
  caf::replies_to<init_wt_atom, transfer_init>::with<std::string>,
  caf::replies_to<start_upd_atom, publication_header>::with<std::string>,
  caf::replies_to<update_atom, weight_chunk>::with<chunk_ack>,
  caf::replies_to<finish_upd_atom, finish_request>::with<commit_result>,
  caf::replies_to<release_atom, std::string>::with<std::uint32_t>,
  caf::replies_to<reset_pc_atom>::with<std::uint64_t>,
  // Graceful stop: shutdown command, wait for exit, reap; then the proxy quits normally.
  caf::replies_to<shutdown_atom>::with<caf::ok_atom>,
  // Fail-stop: kill and reap the process group now, then quit with errc::poisoned.
  caf::replies_to<poison_atom, std::string>::with<caf::ok_atom>>;

// RolloutEngine: the rollout API (generate, sleep/wake, weight-transfer control surface).
// It validates every transition, forwards to the attached proxy, validates the child's
// answers again, stamps outputs with the committed model version, and poisons the runtime
// after an unsafe failure.
using rollout_engine_actor = caf::typed_actor<
  caf::replies_to<status_atom>::with<engine_status>,
  caf::replies_to<describe_atom>::with<runtime_description>,
  caf::replies_to<generate_atom, generate_request>::with<generate_result>,
  // Teacher-forced fp32 logprobs of given sequences on the resident weights (refused
  // exactly when generate is).
  caf::replies_to<score_atom, score_request>::with<score_result>,
  caf::replies_to<sleep_atom, std::uint32_t>::with<engine_status>,
  caf::replies_to<wake_atom, wake_tags>::with<engine_status>,
  caf::replies_to<reset_pc_atom>::with<std::uint64_t>,
  caf::replies_to<init_wt_atom, transfer_init>::with<engine_status>,
  caf::replies_to<start_upd_atom, publication_header>::with<engine_status>,
  caf::replies_to<update_atom, weight_chunk>::with<chunk_ack>,
  caf::replies_to<finish_upd_atom, finish_request>::with<commit_result>,
  caf::replies_to<release_atom>::with<engine_status>,
  caf::replies_to<poison_atom, std::string>::with<engine_status>,
  // From the rollout supervisor: a (re)started runtime and its incarnation number (1 = the
  // first runtime, whose checkpoint weights are usable; >1 needs a full publication).
  caf::reacts_to<attach_atom, runtime_proxy_actor, std::uint64_t>,
  // From the rollout supervisor: no runtime will come back (restart budget exhausted).
  caf::reacts_to<gave_up_atom, std::string>>;

// RolloutSupervisor: spawns the runtime proxy, monitors it, restarts it with bounded
// retries and backoff, and attaches every new proxy to the RolloutEngine.
using rollout_supervisor_actor = caf::typed_actor<
  caf::replies_to<status_atom>::with<supervisor_status>,
  // Orderly stop: no further restarts; the proxy gets a graceful shutdown.
  caf::replies_to<shutdown_atom>::with<caf::ok_atom>,
  // Internal: the backoff timer.
  caf::reacts_to<restart_atom>>;

// TrainerRank: one per trainer rank. Owns the rank's FSDP dim-0 shards, materializes exactly
// one planned chunk at a time into its packed buffer (through the collective, on a worker
// thread it owns) and reports every phase to the ConsensusGate.
using trainer_rank_actor = caf::typed_actor<
  caf::replies_to<describe_atom>::with<rank_info>,
  // One synthetic optimizer step on every shard; answers the new step number.
  caf::replies_to<step_atom>::with<std::uint64_t>,
  caf::reacts_to<prepare_atom, publication_spec>,
  caf::reacts_to<materialize_atom, std::string, std::uint32_t>,
  caf::reacts_to<transferred_atom, std::string, std::uint32_t>,
  caf::reacts_to<manifest_atom, std::string>,
  caf::reacts_to<final_atom, publication_result>,
  // From the gate or the coordinator: the publication failed; drop buffers, wake the collective.
  caf::reacts_to<abort_atom, gate_failure>>;

// ConsensusGate: for each (publication, phase) collects every rank's report. The `open`
// request is answered with all reports once every rank reported ok; any failure, or a rank
// missing at the deadline, fails the request with the same (phase, rank, error) that every
// rank receives as `abort`.
using consensus_gate_actor = caf::typed_actor<
  caf::replies_to<open_atom, phase_id, std::uint32_t, std::uint32_t>::with<std::vector<rank_report>>,
  caf::reacts_to<report_atom, rank_report>,
  caf::reacts_to<attach_atom, std::vector<trainer_rank_actor>>,
  caf::reacts_to<deadline_atom, phase_id>>;

// SyncCoordinator: the publication state machine (Idle -> Initialized -> Started -> Loading
// -> Finalizing -> Committed -> Released -> Idle, Poisoned from every state).
using sync_coordinator_actor = caf::typed_actor<
  caf::replies_to<publish_atom, std::uint64_t>::with<publication_result>,
  caf::replies_to<status_atom>::with<coordinator_status>>;

// ---- multi-process deployment (refit-coordinator serve / trainer processes)

// TrainerHost: one per trainer process, next to its TrainerRank (embedding API). It holds the
// member table the coordinator pushes (it feeds the cross-process all-gather), waits until
// every rank joined, and forwards the caller's collective publish to the RankRegistry. If the
// coordinator goes away, every waiting and later publish fails with coordinator_lost.
using trainer_host_actor = caf::typed_actor<
  // From the RankRegistry: the member table changed (complete or not).
  caf::reacts_to<members_atom, membership>,
  // From the local caller: this rank's share of publish(model_version).
  caf::replies_to<publish_atom, std::uint64_t>::with<publication_result>,
  caf::replies_to<status_atom>::with<host_status>>;

// RankRegistry: the actor `refit-coordinator serve` publishes on its port (the join actor).
// Every request checks the shared secret or the sender; a hello or join with another protocol
// version or a wrong token is refused with a typed error and logged. It owns the membership
// (monitoring every joined rank and host), spawns one SyncCoordinator per complete membership,
// and runs a publication once every rank asked for the same version.
using rank_registry_actor = caf::typed_actor<
  caf::replies_to<hello_atom, std::uint32_t, std::string>::with<welcome, consensus_gate_actor>,
  caf::replies_to<join_atom, join_request, trainer_rank_actor, trainer_host_actor>::with<join_ack>,
  caf::replies_to<publish_atom, publish_request>::with<publication_result>,
  caf::replies_to<status_atom, std::string>::with<registry_status>,
  caf::replies_to<generate_atom, rollout_generate>::with<generate_result>,
  caf::replies_to<sleep_atom, rollout_sleep>::with<engine_status>,
  caf::replies_to<wake_atom, rollout_wake>::with<engine_status>,
  // The communicator token of a publication on GPUs (token, rank, publication id, offered):
  // rank 0 offers it ("nccl:<hex of ncclUniqueId>"), every other rank asks with an empty
  // offer and is answered once rank 0's offer arrived (each asker bounds its own wait).
  caf::replies_to<collective_id_atom, std::string, std::uint32_t, std::string,
                  std::string>::with<std::string>>;

} // namespace refit
