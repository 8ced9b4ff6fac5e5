// Metadata-first chunk planning (see chunk_plan.hpp): only names, shapes and dtypes are read,
// so planning the full Qwen3-30B-A3B stream costs no payload memory.
#include "runtime/publication/chunk_plan.hpp"

#include <algorithm>
#include <string>

#include "runtime/publication/shard.hpp"

namespace refit::publication {

namespace {

std::uint64_t align_up(std::uint64_t value, std::uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

} // namespace

chunk_plan plan_chunks(const std::vector<model::param_meta>& expected, std::uint64_t buffer_bytes,
                       std::uint32_t world) {
  if (world == 0)
    throw model::model_error(expected.empty() ? std::string("plan_chunks") : expected.front().name,
                             "cannot plan slots for world 0 (world must be >= 1)");
  chunk_plan plan;
  plan.buffer_bytes = buffer_bytes;
  plan.tensor_count = expected.size();

  chunk current;
  for (const auto& meta : expected) {
    const std::uint64_t nbytes = meta.nbytes();
    const std::uint64_t slot_bytes = world * shard_of(meta, world, 0).padded_bytes();
    if (slot_bytes > buffer_bytes)
      throw model::model_error(meta.name, "tensor needs " + std::to_string(slot_bytes)
                                              + " bytes (" + std::to_string(nbytes)
                                              + " bytes gathered over world "
                                              + std::to_string(world) + "), buffer is "
                                              + std::to_string(buffer_bytes) + " bytes");
    std::uint64_t offset = align_up(current.bytes_used, slot_alignment);
    if (!current.tensors.empty() && offset + slot_bytes > buffer_bytes) {
      plan.chunks.push_back(std::move(current));
      current = chunk{};
      current.index = static_cast<std::uint32_t>(plan.chunks.size());
      offset = 0;
    }
    current.tensors.push_back({meta, offset, slot_bytes});
    current.bytes_used = offset + slot_bytes;

    plan.total_tensor_bytes += nbytes;
    plan.largest_tensor_bytes = std::max(plan.largest_tensor_bytes, nbytes);
    plan.largest_slot_bytes = std::max(plan.largest_slot_bytes, slot_bytes);
  }
  if (!current.tensors.empty())
    plan.chunks.push_back(std::move(current));
  return plan;
}

} // namespace refit::publication
