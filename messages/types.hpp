// Message types exchanged between refit actors. Every type is default-constructible,
// copyable and fully inspectable (0.17-style `inspect`), so any of them can cross a
// process boundary through CAF's middleman. Protobuf stays at the child-process boundary
// (runtime/protocol.hpp converts); these are the actor-side mirrors.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include <caf/meta/type_name.hpp>

namespace refit {

// ------------------------------------------------------------------ runtime description
struct worker_info {
  std::uint32_t rank = 0;
  std::int32_t device_index = 0;
  std::string device_uuid;
  std::uint64_t weight_bytes_resident = 0;
  std::uint64_t kv_cache_bytes_resident = 0;
  std::uint64_t weight_bytes_offloaded = 0;
  std::uint64_t device_free_bytes = 0;
  std::uint64_t resident_tensor_count = 0;
  std::uint32_t producer_buffers_open = 0;
  std::uint64_t producer_buffers_opened = 0;
  std::string resident_export;            // direct mode: the worker's resident arena handle
  std::uint64_t resident_export_bytes = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, worker_info& x) {
  return f(caf::meta::type_name("worker_info"), x.rank, x.device_index, x.device_uuid,
           x.weight_bytes_resident, x.kv_cache_bytes_resident, x.weight_bytes_offloaded,
           x.device_free_bytes, x.resident_tensor_count, x.producer_buffers_open,
           x.producer_buffers_opened, x.resident_export, x.resident_export_bytes);
}

struct runtime_description {
  std::string runtime_kind;
  std::string runtime_version;
  std::uint32_t tp_world_size = 0;
  std::vector<worker_info> workers;
  std::uint32_t sleep_level = 0;
  bool weights_awake = false;
  bool kv_cache_awake = false;
  std::uint64_t model_version = 0;
  bool weights_valid = false;
  std::uint32_t pid = 0;
  // Version 0's weights: the model directory loaded at start ("" = synthetic weights).
  std::string checkpoint_path;
  std::uint64_t checkpoint_tensors = 0;
  std::uint64_t checkpoint_bytes = 0;
  std::string checkpoint_fingerprint;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, runtime_description& x) {
  return f(caf::meta::type_name("runtime_description"), x.runtime_kind, x.runtime_version,
           x.tp_world_size, x.workers, x.sleep_level, x.weights_awake, x.kv_cache_awake,
           x.model_version, x.weights_valid, x.pid, x.checkpoint_path, x.checkpoint_tensors,
           x.checkpoint_bytes, x.checkpoint_fingerprint);
}

// ------------------------------------------------------------------ generation
struct sampling_params {
  std::uint32_t n = 1;
  std::uint32_t max_tokens = 16;
  float temperature = 1.0f;
  std::int32_t top_k = 0;
  float top_p = 1.0f;
  std::uint64_t seed = 0;
  std::vector<std::int32_t> stop_token_ids;
  std::uint32_t max_prompt_length = 0; // 0 = no truncation
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sampling_params& x) {
  return f(caf::meta::type_name("sampling_params"), x.n, x.max_tokens, x.temperature, x.top_k,
           x.top_p, x.seed, x.stop_token_ids, x.max_prompt_length);
}

struct generate_request {
  std::vector<std::vector<std::int32_t>> prompts;
  sampling_params params;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, generate_request& x) {
  return f(caf::meta::type_name("generate_request"), x.prompts, x.params);
}

struct sample {
  std::uint32_t prompt_index = 0;
  std::vector<std::int32_t> prompt_token_ids;
  std::vector<std::int32_t> token_ids;
  std::vector<float> logprobs;
  std::string finish_reason;
  bool prompt_truncated = false;
  std::uint64_t model_version = 0; // stamped by the RolloutEngine
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sample& x) {
  return f(caf::meta::type_name("sample"), x.prompt_index, x.prompt_token_ids, x.token_ids,
           x.logprobs, x.finish_reason, x.prompt_truncated, x.model_version);
}

// How a generate request ran on the runtime (TP worker 0; control.proto GenerateStats).
struct generation_stats {
  std::uint64_t prompt_tokens = 0;
  std::uint64_t computed_prompt_tokens = 0;
  std::uint64_t prefix_hit_tokens = 0;
  std::uint64_t generated_tokens = 0;
  std::uint64_t waves = 0;
  std::uint64_t forward_passes = 0;
  double prefill_seconds = 0;
  double decode_seconds = 0;
  double first_token_seconds = 0;
  std::uint64_t decode_steps = 0;
  std::uint64_t decode_tokens = 0;
  std::uint64_t decode_kv_positions = 0;
  std::uint64_t decode_expert_loads = 0;
  bool expert_loads_counted = false;
  std::uint64_t kv_bytes_per_position = 0;
  std::uint64_t max_live_samples = 0;
  std::uint64_t graph_replays = 0;
  std::uint64_t graph_captures = 0;
  std::uint64_t peak_workspace_bytes = 0;
  std::uint64_t decode_steps_ahead = 0;  // pipelined decode: steps begun ahead of the last
  std::uint64_t decode_rows_dropped = 0; // rows of samples that had stopped (not tokens)
  std::uint64_t preload_gemms = 0;       // dense projections run on the preloading GEMM
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, generation_stats& x) {
  return f(caf::meta::type_name("generation_stats"), x.prompt_tokens, x.computed_prompt_tokens,
           x.prefix_hit_tokens, x.generated_tokens, x.waves, x.forward_passes, x.prefill_seconds,
           x.decode_seconds, x.first_token_seconds, x.decode_steps, x.decode_tokens,
           x.decode_kv_positions, x.decode_expert_loads, x.expert_loads_counted,
           x.kv_bytes_per_position, x.max_live_samples, x.graph_replays, x.graph_captures,
           x.peak_workspace_bytes, x.decode_steps_ahead, x.decode_rows_dropped,
           x.preload_gemms);
}

struct generate_result {
  std::vector<sample> samples;
  std::uint64_t model_version = 0;
  generation_stats stats;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, generate_result& x) {
  return f(caf::meta::type_name("generate_result"), x.samples, x.model_version, x.stats);
}

// Teacher forcing with the runtime's fp32 forward (control.proto ScoreRequest): the
// log-softmax logprob of every token at positions [start, size) of each sequence.
struct score_request {
  std::vector<std::vector<std::int32_t>> sequences;
  std::uint32_t start = 1;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, score_request& x) {
  return f(caf::meta::type_name("score_request"), x.sequences, x.start);
}

struct score_result {
  std::vector<std::vector<float>> logprobs; // per sequence, size - start values
  std::uint64_t model_version = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, score_result& x) {
  return f(caf::meta::type_name("score_result"), x.logprobs, x.model_version);
}

// ------------------------------------------------------------------ sleep / wake
// Which parts wake_up restores. Default (both true) = all, as wake_up() without tags.
struct wake_tags {
  bool weights = true;
  bool kv_cache = true;
  static wake_tags all() { return {}; }
  static wake_tags only_weights() { return {true, false}; }
  static wake_tags only_kv_cache() { return {false, true}; }
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, wake_tags& x) {
  return f(caf::meta::type_name("wake_tags"), x.weights, x.kv_cache);
}

// ------------------------------------------------------------------ weight transfer
struct transfer_init {
  std::string transport; // "shm" | "cuda_ipc"
  std::uint64_t buffer_bytes = 0;
  std::uint32_t buffer_count = 0;
  std::string mode = "packed"; // "packed" | "direct" (publication.mode)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, transfer_init& x) {
  return f(caf::meta::type_name("transfer_init"), x.transport, x.buffer_bytes, x.buffer_count,
           x.mode);
}

struct publication_header {
  std::uint32_t protocol_version = 0;
  std::string transport;
  std::string publication_id;
  std::uint64_t model_version = 0;
  std::uint32_t tp_world_size = 0;
  std::string manifest_fingerprint;
  std::vector<std::string> device_uuids;
  std::uint64_t expected_tensor_count = 0;
  bool verify = false; // ask workers for resident checksums (byte-exact verifier)
  // Ordered like device_uuids: the process of trainer rank r, whose memfd handles alone TP
  // worker r maps (host transport).
  std::vector<std::uint32_t> producer_pids;
  std::string mode = "packed"; // "packed" | "direct"
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, publication_header& x) {
  return f(caf::meta::type_name("publication_header"), x.protocol_version, x.transport,
           x.publication_id, x.model_version, x.tp_world_size, x.manifest_fingerprint,
           x.device_uuids, x.expected_tensor_count, x.verify, x.producer_pids, x.mode);
}

struct tensor_meta {
  std::string name;
  std::vector<std::int64_t> shape;
  std::uint8_t dtype = 0; // refit::model::dtype value
  std::uint64_t offset = 0;
  std::uint64_t nbytes = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, tensor_meta& x) {
  return f(caf::meta::type_name("tensor_meta"), x.name, x.shape, x.dtype, x.offset, x.nbytes);
}

struct buffer_handle {
  std::string device_uuid;
  std::uint32_t buffer_index = 0;
  std::string handle; // host: "memfd:<pid>:<fd>"; cuda: raw cudaIpcMemHandle_t bytes
  std::uint64_t size = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, buffer_handle& x) {
  return f(caf::meta::type_name("buffer_handle"), x.device_uuid, x.buffer_index, x.handle,
           x.size);
}

struct weight_chunk {
  std::string publication_id;
  std::uint32_t chunk_index = 0;
  bool is_first = false;
  bool is_last = false;
  std::vector<tensor_meta> tensors;
  std::vector<buffer_handle> handles;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, weight_chunk& x) {
  return f(caf::meta::type_name("weight_chunk"), x.publication_id, x.chunk_index, x.is_first,
           x.is_last, x.tensors, x.handles);
}

struct chunk_ack {
  std::uint32_t chunk_index = 0;
  std::uint64_t tensors_loaded = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, chunk_ack& x) {
  return f(caf::meta::type_name("chunk_ack"), x.chunk_index, x.tensors_loaded);
}

struct finish_request {
  std::string publication_id;
  std::uint64_t model_version = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, finish_request& x) {
  return f(caf::meta::type_name("finish_request"), x.publication_id, x.model_version);
}

struct tensor_checksum {
  std::string name;   // resident tensor name
  std::string digest; // element digest, 16 hex digits (runtime/model/digest.hpp)
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, tensor_checksum& x) {
  return f(caf::meta::type_name("tensor_checksum"), x.name, x.digest);
}

struct receipt {
  std::string publication_id;
  std::uint64_t model_version = 0;
  std::uint32_t tp_world_size = 0;
  std::string manifest_fingerprint;
  std::uint32_t tp_rank = 0;
  std::string device_uuid;
  std::uint64_t resident_tensor_count = 0;
  std::vector<tensor_checksum> checksums; // only when the header asked to verify
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, receipt& x) {
  return f(caf::meta::type_name("receipt"), x.publication_id, x.model_version, x.tp_world_size,
           x.manifest_fingerprint, x.tp_rank, x.device_uuid, x.resident_tensor_count,
           x.checksums);
}

struct commit_result {
  std::string publication_id;
  std::uint64_t model_version = 0;
  std::vector<receipt> receipts;
  bool prefix_cache_reset = false;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, commit_result& x) {
  return f(caf::meta::type_name("commit_result"), x.publication_id, x.model_version,
           x.receipts, x.prefix_cache_reset);
}

// ------------------------------------------------------------------ publication (trainer side)
// A publication phase: every rank reports once per phase to the ConsensusGate.
enum class phase_kind : std::uint8_t {
  prepare = 1,     // schema + plan validated, buffers allocated
  materialize = 2, // chunk gathered into the packed buffer and checked against the plan
  transfer = 3,    // chunk loaded by the runtime; the buffer may be reused
  manifest = 4,    // actual emitted manifest
  final = 5,       // committed result checked by the rank
};
const char* to_string(phase_kind k);

struct phase_id {
  std::string publication_id;
  std::uint8_t kind = 0; // phase_kind
  std::uint32_t chunk = 0;
  phase_kind k() const { return static_cast<phase_kind>(kind); }
  bool operator<(const phase_id& o) const {
    return std::tie(publication_id, kind, chunk) < std::tie(o.publication_id, o.kind, o.chunk);
  }
  bool operator==(const phase_id& o) const {
    return publication_id == o.publication_id && kind == o.kind && chunk == o.chunk;
  }
};
std::string to_string(const phase_id& p); // "materialize[3] of <id>"

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, phase_id& x) {
  return f(caf::meta::type_name("phase_id"), x.publication_id, x.kind, x.chunk);
}

