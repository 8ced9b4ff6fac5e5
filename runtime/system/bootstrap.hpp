// Actor-system bootstrap: registers refit's message types and error category, and spawns the
// rollout supervision subtree (RolloutSupervisor -> vLLMRuntimeProxy, RolloutEngine).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>

#include "actors/interfaces.hpp"
#include "actors/rollout_engine.hpp"
#include "actors/rollout_supervisor.hpp"
#include "actors/sync_coordinator.hpp"
#include "runtime/config/config.hpp"
#include "runtime/journal/journal.hpp"
#include "runtime/publication/registered.hpp"

namespace refit {

// Adds refit's type-ID block and error renderer to `cfg`.
void configure(caf::actor_system_config& cfg);

// The production proxy factory: a vLLMRuntimeProxy running `runtime_exe` with `cfg`.
proxy_factory make_runtime_proxy_factory(const config::refit_config& cfg,
                                         std::string runtime_exe);

struct rollout_handles {
  rollout_engine_actor engine;
  rollout_supervisor_actor supervisor;
  // The actor journal when `journal.enabled` (spawn_publication journals into it too).
  journal::sink_ptr journal;
};

// The actors' options as the config says (also what refit-replay rebuilds them from).
rollout_engine_options engine_options(const config::refit_config& cfg);
sync_coordinator_options coordinator_options(const config::refit_config& cfg);

// Opens the journal file of `cfg.journal` (header: the whole config) when it is enabled;
// null otherwise. Throws std::runtime_error when the file cannot be written.
journal::sink_ptr open_journal(const config::refit_config& cfg);

// Spawns the RolloutEngine (journaled through `j` when set).
rollout_engine_actor spawn_engine(caf::actor_system& sys, const config::refit_config& cfg,
                                  const journal::sink_ptr& j);

// Spawns the RolloutEngine and its supervisor (which starts runtime incarnation 1). With
// `journal.enabled`, opens the journal and journals the engine; the supervisor names every
// proxy it spawns "runtime#<incarnation>" in it.
rollout_handles spawn_rollout(caf::actor_system& sys, const config::refit_config& cfg,
                              proxy_factory factory);

struct publication_handles {
  consensus_gate_actor gate;
  std::vector<trainer_rank_actor> ranks;
  sync_coordinator_actor coordinator;
};

// Spawns the trainer side in this process: one TrainerRank per runtime device (rank r on
// runtime.devices[r]), the ConsensusGate and the SyncCoordinator driving `rollout.engine`
// (journaled into `rollout.journal` when it is set). `registered`: one sealed set of the
// trainer's own tensors per rank (the ranks publish that memory); empty: synthetic weights.
publication_handles spawn_publication(
  caf::actor_system& sys, const config::refit_config& cfg, const rollout_handles& rollout,
  std::vector<std::shared_ptr<const publication::registered_weights>> registered = {});

// The pieces of spawn_publication, for tests and refit-replay that bring their own trainer
// ranks: the ConsensusGate, then (once the ranks exist) the ranks' journal names "rank<r>",
// their attach to the gate and the SyncCoordinator.
consensus_gate_actor spawn_gate(caf::actor_system& sys, const journal::sink_ptr& j);
publication_handles spawn_coordinator(caf::actor_system& sys, const config::refit_config& cfg,
                                      const rollout_engine_actor& engine,
                                      const consensus_gate_actor& gate,
                                      std::vector<trainer_rank_actor> ranks,
                                      const journal::sink_ptr& j);
void shutdown_publication(const publication_handles& h);

// Blocks (from a non-actor thread) until the engine reports IDLE with a runtime attached, or
// until `timeout`; returns the last status and whether it became ready.
bool wait_until_ready(caf::actor_system& sys, const rollout_engine_actor& engine,
                      std::chrono::milliseconds timeout, engine_status* last = nullptr);

// Orderly stop: supervisor shutdown (graceful runtime shutdown), then engine exit.
void shutdown_rollout(caf::actor_system& sys, const rollout_handles& h);

} // namespace refit
