#include "runtime/bootstrap.hpp"

#include <thread>

#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/consensus_gate.hpp"
#include "actors/rollout_engine.hpp"
#include "actors/sync_coordinator.hpp"
#include "actors/trainer_rank.hpp"
#include "actors/runtime_proxy.hpp"
#include "runtime/publication/backend.hpp"

namespace refit {

void configure(caf::actor_system_config& cfg) {
  // Work sharing: idle scheduler threads sleep instead of polling for work to steal, so they
  // leave the cores to the threads that copy weights (measured with refit-bench: median
  // publication 0.28 s with sharing vs 0.42 s with stealing on 2 cores).
  cfg.set("scheduler.policy", caf::atom("sharing"));
  cfg.add_message_types<caf::id_block::refit>();
  cfg.add_message_type<runtime_proxy_actor>("refit::runtime_proxy_actor");
  cfg.add_message_type<channel_message>("refit::channel_message");
  cfg.add_message_type<trainer_rank_actor>("refit::trainer_rank_actor");
  cfg.add_error_category(caf::atom("refit"),
                         [](std::uint8_t code, caf::atom_value, const caf::message& ctx) {
                           return render(caf::error{code, caf::atom("refit"), ctx});
                         });
}

proxy_factory make_runtime_proxy_factory(const config::refit_config& cfg,
                                         std::string runtime_exe) {
  runtime_proxy_options opts;
  opts.runtime = cfg.runtime;
  opts.model = cfg.model;
  opts.seed = cfg.job.seed;
  opts.init_scale = cfg.trainer.init_scale;
  opts.executable_path = std::move(runtime_exe);
  return [opts](caf::actor_system& sys, std::uint64_t incarnation) -> runtime_proxy_actor {
    // Test-only faults go to the incarnation they name (0 = every one).
    auto o = opts;
    o.runtime.faults.clear();
    for (const auto& f : opts.runtime.faults)
      if (f.incarnation == 0 || f.incarnation == incarnation)
        o.runtime.faults.push_back(f);
    return sys.spawn(runtime_proxy, std::move(o));
  };
}

rollout_handles spawn_rollout(caf::actor_system& sys, const config::refit_config& cfg,
                              proxy_factory factory) {
  rollout_engine_options eo;
  eo.timeouts_ms = cfg.runtime.timeouts_ms;
  eo.kill_grace_ms = cfg.runtime.kill_grace_ms;
  eo.tp_size = cfg.runtime.tp_size;
  rollout_handles h;
  h.engine = sys.spawn(rollout_engine, eo);
  h.supervisor = sys.spawn(rollout_supervisor, cfg.supervisor, std::move(factory), h.engine);
  return h;
}

publication_handles spawn_publication(caf::actor_system& sys, const config::refit_config& cfg,
                                      const rollout_engine_actor& engine) {
  publication_handles h;
  h.gate = sys.spawn(consensus_gate);
  auto world = cfg.runtime.tp_size;
  std::vector<device::spec> rank_devices;
  for (std::uint32_t r = 0; r < world; ++r)
    rank_devices.push_back(device::parse(
      cfg.trainer.devices.empty() ? cfg.runtime.devices[r] : cfg.trainer.devices[r],
      cfg.trainer.devices.empty() ? "runtime.devices[" + std::to_string(r) + "]"
                                  : "trainer.devices[" + std::to_string(r) + "]"));
  auto collectives = publication::make_collective_registry(rank_devices);
  model::synthetic_weights weights{cfg.job.seed, cfg.trainer.lr, cfg.trainer.init_scale};
  for (std::uint32_t r = 0; r < world; ++r) {
    trainer_rank_options o;
    o.rank = r;
    o.world = world;
    o.device = cfg.trainer.devices.empty() ? cfg.runtime.devices[r] : cfg.trainer.devices[r];
    o.device_uuid = publication::device_uuid(rank_devices[r]);
    o.model = cfg.model;
    o.weights = weights;
    for (const auto& f : cfg.trainer.faults)
      if (f.rank == r)
        o.faults.push_back(f);
    o.collectives = collectives;
    o.gate = h.gate;
    // Shorter than the gate's deadline, so a rank stuck in the collective reports which peer
    // never arrived before the gate gives up on it.
    o.collective_timeout_ms = cfg.publication.gate_deadline_ms * 9 / 10;
    h.ranks.push_back(sys.spawn(trainer_rank, std::move(o)));
  }
  caf::anon_send(h.gate, attach_atom::value, h.ranks);
  h.coordinator = sys.spawn(sync_coordinator, make_sync_coordinator_options(cfg), engine, h.gate,
                            h.ranks);
  return h;
}

sync_coordinator_options make_sync_coordinator_options(const config::refit_config& cfg) {
  sync_coordinator_options so;
  so.model = cfg.model;
  so.publication = cfg.publication;
  so.timeouts_ms = cfg.runtime.timeouts_ms;
  so.kill_grace_ms = cfg.runtime.kill_grace_ms;
  so.weights = {cfg.job.seed, cfg.trainer.lr, cfg.trainer.init_scale};
  // A republish waits for the supervisor's whole restart schedule plus one startup.
  so.restart_wait_ms = cfg.runtime.timeouts_ms.startup
                       + cfg.supervisor.backoff_max_ms * (cfg.supervisor.max_restarts + 1) + 10000;
  return so;
}

void shutdown_publication(const publication_handles& h) {
  caf::anon_send_exit(h.coordinator, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(h.gate, caf::exit_reason::user_shutdown);
  for (const auto& r : h.ranks)
    caf::anon_send_exit(r, caf::exit_reason::user_shutdown);
}

bool wait_until_ready(caf::actor_system& sys, const rollout_engine_actor& engine,
                      std::chrono::milliseconds timeout, engine_status* last) {
  caf::scoped_actor self{sys};
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    engine_status st;
    bool got = false;
    self->request(engine, std::chrono::seconds(5), status_atom::value)
      .receive([&](engine_status& s) { st = s, got = true; }, [&](caf::error&) {});
    if (got && last)
      *last = st;
    if (got && st.conn() == connection_state::idle)
      return true;
    if (got && st.gave_up)
      return false;
    if (std::chrono::steady_clock::now() >= deadline)
      return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void shutdown_rollout(caf::actor_system& sys, const rollout_handles& h) {
  caf::scoped_actor self{sys};
  self->request(h.supervisor, std::chrono::seconds(60), shutdown_atom::value)
    .receive([](caf::ok_atom) {}, [](caf::error&) {});
  caf::anon_send_exit(h.engine, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(h.supervisor, caf::exit_reason::user_shutdown);
}

} // namespace refit