// One rank's outcome of one phase.
struct rank_report {
  phase_id phase;
  std::uint32_t rank = 0;
  bool ok = false;
  std::string error;                 // what failed, when !ok
  std::vector<tensor_meta> tensors;  // materialize: what the rank packed (name/shape/dtype/offset/nbytes)
  std::vector<buffer_handle> handles;// materialize: the rank's buffer holding the chunk
  std::string fingerprint;           // manifest: SHA-256 of the rank's actual emitted stream
  std::uint64_t tensor_count = 0;    // manifest: tensors emitted
  // manifest, registered weights with verify: this rank's digest terms per TP worker and
  // resident tensor (flattened [tp][resident], see publication::registered_weights)
  std::vector<std::uint64_t> digest_terms;
  // materialize, direct mode: placed bytes this rank wrote into the TP worker on its own
  // device (local) and into the other TP workers (cross)
  std::uint64_t moved_local = 0;
  std::uint64_t moved_cross = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rank_report& x) {
  return f(caf::meta::type_name("rank_report"), x.phase, x.rank, x.ok, x.error, x.tensors,
           x.handles, x.fingerprint, x.tensor_count, x.digest_terms, x.moved_local, x.moved_cross);
}

// The failure the gate hands to every rank and to the coordinator.
struct gate_failure {
  phase_id phase;
  std::uint32_t rank = 0; // first failing (or missing) rank
  std::string error;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, gate_failure& x) {
  return f(caf::meta::type_name("gate_failure"), x.phase, x.rank, x.error);
}

