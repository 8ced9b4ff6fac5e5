#include "actors/trainer_host.hpp"

#include <set>

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

namespace refit {

using self_ptr = trainer_host_impl::stateful_pointer<trainer_host_state>;

host_status trainer_host_state::status() const {
  host_status s;
  s.rank = opts.rank;
  s.world = opts.world;
  s.epoch = current.epoch;
  s.complete = current.complete;
  s.coordinator_lost = lost;
  s.last_error = last_error;
  return s;
}

namespace {

caf::error lost_error(const trainer_host_state& st) {
  return make_refit_error(errc::coordinator_lost, "coordinator " + st.opts.coordinator,
                          "the coordinator went away (" + st.lost_reason
                            + "); connect a new refit host once it is back");
}

void deliver(self_ptr self, caf::expected<publication_result> res) {
  auto& st = self->state;
  if (!st.pending)
    return;
  auto p = std::move(*st.pending);
  st.pending.reset();
  if (res) {
    p.rp.deliver(std::move(*res));
  } else {
    st.last_error = render(res.error());
    p.rp.deliver(res.error());
  }
}

// Checks a pushed table: every listed rank in range and once; a complete one lists all ranks,
// this one included. Returns what is wrong, or "".
std::string check_table(const trainer_host_state& st, const membership& m) {
  if (m.world != st.opts.world)
    return "the table is for " + std::to_string(m.world) + " ranks, this process is one of "
           + std::to_string(st.opts.world);
  std::set<std::uint32_t> seen;
  for (const auto& mi : m.members)
    if (mi.rank >= m.world || !seen.insert(mi.rank).second)
      return "rank " + std::to_string(mi.rank) + " is out of range or listed twice";
  if (m.complete && (seen.size() != m.world || !seen.count(st.opts.rank)))
    return "a complete table without every rank";
  return {};
}

void send_publish(self_ptr self) {
  auto& st = self->state;
  auto& p = *st.pending;
  p.sent = true;
  auto seq = p.seq;
  publish_request req{st.opts.rank, p.version, st.current.epoch};
  self->request(st.opts.registry, std::chrono::milliseconds(st.opts.publish_timeout_ms),
                publish_atom::value, req)
    .then(
      [self, seq](publication_result& res) {
        if (self->state.pending && self->state.pending->seq == seq)
          deliver(self, std::move(res));
      },
      [self, seq](caf::error& err) {
        auto& st = self->state;
        if (!st.pending || st.pending->seq != seq)
          return;
        deliver(self, st.lost ? lost_error(st) : err);
      });
}

} // namespace

trainer_host_impl::behavior_type trainer_host(self_ptr self, trainer_host_options opts) {
  auto& st = self->state;
  st.opts = std::move(opts);
  st.current.world = st.opts.world;
  self->monitor(st.opts.registry);
  self->set_down_handler([self](caf::down_msg& dm) {
    auto& st = self->state;
    if (dm.source != st.opts.registry.address() || st.lost)
      return;
    st.lost = true;
    st.lost_reason = render(dm.reason);
    st.current.complete = false;
    st.opts.group->clear_members("the coordinator went away (" + st.lost_reason + ")");
    if (st.pending)
      deliver(self, lost_error(st));
  });
  return {
    [=](members_atom, membership& m) {
      auto& st = self->state;
      if (auto bad = check_table(st, m); !bad.empty()) {
        st.last_error = "ignored a member table from the coordinator: " + bad;
        return;
      }
      st.current = std::move(m);
      if (!st.current.complete) {
        st.opts.group->clear_members(st.current.reason);
        return;
      }
      std::vector<publication::shm_peer> peers;
      for (const auto& mi : st.current.members)
        peers.push_back({mi.rank, mi.pid, mi.collective_endpoint});
      st.opts.group->set_members(std::move(peers));
      if (st.pending && !st.pending->sent)
        send_publish(self);
    },
    [=](publish_atom, std::uint64_t version) -> caf::result<publication_result> {
      auto& st = self->state;
      if (st.lost)
        return lost_error(st);
      if (st.pending)
        return make_refit_error(errc::busy, "publish",
                                "this rank already waits for the publish of version "
                                  + std::to_string(st.pending->version));
      auto rp = self->make_response_promise<publication_result>();
      st.pending = trainer_host_state::pending_publish{st.next_seq++, version, rp, false};
      if (st.current.complete)
        send_publish(self);
      else
        self->delayed_send(self, std::chrono::milliseconds(st.opts.membership_wait_ms),
                           deadline_atom::value, st.pending->seq);
      return rp;
    },
    [=](deadline_atom, std::uint64_t seq) {
      auto& st = self->state;
      if (!st.pending || st.pending->seq != seq || st.pending->sent)
        return;
      std::string joined;
      for (const auto& mi : st.current.members)
        joined += (joined.empty() ? "" : ", ") + std::to_string(mi.rank);
      deliver(self, make_refit_error(errc::barrier_timeout, "publish",
                                     "not every trainer rank joined within "
                                       + std::to_string(st.opts.membership_wait_ms)
                                       + " ms (joined: " + (joined.empty() ? "none" : joined)
                                       + "; last change: " + st.current.reason + ")"));
    },
    [=](status_atom) { return self->state.status(); },
  };
}

} // namespace refit
