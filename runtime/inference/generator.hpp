// Generation on one TP rank of refit-runtime (torch-free header).
//
// SPMD: every TP worker of a runtime runs engine::generate with the same request on its own
// shard. All ranks see identical (all-gathered) logits and draw from the same counter-based
// random streams, so all of them pick identical tokens and produce identical results.
//
// A request is validated and planned first (plan_request): prompts longer than
// max_prompt_length keep their LAST tokens; a prompt whose worst-case KV need does not fit the
// worker's KV arena alone is an INVALID_ARGUMENT, never an allocation elsewhere.
//
// Continuous batching: prompts are admitted in order while their worst-case KV need fits what
// the admitted ones have not reserved and their samples fit max_batch decoding slots. An
// admission round is one batched prefill (after the prefix-cache lookup) whose last-token
// logits give the first token of each of the prompt's n samples; the samples fork from the
// prompt's KV (full blocks shared, the partial block copied). Then one batched decode step per
// token over every live sample; a sample that stops ("stop": a stop token was sampled and is
// included) or reaches max_tokens ("length") frees its blocks and its slot at once, and the
// next waiting prompts are admitted before the following step. The schedule depends only on
// the request, so results are deterministic run to run.
//
// The prefix cache is dropped on reset_prefix_cache (the server calls it on every committed
// publication), when the engine is destroyed (KV cache freed on sleep) and, as a last line of
// defence, whenever generate is called with another weights version than the cache was
// filled with: KV computed with old weights is never reused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/inference/forward.hpp"
#include "runtime/inference/kv_cache.hpp"
#include "runtime/inference/sampling.hpp"
#include "runtime/inference/tp_comm.hpp"
#include "runtime/model/qwen3_moe.hpp"

namespace refit::inference {

struct generate_input {
  std::vector<std::vector<std::int32_t>> prompts;
  sampling_config params;
};

struct generation {
  std::uint32_t prompt_index = 0;
  std::uint32_t sample_index = 0;
  std::vector<std::int32_t> prompt_token_ids; // after truncation: what the model saw
  std::vector<std::int32_t> token_ids;
  std::vector<float> logprobs;
  std::string finish_reason; // "stop" | "length"
  bool prompt_truncated = false;
};
// Exact (bitwise for logprobs) equality.
bool operator==(const generation& a, const generation& b);
inline bool operator!=(const generation& a, const generation& b) { return !(a == b); }

struct generate_stats {
  std::uint64_t model_version = 0;
  std::uint64_t prompts = 0;
  std::uint64_t samples = 0;
  std::uint64_t waves = 0;                  // admission rounds (batched prefills)
  std::uint64_t prompt_tokens = 0;          // after truncation
  std::uint64_t prefix_hit_tokens = 0;      // prompt positions whose KV came from the cache
  std::uint64_t prefix_hit_blocks = 0;
  std::uint64_t computed_prompt_tokens = 0; // prompt positions prefilled
  std::uint64_t generated_tokens = 0;
  std::uint64_t forward_passes = 0;
  std::uint64_t stale_entries_dropped = 0;  // cache entries of another weights version
  std::uint64_t max_live_samples = 0;       // most samples decoding at once
  std::uint64_t graph_replays = 0;          // decode steps replayed from CUDA graphs
  std::uint64_t graph_captures = 0;
  std::uint64_t peak_workspace_bytes = 0;   // bf16 engine: device memory beyond weights + KV
  std::uint64_t preload_gemms = 0;          // bf16 engine: projections on the preloading GEMM

