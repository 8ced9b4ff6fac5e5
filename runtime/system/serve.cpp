#include "runtime/system/serve.hpp"

#include <unistd.h>

#include <algorithm>

#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/consensus_gate.hpp"
#include "actors/rank_registry.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/system/network.hpp"
#include "runtime/control/protocol_version.hpp"

namespace refit::serve {

bounds bounds_of(const config::refit_config& cfg) {
  bounds b;
  // As long as a republish waits: the supervisor's whole restart schedule plus one startup.
  b.ready_wait_ms = cfg.runtime.timeouts_ms.startup
                    + cfg.supervisor.backoff_max_ms * (cfg.supervisor.max_restarts + 1) + 10000;
  b.membership_wait_ms = cfg.serve.publish_barrier_ms;
  // The registry answers within barrier + readiness + publication (+ the schedule's requests);
  // a rank's request waits a margin longer, so the registry's typed error arrives first.
  b.host_publish_timeout_ms = cfg.serve.publish_barrier_ms + b.ready_wait_ms
                              + cfg.serve.publish_timeout_ms
                              + 3 * (cfg.runtime.timeouts_ms.sleep + cfg.runtime.timeouts_ms.startup)
                              + 30000;
  return b;
}

std::string process_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return "pid " + std::to_string(::getpid()) + " on " + host;
}

caf::expected<coordinator_services> start_coordinator(caf::actor_system& sys,
                                                      const config::refit_config& cfg,
                                                      const std::string& runtime_exe,
                                                      std::uint16_t port,
                                                      std::function<void(const std::string&)> log) {
  std::string token;
  try {
    token = config::resolve_token(cfg.serve);
  } catch (const config::config_error& e) {
    return make_refit_error(errc::invalid_argument, e.key, e.what());
  }
  coordinator_services s;
  s.rollout = spawn_rollout(sys, cfg, make_runtime_proxy_factory(cfg, runtime_exe));
  engine_status status;
  auto ready_within = std::chrono::milliseconds(cfg.runtime.timeouts_ms.startup) + std::chrono::seconds(10);
  if (!wait_until_ready(sys, s.rollout.engine, ready_within, &status)) {
    shutdown_rollout(sys, s.rollout);
    return make_refit_error(errc::not_attached, "runtime",
                            "the runtime did not become ready: " + status.last_error);
  }
  s.gate = spawn_gate(sys, s.rollout.journal);
  rank_registry_options ro;
  ro.world = config::serve_world(cfg);
  ro.protocol_version = wire::serve_protocol_version;
  // Plain mode: every remote peer proved the secret in the listener's handshake before it
  // could send a message. TLS: the hello carries the token, to a certificate-verified peer.
  ro.peers_authenticated = !cfg.serve.tls.enabled;
  if (cfg.serve.tls.enabled)
    ro.token = token;
  auto refusals = std::make_shared<std::shared_ptr<const net::listener_counters>>();
  ro.external_refusals = [refusals]() -> std::uint64_t {
    auto c = std::atomic_load(refusals.get());
    return c ? c->refused.load() : 0;
  };
  ro.manifest_fingerprint = model::structural_manifest(model::expected_key_stream(cfg.model));
  ro.identity = process_identity();
  ro.coordinator = coordinator_options(cfg);
  auto b = bounds_of(cfg);
  ro.publish_barrier_ms = cfg.serve.publish_barrier_ms;
  ro.publish_timeout_ms = cfg.serve.publish_timeout_ms;
  ro.ready_wait_ms = b.ready_wait_ms;
  ro.generate_timeout_ms = cfg.runtime.timeouts_ms.generate + 10000;
  ro.sleep_wake_timeout_ms
    = std::max(cfg.runtime.timeouts_ms.sleep, cfg.runtime.timeouts_ms.wake_up) + 10000;
  ro.log = log;
  s.registry = sys.spawn(rank_registry, std::move(ro), s.rollout.engine, s.gate);
  auto bound = net::publish_registry(sys, s.registry, cfg.serve, token, port, log);
  if (!bound) {
    stop_coordinator(sys, s);
    return bound.error();
  }
  s.port = bound->port;
  s.listener = bound->listener;
  if (s.listener)
    std::atomic_store(refusals.get(), s.listener->shared_counters());
  return s;
}

void stop_coordinator(caf::actor_system& sys, const coordinator_services& s) {
  // The port closes first: no new peer is admitted while the services go.
  if (s.listener)
    s.listener->stop();
  if (s.registry)
    caf::anon_send_exit(s.registry, caf::exit_reason::user_shutdown);
  if (s.gate)
    caf::anon_send_exit(s.gate, caf::exit_reason::user_shutdown);
  shutdown_rollout(sys, s.rollout);
}

} // namespace refit::serve
