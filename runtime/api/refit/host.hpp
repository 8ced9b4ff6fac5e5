// refit embedding API: one trainer rank, embedded in its training process (one process per
// rank, torchrun-style), publishing weights into the TP rollout runtime through a refit
// coordinator over CAF's network layer. Installed as include/refit/host.hpp; link refit::refit
// (find_package(refit)). Plain C++17: no CAF, YAML or protobuf header reaches the caller.
//
//   auto h = refit::api::host::create({"recipe.yaml"});            // the recipe shared with the coordinator
//   h->register_rank({rank, world, "cpu:" + std::to_string(rank)});
//   h->register_weights(h->recipe_weights());
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

// The weight source of this rank: the synthetic FSDP dim-0 shards refit publishes today
// (seeded init plus lr * noise per optimizer step), the same weights the coordinator's
// byte-exact verifier recomputes. LibTorch tensors handed over by the trainer are a later
// source.
struct synthetic_weights {
  std::uint64_t seed = 0;
  float lr = 0;
  float init_scale = 0;
  std::uint64_t start_step = 0; // optimizer steps already taken (a restarted rank catches up)
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
