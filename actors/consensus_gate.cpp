#include "actors/consensus_gate.hpp"

#include <set>

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "runtime/trace/trace.hpp"

namespace refit {

using self_ptr = consensus_gate_actor::stateful_pointer<consensus_gate_state>;

namespace {

// --trace: a round from open to its outcome, on the row of its kind (rounds of different
// kinds overlap: materialize[k + 1] runs while transfer[k] waits).
void trace_round(const phase_id& phase, std::int64_t start_ns, bool passed) {
  if (!trace::enabled())
    return;
  const auto where = phase.k() == phase_kind::materialize ? trace::tracks::gate_materialize()
                     : phase.k() == phase_kind::transfer  ? trace::tracks::gate_transfer()
                                                          : trace::tracks::gate_other();
  trace::complete(where, to_string(phase.k()), start_ns,
                  {{"chunk", phase.chunk}, {"passed", passed}, {"publication", phase.publication_id}});
}

// Fails the whole publication of `phase`: the open request(s) get the error, every rank gets
// the same gate_failure.
void fail(self_ptr self, const phase_id& phase, std::uint32_t rank, const std::string& error) {
  auto& st = self->state;
  gate_failure g{phase, rank, error};
  st.failed.insert(phase.publication_id);
  auto err = make_refit_error(errc::gate_failed, to_string(phase),
                              "rank " + std::to_string(rank) + ": " + error);
  for (auto it = st.open.begin(); it != st.open.end();) {
    if (it->first.publication_id == phase.publication_id) {
      trace_round(it->first, it->second.trace_start_ns, false);
      it->second.rp.deliver(err);
      it = st.open.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = st.early.begin(); it != st.early.end();)
    it = it->first.publication_id == phase.publication_id ? st.early.erase(it) : std::next(it);
  for (const auto& r : st.ranks) {
    journal::note_send(self, st.opts.journal, r, abort_atom::value, g);
    self->send(r, abort_atom::value, g);
  }
}

void absorb(self_ptr self, const rank_report& r) {
  auto& st = self->state;
  auto it = st.open.find(r.phase);
  if (it == st.open.end())
    return;
  auto& round = it->second;
  if (r.rank >= round.world)
    return fail(self, r.phase, r.rank,
                "reported as rank " + std::to_string(r.rank) + " of a "
                  + std::to_string(round.world) + "-rank publication");
  if (!r.ok)
    return fail(self, r.phase, r.rank, r.error);
  if (!round.reports.emplace(r.rank, r).second)
    return fail(self, r.phase, r.rank, "reported " + to_string(r.phase) + " twice");
  if (round.reports.size() < round.world)
    return;
  std::vector<rank_report> all;
  all.reserve(round.reports.size());
  for (auto& [rank, rep] : round.reports)
    all.push_back(std::move(rep));
  round.rp.deliver(std::move(all));
  trace_round(it->first, round.trace_start_ns, true);
  st.open.erase(it);
  ++st.passed;
}

// Why rank `r` cannot take part: it went away since the last attach.
std::string gone_message(std::uint32_t r, const std::string& reason) {
  return "trainer rank " + std::to_string(r) + " is gone (" + reason + ")";
}

} // namespace

consensus_gate_actor::behavior_type consensus_gate(self_ptr self, consensus_gate_options opts) {
  self->state.opts = std::move(opts);
  self->set_down_handler([self](caf::down_msg& dm) {
    auto& st = self->state;
    for (std::uint32_t r = 0; r < st.ranks.size(); ++r) {
      if (st.ranks[r].address() != dm.source)
        continue;
      st.gone[r] = render(dm.reason);
      std::set<std::string> pubs;
      for (const auto& [phase, round] : st.open)
        if (r < round.world)
          pubs.insert(phase.publication_id);
      for (const auto& pub : pubs)
        for (const auto& [phase, round] : st.open)
          if (phase.publication_id == pub) {
            fail(self, phase, r, gone_message(r, st.gone[r]));
            break;
          }
    }
  });
  return {
    [=](attach_atom, std::vector<trainer_rank_actor>& ranks) {
      auto& st = self->state;
      for (const auto& r : st.ranks)
        self->demonitor(r.address());
      st.ranks = std::move(ranks);
      st.gone.clear();
      for (const auto& r : st.ranks)
        self->monitor(r);
    },
    [=](open_atom, const phase_id& phase, std::uint32_t world,
        std::uint32_t deadline_ms) -> caf::result<std::vector<rank_report>> {
      auto& st = self->state;
      if (st.failed.count(phase.publication_id))
        return make_refit_error(errc::gate_failed, to_string(phase),
                                "the publication already failed");
      if (world == 0 || st.open.count(phase))
        return make_refit_error(errc::invalid_argument, to_string(phase),
                                world == 0 ? "a phase needs at least one rank"
                                           : "this phase is already open");
      auto rp = self->make_response_promise<std::vector<rank_report>>();
      auto& round = st.open[phase];
      round.world = world;
      round.deadline_ms = deadline_ms;
      round.rp = rp;
      round.trace_start_ns = trace::start();
      for (const auto& [r, reason] : st.gone)
        if (r < world) {
          fail(self, phase, r, gone_message(r, reason));
          return rp;
        }
      self->delayed_send(self, std::chrono::milliseconds(deadline_ms), deadline_atom::value,
                         phase);
      if (auto e = st.early.find(phase); e != st.early.end()) {
        auto reports = std::move(e->second);
        st.early.erase(e);
        for (const auto& r : reports)
          absorb(self, r);
      }
      return rp;
    },
    [=](report_atom, const rank_report& r) {
      auto& st = self->state;
      if (st.failed.count(r.phase.publication_id))
        return;
      if (!st.open.count(r.phase)) {
        st.early[r.phase].push_back(r);
        return;
      }
      absorb(self, r);
    },
    [=](deadline_atom, const phase_id& phase) {
      auto& st = self->state;
      auto it = st.open.find(phase);
      if (it == st.open.end())
        return; // passed or failed in time
      std::vector<std::uint32_t> missing;
      for (std::uint32_t r = 0; r < it->second.world; ++r)
        if (!it->second.reports.count(r))
          missing.push_back(r);
      std::string who;
      for (auto r : missing)
        who += (who.empty() ? "" : ", ") + std::to_string(r);
      fail(self, phase, missing.front(),
           std::string(missing.size() == 1 ? "rank " : "ranks ") + who + " did not report "
             + to_string(phase) + " within " + std::to_string(it->second.deadline_ms) + " ms");
    },
  };
}

} // namespace refit
