// Registered tensors: a trainer rank's weight source when the trainer hands refit its own
// FSDP2 shards (memory the caller owns) instead of the synthetic ones (shard.hpp).
//
// The caller registers, per parameter, the rank's local shard as (pointer, bytes, dtype,
// device, global shape, which global dim-0 rows the memory holds):
//   - Shard(0), FSDP2's chunking: c = ceil(N / W) rows; rank r holds rows
//     [r*c, min(N, (r+1)*c)), possibly none; the memory is unpadded (DTensor.to_local()).
//   - replicated: every rank holds all N rows.
//   - the transformers 5 fused expert parameters <layer>.mlp.experts.gate_up_proj [E, 2I, H]
//     (gate rows then up rows) and <layer>.mlp.experts.down_proj [E, H, I], either way.
// seal() checks the registered set against the model's canonical key stream and maps every
// canonical tensor onto byte ranges of the registered memory: no staging copy. For each
// canonical tensor, rank q contributes the bytes of global rows fsdp_chunk(N_T, W, q) of the
// registered tensor T that fall inside it (T's own dim-0 chunk, so a replicated tensor is
// contributed once, and a fused expert's canonical tensors by the rank that holds expert e);
// these pieces concatenate to the canonical tensor in rank order and are what the collective
// writes into the packed buffer (gather_item with a variable layout).
//
// The memory must stay valid and unchanged from registration until the last publish that
// reads it returns: refit keeps only the pointer. Digests computed from it after the gather
// (partial_digests) let the verifier catch memory that changed during a publication.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/device/device.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/publication/collective.hpp"

namespace refit::publication {

enum class tensor_placement : std::uint8_t { shard0 = 0, replicated = 1 };

struct tensor_registration {
  std::string name; // canonical HF name, or a fused expert parameter (see above)
  const std::byte* data = nullptr;
  std::uint64_t bytes = 0;
  model::dtype dt = model::dtype::bfloat16;
  std::string device = "cpu"; // "cpu", "cpu:N" or "cuda:N": where data lives
  std::vector<std::int64_t> global_shape;
  tensor_placement placement = tensor_placement::shard0;
  std::uint64_t row_begin = 0; // first global dim-0 row the memory holds
  std::uint64_t rows = 0;      // rows it holds (0-d tensors: 1 row)
};

struct row_range {
  std::uint64_t begin = 0;
  std::uint64_t count = 0;
};
// FSDP2's Shard(0) rows of rank `rank`: c = ceil(n / world), [r*c, min(n, (r+1)*c)).
row_range fsdp_chunk(std::uint64_t n, std::uint32_t world, std::uint32_t rank);

const char* placement_name(tensor_placement p);

class registered_weights {
public:
  // Throws model_error when the config is invalid, std::invalid_argument for rank >= world.
  registered_weights(const model::model_config& cfg, std::uint32_t world, std::uint32_t rank,
                     device::spec rank_device);

  // Records one tensor; throws model_error naming it when it is not part of the model (an
  // extra tensor), has another dtype or global shape than the model's, is registered twice,
  // holds rows other than this rank's (FSDP2 chunk or all), has a size that does not match
  // its rows or a null pointer, or lives on another device than this rank. Not after seal().
  void add(tensor_registration t);
  // Checks the set against the model's key stream and builds the canonical map; throws
  // model_error naming the first canonical tensor registered twice (directly and through a
  // fused parameter) or missing (in canonical order). Idempotent once it succeeded.
  void seal();
  bool sealed() const { return sealed_; }

  std::uint32_t world() const { return world_; }
  std::uint32_t rank() const { return rank_; }
  const device::spec& device() const { return device_; }
  const std::vector<tensor_registration>& tensors() const { return tensors_; }
  const tensor_registration* find(const std::string& name) const;
  // After seal(): the canonical key stream (model::expected_key_stream).
  const std::vector<model::param_meta>& params() const { return params_; }
  // This rank's item for canonical tensor i, whose slot in the packed buffer is `out`.
  gather_item item(std::size_t i, std::byte* out) const;
  // Bytes of registered memory.
  std::uint64_t bytes() const;
  // Digest terms of this rank's pieces of the canonical tensors `indices`, read from the
  // registered memory: out[t * residents + d] = sum over every element this rank contributed
  // that lands at resident d of TP worker t of element_term(index, bits) - element_term(index, 0)
  // (mod 2^64). The coordinator adds every rank's terms to the zero digests
  // (model/digest.hpp): the expected resident digests without any rank holding a full tensor.
  std::vector<std::uint64_t> partial_digests(const model::tp_layout& layout,
                                             const std::vector<std::size_t>& indices) const;

private:
  struct canonical_source {
    std::size_t tensor = 0;        // index into tensors_
    std::uint64_t base = 0;        // byte offset of the canonical tensor inside T's global bytes
  };
  model::model_config cfg_;
  std::uint32_t world_;
  std::uint32_t rank_;
  device::spec device_;
  bool sealed_ = false;
  std::vector<tensor_registration> tensors_;
  std::unordered_map<std::string, std::size_t> by_name_;
  std::vector<model::param_meta> expected_;                 // the model's key stream
  std::unordered_map<std::string, std::size_t> canonical_; // its names
  std::vector<model::param_meta> params_;
  std::vector<std::vector<gather_piece>> pieces_; // canonical -> per rank
  std::vector<const std::byte*> sources_;         // canonical -> this rank's piece in memory
};

} // namespace refit::publication