// What a trainer rank tells the coordinator in preflight.
struct rank_info {
  std::uint32_t rank = 0;
  std::uint32_t world = 0;
  std::string device;       // "cpu:N" / "cuda:N"
  std::string device_uuid;
  std::uint64_t free_bytes = 0;
  std::uint64_t step = 0;   // synthetic optimizer steps applied
  std::uint64_t shard_bytes = 0;
  std::uint64_t peak_materialized_bytes = 0; // most packed bytes held before a transfer freed them
  std::uint32_t pid = 0;    // the process holding the rank's packed buffers
  std::string weight_source = "synthetic";   // or "registered": the trainer's own tensors
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rank_info& x) {
  return f(caf::meta::type_name("rank_info"), x.rank, x.world, x.device, x.device_uuid,
           x.free_bytes, x.step, x.shard_bytes, x.peak_materialized_bytes, x.pid,
           x.weight_source);
}

// Sent to every rank before any materialization: each rank re-plans from its own model
// config and checks the result against this (validation point 1).
struct publication_spec {
  std::string publication_id;
  std::uint64_t model_version = 0;
  std::string manifest_fingerprint;
  std::uint64_t tensor_count = 0;
  std::uint64_t buffer_bytes = 0;
  std::uint32_t buffer_count = 0;
  std::uint32_t chunk_count = 0;
  std::uint32_t world = 0;
  std::uint32_t tp = 0;  // the runtime's TP size (registered weights: digest terms per worker)
  bool verify = false;   // publication.verify: registered ranks report digest terms
  // Direct mode: every TP worker's exported resident arena (buffer_index = TP rank, size =
  // arena bytes), opened for writing by every rank; runtime_pid: the only process whose
  // memfds a rank opens.
  std::string mode = "packed";
  std::vector<buffer_handle> targets;
  std::uint32_t runtime_pid = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, publication_spec& x) {
  return f(caf::meta::type_name("publication_spec"), x.publication_id, x.model_version,
           x.manifest_fingerprint, x.tensor_count, x.buffer_bytes, x.buffer_count,
           x.chunk_count, x.world, x.tp, x.verify, x.mode, x.targets, x.runtime_pid);
}

