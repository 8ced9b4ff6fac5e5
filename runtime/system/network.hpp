// CAF's network layer for the multi-process deployment: the middleman (BASP over TCP, or
// libcaf_openssl's TLS variant with serve.tls.enabled), the message and handle types that cross
// processes, and bounded publish / connect of the RankRegistry. In plain TCP mode the port is
// ours (guarded_listener.hpp): a connection reaches CAF's BASP only after the mutual handshake
// of runtime/auth/handshake.hpp; the trainer side runs the same handshake before it speaks BASP.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <functional>
#include <set>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/expected.hpp>

#include "actors/interfaces.hpp"
#include "runtime/config/config.hpp"
#include "runtime/system/guarded_listener.hpp"

namespace refit::net {

// Loads the middleman (and, with serve.tls.enabled, the OpenSSL manager with the configured
// certificate, key, passphrase and CA file), registers refit's network type-ID block and every
// actor handle type that travels in a message, and turns on BASP heartbeats so that a frozen
// peer is declared dead. Call after refit::configure(cfg). Throws config_error naming the
// serve.tls key when a file it names cannot be read.
void configure_network(caf::actor_system_config& cfg, const config::serve_config& serve);

struct published_registry {
  std::uint16_t port = 0;
  // Plain TCP mode: the listener that admits peers (stopping it closes the port). Null with
  // TLS, where CAF's openssl doorman owns the port.
  std::shared_ptr<guarded_listener> listener;
};

// Publishes the RankRegistry on serve.host:`port` (0: a free port). Plain mode: a
// guarded_listener with `token`, serve.handshake_timeout_ms and serve.max_pending_handshakes
// hands every admitted socket to the BASP broker, which serves the registry on it. TLS: CAF's
// openssl publish. Returns the bound port, or a typed error (errc::spawn_failed at
// "serve.port") naming the address.
caf::expected<published_registry> publish_registry(caf::actor_system& sys,
                                                   const rank_registry_actor& registry,
                                                   const config::serve_config& serve,
                                                   const std::string& token, std::uint16_t port,
                                                   std::function<void(const std::string&)> log);

// Connects to the RankRegistry at host:port within `timeout` (never longer), proving the
// shared secret of `serve` (serve.token / serve.token_env) and requiring the listener's proof
// first. A refused, silent or closing address is errc::coordinator_unreachable; a listener
// that cannot prove the secret (an impostor, or another token) or that refuses ours is
// errc::unauthorized at "handshake.token"; a peer that publishes another interface (another
// refit wire protocol) errc::protocol_mismatch.
caf::expected<rank_registry_actor> connect_registry(caf::actor_system& sys,
                                                    const config::serve_config& serve,
                                                    const std::string& host, std::uint16_t port,
                                                    std::chrono::milliseconds timeout);

// The same, for an arbitrary typed interface (tests check the interface mismatch with it).
template <class Handle>
caf::expected<Handle> connect_as(caf::actor_system& sys, const config::serve_config& serve,
                                 const std::string& host, std::uint16_t port,
                                 std::chrono::milliseconds timeout);

// Untyped core of connect_as: the peer's actor and its published interface, or the error.
caf::expected<caf::strong_actor_ptr> connect_raw(caf::actor_system& sys,
                                                 const config::serve_config& serve,
                                                 const std::string& host, std::uint16_t port,
                                                 std::chrono::milliseconds timeout,
                                                 const std::set<std::string>& expected_interface);

template <class Handle>
caf::expected<Handle> connect_as(caf::actor_system& sys, const config::serve_config& serve,
                                 const std::string& host, std::uint16_t port,
                                 std::chrono::milliseconds timeout) {
  auto ptr = connect_raw(sys, serve, host, port, timeout, sys.message_types<Handle>());
  if (!ptr)
    return ptr.error();
  return caf::actor_cast<Handle>(std::move(*ptr));
}

} // namespace refit::net
