#include "runtime/system/network.hpp"

#include <unistd.h>

#include <fstream>
#include <future>

#include <caf/io/basp_broker.hpp>
#include <caf/io/middleman.hpp>
#include <caf/io/network/multiplexer.hpp>
#include <caf/node_id.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/publish.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "runtime/auth/handshake.hpp"
#include "runtime/fileio/read_file.hpp"

namespace refit::net {

namespace {

void require_readable(const std::string& key, const std::string& path) {
  if (path.empty())
    return;
  try {
    fileio::read_regular_file(path, fileio::max_pem_bytes, "PEM file");
  } catch (const fileio::file_error& e) {
    throw config::config_error(key, e.what());
  }
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

caf::expected<published_registry> publish_registry(caf::actor_system& sys,
                                                   const rank_registry_actor& registry,
                                                   const config::serve_config& serve,
                                                   const std::string& token, std::uint16_t port,
                                                   std::function<void(const std::string&)> log) {
  const auto address = serve.host + ":" + std::to_string(port);
  published_registry out;
  if (serve.tls.enabled) {
    // SO_REUSEADDR: a restarted coordinator binds its port again while old connections linger.
    auto res = caf::openssl::publish(registry, port, serve.host.c_str(), true);
    if (!res)
      return make_refit_error(errc::spawn_failed, "serve.port",
                              "cannot listen on " + address + ": " + sys.render(res.error()));
    out.port = *res;
    return out;
  }
  // Plain mode: our listener admits a peer after the handshake; the BASP broker then serves
  // the registry on that one socket (it writes its server handshake, as after an accept).
  auto* mm = &sys.middleman();
  auto basp = mm->named_broker<caf::io::basp_broker>(caf::atom("BASP"));
  auto whom = caf::actor_cast<caf::strong_actor_ptr>(registry);
  auto sigs = sys.message_types(registry);
  auto bound = std::make_shared<std::atomic<std::uint16_t>>(port);
  listener_options lo;
  lo.host = serve.host;
  lo.port = port;
  lo.token = token;
  lo.handshake_timeout = std::chrono::milliseconds(serve.handshake_timeout_ms);
  lo.max_pending = serve.max_pending_handshakes;
  lo.log = std::move(log);
  lo.admit = [mm, basp, whom, sigs, bound](int fd) {
    mm->backend().post([mm, basp, whom, sigs, bound, fd] {
      auto scribe = mm->backend().new_scribe(fd);
      caf::anon_send(basp, caf::publish_atom::value, std::move(scribe), bound->load(), whom, sigs);
    });
  };
  try {
    out.listener = std::make_shared<guarded_listener>(std::move(lo));
  } catch (const std::exception& e) {
    return make_refit_error(errc::spawn_failed, "serve.port", e.what());
  }
  out.port = out.listener->port();
  bound->store(out.port);
  return out;
}

namespace {

// TLS mode: the middleman's own connect (CAF's openssl doorman owns the authentication).
caf::expected<caf::strong_actor_ptr> connect_tls(caf::actor_system& sys,
                                                 const config::serve_config& serve,
                                                 const std::string& host, std::uint16_t port,
                                                 std::chrono::milliseconds timeout,
                                                 const std::set<std::string>& expected_interface);

caf::error interface_check(caf::actor_system& sys, const std::string& address,
                           const caf::strong_actor_ptr& ptr, const std::set<std::string>& interface,
                           const std::set<std::string>& expected_interface) {
  if (!ptr)
    return make_refit_error(errc::coordinator_unreachable, address,
                            "nothing is published on that port");
  if (!sys.assignable(interface, expected_interface))
    return make_refit_error(errc::protocol_mismatch, address,
                            "the peer publishes another actor interface than this build's "
                            "RankRegistry: it speaks another refit wire protocol (or is no "
                            "refit coordinator)");
  return {};
}

} // namespace

caf::expected<caf::strong_actor_ptr> connect_raw(caf::actor_system& sys,
                                                 const config::serve_config& serve,
                                                 const std::string& host, std::uint16_t port,
                                                 std::chrono::milliseconds timeout,
                                                 const std::set<std::string>& expected_interface) {
  if (serve.tls.enabled)
    return connect_tls(sys, serve, host, port, timeout, expected_interface);
  auto address = host + ":" + std::to_string(port);
  std::string token;
  try {
    token = config::resolve_token(serve);
  } catch (const config::config_error& e) {
    return make_refit_error(errc::invalid_argument, e.key, e.what());
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string why;
  int fd = connect_tcp(host, port, deadline, why);
  if (fd < 0)
    return make_refit_error(errc::coordinator_unreachable, address, "cannot connect: " + why);
  auth::client_result hs;
  try {
    hs = auth::run_client(fd, token, deadline);
  } catch (const std::exception& e) {
    ::close(fd);
    return make_refit_error(errc::spawn_failed, "handshake", e.what());
  }
  if (hs.outcome != auth::client_outcome::admitted) {
    ::close(fd);
    if (hs.outcome == auth::client_outcome::unreachable)
      return make_refit_error(errc::coordinator_unreachable, address, "handshake: " + hs.detail);
    return make_refit_error(
      errc::unauthorized, "handshake.token",
      hs.detail + " (" + address + "): the two sides have different shared secrets "
        + "(serve.token / serve.token_env), or the listener is not this deployment's coordinator; "
        + "nothing derived from this process's secret but its proof was sent, and that only "
        + "after the listener proved itself");
  }
  // Admitted: the socket becomes a BASP scribe of this node's broker (created on the
  // multiplexer's thread), which awaits the coordinator's BASP server handshake.
  auto* mm = &sys.middleman();
  std::promise<caf::io::scribe_ptr> made;
  auto scribe_future = made.get_future();
  mm->backend().post([mm, fd, &made] { made.set_value(mm->backend().new_scribe(fd)); });
  auto scribe = scribe_future.get();
  auto basp = mm->named_broker<caf::io::basp_broker>(caf::atom("BASP"));
  auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                         deadline - std::chrono::steady_clock::now()),
                       std::chrono::milliseconds(1));
  caf::expected<caf::strong_actor_ptr> out{caf::error{}};
  caf::scoped_actor self{sys, true};
  self->request(basp, left, caf::connect_atom::value, std::move(scribe), port)
    .receive(
      [&](caf::node_id&, caf::strong_actor_ptr& ptr, std::set<std::string>& interface) {
        if (auto bad = interface_check(sys, address, ptr, interface, expected_interface))
          out = std::move(bad);
        else
          out = std::move(ptr);
      },
      [&](caf::error& err) {
        out = make_refit_error(errc::coordinator_unreachable, address,
                               err == caf::sec::request_timeout
                                 ? "no BASP handshake within " + std::to_string(timeout.count())
                                     + " ms (serve.join_timeout_ms)"
                                 : "BASP handshake failed: " + sys.render(err));
      });
  return out;
}

namespace {

caf::expected<caf::strong_actor_ptr> connect_tls(caf::actor_system& sys,
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
        if (auto bad = interface_check(sys, address, ptr, interface, expected_interface))
          out = std::move(bad);
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

} // namespace

caf::expected<rank_registry_actor> connect_registry(caf::actor_system& sys,
                                                    const config::serve_config& serve,
                                                    const std::string& host, std::uint16_t port,
                                                    std::chrono::milliseconds timeout) {
  return connect_as<rank_registry_actor>(sys, serve, host, port, timeout);
}

} // namespace refit::net
