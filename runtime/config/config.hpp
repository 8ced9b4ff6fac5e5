// Typed refit configuration, parsed from YAML recipes in configs/.
//
// Every key is known: an unknown key, a wrong type or an out-of-range value is a
// config_error whose `key` is the full dotted path (e.g. "runtime.timeouts_ms.sleep")
// and whose message says what was wrong with which value.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"

namespace refit::config {

struct config_error : std::runtime_error {
  config_error(std::string key, const std::string& what)
    : std::runtime_error(key.empty() ? what : key + ": " + what), key(std::move(key)) {}
  std::string key;
};

// Per-command timeouts of the runtime control protocol (milliseconds).
struct timeouts {
  std::uint32_t describe = 10000;
  std::uint32_t generate = 120000;
  std::uint32_t sleep = 30000;
  std::uint32_t wake_up = 30000;
  std::uint32_t init_weight_transfer = 30000;
  std::uint32_t start_weight_update = 30000;
  std::uint32_t update_weights = 60000;
  std::uint32_t finish_weight_update = 60000;
  std::uint32_t release_ipc = 30000;
  std::uint32_t reset_prefix_cache = 10000;
  std::uint32_t shutdown = 10000;
  std::uint32_t startup = 30000; // spawn -> first describe answered
};

// A test-only fault the child runtime applies to one command (see refit-runtime --fault).
struct runtime_fault {
  std::string command; // describe, generate, sleep, wake_up, ..., shutdown
  std::string kind;    // stall | exit | sigkill | error | bad_frame | wrong_id | wrong_command |
                       // wrong_result | wrong_version | forge_receipt | skew_logprobs
  std::uint32_t after = 0; // apply on the (after+1)-th occurrence of the command
  std::uint32_t incarnation = 1; // the runtime incarnation it is injected into (0 = every one)
};

struct runtime_config {
  std::string executable = "refit-runtime"; // relative: resolved next to the calling binary
  std::uint32_t tp_size = 1;
  std::vector<std::string> devices = {"cpu:0"}; // one per TP worker, in TP rank order
  std::uint64_t kv_cache_bytes = 4u << 20;      // per worker
  // auto | float32 | bfloat16. auto: bfloat16 (the bf16 engine) on CUDA devices when the
  // model is bf16, float32 (the reference forward) otherwise.
  std::string compute_dtype = "auto";
  std::uint32_t max_batch = 256;                // samples decoding at once per request
  std::uint64_t max_frame_bytes = 64u << 20;
  std::uint32_t kill_grace_ms = 2000;           // SIGTERM -> SIGKILL
  timeouts timeouts_ms;
  std::vector<runtime_fault> faults;            // test-only
};

struct supervisor_config {
  std::uint32_t max_restarts = 3;
  std::uint32_t backoff_initial_ms = 100;
  std::uint32_t backoff_max_ms = 5000;
  std::uint32_t restart_window_ms = 60000; // restarts older than this are forgiven
};

// A test-only fault of one trainer rank's exporter (see trainer.faults in configs/).
struct trainer_fault {
  std::uint32_t rank = 0;
  std::string kind;        // drop_tensor | wrong_shape | fail_materialize | never_report |
                           // wrong_manifest | reject_final | wrong_digest_terms |
                           // fail_copy (direct mode: half of chunk `chunk` written, then fails)
  std::string tensor;      // drop_tensor / wrong_shape: canonical tensor name
  std::uint32_t chunk = 0; // fail_materialize / never_report: chunk index
  bool repeat = false;     // false: fires in one publication only (a republish then succeeds)
};

// Trainer ranks: one per device of runtime.devices (colocated: rank r and TP worker r share
// device r). Weights are synthetic: seeded init (job.seed) plus `lr * noise` per step.
struct trainer_config {
  std::vector<std::string> devices; // rank r's device; empty = runtime.devices (colocated)
  float lr = 1e-3f;
  float init_scale = 0.02f;
  std::vector<trainer_fault> faults; // test-only
};

struct publication_config {
  std::uint64_t buffer_bytes = 4u << 20;    // one packed buffer per rank
  std::uint32_t buffer_count = 2;
  // shm (memfd, CPU devices) | cuda_ipc (CUDA IPC, GPUs). Left out of a YAML file, it
  // follows runtime.devices[0]'s kind.
  std::string transport = "shm";
  // packed: trainer ranks all-gather canonical tensors into packed buffers the runtime reads
  // (the canonical-stream contract). direct: the runtime exports its resident weights and
  // every rank writes the placements of its own shard bytes straight into them (one copy).
  std::string mode = "packed";
  bool verify = false;                      // byte-exact verifier after commit
  std::uint32_t gate_deadline_ms = 30000;   // a rank missing a phase by then fails it
  std::uint64_t memory_headroom_bytes = 64u << 20;
  // After a failed (poisoned) publication, wait for the supervisor's fresh runtime and publish
  // the same weights again, up to this many times, before reporting the failure.
  std::uint32_t republish_attempts = 1;
};

// The main job (refit-coordinator): K iterations of generate -> optimizer step -> sleep(2)
// -> wake(weights) -> publish -> wake(kv_cache) -> generate, with a parity check each time.
struct job_config {
  std::uint32_t iterations = 3;
  std::uint64_t seed = 1234;       // synthetic trainer weights (and the runtime's checkpoint)
  std::vector<std::string> prompts = {"The quick brown fox", "Colocated RL publishes weights"};
  std::uint32_t n = 2;             // samples per prompt
  std::uint32_t max_tokens = 16;
  float temperature = 0.8f;        // 0 = greedy
  std::int32_t top_k = 0;          // 0 = disabled
  float top_p = 1.0f;              // 1 = disabled
  std::uint32_t max_prompt_length = 64;
  float parity_tolerance = 1e-3f;  // max |runtime logprob - trainer reference logprob|
};

// The actor journal (runtime/journal.hpp): every message the SyncCoordinator, ConsensusGate and
// RolloutEngine process, their transitions and outputs, for refit-replay. Off by default.
struct journal_config {
  bool enabled = false;
  std::string path = "refit-journal.bin"; // truncated when the rollout side is spawned
};

// TLS for the serve connections (libcaf_openssl). A certificate, key and CA file are required:
// both sides authenticate each other (mutual verification) before the hello carries the token.
// (Anonymous TLS authenticates nobody, so an impostor listener would receive the secret: it is
// refused by validate.)
struct tls_config {
  bool enabled = false;
  std::string certificate; // PEM certificate of this side
  std::string key;         // PEM private key of this side
  std::string passphrase;  // of the key, if it is encrypted
  std::string cafile;      // PEM CA bundle that signed the peers' certificates
};

// Multi-process deployment (`refit-coordinator serve`, trainer processes through the
// embedding API): where the coordinator listens and trainer processes connect, the shared
// secret every join presents, and the bounds of the join handshake and of a collective publish.
struct serve_config {
  bool present = false;                 // the recipe has a serve section
  std::string host = "127.0.0.1";       // listen address (coordinator) / connect address (ranks)
  std::uint32_t port = 0;               // 0: the coordinator picks a free port and prints it
  std::string token;                    // the shared secret inline, or ...
  std::string token_env;                // ... the environment variable holding it
  std::uint32_t world_size = 0;         // trainer ranks; 0 = runtime.tp_size
  bool embedded = false;                // rank 0's trainer process hosts the coordinator
  std::uint32_t join_timeout_ms = 10000;     // connect + hello + join
  std::uint32_t publish_barrier_ms = 60000;  // first rank's publish -> every rank's publish
  std::uint32_t publish_timeout_ms = 600000; // every rank arrived -> committed or failed
  // The listener's own handshake (plain TCP mode, runtime/system/guarded_listener.hpp): how
  // long an unauthenticated connection may take to prove the secret, and how many may wait.
  std::uint32_t handshake_timeout_ms = 5000;
  std::uint32_t max_pending_handshakes = 64;
  tls_config tls;
};

struct refit_config {
  model::model_config model;
  // model.path: a Hugging Face model directory (absolute once parsed; relative paths are
  // resolved against the recipe's directory). Its config.json gives `model`; the runtime
  // loads its weights as version 0 and the trainer ranks start from them. "" = the model
  // fields of the recipe and synthetic weights.
  std::string model_path;
  runtime_config runtime;
  supervisor_config supervisor;
  trainer_config trainer;
  publication_config publication;
  job_config job;
  journal_config journal;
  serve_config serve;
};

// Parses YAML text. `origin` (file name or "<embedded>") prefixes error messages; a relative
// model.path is resolved against `base_dir` ("" = the working directory).
refit_config parse_yaml(const std::string& text, const std::string& origin = "<string>",
                        const std::string& base_dir = "");
refit_config load_file(const std::string& path);

// Cross-field checks (tp_size == devices.size(), model valid for tp, ...). parse_yaml
// calls it; exposed for configs built in code.
void validate(const refit_config& cfg);

// The whole config as YAML that parse_yaml reads back to the same values (the journal header
// carries it, so refit-replay rebuilds the same actors).
std::string to_yaml(const refit_config& cfg);

// The `model:` section alone (also how refit-runtime receives its model on the command
// line): parse from YAML text whose top level is the model map, and render back.
model::model_config parse_model_yaml(const std::string& text, const std::string& origin);
std::string model_to_yaml(const model::model_config& m);

// The trainer's weights of the recipe: job.seed, trainer.lr, trainer.init_scale, starting
// from model.path's checkpoint when the recipe has one (opened once per process).
model::synthetic_weights trainer_weights(const refit_config& cfg);

// Serve the Hugging Face model directory `dir` (refit-coordinator --model): model.path and
// the model fields from its config.json. Throws naming the file and field.
void use_model_dir(refit_config& cfg, const std::string& dir);

// Where the embedded default's relative paths (model.path) are resolved: $REFIT_CONFIGS_DIR,
// else <prefix>/share/refit/configs next to an installed executable, else the source tree's
// configs/.
std::string embedded_base_dir();

// The embedded default (configs/tiny-cpu.yaml, compiled in).
const std::string& embedded_default_yaml();

// The serve section's shared secret: serve.token, or the value of the environment variable
// serve.token_env. Throws config_error naming the key when there is none (no serve section,
// neither key set, the variable unset or empty).
std::string resolve_token(const serve_config& serve);

// Trainer ranks of a serve deployment (serve.world_size, or runtime.tp_size when 0).
std::uint32_t serve_world(const refit_config& cfg);

inline std::chrono::milliseconds ms(std::uint32_t v) { return std::chrono::milliseconds(v); }

} // namespace refit::config
