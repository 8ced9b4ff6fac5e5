// The SyncCoordinator's preflight (sync_coordinator.hpp), before any materialization:
// topology, identity, step, weight source, the chunk plan (direct mode: with the placed bytes
// every chunk must account for) and the memory budget.
#include "actors/sync_coordinator.hpp"

#include <algorithm>

#include "runtime/publication/direct_plan.hpp"

namespace refit {

// Preflight, before any materialization: topology, buffer fit, memory budget.
caf::error preflight(const sync_coordinator_state& st, publication_ctx& ctx) {
  auto bad = [](const std::string& where, const std::string& msg) {
    return make_refit_error(errc::preflight_failed, where, msg);
  };
  const auto& d = ctx.runtime;
  if (ctx.ranks.size() != d.tp_world_size)
    return bad("world", std::to_string(ctx.ranks.size()) + " trainer ranks but the runtime has TP "
                          + std::to_string(d.tp_world_size)
                          + " (one TP worker per trainer rank is required)");
  for (std::size_t r = 0; r < ctx.ranks.size(); ++r) {
    const auto& ri = ctx.ranks[r];
    if (ri.rank != r || ri.world != ctx.ranks.size())
      return bad("rank " + std::to_string(r), "reports itself as rank " + std::to_string(ri.rank)
                                                + " of " + std::to_string(ri.world));
    if (ri.device_uuid != d.workers[r].device_uuid)
      return bad("device_uuids[" + std::to_string(r) + "]",
                 "trainer rank " + std::to_string(r) + " is on " + ri.device_uuid
                   + " but TP worker " + std::to_string(r) + " is on " + d.workers[r].device_uuid);
  }
  if (!std::all_of(ctx.ranks.begin(), ctx.ranks.end(),
                   [&](const rank_info& ri) { return ri.step == ctx.ranks.front().step; }))
    return bad("step", "trainer ranks are at different optimizer steps");
  for (const auto& ri : ctx.ranks)
    if (ri.weight_source != ctx.ranks.front().weight_source)
      return bad("weight_source", "trainer rank 0 publishes " + ctx.ranks.front().weight_source
                                    + " weights, rank " + std::to_string(ri.rank) + " "
                                    + ri.weight_source + " weights");
  const auto& pc = st.opts.publication;
  try {
    // Direct mode: chunks group canonical tensors by their own bytes (no gather slots).
    ctx.plan = publication::plan_chunks(
      ctx.expected, pc.buffer_bytes, ctx.direct ? 1 : static_cast<std::uint32_t>(ctx.ranks.size()));
    if (ctx.direct) {
      const model::tp_layout layout(st.opts.model, d.tp_world_size);
      ctx.direct_placed.clear();
      for (const auto& c : ctx.plan.chunks) {
        std::uint64_t placed = 0;
        for (const auto& t : c.tensors)
          placed += publication::placed_bytes(layout, t.meta);
        ctx.direct_placed.push_back(placed);
      }
    }
  } catch (const model::model_error& e) {
    return bad(e.where, std::string(ctx.direct ? "cannot be planned: " : "does not fit the packed buffer: ")
                          + e.what());
  }
  // Direct mode holds no packed buffers and builds no canonical tensor: only the headroom.
  auto required = ctx.direct ? pc.memory_headroom_bytes
                             : 3 * pc.buffer_bytes + ctx.plan.largest_tensor_bytes
                                 + pc.memory_headroom_bytes;
  for (const auto& ri : ctx.ranks)
    if (ri.free_bytes < required)
      return bad("memory",
                 "trainer rank " + std::to_string(ri.rank) + " has " + std::to_string(ri.free_bytes)
                   + " free bytes; the publication needs " + std::to_string(required)
                   + " (3 x buffer " + std::to_string(pc.buffer_bytes) + " + largest tensor "
                   + std::to_string(ctx.plan.largest_tensor_bytes) + " + headroom "
                   + std::to_string(pc.memory_headroom_bytes) + ")");
  for (const auto& w : d.workers)
    if (w.device_free_bytes != 0 && w.device_free_bytes < required)
      return bad("memory", "TP worker " + std::to_string(w.rank) + " has "
                             + std::to_string(w.device_free_bytes) + " free bytes; needs "
                             + std::to_string(required));
  return {};
}

} // namespace refit