  // Phases and traffic (refit-bench generate; filled by generator.cpp's phase_meter).
  double prefill_seconds = 0;      // prefill forwards + drawing each sample's first token
  double decode_seconds = 0;       // batched decode steps (forward + sampling)
  double first_token_seconds = 0;  // generate() entered -> the first wave's first tokens drawn
  std::uint64_t decode_steps = 0;  // batched decode forward calls
  std::uint64_t decode_tokens = 0; // tokens the decode steps fed (one per active sample)
  // Pipelined decode (engine_options::pipeline_decode): the steps begun while the one before
  // was still in flight, and the rows dropped because their sample had stopped one step
  // earlier (extra rows the steps ran; not in decode_tokens).
  std::uint64_t decode_steps_ahead = 0;
  std::uint64_t decode_rows_dropped = 0;
  // Sum over decode steps and their tokens of the positions attended (cached ones plus the
  // new one): the KV positions the steps read.
  std::uint64_t decode_kv_positions = 0;
  // Sum over decode steps and layers of the distinct experts routed to (the expert weights a
  // step must read); valid when expert_loads_counted (the forward counts its routing).
  std::uint64_t decode_expert_loads = 0;
  bool expert_loads_counted = false;
  std::uint64_t kv_bytes_per_position = 0; // KV bytes of one position of one sequence (rank)
};

// A request field is out of range. `where` is relative to the GenerateRequest
// ("params.temperature", "prompts[1].token_ids[3]"); the server prefixes "generate.".
struct request_error : std::invalid_argument {
  request_error(std::string where, const std::string& message)
    : std::invalid_argument(message), where(std::move(where)) {}
  std::string where;
};

struct request_plan {
  std::vector<std::vector<std::int32_t>> prompts; // after truncation
  std::vector<bool> truncated;
  std::vector<std::uint64_t> needs;               // worst-case KV blocks per prompt
  std::vector<std::vector<std::uint32_t>> waves;  // prompt indices per wave, in order
  std::uint32_t capacity_blocks = 0;
};

// Validates a score request (engine::score) against the model and an arena of
// kv_cache_bytes; returns the sequences grouped into waves that fit (indices in order).
std::vector<std::vector<std::uint32_t>> plan_score(
  const model::model_config& cfg, const kv_geometry& kv, std::uint64_t kv_cache_bytes,
  const std::vector<std::vector<std::int32_t>>& sequences, std::uint32_t start);

// Worst-case KV blocks of one prompt: its full blocks (shared) plus, per sample, the blocks of
// positions [full blocks * block_size, prompt + max_tokens - 1).
std::uint64_t kv_blocks_needed(std::uint64_t prompt_tokens, std::uint32_t n,
                               std::uint32_t max_tokens, std::uint32_t block_size);

// Validates `input` (throws request_error) and plans it for an arena of kv_cache_bytes.
request_plan plan_request(const model::model_config& cfg, const kv_geometry& kv,
                          std::uint64_t kv_cache_bytes, const generate_input& input);

struct engine_options {
  std::uint32_t block_size = 16;  // positions per KV block (prefix-cache granularity)
  int compute_threads = 0;        // LibTorch threads of the worker thread (0: leave)
  // Keep fp32 conversions of the weights during one request when the rank's residents are at
  // most this large (else convert on every use).
  std::uint64_t fp32_cache_limit_bytes = std::uint64_t{1} << 30;
  // >= 0: weights and KV arena live on this CUDA device (rank_forward_options::cuda_device).
  int cuda_device = -1;
  // Copies one KV block inside the arena (dst, src, bytes); empty: std::memcpy (host arena).
  std::function<void(std::byte*, const std::byte*, std::uint64_t)> copy_kv_block;
  // float32: the reference forward (fp32 KV). bfloat16: the bf16 engine (bf16 KV, device
  // sampling, CUDA graphs on a GPU at tp 1), kept across requests while the residents stay.
  model::dtype compute_dtype = model::dtype::float32;
  std::uint32_t max_batch = 256; // samples decoding at once (continuous batching)
  bool cuda_graphs = true;
  // Pipelined decode where the forward supports it (rank_forward::pipelines_samples: the bf16
  // engine at TP 1) and every prompt has been admitted: step N + 1 is enqueued before step N's
  // tokens reach the host, its input tokens taken from step N's draws on the device, so the
  // host's bookkeeping and the next step's launch overlap the device's work. The tokens and
  // log-probabilities are those of the synchronous schedule; a sample that stops on a stop
  // token at step N still has a row in step N + 1, which is dropped.
  bool pipeline_decode = true;
};

// The KV geometry an engine with `options` uses (element size from the compute dtype).
kv_geometry engine_kv_geometry(const model::model_config& cfg, std::uint32_t tp,
                               const engine_options& options);
// The fp32 KV geometry engine::score uses over the same arena: one score block occupies one
// engine block (half the positions of a bf16 block, the same bytes).
kv_geometry score_kv_geometry(const model::model_config& cfg, std::uint32_t tp,
                              const engine_options& options);

class engine {
public:
  // `kv_arena` (kv_bytes) must outlive the engine; `layout` is the runtime's TP layout.
  engine(const model::model_config& cfg, std::shared_ptr<const model::tp_layout> layout,
         std::uint32_t rank, std::byte* kv_arena, std::uint64_t kv_bytes,
         engine_options options = {});
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;

