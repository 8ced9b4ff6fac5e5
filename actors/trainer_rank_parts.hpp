// Internal to the TrainerRank actor (trainer_rank.cpp, trainer_rank_direct.cpp): the pieces
// both files use. Not part of any interface.
#pragma once

#include <string>
#include <utility>

#include "actors/trainer_rank.hpp"

namespace refit::trainer_rank_parts {

// The test-only fault of `kind` armed for this publication, if any.
const config::trainer_fault* find_fault(const rank_session& s, const std::string& kind);

rank_report failed(rank_report r, std::string error);

// The rank's weight source: the synthetic shard store or the registered tensors.
struct source_view {
  const publication::shard_store* shards = nullptr;
  const publication::registered_weights* registered = nullptr;

  bool ready() const { return registered != nullptr || shards->ready(); }
  const std::vector<model::param_meta>& params() const {
    return registered ? registered->params() : shards->params();
  }
  const device::spec& device() const { return registered ? registered->device() : shards->device(); }
  publication::gather_item item(std::size_t i, std::byte* out) const {
    if (registered)
      return registered->item(i, out);
    return {shards->data(i), shards->spec(i).padded_bytes(), out, {}};
  }
  // Direct mode: the canonical bytes of tensor i this rank owns and where they are (its
  // FSDP2 chunk; a replicated tensor's own chunk; the experts of a fused parameter it holds).
  std::pair<const std::byte*, publication::owned_piece> owned(std::size_t i,
                                                              std::uint32_t rank) const {
    if (registered) {
      auto it = registered->item(i, nullptr);
      return {it.shard, {publication::piece_offset(it, rank), it.shard_bytes}};
    }
    const auto& spec = shards->spec(i);
    return {shards->data(i), {spec.row_begin * spec.row_bytes, spec.real_bytes()}};
  }
};

// The tensor the exporter emits at stream position `pos`: the source's own metadata, or a copy
// bent by the test-only wrong_shape fault.
struct emitted_tensor {
  const model::param_meta* meta = nullptr;
  model::param_meta bent;
  const model::param_meta& get() const { return meta ? *meta : bent; }
};
emitted_tensor emitted_at(const source_view& shards, const rank_session& s, std::size_t pos);

// Why the emitted tensor differs from the planned one ("" when it matches).
std::string emission_error(const model::param_meta& emitted, const model::param_meta& planned);

// Direct mode, in prepare: opens every TP worker's resident arena and plans every chunk's
// moves (bounds-checked) into the writer. In materialize: chunk k's planned copies, started
// (launched, on a GPU) by start_direct; finish_direct waits for them and accounts the bytes.
rank_report prepare_direct(const trainer_rank_options& o, const source_view& shards,
                           rank_session& s, rank_report r);
rank_report start_direct(rank_session& s, std::uint32_t k, rank_report r);
rank_report finish_direct(rank_session& s, std::uint32_t k, rank_report r);

} // namespace refit::trainer_rank_parts
