// SyncCoordinator: the publication state machine
//   Idle -> Initialized -> Started -> Loading -> Finalizing -> Committed -> Released -> Idle
// and -> Poisoned from every state on any failure (the runtime is poisoned and killed; its
// supervisor restarts it; nothing is retried on the same runtime, there is no fallback).
// Per publication: preflight (topology, buffer fit, memory budget) before any
// materialization; a metadata-first chunk plan; chunk by chunk materialize -> consensus ->
// update_weights -> consensus; every rank's actual manifest == the expected one; finish
// (receipts validated by runtime and engine), the optional byte-exact verifier, the final
// result checked by every rank, then release: only then is the version committed. After a
// failure it can republish the same version on the supervisor's fresh runtime.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/interfaces.hpp"
#include "runtime/config/config.hpp"
#include "runtime/journal/journal.hpp"
#include "runtime/model/synthetic.hpp"
#include "runtime/publication/chunk_plan.hpp"
#include "runtime/control/worker_thread.hpp"

namespace refit {

struct sync_coordinator_options {
  model::model_config model;
  config::publication_config publication;
  config::timeouts timeouts_ms;       // the runtime's per-command timeouts
  std::uint32_t kill_grace_ms = 2000;
  model::synthetic_weights weights;   // the trainer's weights (for the byte-exact verifier)
  std::uint32_t restart_wait_ms = 60000; // a republish waits this long for a fresh runtime
  journal::sink_ptr journal;             // set when journaling (rank messages, drawn values)
};

// Everything about the publication in flight.
struct publication_ctx {
  std::string id;
  std::int64_t trace_start_ns = 0; // --trace: when the attempt began (trace::start)
  std::uint64_t version = 0;
  caf::typed_response_promise<publication_result> rp;
  std::vector<model::param_meta> expected;
  std::string fingerprint;
  publication::chunk_plan plan;
  publication_header header;
  runtime_description runtime;
  std::vector<rank_info> ranks;
  std::chrono::steady_clock::time_point first_chunk;
  double seconds = 0;
  std::uint64_t peak_bytes = 0;          // most packed bytes one rank held at once
  // The chunk pipeline (double buffering): chunk k + 1 materializes while chunk k loads.
  std::uint32_t buffer_count = 2;        // packed buffers per rank
  std::uint32_t next_materialize = 0;    // next chunk to ask the ranks for
  bool materializing = false;            // a materialize phase is open
  bool updating = false;                 // an update_weights + transfer phase is in flight
  std::uint32_t transferred = 0;         // chunks loaded by the runtime and released by ranks
  std::map<std::uint32_t, weight_chunk> ready; // materialized, not yet sent to the engine
  std::map<std::uint32_t, std::uint64_t> held; // packed bytes per chunk not yet transferred
  commit_result commit;
  bool verify = false;
  bool verify_done = false;              // expected checksums computed
  bool commit_waiting_for_verify = false;
  std::vector<receipt> expected_checksums; // per TP rank, from the trainer's full weights
  std::string verify_error;
  phase_id current;                      // for error reports
  std::uint32_t attempt = 1;             // 1 + republishes so far
  std::vector<std::string> recovered_errors;
  // Direct mode: placed bytes the plan expects per chunk (from the TP layout alone) and what
  // the ranks reported writing, on their own device and across devices.
  bool direct = false;
  std::vector<std::uint64_t> direct_placed;
  std::uint64_t bytes_local = 0;
  std::uint64_t bytes_cross = 0;
};

// A failed publication waiting for the supervisor's fresh runtime, to be published again.
struct pending_republish {
  std::uint64_t version = 0;
  caf::typed_response_promise<publication_result> rp;
  std::uint32_t next_attempt = 2;
  std::vector<std::string> errors;       // every failure so far
  caf::error last_error;
  std::uint64_t failed_incarnation = 0;  // the poisoned runtime
  std::chrono::steady_clock::time_point deadline;
};

using sync_coordinator_impl = sync_coordinator_actor::extend<
  // The worker thread finished the verifier's expected checksums (or failed: error text).
  caf::reacts_to<done_atom, std::string, std::vector<receipt>, std::string>,
  // Poll for the fresh runtime a pending republish waits for.
  caf::reacts_to<restart_atom>>;

struct sync_coordinator_state {
  static inline const char* name = "SyncCoordinator";

  sync_coordinator_options opts;
  rollout_engine_actor engine;
  consensus_gate_actor gate;
  std::vector<trainer_rank_actor> ranks;
  publication_state state = publication_state::idle;
  std::uint64_t committed_version = 0;
  std::uint64_t publications = 0;
  std::uint64_t failures = 0;
  std::string last_error;
  std::string last_publication_id;       // of the publication in flight, or the last one
  std::vector<std::string> transitions;
  std::shared_ptr<publication_ctx> ctx;
  std::optional<pending_republish> retry;
  std::unique_ptr<worker_thread> worker; // last member: joined first

  coordinator_status status() const;
};

sync_coordinator_impl::behavior_type
sync_coordinator(sync_coordinator_impl::stateful_pointer<sync_coordinator_state> self,
                 sync_coordinator_options opts, rollout_engine_actor engine,
                 consensus_gate_actor gate, std::vector<trainer_rank_actor> ranks);

// Expected resident element digests of every TP worker for synthetic weights at `step`
// (publication::expected_resident_digests), computed on `device` ("cpu:N" or, in CUDA
// builds, "cuda:N": the trainer's first device). Blocking; worker threads only.
// The expected resident digests of registered weights: every rank's manifest-phase digest
// terms (flattened [tp][resident]) added to the zero digests. Throws std::runtime_error when a
// rank's terms do not fit the layout.
// Preflight of attempt `ctx` (sync_preflight.cpp): fills ctx.plan (and, in direct mode,
// ctx.direct_placed); a preflight_failed error naming what does not fit, or none.
caf::error preflight(const sync_coordinator_state& st, publication_ctx& ctx);

std::vector<receipt> expected_from_terms(const model::model_config& model, std::uint32_t tp,
                                         const std::vector<rank_report>& reports);
std::vector<receipt> expected_resident_checksums(const model::model_config& model,
                                                 std::uint32_t tp,
                                                 const model::synthetic_weights& weights,
                                                 std::uint64_t step,
                                                 const std::string& device = "cpu:0");

} // namespace refit