  // One request on this rank (every rank of `comm` must call it with the same arguments).
  // `residents`: this rank's resident tensors (layout order); `weights_version`: the
  // committed model version those weights are. Results: prompt-major, n samples per prompt.
  std::vector<generation> generate(const std::vector<const std::byte*>& residents,
                                   tp_comm& comm, const generate_input& input,
                                   std::uint64_t weights_version,
                                   generate_stats* stats = nullptr);

  // Teacher forcing with the fp32 forward (compute_dtype float32, no fp32 weight copies):
  // the log-softmax (temperature 1, no filters) log-probability of every token at positions
  // [start, size) of each sequence, given the tokens before it. Mirrors generation's
  // schedule (one batched prefill of [0, start), then one batched step per token), so for
  // a generation of the same sequences the CPU engine's logprobs are reproduced bitwise.
  // Scratch KV blocks come from this engine's pool (the prefix cache is neither read nor
  // filled). Throws request_error ("sequences[i]...", "start") for a bad request.
  // Defined in score.cpp.
  std::vector<std::vector<float>> score(const std::vector<const std::byte*>& residents,
                                        tp_comm& comm,
                                        const std::vector<std::vector<std::int32_t>>& sequences,
                                        std::uint32_t start);

  // Drops the prefix cache; returns the number of entries dropped.
  std::uint64_t reset_prefix_cache();
  std::uint64_t prefix_cache_entries() const { return pool_.prefix_entries(); }
  std::uint32_t capacity_blocks() const { return pool_.capacity(); }
  std::uint32_t available_blocks() const { return pool_.available(); }
  const kv_geometry& geometry() const { return kv_; }

  // Lifetime counters (for tests and logs).
  struct totals {
    std::uint64_t requests = 0;
    std::uint64_t prefix_hit_blocks = 0;
    std::uint64_t prefix_hit_tokens = 0;
    std::uint64_t cache_resets = 0;
  };
  const totals& lifetime() const { return totals_; }

private:
  const model::model_config cfg_;
  const std::shared_ptr<const model::tp_layout> layout_;
  const std::uint32_t rank_;
  const engine_options options_;
  const kv_geometry kv_;
  std::byte* const arena_;
  const std::uint64_t arena_bytes_;
  // This engine's forward options over `residents` (score.cpp adjusts them for fp32).
  rank_forward_options forward_options(const std::vector<const std::byte*>& residents,
                                       tp_comm& comm) const;
  // The forward of this request (the bf16 engine's is kept while residents and comm stay).
  rank_forward& forward_for(const std::vector<const std::byte*>& residents, tp_comm& comm);

  block_pool pool_;
  std::optional<std::uint64_t> cache_version_;
  totals totals_;
  std::unique_ptr<rank_forward> forward_;
  std::vector<const std::byte*> forward_residents_;
  const tp_comm* forward_comm_ = nullptr;
};

} // namespace refit::inference
