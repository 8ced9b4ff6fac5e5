// Internal to librefit (never installed): the state behind refit::api::host, shared by the
// translation units of the embedding API (host.cpp: registration, connect, publish;
// rollout.cpp: generate, sleep, wake, status).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/trainer_host.hpp"
#include "actors/trainer_rank.hpp"
#include "refit/host.hpp"
#include "runtime/config/config.hpp"
#include "runtime/publication/registered.hpp"
#include "runtime/publication/shm_collective.hpp"
#include "runtime/system/serve.hpp"

namespace refit::api {

// "refit.<code> at <where>: <message>".
error api_error(const std::string& code, const std::string& where, const std::string& message);
// A CAF error (refit's category: its errc name; otherwise code "caf"); empty for none.
error from_caf(const caf::error& err);
// The refusal of a registered tensor whose memory moved or resized.
error moved_error(const tensor_spec& t, const void* data, std::uint64_t bytes);

struct host::impl {
  host_options options;
  config::refit_config cfg;
  std::optional<rank_spec> rank;
  std::optional<synthetic_weights> weights;
  // The trainer's own tensors (register_tensor); sealed by connect().
  std::shared_ptr<refit::publication::registered_weights> registered;
  std::vector<tensor_spec> tensors;
  std::string address; // host:port of the coordinator
  std::string token;   // what requests to the registry carry: the secret with TLS, else ""
                       // (the serve handshake authenticated the connection)

  std::unique_ptr<caf::actor_system_config> sys_cfg;
  std::unique_ptr<caf::actor_system> sys;
  std::optional<serve::coordinator_services> embedded;
  rank_registry_actor registry;
  trainer_rank_actor rank_actor;
  trainer_host_actor host_actor;
  std::shared_ptr<refit::publication::shm_group> group;
  bool connected = false;

  // Stops everything connect() started, in order: the collective is woken, the actors quit,
  // the embedded coordinator shuts its runtime down, the actor system (and its middleman) goes.
  void stop() {
    if (group)
      group->abort_all("this trainer process is leaving");
    if (host_actor)
      caf::anon_send_exit(host_actor, caf::exit_reason::user_shutdown);
    if (rank_actor)
      caf::anon_send_exit(rank_actor, caf::exit_reason::user_shutdown);
    if (embedded && sys)
      serve::stop_coordinator(*sys, *embedded);
    host_actor = nullptr;
    rank_actor = nullptr;
    registry = nullptr;
    embedded.reset();
    sys.reset();
    sys_cfg.reset();
    group.reset();
    connected = false;
  }

  error connect();
  error connect_steps(); // connect() without the cleanup on failure
};

} // namespace refit::api
