// Direct publication's moves (see direct_plan.hpp): placements intersected with owned pieces.
#include "runtime/publication/direct_plan.hpp"

#include <algorithm>
#include <string>

namespace refit::publication {

std::vector<std::uint64_t> resident_offsets(const model::tp_layout& layout) {
  std::vector<std::uint64_t> offsets;
  offsets.reserve(layout.residents().size());
  std::uint64_t offset = 0;
  for (const auto& r : layout.residents()) {
    offsets.push_back(offset);
    offset = (offset + r.nbytes + resident_alignment - 1) / resident_alignment * resident_alignment;
  }
  return offsets;
}

std::uint64_t resident_arena_bytes(const model::tp_layout& layout) {
  const auto offsets = resident_offsets(layout);
  return offsets.empty() ? 0 : offsets.back() + layout.residents().back().nbytes;
}

namespace {

// Appends the part of placement `pl` (of TP rank `tp`) that canonical bytes [a, b) cover.
void intersect(const model::placement& pl, std::uint32_t tp, std::uint64_t arena_offset,
               std::uint64_t a, std::uint64_t b, std::vector<direct_move>& out) {
  if (pl.rows == 0 || pl.row_bytes == 0 || a >= b)
    return;
  const std::uint64_t base_dst = arena_offset + pl.dst_offset;
  // One row j: canonical [s, s + row_bytes) -> arena base_dst + j * dst_stride.
  auto row_part = [&](std::uint64_t j) {
    const std::uint64_t s = pl.src_offset + j * pl.src_stride;
    const std::uint64_t lo = std::max(s, a);
    const std::uint64_t hi = std::min(s + pl.row_bytes, b);
    if (lo < hi)
      out.push_back({tp, lo - a, hi - lo, base_dst + j * pl.dst_stride + (lo - s), hi - lo,
                     hi - lo, 1});
  };
  if (pl.rows == 1 || pl.src_stride < pl.row_bytes) {
    for (std::uint64_t j = 0; j < pl.rows; ++j)
      row_part(j);
    return;
  }
  const std::uint64_t first = pl.src_offset;
  const std::uint64_t stride = pl.src_stride;
  // Rows fully inside [a, b): j in [f0, f1).
  const std::uint64_t f0 = a <= first ? 0 : (a - first + stride - 1) / stride;
  std::uint64_t f1 = 0;
  if (b >= first + pl.row_bytes)
    f1 = std::min<std::uint64_t>(pl.rows, (b - first - pl.row_bytes) / stride + 1);
  // Rows that contain a or b - 1 but are not inside: cut at the piece's ends.
  auto row_of = [&](std::uint64_t x) -> std::uint64_t {
    return x < first ? 0 : std::min<std::uint64_t>(pl.rows - 1, (x - first) / stride);
  };
  const std::uint64_t ja = row_of(a);
  const std::uint64_t jb = row_of(b - 1);
  const bool full = f0 < f1;
  if (!(full && ja >= f0 && ja < f1))
    row_part(ja);
  if (full)
    out.push_back({tp, first + f0 * stride - a, stride, base_dst + f0 * pl.dst_stride,
                   pl.dst_stride, pl.row_bytes, f1 - f0});
  if (jb != ja && !(full && jb >= f0 && jb < f1))
    row_part(jb);
}

} // namespace

std::vector<direct_move> plan_moves(const model::tp_layout& layout,
                                    const std::vector<std::uint64_t>& offsets,
                                    const model::param_meta& p, owned_piece piece) {
  if (piece.offset > p.nbytes() || piece.bytes > p.nbytes() - piece.offset)
    throw model::model_error(p.name, "owned bytes [" + std::to_string(piece.offset) + ", +"
                                       + std::to_string(piece.bytes) + ") lie outside its "
                                       + std::to_string(p.nbytes()) + " bytes");
  std::vector<direct_move> out;
  if (piece.bytes == 0)
    return out;
  for (std::uint32_t t = 0; t < layout.tp(); ++t)
    for (const auto& pl : layout.place(p, t))
      intersect(pl, t, offsets.at(pl.resident_index), piece.offset, piece.offset + piece.bytes,
                out);
  return out;
}

std::uint64_t placed_bytes(const model::tp_layout& layout, const model::param_meta& p) {
  std::uint64_t total = 0;
  for (std::uint32_t t = 0; t < layout.tp(); ++t)
    for (const auto& pl : layout.place(p, t))
      total += pl.row_bytes * pl.rows;
  return total;
}

} // namespace refit::publication
