// RankRegistry: a trainer process's generate / sleep / wake (rank_registry.hpp), forwarded to
// the RolloutEngine after the shared secret and the open-publication check.
#include "actors/rank_registry_parts.hpp"

#include <optional>

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

namespace refit {

using self_ptr = rank_registry_self;

namespace {

// A trainer's generate / sleep / wake: the shared secret, and no collective publish open (at
// its barrier the registry is about to sleep and wake the runtime itself).
std::optional<caf::error> refuse_rollout(self_ptr self, const std::string& token,
                                         const std::string& what) {
  auto& st = self->state;
  if (!registry_token_ok(st, token))
    return registry_refuse(self, errc::unauthorized, what + ".token",
                  "wrong or missing shared secret (serve.token / serve.token_env)",
                  what + ": wrong token");
  if (st.run)
    return registry_refuse(self, errc::update_open, what,
                  "a publication of version " + std::to_string(st.run->version) + " is open ("
                    + (st.run->running ? "running" : "waiting for every rank at the barrier")
                    + "): " + what + " once it finished",
                  what + " during the publication of version " + std::to_string(st.run->version));
  return std::nullopt;
}

// Forwards a rollout request to the engine and relays its answer (or its typed error).
template <class T, class... Ts>
caf::result<T> forward_rollout(self_ptr self, std::uint32_t timeout_ms, Ts&&... xs) {
  auto rp = self->make_response_promise<T>();
  self->request(self->state.engine, std::chrono::milliseconds(timeout_ms), std::forward<Ts>(xs)...)
    .then([rp](T& x) mutable { rp.deliver(std::move(x)); },
          [rp](caf::error& e) mutable { rp.deliver(std::move(e)); });
  return rp;
}

} // namespace

caf::result<generate_result> registry_generate(self_ptr self, rollout_generate& req) {
  if (auto refusal = refuse_rollout(self, req.token, "generate"))
    return *refusal;
  return forward_rollout<generate_result>(self, self->state.opts.generate_timeout_ms,
                                          generate_atom::value, std::move(req.request));
}

caf::result<engine_status> registry_sleep(self_ptr self, const rollout_sleep& req) {
  if (auto refusal = refuse_rollout(self, req.token, "sleep"))
    return *refusal;
  return forward_rollout<engine_status>(self, self->state.opts.sleep_wake_timeout_ms,
                                        sleep_atom::value, req.level);
}

caf::result<engine_status> registry_wake(self_ptr self, const rollout_wake& req) {
  if (auto refusal = refuse_rollout(self, req.token, "wake"))
    return *refusal;
  return forward_rollout<engine_status>(self, self->state.opts.sleep_wake_timeout_ms,
                                        wake_atom::value, req.tags);
}

} // namespace refit
