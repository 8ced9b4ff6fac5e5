// Deterministic synthetic weights: the weight source of the trainer ranks when no real
// weights are registered, the runtime's generated checkpoint, the benchmarks and the tests.
// Not part of the model schema (qwen3_moe.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/model/qwen3_moe.hpp"

namespace refit::model {

// ---------------------------------------------------------------------------------------
// Deterministic synthetic weights: value of element `index` (global, row-major index in
// the full canonical tensor) of tensor `name`, after `step` synthetic optimizer steps:
//   w_0 = init(seed, name, index)
//   w_{s} = round_to_dtype(w_{s-1} + lr * noise(seed, s, name, index))
// Counter-based (no RNG state), so any shard or the full tensor can be recomputed.
// ---------------------------------------------------------------------------------------
// Step-0 values read from a checkpoint instead of the seeded init (runtime/checkpoint
// implements it over a Hugging Face model directory). Thread-safe reads.
class initial_weights {
public:
  virtual ~initial_weights() = default;
  // Bytes [byte_begin, byte_begin + bytes) of canonical tensor `p` (row-major, encoded in
  // p.dt). Throws naming the file and tensor.
  virtual void read(const param_meta& p, std::uint64_t byte_begin, std::uint64_t bytes,
                    std::byte* out) const = 0;
  // Where the values come from (a model directory), for logs and describe.
  virtual std::string source() const = 0;
};

struct synthetic_weights {
  std::uint64_t seed = 0;
  float lr = 1e-3f;
  float init_scale = 0.02f;
  // Set: w_0 is the checkpoint's value instead of init(seed, name, index); the steps are the
  // same counter-based noise.
  std::shared_ptr<const initial_weights> initial;
};

// Fills `out` with elements [begin, begin + count) of tensor `p` at optimizer step `step`,
// encoded in p.dt. Norm weights (names ending in "norm.weight") start around 1.0.
void fill_synthetic(const param_meta& p, const synthetic_weights& w, std::uint64_t step,
                    std::uint64_t begin, std::uint64_t count, std::byte* out);

// The counter-stream bases behind tensor `name`'s values at `step`: element e of the stream
// of step s is uniform(bases[s], e) (out has step + 1 entries; the device twin in
// runtime/cuda uses them), and whether the name is a norm weight (initialized around 1.0).
std::vector<std::uint64_t> synthetic_bases(const std::string& name, std::uint64_t seed,
                                           std::uint64_t step);
bool synthetic_is_norm(const std::string& name);

// Advances elements in place by one synthetic optimizer step (step is the new step number).
void apply_synthetic_step(const param_meta& p, const synthetic_weights& w, std::uint64_t step,
                          std::uint64_t begin, std::uint64_t count, std::byte* inout);

} // namespace refit::model
