// The rollout side of the embedding API (refit/host.hpp): generate, sleep, wake and status,
// requests to the coordinator's RankRegistry with the shared secret.
#include "host_impl.hpp"

#include <algorithm>
#include <type_traits>

namespace refit::api {

namespace {

// As the hello and join: the secret travels only over TLS (to a certificate-verified
// coordinator); over plain TCP the listener's mutual handshake already proved it.
std::string wire_token(const host::impl& p) {
  return p.cfg.serve.tls.enabled ? p.token : std::string();
}

} // namespace


namespace {

rollout_status convert(const engine_status& e) {
  rollout_status s;
  s.committed_version = e.committed_version;
  s.connection = to_string(e.conn());
  s.needs_publication = e.needs_publication;
  s.sleep_level = e.sleep_level;
  s.weights_awake = e.weights_awake;
  s.kv_cache_awake = e.kv_cache_awake;
  s.last_error = e.last_error;
  return s;
}

} // namespace

result<generation> host::generate(const std::vector<std::vector<std::int32_t>>& prompts,
                                  const sampling_params& params) {
  auto& p = *impl_;
  if (!p.connected)
    return api_error("invalid_state", "generate", "connect first");
  rollout_generate req;
  req.token = wire_token(p);
  req.rank = p.rank->rank;
  req.request.prompts = prompts;
  auto& q = req.request.params;
  q.n = params.n;
  q.max_tokens = params.max_tokens;
  q.temperature = params.temperature;
  q.top_k = params.top_k;
  q.top_p = params.top_p;
  q.seed = params.seed;
  q.stop_token_ids = params.stop_token_ids;
  q.max_prompt_length = params.max_prompt_length;
  caf::scoped_actor self{*p.sys};
  std::optional<generation> out;
  caf::error err;
  self->request(p.registry, std::chrono::milliseconds(p.cfg.runtime.timeouts_ms.generate + 20000),
                generate_atom::value, std::move(req))
    .receive(
      [&](generate_result& r) {
        generation g;
        g.model_version = r.model_version;
        for (auto& s : r.samples)
          g.samples.push_back({s.prompt_index, std::move(s.prompt_token_ids),
                               std::move(s.token_ids), std::move(s.logprobs),
                               std::move(s.finish_reason), s.prompt_truncated, s.model_version});
        out = std::move(g);
      },
      [&](caf::error& e) { err = std::move(e); });
  if (!out)
    return from_caf(err);
  return *out;
}

namespace {

template <class Msg>
result<rollout_status> sleep_or_wake(host::impl& p, const char* what, Msg msg) {
  if (!p.connected)
    return api_error("invalid_state", what, "connect first");
  caf::scoped_actor self{*p.sys};
  std::optional<rollout_status> out;
  caf::error err;
  const auto timeout = std::chrono::milliseconds(
    std::max(p.cfg.runtime.timeouts_ms.sleep, p.cfg.runtime.timeouts_ms.wake_up) + 20000);
  using atom = std::conditional_t<std::is_same_v<Msg, rollout_sleep>, sleep_atom, wake_atom>;
  self->request(p.registry, timeout, atom::value, std::move(msg))
    .receive([&](engine_status& e) { out = convert(e); },
             [&](caf::error& e) { err = std::move(e); });
  if (!out)
    return from_caf(err);
  return *out;
}

} // namespace

result<rollout_status> host::sleep(std::uint32_t level) {
  rollout_sleep m;
  m.token = wire_token(*impl_);
  m.rank = impl_->rank ? impl_->rank->rank : 0;
  m.level = level;
  return sleep_or_wake(*impl_, "sleep", std::move(m));
}

result<rollout_status> host::wake(bool weights, bool kv_cache) {
  rollout_wake m;
  m.token = wire_token(*impl_);
  m.rank = impl_->rank ? impl_->rank->rank : 0;
  m.tags.weights = weights;
  m.tags.kv_cache = kv_cache;
  return sleep_or_wake(*impl_, "wake", std::move(m));
}

result<rollout_status> host::status() {
  auto& p = *impl_;
  if (!p.connected)
    return api_error("invalid_state", "status", "connect first");
  caf::scoped_actor self{*p.sys};
  std::optional<rollout_status> out;
  caf::error err;
  self->request(p.registry, std::chrono::seconds(30), status_atom::value, wire_token(p))
    .receive(
      [&](registry_status& r) {
        auto s = convert(r.engine);
        s.committed_version = r.committed_version;
        s.publishing = r.publishing || r.barrier_version != 0;
        s.epoch = r.epoch;
        s.complete = r.complete;
        if (s.last_error.empty())
          s.last_error = r.last_error;
        out = std::move(s);
      },
      [&](caf::error& e) { err = std::move(e); });
  if (!out)
    return from_caf(err);
  return *out;
}

} // namespace refit::api
