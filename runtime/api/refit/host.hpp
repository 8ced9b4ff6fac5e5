// refit embedding API: one trainer rank, embedded in its training process (one process per
// rank, torchrun-style), publishing weights into the TP rollout runtime through a refit
// coordinator over CAF's network layer. Installed as include/refit/host.hpp; link refit::refit
// (find_package(refit)). Plain C++17: no CAF, YAML or protobuf header reaches the caller.
//
//   auto h = refit::api::host::create({"recipe.yaml"});            // the recipe shared with the coordinator
//   h->register_rank({rank, world, "cpu:" + std::to_string(rank)});
//   h->register_weights(h->recipe_weights());                // or register_tensor(...) per parameter
//   if (auto e = h->connect()) { ... e.text ... }             // join (version + shared secret)
//   for (std::uint64_t v = 1; ...; ++v) {
//     h->step();                                              // the trainer's optimizer step
//     auto r = h->publish(v);                                 // collective: every rank calls it
//     if (!r) { ... r.failure().code == "rank_lost" ... }     // typed failure, never a hang
//   }
//
// publish(v) returns only once the runtime committed version v (with the receipts the TP
// workers produced) or with the typed failure every rank got: a rank whose process died
// ("rank_lost"; publish again once it rejoined), the coordinator gone ("coordinator_lost"), a
// rank that never called publish ("barrier_timeout"), or any publication failure of the
// coordinator ("gate_failed", "verification_failed", ...). Every wait is bounded by the
// recipe's serve and publication timeouts. A host is used from one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "refit/result.hpp"

namespace refit::api {

// refit's version ("0.1.0") and the wire protocol version a coordinator must speak.
REFIT_API const char* library_version();
REFIT_API std::uint32_t wire_protocol_version();

struct host_options {
  std::string config_path;        // the recipe: model, trainer, publication and serve sections
  std::string coordinator_host;   // overrides serve.host ("" = keep)
  int coordinator_port = -1;      // overrides serve.port (-1 = keep)
  std::string runtime_executable; // serve.embedded, rank 0 only: overrides runtime.executable
};

// Which rank this process is.
struct rank_spec {
  std::uint32_t rank = 0;
  std::uint32_t world = 0; // 0 = the recipe's (serve.world_size, or runtime.tp_size)
  std::string device;      // "cpu:N"; "" = trainer.devices[rank], else runtime.devices[rank]
};

class host;

// The synthetic weight source of a rank: FSDP dim-0 shards with seeded init plus lr * noise
// per optimizer step, the same weights the coordinator's byte-exact verifier recomputes (the
// trainer's own tensors are registered with register_tensor instead).
struct synthetic_weights {
  std::uint64_t seed = 0;
  float lr = 0;
  float init_scale = 0;
  std::uint64_t start_step = 0; // optimizer steps already taken (a restarted rank catches up)
};

// How a registered tensor is spread over the trainer ranks.
enum class placement : std::uint8_t {
  shard0 = 0,     // FSDP2 Shard(0): c = ceil(N / W) rows, rank r holds [r*c, min(N, (r+1)*c))
  replicated = 1, // every rank holds all N rows
};

// One parameter's local shard, as memory the caller owns (the trainer's own weights). `name`
// is the canonical HF name (model.layers.0.self_attn.q_proj.weight, ...) or a transformers 5
// fused expert parameter (model.layers.L.mlp.experts.gate_up_proj [E, 2I, H], gate rows then
// up rows; model.layers.L.mlp.experts.down_proj [E, H, I]). The memory is read in place
// (zero copy) by every publish: it must stay valid, at the same address and size, from
// register_tensor until the last publish that reads it returned, and must not change while a
// publish runs (with publication.verify, a change is caught as "verification_failed").
struct tensor_spec {
  std::string name;
  const void* data = nullptr;
  std::uint64_t bytes = 0;       // of the local shard: rows * (product of the other dims) * dtype size
  std::string dtype;             // "bfloat16" ("bf16"), "float16" ("fp16", "half"), "float32" ("fp32", "float")
  std::string device = "cpu";    // "cpu", "cpu:N" or "cuda:N"
  std::vector<std::int64_t> global_shape;
  placement sharding = placement::shard0;
  std::uint64_t row_begin = 0;   // first global dim-0 row held
  std::uint64_t rows = 0;        // rows held (0-d tensors: 1)
  // Optional: where the tensor's memory is now (e.g. a framework tensor's data pointer and
  // size). publish() calls it first and refuses, naming the tensor, when it moved or resized.
  std::function<void(const void*& data, std::uint64_t& bytes)> current;
};

// A tensor of the model's canonical key stream (what must be registered).
struct model_tensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string dtype;
};

struct tensor_checksum {
  std::string name;   // resident tensor name in the runtime's TP layout
  std::string digest; // element digest, 16 hex digits
};

// What one TP worker of the runtime reported for the committed version.
struct receipt {
  std::uint32_t tp_rank = 0;
  std::string device_uuid;
  std::uint64_t resident_tensor_count = 0;
  std::vector<tensor_checksum> checksums; // with publication.verify
};

