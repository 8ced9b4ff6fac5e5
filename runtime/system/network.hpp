// CAF's network layer for the multi-process deployment: the middleman (BASP over TCP, or
// libcaf_openssl's TLS variant with serve.tls.enabled), the message and handle types that cross
// processes, and bounded publish / connect of the RankRegistry. Nothing else opens sockets.
#pragma once

#include <chrono>
#include <cstdint>
#include <set>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/expected.hpp>

#include "actors/interfaces.hpp"
#include "runtime/config/config.hpp"

namespace refit::net {

// Loads the middleman (and, with serve.tls.enabled, the OpenSSL manager with the configured
// certificate, key, passphrase and CA file), registers refit's network type-ID block and every
// actor handle type that travels in a message, and turns on BASP heartbeats so that a frozen
// peer is declared dead. Call after refit::configure(cfg). Throws config_error naming the
// serve.tls key when a file it names cannot be read.
void configure_network(caf::actor_system_config& cfg, const config::serve_config& serve);

// Publishes the RankRegistry on serve.host:`port` (0: a free port). Returns the bound port,
// or a typed error (errc::spawn_failed at "serve.port") naming the address.
caf::expected<std::uint16_t> publish_registry(caf::actor_system& sys,
                                              const rank_registry_actor& registry,
                                              const config::serve_config& serve,
                                              std::uint16_t port);

// Connects to the RankRegistry at host:port within `timeout` (never longer): a refused or
// silent address is errc::coordinator_unreachable, a peer that publishes another interface
// (another refit wire protocol) errc::protocol_mismatch.
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
