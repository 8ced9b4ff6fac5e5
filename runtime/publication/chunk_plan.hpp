// Metadata-first chunk planning: from the expected canonical key stream alone (names, shapes,
// bytes; no payload), assign every tensor a slot in a packed buffer and group tensors into
// chunks that fit the buffer. A slot holds the all-gather output of the tensor's dim-0 shards
// (world * padded shard bytes, see shard.hpp), so a collective can write it in place; the
// tensor itself is the first `meta.nbytes()` bytes of its slot.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/model/qwen3_moe.hpp"

namespace refit::publication {

struct planned_tensor {
  model::param_meta meta;
  std::uint64_t offset = 0;     // slot start inside the packed buffer (aligned)
  std::uint64_t slot_bytes = 0; // world * padded shard bytes (>= meta.nbytes())
};

struct chunk {
  std::uint32_t index = 0;
  std::vector<planned_tensor> tensors; // in canonical order
  std::uint64_t bytes_used = 0;        // end of the last slot
};

struct chunk_plan {
  std::vector<chunk> chunks;
  std::uint64_t buffer_bytes = 0;
  std::uint64_t total_tensor_bytes = 0;  // sum of meta.nbytes()
  std::uint64_t largest_tensor_bytes = 0;
  std::uint64_t largest_slot_bytes = 0;
  std::size_t tensor_count = 0;
};

inline constexpr std::uint64_t slot_alignment = 256;

// Greedy in canonical order: a chunk takes tensors while their aligned slots fit
// `buffer_bytes`. Throws model::model_error (where = tensor name) if one slot alone is larger
// than the buffer ("tensor X needs N bytes, buffer is M bytes"), or if `world` is 0.
chunk_plan plan_chunks(const std::vector<model::param_meta>& expected, std::uint64_t buffer_bytes,
                       std::uint32_t world);

} // namespace refit::publication
