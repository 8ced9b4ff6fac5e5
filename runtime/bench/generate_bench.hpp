// refit-bench generate: generation throughput of refit-runtime per batch size, the decode
// step against the bytes it must read (roofline), and the log-probability gap of the
// generated tokens to the fp32 reference forward. See generate_bench.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/config/config.hpp"

namespace refit::bench {

struct generate_options {
  std::string config_path;
  std::vector<std::uint32_t> batches{1, 16, 64, 256};
  std::uint32_t prompt_len = 128;
  std::uint32_t max_tokens = 64;
  float temperature = 1.0f;
  std::uint64_t seed = 1;
  unsigned repeat = 3;                       // measured requests per batch size (median)
  std::uint64_t bound_bytes = 256ull << 20;  // bytes of one bound copy
  unsigned bound_reps = 3;                   // bound copies after each measured request
  bool gap = true;                           // score the generated tokens with the fp32 forward
  bool as_json = false;
};

// The bytes one decode step must read and write on one TP rank (its resident share), from
// the model config and what the step did. `tokens`: sequences fed; `expert_loads`: sum over
// layers of the distinct experts routed to; `kv_positions`: sum over the fed sequences of
// the positions attended; `kv_bytes_per_position`: the runtime's KV bytes of one position.
struct decode_bytes {
  double attention = 0;  // qkv_proj + o_proj of every layer
  double norms = 0;      // q/k norm, input and post-attention norms, final norm
  double router = 0;     // mlp.gate of every layer
  double lm_head = 0;    // the rank's vocab rows
  double embedding = 0;  // one embedding row per fed token
  double experts = 0;    // w13 + w2 of each routed expert, per layer
  double kv_read = 0;
  double kv_write = 0;
  double total() const {
    return attention + norms + router + lm_head + embedding + experts + kv_read + kv_write;
  }
};
decode_bytes decode_step_bytes(const model::model_config& m, std::uint32_t tp, double tokens,
                               double expert_loads, double kv_positions,
                               double kv_bytes_per_position);

// Runs the benchmark (throws bench_error, publish_bench.hpp).
nlohmann::ordered_json run_generate(const generate_options& o, const config::refit_config& cfg,
                                    const std::string& runtime_exe);
void print_generate_table(const nlohmann::ordered_json& r);

} // namespace refit::bench
