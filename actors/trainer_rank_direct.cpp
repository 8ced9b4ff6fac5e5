// TrainerRank, direct mode: every chunk's moves planned in prepare (from the rank's shards and
// the TP layout, into the resident arenas it opened), a chunk's write started before its
// metadata is recorded and waited for after (trainer_rank.cpp's run_materialize).
#include <stdexcept>

#include "actors/trainer_rank_parts.hpp"
#include "runtime/trace/trace.hpp"

namespace refit::trainer_rank_parts {

namespace {

// Opens TP worker t's resident arena for every t; "" or why not.
std::string open_targets(const source_view& shards, rank_session& s) {
  const auto arena = publication::resident_arena_bytes(*s.layout);
  for (std::uint32_t t = 0; t < s.spec.tp; ++t) {
    const auto& h = s.spec.targets[t];
    if (h.buffer_index != t || h.size != arena)
      return "resident arena " + std::to_string(t) + " is announced as TP rank "
             + std::to_string(h.buffer_index) + " with " + std::to_string(h.size)
             + " bytes; the layout has " + std::to_string(arena) + " bytes";
    try {
      s.targets.push_back(publication::open_resident_target(
        shards.device(), h.handle, h.size, static_cast<int>(s.spec.runtime_pid)));
    } catch (const std::exception& e) {
      return "resident arena of TP worker " + std::to_string(t) + ": " + e.what();
    }
  }
  return {};
}

} // namespace

rank_report prepare_direct(const trainer_rank_options& o, const source_view& shards,
                           rank_session& s, rank_report r) {
  if (s.spec.targets.size() != s.spec.tp)
    return failed(r, std::to_string(s.spec.targets.size()) + " resident arenas for TP "
                       + std::to_string(s.spec.tp));
  s.layout = std::make_shared<model::tp_layout>(o.model, s.spec.tp);
  s.offsets = publication::resident_offsets(*s.layout);
  {
    trace::span opening(trace::tracks::trainer_rank(o.rank), "open arenas", {{"tp", s.spec.tp}});
    if (auto why = open_targets(shards, s); !why.empty())
      return failed(r, why);
  }
  trace::span planning(trace::tracks::trainer_rank(o.rank), "plan copies");
  s.writer = publication::make_direct_writer(shards.device());
  // The same walk materialize makes: stream position by position against the plan. Where the
  // exporter's stream leaves the plan, planning stops; materialize reports the mismatch at
  // that chunk before writing anything.
  std::vector<std::vector<publication::direct_copy>> copies(s.plan.chunks.size());
  s.direct.assign(s.plan.chunks.size(), {});
  std::size_t pos = 0;
  bool on_plan = true;
  for (std::size_t k = 0; k < s.plan.chunks.size() && on_plan; ++k) {
    auto& d = s.direct[k];
    for (const auto& planned : s.plan.chunks[k].tensors) {
      if (pos >= s.stream.size()
          || !emission_error(emitted_at(shards, s, pos).get(), planned.meta).empty()) {
        on_plan = false;
        break;
      }
      auto [src, piece] = shards.owned(s.stream[pos++], o.rank);
      std::vector<publication::direct_move> moves;
      try {
        moves = publication::plan_moves(*s.layout, s.offsets, planned.meta, piece);
      } catch (const std::exception& e) {
        return failed(r, "direct moves of " + planned.meta.name + ": " + e.what());
      }
      for (const auto& m : moves) {
        const auto& target = *s.targets.at(m.tp_rank);
        const std::uint64_t last = m.rows == 0 ? 0 : (m.rows - 1) * m.dst_stride + m.row_bytes;
        if (m.dst_offset > target.size() || last > target.size() - m.dst_offset)
          return failed(r, "a direct move of " + planned.meta.name + " (chunk "
                             + std::to_string(k) + ") ends past the "
                             + std::to_string(target.size()) + "-byte resident arena of TP worker "
                             + std::to_string(m.tp_rank));
        copies[k].push_back({target.data() + m.dst_offset, m.dst_stride, src + m.src_offset,
                             m.src_stride, m.row_bytes, m.rows});
        (m.tp_rank == o.rank ? d.local : d.cross) += m.bytes();
      }
    }
    d.planned = on_plan;
    d.copies = copies[k].size();
  }
  try {
    s.writer->plan(copies);
  } catch (const std::exception& e) {
    return failed(r, std::string("planning the direct copies: ") + e.what());
  }
  return r;
}

rank_report start_direct(rank_session& s, std::uint32_t k, rank_report r) {
  if (k >= s.direct.size() || !s.direct[k].planned)
    return failed(r, "chunk " + std::to_string(k) + " has no planned direct moves");
  auto& d = s.direct[k];
  d.started = d.copies;
  if (const auto* f = find_fault(s, "fail_copy"); f && f->chunk == k)
    d.started = d.copies / 2; // test-only: half of the chunk lands, then the write fails
  try {
    s.writer->start(k, d.started);
  } catch (const std::exception& e) {
    d.started = 0;
    return failed(r, "direct write of chunk " + std::to_string(k) + ": " + e.what());
  }
  return r;
}

rank_report finish_direct(rank_session& s, std::uint32_t k, rank_report r) {
  const auto& d = s.direct.at(k);
  try {
    s.writer->finish();
  } catch (const std::exception& e) {
    return failed(r, "direct write of chunk " + std::to_string(k) + ": " + e.what());
  }
  if (d.started != d.copies)
    return failed(r, "injected copy failure after " + std::to_string(d.started) + " of "
                       + std::to_string(d.copies) + " direct moves of chunk "
                       + std::to_string(k));
  r.moved_local = d.local;
  r.moved_cross = d.cross;
  return r;
}

} // namespace refit::trainer_rank_parts
