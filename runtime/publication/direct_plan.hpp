// Direct publication's chunk plan (publication.mode: direct), made from both layouts: the
// trainer ranks' shards (which canonical bytes each rank owns: an FSDP2 Shard(0) chunk, a
// replicated tensor's own chunk, a fused expert parameter's experts) and the runtime's TP
// resident placements (model::tp_layout). Each placement of each owned byte becomes one
// direct_move: a strided copy from the owner's memory straight into the resident arena of the
// TP worker that holds it. No packed buffer, no canonical tensor is ever built: every placed
// byte is written exactly once, by the one rank that owns it.
//
// The resident arena is one allocation per TP worker; resident tensor i starts at
// resident_offsets(layout)[i] (the runtime allocates it, the trainer ranks compute the same
// offsets from the layout alone). Offsets are multiples of resident_alignment, so every
// resident tensor meets the 16-byte vector loads of cuBLAS, the grouped GEMM and the bf16
// engine's kernels whatever the sizes of the tensors before it.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/model/qwen3_moe.hpp"

namespace refit::publication {

constexpr std::uint64_t resident_alignment = 256;
std::vector<std::uint64_t> resident_offsets(const model::tp_layout& layout);
std::uint64_t resident_arena_bytes(const model::tp_layout& layout);

// Canonical bytes [offset, offset + bytes) of one tensor that a rank owns (and holds
// contiguously in its memory).
struct owned_piece {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

// rows copies of row_bytes: piece memory + src_offset + r * src_stride -> TP worker tp_rank's
// arena + dst_offset + r * dst_stride.
struct direct_move {
  std::uint32_t tp_rank = 0;
  std::uint64_t src_offset = 0; // relative to the start of the owned piece
  std::uint64_t src_stride = 0;
  std::uint64_t dst_offset = 0; // relative to the start of the arena
  std::uint64_t dst_stride = 0;
  std::uint64_t row_bytes = 0;
  std::uint64_t rows = 0;
  std::uint64_t bytes() const { return row_bytes * rows; }
};

// Every move that lands the owned bytes `piece` of canonical tensor `p` in the TP workers'
// arenas (`offsets`: resident_offsets(layout)), TP rank by TP rank. Rows cut by the piece's
// ends become single-row moves of the part inside it. Throws model_error like
// tp_layout::place, or when the piece lies outside the tensor.
std::vector<direct_move> plan_moves(const model::tp_layout& layout,
                                    const std::vector<std::uint64_t>& offsets,
                                    const model::param_meta& p, owned_piece piece);

// Bytes of `p` placed over all TP workers (a replicated tensor counts once per worker): what
// the owners of its pieces write in total, whoever they are.
std::uint64_t placed_bytes(const model::tp_layout& layout, const model::param_meta& p);

} // namespace refit::publication
