// Actor-system bootstrap: registers refit's message types and error category, and spawns the
// rollout supervision subtree (RolloutSupervisor -> vLLMRuntimeProxy, RolloutEngine).
#pragma once

#include <chrono>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>

#include "actors/interfaces.hpp"
#include "actors/rollout_supervisor.hpp"
#include "actors/sync_coordinator.hpp"
#include "runtime/config.hpp"

namespace refit {

// Adds refit's type-ID block and error renderer to `cfg`.
void configure(caf::actor_system_config& cfg);

// The production proxy factory: a vLLMRuntimeProxy running `runtime_exe` with `cfg`.
proxy_factory make_runtime_proxy_factory(const config::refit_config& cfg,
                                         std::string runtime_exe);

struct rollout_handles {
  rollout_engine_actor engine;
  rollout_supervisor_actor supervisor;
};

// Spawns the RolloutEngine and its supervisor (which starts runtime incarnation 1).
rollout_handles spawn_rollout(caf::actor_system& sys, const config::refit_config& cfg,
                              proxy_factory factory);

struct publication_handles {
  consensus_gate_actor gate;
  std::vector<trainer_rank_actor> ranks;
  sync_coordinator_actor coordinator;
};

// Spawns the trainer side in this process: one TrainerRank per runtime device (rank r on
// runtime.devices[r]), the ConsensusGate and the SyncCoordinator driving `engine`.
publication_handles spawn_publication(caf::actor_system& sys, const config::refit_config& cfg,
                                      const rollout_engine_actor& engine);
void shutdown_publication(const publication_handles& h);

// The SyncCoordinator's options for `cfg` (spawn_publication's, and every epoch's coordinator
// of a multi-process deployment): the recipe's publication settings and timeouts, its
// synthetic weights for the verifier, and how long a republish waits for a fresh runtime.
sync_coordinator_options make_sync_coordinator_options(const config::refit_config& cfg);

// Blocks (from a non-actor thread) until the engine reports IDLE with a runtime attached, or
// until `timeout`; returns the last status and whether it became ready.
bool wait_until_ready(caf::actor_system& sys, const rollout_engine_actor& engine,
                      std::chrono::milliseconds timeout, engine_status* last = nullptr);

// Orderly stop: supervisor shutdown (graceful runtime shutdown), then engine exit.
void shutdown_rollout(caf::actor_system& sys, const rollout_handles& h);

} // namespace refit
