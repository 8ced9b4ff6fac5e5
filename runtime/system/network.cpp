#include "runtime/system/network.hpp"

#include <fstream>

#include <caf/io/middleman.hpp>
#include <caf/node_id.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/publish.hpp>
#include <caf/scoped_actor.hpp>

namespace refit::net {

namespace {

void require_readable(const std::string& key, const std::string& path) {
  if (path.empty())
    return;
  std::ifstream in(path);
  if (!in)
    throw config::config_error(key, "cannot read '" + path + "'");
}

caf::io::middleman_actor connector(caf::actor_system& sys, const config::serve_config& serve) {
  return serve.tls.enabled ? sys.openssl_manager().actor_handle() : sys.middleman().actor_handle();
}

} // namespace

void configure_network(caf::actor_system_config& cfg, const config::serve_config& serve) {
  cfg.load<caf::io::middleman>();
  if (serve.tls.enabled) {
    require_readable("serve.tls.certificate", serve.tls.certificate);
    require_readable("serve.tls.key", serve.tls.key);
    require_readable("serve.tls.cafile", serve.tls.cafile);
    cfg.openssl_certificate = serve.tls.certificate;
    cfg.openssl_key = serve.tls.key;
    cfg.openssl_passphrase = serve.tls.passphrase;
    cfg.openssl_cafile = serve.tls.cafile;
    cfg.load<caf::openssl::manager>();
  }
  cfg.add_message_types<caf::id_block::refit_net>();
  cfg.add_message_type<consensus_gate_actor>("refit::consensus_gate_actor");
  cfg.add_message_type<trainer_host_actor>("refit::trainer_host_actor");
  cfg.add_message_type<rank_registry_actor>("refit::rank_registry_actor");
  // A peer that stops answering (frozen, or a half-open connection) is declared dead: its
  // proxies die, and every monitor (gate, registry, trainer host) gets a DOWN.
  cfg.set("middleman.heartbeat-interval", caf::timespan{std::chrono::seconds(1)});
  cfg.set("middleman.connection-timeout", caf::timespan{std::chrono::seconds(10)});
}

caf::expected<std::uint16_t> publish_registry(caf::actor_system& sys,
                                              const rank_registry_actor& registry,
                                              const config::serve_config& serve,
                                              std::uint16_t port) {
  // SO_REUSEADDR: a restarted coordinator binds its port again while old connections linger.
  auto res = serve.tls.enabled ? caf::openssl::publish(registry, port, serve.host.c_str(), true)
                               : sys.middleman().publish(registry, port, serve.host.c_str(), true);
  if (!res)
    return make_refit_error(errc::spawn_failed, "serve.port",
                            "cannot listen on " + serve.host + ":" + std::to_string(port) + ": "
                              + sys.render(res.error()));
  return *res;
}

caf::expected<caf::strong_actor_ptr> connect_raw(caf::actor_system& sys,
                                                 const config::serve_config& serve,
                                                 const std::string& host, std::uint16_t port,
                                                 std::chrono::milliseconds timeout,
                                                 const std::set<std::string>& expected_interface) {
  auto address = host + ":" + std::to_string(port);
  caf::expected<caf::strong_actor_ptr> out{caf::error{}};
  caf::scoped_actor self{sys, true};
  // The middleman's own connect has no deadline: ask it through a request that has one.
  self->request(connector(sys, serve), timeout, caf::connect_atom::value, host, port)
    .receive(
      [&](caf::node_id&, caf::strong_actor_ptr& ptr, std::set<std::string>& interface) {
        if (!ptr)
          out = make_refit_error(errc::coordinator_unreachable, address,
                                 "nothing is published on that port");
        else if (!sys.assignable(interface, expected_interface))
          out = make_refit_error(errc::protocol_mismatch, address,
                                 "the peer publishes another actor interface than this build's "
                                 "RankRegistry: it speaks another refit wire protocol (or is no "
                                 "refit coordinator)");
        else
          out = std::move(ptr);
      },
      [&](caf::error& err) {
        if (err == caf::sec::request_timeout)
          out = make_refit_error(errc::coordinator_unreachable, address,
                                 "no coordinator answered within " + std::to_string(timeout.count())
                                   + " ms (serve.join_timeout_ms)");
        else
          out = make_refit_error(errc::coordinator_unreachable, address,
                                 "cannot connect: " + sys.render(err));
      });
  return out;
}

caf::expected<rank_registry_actor> connect_registry(caf::actor_system& sys,
                                                    const config::serve_config& serve,
                                                    const std::string& host, std::uint16_t port,
                                                    std::chrono::milliseconds timeout) {
  return connect_as<rank_registry_actor>(sys, serve, host, port, timeout);
}

} // namespace refit::net
