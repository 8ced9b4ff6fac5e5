#include "runtime/system/bootstrap.hpp"

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
#include "runtime/journal/journal_actor.hpp"
#include "runtime/journal/journal_file.hpp"

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
  opts.model_path = cfg.model_path;
  opts.publication_mode = cfg.publication.mode;
  opts.executable_path = std::move(runtime_exe);
  if (!cfg.serve.token_env.empty())
    opts.scrub_env.push_back(cfg.serve.token_env); // whatever its name, the secret stays here
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

// What the journal records as each journaled actor's state (runtime/journal_actor.hpp).
caf::message journal_state(const sync_coordinator_state& st) {
  std::string retry = "none";
  if (st.retry)
    retry = "version " + std::to_string(st.retry->version) + " attempt "
            + std::to_string(st.retry->next_attempt) + " after incarnation "
            + std::to_string(st.retry->failed_incarnation);
  return caf::make_message(st.status(), retry);
}

caf::message journal_state(const rollout_engine_state& st) {
  std::string flags = "transfer_initialized=" + std::to_string(st.transfer_initialized)
                      + " ipc_open=" + std::to_string(st.ipc_open)
                      + " next_chunk=" + std::to_string(st.next_chunk)
                      + " publication=" + st.header.publication_id;
  return caf::make_message(st.status(), flags);
}

caf::message journal_state(const consensus_gate_state& st) {
  std::string open;
  for (const auto& [phase, round] : st.open)
    open += (open.empty() ? "" : ", ") + to_string(phase) + ": "
            + std::to_string(round.reports.size()) + "/" + std::to_string(round.world);
  std::string early;
  for (const auto& [phase, reports] : st.early)
    early += (early.empty() ? "" : ", ") + to_string(phase) + ": "
             + std::to_string(reports.size());
  std::string failed;
  for (const auto& id : st.failed)
    failed += (failed.empty() ? "" : ", ") + id;
  return caf::make_message("passed=" + std::to_string(st.passed) + "; open=[" + open
                           + "]; early=[" + early + "]; failed=[" + failed + "]; ranks="
                           + std::to_string(st.ranks.size()));
}

rollout_engine_options engine_options(const config::refit_config& cfg) {
  rollout_engine_options eo;
  eo.timeouts_ms = cfg.runtime.timeouts_ms;
  eo.kill_grace_ms = cfg.runtime.kill_grace_ms;
  eo.tp_size = cfg.runtime.tp_size;
  return eo;
}

sync_coordinator_options coordinator_options(const config::refit_config& cfg) {
  sync_coordinator_options so;
  so.model = cfg.model;
  so.publication = cfg.publication;
  so.timeouts_ms = cfg.runtime.timeouts_ms;
  so.kill_grace_ms = cfg.runtime.kill_grace_ms;
  so.weights = config::trainer_weights(cfg);
  // A republish waits for the supervisor's whole restart schedule plus one startup.
  so.restart_wait_ms = cfg.runtime.timeouts_ms.startup
                       + cfg.supervisor.backoff_max_ms * (cfg.supervisor.max_restarts + 1) + 10000;
  return so;
}

journal::sink_ptr open_journal(const config::refit_config& cfg) {
  if (!cfg.journal.enabled)
    return nullptr;
  return journal::record_to_file(cfg.journal.path,
                                 journal::make_header(config::to_yaml(cfg), cfg.job.seed));
}

rollout_engine_actor spawn_engine(caf::actor_system& sys, const config::refit_config& cfg,
                                  const journal::sink_ptr& j) {
  auto eo = engine_options(cfg);
  eo.journal = j;
  return journal::spawn(sys, j, rollout_engine, eo);
}

rollout_handles spawn_rollout(caf::actor_system& sys, const config::refit_config& cfg,
                              proxy_factory factory) {
  rollout_handles h;
  h.journal = open_journal(cfg);
  h.engine = spawn_engine(sys, cfg, h.journal);
  if (auto j = h.journal)
    factory = [j, inner = std::move(factory)](caf::actor_system& s, std::uint64_t n) {
      auto proxy = inner(s, n);
      j->name(caf::actor_cast<caf::actor_addr>(proxy), "runtime#" + std::to_string(n),
              journal::sink::role::runtime);
      return proxy;
    };
  h.supervisor = sys.spawn(rollout_supervisor, cfg.supervisor, std::move(factory), h.engine);
  return h;
}

consensus_gate_actor spawn_gate(caf::actor_system& sys, const journal::sink_ptr& j) {
  consensus_gate_options go;
  go.journal = j;
  return journal::spawn(sys, j, consensus_gate, go);
}

publication_handles spawn_coordinator(caf::actor_system& sys, const config::refit_config& cfg,
                                      const rollout_engine_actor& engine,
                                      const consensus_gate_actor& gate,
                                      std::vector<trainer_rank_actor> ranks,
                                      const journal::sink_ptr& j) {
  publication_handles h;
  h.gate = gate;
  h.ranks = std::move(ranks);
  if (j)
    for (std::size_t r = 0; r < h.ranks.size(); ++r)
      j->name(caf::actor_cast<caf::actor_addr>(h.ranks[r]), "rank" + std::to_string(r),
              journal::sink::role::rank);
  caf::anon_send(h.gate, attach_atom::value, h.ranks);
  auto so = coordinator_options(cfg);
  so.journal = j;
  h.coordinator = journal::spawn(sys, j, sync_coordinator, so, engine, h.gate, h.ranks);
  return h;
}

publication_handles spawn_publication(
  caf::actor_system& sys, const config::refit_config& cfg, const rollout_handles& rollout,
  std::vector<std::shared_ptr<const publication::registered_weights>> registered) {
  auto gate = spawn_gate(sys, rollout.journal);
  auto world = cfg.runtime.tp_size;
  if (!registered.empty() && registered.size() != world)
    throw std::invalid_argument("spawn_publication: " + std::to_string(registered.size())
                                + " registered weight sets for " + std::to_string(world)
                                + " trainer ranks");
  std::vector<device::spec> rank_devices;
  for (std::uint32_t r = 0; r < world; ++r)
    rank_devices.push_back(device::parse(
      cfg.trainer.devices.empty() ? cfg.runtime.devices[r] : cfg.trainer.devices[r],
      cfg.trainer.devices.empty() ? "runtime.devices[" + std::to_string(r) + "]"
                                  : "trainer.devices[" + std::to_string(r) + "]"));
  auto collectives = publication::make_collective_registry(rank_devices);
  model::synthetic_weights weights = config::trainer_weights(cfg);
  std::vector<trainer_rank_actor> ranks;
  for (std::uint32_t r = 0; r < world; ++r) {
    trainer_rank_options o;
    o.rank = r;
    o.world = world;
    o.device = cfg.trainer.devices.empty() ? cfg.runtime.devices[r] : cfg.trainer.devices[r];
    o.device_uuid = publication::device_uuid(rank_devices[r]);
    o.model = cfg.model;
    o.weights = weights;
    if (!registered.empty())
      o.registered = registered[r];
    for (const auto& f : cfg.trainer.faults)
      if (f.rank == r)
        o.faults.push_back(f);
    o.collectives = collectives;
    o.gate = gate;
    // Shorter than the gate's deadline, so a rank stuck in the collective reports which peer
    // never arrived before the gate gives up on it.
    o.collective_timeout_ms = cfg.publication.gate_deadline_ms * 9 / 10;
    ranks.push_back(sys.spawn(trainer_rank, std::move(o)));
  }
  return spawn_coordinator(sys, cfg, rollout.engine, gate, std::move(ranks), rollout.journal);
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