// The committed result, handed to every rank (validation point 7) and to the caller.
struct publication_result {
  std::string publication_id;
  std::uint64_t model_version = 0;
  std::string manifest_fingerprint;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;
  std::uint32_t chunks = 0;
  std::uint32_t trainer_ranks = 0;
  std::uint32_t tp = 0;
  double seconds = 0;                 // first chunk requested -> version committed
  std::uint64_t peak_buffer_bytes = 0;// packed-buffer bytes materialized at once (per rank)
  std::vector<receipt> receipts;
  std::uint32_t attempts = 1;         // > 1: earlier attempts failed and were republished
  std::vector<std::string> recovered_errors; // why each earlier attempt failed
  std::string mode = "packed";        // publication.mode
  // Direct mode: placed bytes written by a rank into its own device's TP worker (local) and
  // into another device's (cross); packed mode: 0.
  std::uint64_t bytes_local = 0;
  std::uint64_t bytes_cross = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, publication_result& x) {
  return f(caf::meta::type_name("publication_result"), x.publication_id, x.model_version,
           x.manifest_fingerprint, x.tensors, x.bytes, x.chunks, x.trainer_ranks, x.tp,
           x.seconds, x.peak_buffer_bytes, x.receipts, x.attempts, x.recovered_errors, x.mode,
           x.bytes_local, x.bytes_cross);
}

