// The coordinator side of a multi-process deployment, as `refit-coordinator serve` runs it
// and as rank 0's trainer process hosts it with serve.embedded: the rollout subtree
// (RolloutSupervisor -> vLLMRuntimeProxy -> refit-runtime, RolloutEngine), the ConsensusGate,
// and the RankRegistry published on serve.host:serve.port through CAF's middleman. The
// trainer ranks are not spawned here: they join from their own processes.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/expected.hpp>

#include "actors/interfaces.hpp"
#include "runtime/system/bootstrap.hpp"
#include "runtime/config/config.hpp"
#include "runtime/system/guarded_listener.hpp"

namespace refit::serve {

// The bounds both sides derive from one recipe.
struct bounds {
  std::uint32_t ready_wait_ms = 0;           // a publish waits this long for an IDLE runtime
  std::uint32_t membership_wait_ms = 0;      // a rank's publish waits for every rank to join
  std::uint32_t host_publish_timeout_ms = 0; // a rank's publish request to the registry
};
bounds bounds_of(const config::refit_config& cfg);

struct coordinator_services {
  rollout_handles rollout;
  consensus_gate_actor gate;
  rank_registry_actor registry;
  std::uint16_t port = 0; // where the registry listens
  // Plain TCP mode: the listener that admits authenticated peers (null with TLS).
  std::shared_ptr<net::guarded_listener> listener;
};

// Starts everything (blocking until the runtime is IDLE, at most timeouts_ms.startup + 10 s)
// and publishes the registry on serve.host:`port`. The system must have been configured with
// refit::configure and net::configure_network. `log` receives one line per registry event.
// Errors are typed: the runtime never became ready, the port could not be bound, or the
// recipe has no shared secret (config_error is converted to invalid_argument at its key).
caf::expected<coordinator_services> start_coordinator(caf::actor_system& sys,
                                                      const config::refit_config& cfg,
                                                      const std::string& runtime_exe,
                                                      std::uint16_t port,
                                                      std::function<void(const std::string&)> log);

// Orderly stop: the registry and the gate quit (remote trainer hosts see the coordinator go),
// the supervisor shuts the runtime down gracefully and the group is reaped.
void stop_coordinator(caf::actor_system& sys, const coordinator_services& s);

// "pid <pid> on <hostname>".
std::string process_identity();

} // namespace refit::serve
