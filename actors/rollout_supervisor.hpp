// RolloutSupervisor: the root of the rollout supervision subtree. It spawns the runtime
// proxy (through a factory, so tests substitute a scripted proxy), monitors it, and when the
// proxy dies (broken, poisoned, crashed) respawns it with bounded retries and exponential
// backoff, attaching every new proxy to the RolloutEngine with its incarnation number.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>

#include "actors/interfaces.hpp"
#include "runtime/config/config.hpp"

namespace refit {

// Creates the runtime proxy of incarnation `n` (1 = first).
using proxy_factory = std::function<runtime_proxy_actor(caf::actor_system&, std::uint64_t n)>;

struct rollout_supervisor_state {
  static inline const char* name = "RolloutSupervisor";

  config::supervisor_config cfg;
  proxy_factory factory;
  rollout_engine_actor engine;
  runtime_proxy_actor proxy;
  std::uint64_t incarnation = 0;
  std::deque<caf::actor_clock::time_point> restarts; // inside restart_window_ms
  bool restart_pending = false;
  bool stopping = false;
  bool gave_up = false;
  std::string last_exit;

  supervisor_status status() const;
  ~rollout_supervisor_state();
};

rollout_supervisor_actor::behavior_type
rollout_supervisor(rollout_supervisor_actor::stateful_pointer<rollout_supervisor_state> self,
                   config::supervisor_config cfg, proxy_factory factory,
                   rollout_engine_actor engine);

} // namespace refit
