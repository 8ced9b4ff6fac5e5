// TrainerRank: one per trainer rank. Its weight source is either its FSDP dim-0 shard of every
// canonical tensor (synthetic weights) or the trainer's own registered memory
// (publication::registered_weights: Shard(0) rows, replicated tensors, fused experts). Per
// publication it re-plans from its own model config (validation point 1), materializes
// planned chunks in order through the collective into its packed buffers (host memfds or GPU
// memory; up to buffer_count chunks held at once), checks every emitted tensor against the
// plan (point 2), records its actual manifest (point 3; with registered weights and verify,
// also the verifier's digest terms of its memory) and checks the committed result (point 7).
// Blocking work runs on a worker thread the actor owns; every phase outcome goes to the
// ConsensusGate.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "actors/interfaces.hpp"
#include "runtime/config/config.hpp"
#include "runtime/model/manifest.hpp"
#include "runtime/publication/chunk_plan.hpp"
#include "runtime/publication/collective_registry.hpp"
#include "runtime/publication/backend.hpp"
#include "runtime/publication/direct_backend.hpp"
#include "runtime/publication/direct_plan.hpp"
#include "runtime/publication/registered.hpp"
#include "runtime/publication/shard.hpp"
#include "runtime/control/worker_thread.hpp"

namespace refit {

struct trainer_rank_options {
  std::uint32_t rank = 0;
  std::uint32_t world = 1;
  std::string device = "cpu:0";
  // The device's physical identity, resolved by whoever spawns the rank (on a GPU it takes a
  // CUDA call, which does not belong on a scheduler thread); empty: resolved here (CPU only).
  std::string device_uuid;
  model::model_config model;
  model::synthetic_weights weights;
  // The trainer's own tensors (sealed); null: the synthetic shards from `weights`. With it,
  // `step` only counts the trainer's steps (the trainer changes its memory itself).
  std::shared_ptr<const publication::registered_weights> registered;
  std::vector<config::trainer_fault> faults; // this rank's test-only faults
  std::shared_ptr<publication::collective_registry> collectives;
  consensus_gate_actor gate;
  std::uint32_t collective_timeout_ms = 30000;
};

// What the worker thread owns during one publication.
struct rank_session {
  publication_spec spec;
  publication::chunk_plan plan;
  std::unique_ptr<publication::buffer_pool> pool;
  std::shared_ptr<publication::collective> coll;
  std::vector<std::size_t> stream;         // emission order (canonical indices)
  std::size_t cursor = 0;
  std::vector<model::param_meta> emitted;  // the actual manifest
  std::vector<config::trainer_fault> faults; // test-only faults armed for this publication
  // Direct mode (spec.mode == "direct"): every TP worker's resident arena, opened for writing
  // in prepare and closed with the session; the TP layout and arena offsets of the moves.
  std::vector<std::unique_ptr<publication::resident_target>> targets;
  std::unique_ptr<publication::direct_writer> writer;
  std::shared_ptr<const model::tp_layout> layout;
  std::vector<std::uint64_t> offsets;
  // Direct mode, per chunk: its copies (planned in prepare, held by the writer), how many a
  // materialize started, and the bytes they place on this rank's own TP worker / on others.
  struct direct_chunk {
    bool planned = false;
    std::size_t copies = 0;
    std::size_t started = 0;
    std::uint64_t local = 0;
    std::uint64_t cross = 0;
  };
  std::vector<direct_chunk> direct;
  // The manifest of `emitted`, hashed chunk by chunk (while a GPU copies the chunk's bytes).
  std::unique_ptr<model::manifest_stream> manifest;
};

using trainer_rank_impl = trainer_rank_actor::extend<
  caf::reacts_to<done_atom, rank_report>,                   // a worker job's phase outcome
  caf::reacts_to<done_atom, std::uint32_t, std::uint64_t>>; // a step (new step) or describe
                                                            // (free bytes) job finished

struct trainer_rank_state {
  static inline const char* name = "TrainerRank";

  trainer_rank_options opts;
  std::string uuid;
  std::shared_ptr<publication::shard_store> shards; // synthetic source only
  // Why the worker thread could not allocate the shards (written there before any later job
  // runs; read only by later jobs on the same thread).
  std::shared_ptr<std::string> storage_error = std::make_shared<std::string>();
  std::shared_ptr<rank_session> session; // null between publications
  std::uint64_t step = 0;
  std::uint32_t next_job = 1;
  std::map<std::uint32_t, caf::typed_response_promise<std::uint64_t>> steps;
  std::map<std::uint32_t, caf::typed_response_promise<rank_info>> describes;
  std::int64_t last_transferred = -1;    // chunk index whose transfer this rank reported
  std::int64_t last_requested = -1;      // chunk index last asked to materialize
  std::map<std::uint32_t, std::uint64_t> packed; // chunk -> packed bytes not yet transferred
  std::uint64_t peak_materialized_bytes = 0;
  struct armed_fault {
    config::trainer_fault fault;
    bool spent = false; // a one-shot fault already fired in a publication
  };
  std::vector<armed_fault> faults;       // from opts.faults
  std::unique_ptr<worker_thread> worker; // last member: joined first

  // `free_bytes`: the device's free memory, read on the worker thread.
  rank_info info(std::uint64_t free_bytes) const;
};

trainer_rank_impl::behavior_type
trainer_rank(trainer_rank_impl::stateful_pointer<trainer_rank_state> self,
             trainer_rank_options opts);

} // namespace refit