// SyncCoordinator's publication state machine (the seed's states).
enum class publication_state : std::uint8_t {
  idle = 0, initialized, started, loading, finalizing, committed, released, poisoned
};
const char* to_string(publication_state s);

struct coordinator_status {
  std::uint8_t state = 0;                // publication_state
  std::uint64_t committed_version = 0;
  std::string publication_id;            // current or last
  std::uint64_t publications = 0;        // committed so far
  std::uint64_t failures = 0;            // poisoned so far
  std::string last_error;
  std::vector<std::string> transitions;  // state names of the current/last publication, in order
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, coordinator_status& x) {
  return f(caf::meta::type_name("coordinator_status"), x.state, x.committed_version,
           x.publication_id, x.publications, x.failures, x.last_error, x.transitions);
}

// ------------------------------------------------------------------ rollout engine status
// Connection state of the RolloutEngine towards its runtime (the seed's IDLE/INFLIGHT/BROKEN,
// plus DETACHED while no runtime is attached).
enum class connection_state : std::uint8_t { detached = 0, idle = 1, inflight = 2, broken = 3 };
const char* to_string(connection_state s);

struct engine_status {
  std::uint8_t connection = 0;       // connection_state
  std::uint64_t incarnation = 0;     // how many runtimes this engine has had attached
  std::uint64_t committed_version = 0;
  bool needs_publication = false;    // weights invalid: generation refused until a commit
  bool update_open = false;          // between start_weight_update and finish/release
  std::uint32_t sleep_level = 0;     // 0 = awake
  bool weights_awake = false;
  bool kv_cache_awake = false;
  std::string last_error;
  bool gave_up = false;              // the supervisor exhausted its restart budget
  connection_state conn() const { return static_cast<connection_state>(connection); }
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, engine_status& x) {
  return f(caf::meta::type_name("engine_status"), x.connection, x.incarnation,
           x.committed_version, x.needs_publication, x.update_open, x.sleep_level,
           x.weights_awake, x.kv_cache_awake, x.last_error, x.gave_up);
}

// What a rollout supervisor reports.
struct supervisor_status {
  std::uint64_t incarnation = 0;   // runtimes started so far
  std::uint32_t restarts = 0;      // restarts inside the current window
  bool running = false;            // a runtime proxy is alive
  bool gave_up = false;            // restart budget exhausted
  std::string last_exit;           // why the last runtime went away
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, supervisor_status& x) {
  return f(caf::meta::type_name("supervisor_status"), x.incarnation, x.restarts, x.running,
           x.gave_up, x.last_exit);
}

} // namespace refit
