#include "actors/rollout_supervisor.hpp"

#include <algorithm>

#include <caf/actor_system.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

namespace refit {

using self_ptr = rollout_supervisor_actor::stateful_pointer<rollout_supervisor_state>;

supervisor_status rollout_supervisor_state::status() const {
  supervisor_status s;
  s.incarnation = incarnation;
  s.restarts = static_cast<std::uint32_t>(restarts.size());
  s.running = static_cast<bool>(proxy);
  s.gave_up = gave_up;
  s.last_exit = last_exit;
  return s;
}

rollout_supervisor_state::~rollout_supervisor_state() {
  // The runtime never outlives its supervisor.
  if (proxy)
    caf::anon_send_exit(proxy, caf::exit_reason::kill);
}

namespace {

void start_runtime(self_ptr self) {
  auto& st = self->state;
  st.restart_pending = false;
  ++st.incarnation;
  st.proxy = st.factory(self->system(), st.incarnation);
  self->monitor(st.proxy);
  self->send(st.engine, attach_atom::value, st.proxy, st.incarnation);
}

std::chrono::milliseconds backoff(const config::supervisor_config& cfg, std::uint32_t failures) {
  std::uint64_t delay = cfg.backoff_initial_ms;
  for (std::uint32_t i = 1; i < failures && delay < cfg.backoff_max_ms; ++i)
    delay *= 2;
  return std::chrono::milliseconds(std::min<std::uint64_t>(delay, cfg.backoff_max_ms));
}

} // namespace

rollout_supervisor_actor::behavior_type
rollout_supervisor(self_ptr self, config::supervisor_config cfg, proxy_factory factory,
                   rollout_engine_actor engine) {
  auto& st = self->state;
  st.cfg = cfg;
  st.factory = std::move(factory);
  st.engine = std::move(engine);
  self->set_down_handler([=](const caf::down_msg& msg) {
    auto& st = self->state;
    if (!st.proxy || msg.source != st.proxy.address())
      return;
    st.proxy = nullptr;
    st.last_exit = msg.reason ? render(msg.reason) : "normal exit";
    if (st.stopping)
      return;
    // A deterministic startup failure (the recipe asks for more memory than the machine has)
    // fails the same way every time: no restart, the engine hears why at once.
    if (msg.reason && msg.reason.category() == caf::atom("refit")
        && static_cast<errc>(msg.reason.code()) == errc::preflight_failed) {
      st.gave_up = true;
      self->send(st.engine, gave_up_atom::value,
                 "the runtime cannot start (not retried: a deterministic startup failure, not a "
                 "crash): " + st.last_exit);
      return;
    }
    auto now = self->clock().now();
    auto window = std::chrono::milliseconds(st.cfg.restart_window_ms);
    while (!st.restarts.empty() && now - st.restarts.front() > window)
      st.restarts.pop_front();
    if (st.restarts.size() >= st.cfg.max_restarts) {
      st.gave_up = true;
      // The engine stays detached and answers errc::restart_limit from now on.
      self->send(st.engine, gave_up_atom::value,
                 "restart limit: " + std::to_string(st.restarts.size()) + " restarts within "
                   + std::to_string(st.cfg.restart_window_ms) + " ms; last exit: " + st.last_exit);
      return;
    }
    st.restarts.push_back(now);
    st.restart_pending = true;
    // Backoff grows with the restarts inside the window: forgiven restarts reset it.
    auto failures = static_cast<std::uint32_t>(st.restarts.size());
    self->delayed_send(self, backoff(st.cfg, failures), restart_atom::value);
  });
  start_runtime(self);
  return {
    [=](status_atom) { return self->state.status(); },
    [=](restart_atom) {
      auto& st = self->state;
      if (st.stopping || !st.restart_pending)
        return;
      start_runtime(self);
    },
    [=](shutdown_atom) -> caf::result<caf::ok_atom> {
      auto& st = self->state;
      st.stopping = true;
      st.restart_pending = false;
      auto rp = self->make_response_promise<caf::ok_atom>();
      if (!st.proxy) {
        rp.deliver(caf::ok_atom::value);
        self->quit();
        return rp;
      }
      auto grace = std::chrono::milliseconds(st.cfg.backoff_max_ms) + std::chrono::seconds(30);
      self->request(st.proxy, grace, shutdown_atom::value)
        .then(
          [=](caf::ok_atom) mutable {
            rp.deliver(caf::ok_atom::value);
            self->quit();
          },
          [=](caf::error&) mutable {
            rp.deliver(caf::ok_atom::value); // the destructor kills what is left
            self->quit();
          });
      return rp;
    },
  };
}

} // namespace refit