// A committed publication.
struct publication {
  std::string publication_id;
  std::uint64_t model_version = 0;
  std::string manifest_fingerprint;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;
  std::uint32_t chunks = 0;
  std::uint32_t trainer_ranks = 0;
  std::uint32_t tp = 0;
  double seconds = 0;                 // first chunk requested -> the runtime's commit validated
  std::uint64_t peak_buffer_bytes = 0;
  std::uint32_t attempts = 1;         // > 1: republished on a restarted runtime
  std::vector<std::string> recovered_errors;
  std::vector<receipt> receipts;
};

// Sampling parameters of a generate (see docs/architecture.md §7).
struct sampling_params {
  std::uint32_t n = 1;             // samples per prompt
  std::uint32_t max_tokens = 16;
  float temperature = 1.0f;        // 0 = greedy
  std::int32_t top_k = 0;          // 0 = off
  float top_p = 1.0f;
  std::uint64_t seed = 0;
  std::vector<std::int32_t> stop_token_ids;
  std::uint32_t max_prompt_length = 0; // 0 = no truncation; else keep the last tokens
};

struct sample {
  std::uint32_t prompt_index = 0;
  std::vector<std::int32_t> prompt_token_ids; // after truncation
  std::vector<std::int32_t> token_ids;
  std::vector<float> logprobs;                 // of each sampled token (processed distribution)
  std::string finish_reason;                   // "stop" or "length"
  bool prompt_truncated = false;
  std::uint64_t model_version = 0;             // the committed version that produced it
};

struct generation {
  std::vector<sample> samples;
  std::uint64_t model_version = 0;
};

// The rollout side as the coordinator sees it.
struct rollout_status {
  std::uint64_t committed_version = 0;
  std::string connection;          // "IDLE", "INFLIGHT", "BROKEN", "DETACHED"
  bool needs_publication = false;
  std::uint32_t sleep_level = 0;
  bool weights_awake = false;
  bool kv_cache_awake = false;
  bool publishing = false;         // a collective publish is open (barrier or running)
  std::uint64_t epoch = 0;
  bool complete = false;           // every rank joined
  std::string last_error;
};

class REFIT_API host {
public:
  // Loads and validates the recipe (every key typed and checked); nothing is started yet.
  static result<std::unique_ptr<host>> create(host_options options);
  // Leaves the deployment: the coordinator sees this rank go (with serve.embedded, rank 0 also
  // shuts the runtime down).
  ~host();
  host(const host&) = delete;
  host& operator=(const host&) = delete;

  // This process's rank. Checked against the recipe (rank < world, world, device).
  error register_rank(rank_spec spec);
  // This rank's weights (before connect).
  error register_weights(synthetic_weights weights);
  // The recipe's synthetic weights: job.seed, trainer.lr, trainer.init_scale, step 0.
  synthetic_weights recipe_weights() const;
  // Or: this rank's own tensors, one call per parameter (after register_rank, before
  // connect; not together with register_weights). Checked at once (device, rows against
  // FSDP2's chunking, size, pointer, registered twice), and as a set by connect() against the
  // model's key stream: the first extra, mis-typed, mis-shaped or missing tensor is named
  // ("invalid_argument" at the tensor's name).
  error register_tensor(tensor_spec spec);
  // Whether registered tensor `name` still is (data, bytes): "invalid_argument" at `name`
  // when it moved or resized since registration, or when no such tensor is registered.
  error check_tensor(const std::string& name, const void* data, std::uint64_t bytes) const;
  // The model's canonical key stream, in order (from the recipe's model section).
  std::vector<model_tensor> model_tensors() const;
  // Connects to the coordinator at serve.host:serve.port (rank 0 with serve.embedded first
  // starts it in this process; a refused connection is retried until serve.join_timeout_ms)
  // and joins as the registered rank: protocol version and shared secret are checked by the
  // coordinator; a refusal comes back as the typed error ("unauthorized", "protocol_mismatch",
  // "join_refused", "coordinator_unreachable").
  error connect();
  // One optimizer step of the weight source; answers the new step number. Refused while a
  // publication of this rank is open.
  result<std::uint64_t> step();
  // This rank's share of the collective publish of `model_version` (see above).
  result<publication> publish(std::uint64_t model_version);
  // Generation through the coordinator (after connect): every prompt as token ids (the tiny
  // recipes' byte tokenizer: the UTF-8 bytes of a text). Refused with "update_open" while a
  // collective publish is open (barrier or running), "asleep" while the runtime sleeps,
  // "needs_publication" while its weights are invalid (after sleep level 2 or a restart).
  result<generation> generate(const std::vector<std::vector<std::int32_t>>& prompts,
                              const sampling_params& params);
  // Sleep level 1 or 2 / wake (weights, KV cache) of the runtime; refused like generate.
  result<rollout_status> sleep(std::uint32_t level);
  result<rollout_status> wake(bool weights, bool kv_cache);
  result<rollout_status> status();
  // Disconnects and stops everything this host started (the destructor does it too).
  void close();

  std::uint32_t rank() const;
  std::uint32_t world() const;
  bool connected() const;

  struct impl;

private:
  explicit host(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

} // namespace refit::api
