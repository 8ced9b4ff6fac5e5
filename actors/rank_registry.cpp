#include "actors/rank_registry.hpp"
#include "actors/rank_registry_parts.hpp"

#include <algorithm>
#include <optional>

#include <caf/actor_cast.hpp>
#include <caf/node_id.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

namespace refit {

using self_ptr = rank_registry_self;
using clock_type = std::chrono::steady_clock;

namespace {

constexpr auto poll_interval = std::chrono::milliseconds(20);

// Compares the shared secret without an early exit on the first differing byte.
bool same_secret(const std::string& given, const std::string& expected) {
  unsigned char diff = given.size() == expected.size() ? 0 : 1;
  for (std::size_t i = 0; i < expected.size(); ++i)
    diff |= static_cast<unsigned char>(expected[i]) ^ static_cast<unsigned char>(i < given.size() ? given[i] : 0);
  return diff == 0;
}

// Whether a message's token field passes: always when the connection itself was
// authenticated (the field is then unused), else the shared secret.
bool token_ok(const rank_registry_state& st, const std::string& given) {
  return st.opts.peers_authenticated || same_secret(given, st.opts.token);
}

// "node <id>" of the current message's sender, for logs.
std::string sender_of(self_ptr self) {
  const auto& s = self->current_sender();
  return s ? "node " + caf::to_string(s->node()) : std::string("an anonymous sender");
}

caf::error refuse(self_ptr self, errc code, const std::string& where, const std::string& what,
                  const std::string& log_what) {
  auto& st = self->state;
  ++st.refusals;
  st.log("refused " + where + " from " + sender_of(self) + ": " + log_what);
  return make_refit_error(code, where, what);
}

} // namespace

caf::error registry_refuse(self_ptr self, errc code, const std::string& where,
                           const std::string& what, const std::string& log_what) {
  return refuse(self, code, where, what, log_what);
}

bool registry_token_ok(const rank_registry_state& st, const std::string& given) {
  return token_ok(st, given);
}

namespace {

std::string ranks_text(const std::vector<std::uint32_t>& ranks) {
  std::string out;
  for (auto r : ranks)
    out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

std::chrono::milliseconds engine_timeout(const rank_registry_state& st, std::uint32_t cmd_ms) {
  const auto& c = st.opts.coordinator;
  return std::chrono::milliseconds(cmd_ms) + std::chrono::milliseconds(c.timeouts_ms.startup)
         + std::chrono::milliseconds(c.kill_grace_ms) + std::chrono::seconds(10);
}

membership table(const rank_registry_state& st) {
  membership m;
  m.epoch = st.epoch;
  m.complete = st.complete;
  m.world = st.opts.world;
  m.reason = st.last_change;
  for (const auto& [r, member] : st.members)
    m.members.push_back(member.info);
  return m;
}

void push_members(self_ptr self) {
  auto m = table(self->state);
  for (const auto& [r, member] : self->state.members)
    self->send(member.host, members_atom::value, m);
}

void retire(const sync_coordinator_actor& c) {
  if (c)
    caf::anon_send_exit(c, caf::exit_reason::user_shutdown);
}

// Every rank joined: a new epoch with its own SyncCoordinator over the ranks' handles.
void start_epoch(self_ptr self) {
  auto& st = self->state;
  std::vector<trainer_rank_actor> ranks;
  for (const auto& [r, member] : st.members)
    ranks.push_back(member.rank);
  ++st.epoch;
  st.complete = true;
  st.last_change = "every rank joined (epoch " + std::to_string(st.epoch) + ")";
  self->send(st.gate, attach_atom::value, ranks);
  st.coordinator = self->spawn(sync_coordinator, st.opts.coordinator, st.engine, st.gate, ranks);
  st.log("membership complete: " + std::to_string(st.opts.world) + " ranks, epoch "
         + std::to_string(st.epoch));
  push_members(self);
}

// Ends the run: every waiting rank gets `res`.
void finish(self_ptr self, caf::expected<publication_result> res) {
  auto& st = self->state;
  if (!st.run)
    return;
  auto run = std::move(*st.run);
  st.run.reset();
  if (res) {
    ++st.publications;
    st.committed_version = std::max(st.committed_version, res->model_version);
    st.log("published version " + std::to_string(res->model_version) + " (" + res->publication_id
           + ", " + std::to_string(res->chunks) + " chunks, "
           + std::to_string(static_cast<long long>(res->seconds * 1000.0)) + " ms, attempt "
           + std::to_string(res->attempts) + ")");
  } else {
    ++st.failures;
    st.last_error = render(res.error());
    st.log("publication of version " + std::to_string(run.version) + " failed: " + st.last_error);
  }
  for (auto& [r, rp] : run.waiting) {
    if (res)
      rp.deliver(*res);
    else
      rp.deliver(res.error());
  }
  // The run's coordinator belongs to an epoch that ended meanwhile: it goes now.
  if (run.coordinator && run.coordinator != st.coordinator)
    retire(run.coordinator);
  if (!st.complete && st.members.size() == st.opts.world)
    start_epoch(self);
}

// The failure every rank gets when rank `lost` left during the run.
caf::error lost_error(const publish_run& run, const std::string& detail) {
  std::string msg = "trainer rank " + std::to_string(*run.lost_rank) + " left during the publish of version "
                    + std::to_string(run.version) + " (" + run.lost_reason + ")";
  if (!detail.empty())
    msg += "; " + detail;
  msg += "; publish again once it rejoined";
  return make_refit_error(errc::rank_lost, "rank " + std::to_string(*run.lost_rank), msg);
}

// A step of run `seq` failed with `err`: the run ends with it, or with rank_lost when a rank
// left meanwhile (its loss is then the cause: e.g. the epoch's coordinator was shut down).
void fail_run(self_ptr self, std::uint64_t seq, const caf::error& err) {
  auto& st = self->state;
  if (!st.run || st.run->seq != seq)
    return;
  if (st.run->lost_rank)
    return finish(self, lost_error(*st.run, st.run->publish_sent
                                              ? "the publication failed: " + render(err)
                                              : "nothing was published"));
  finish(self, err);
}

void step_schedule(self_ptr self, std::uint64_t seq);

// Whether an answer to a step of run `seq` should carry the run on: not when the run ended
// (or another began), nor when a rank left before anything was published; the run then ends
// here with rank_lost.
bool run_goes_on(self_ptr self, std::uint64_t seq) {
  auto& st = self->state;
  if (!st.run || st.run->seq != seq)
    return false;
  if (st.run->lost_rank) {
    finish(self, lost_error(*st.run, "nothing was published"));
    return false;
  }
  return true;
}

// Waits (polling) for the runtime to be IDLE: right after a failure the supervisor is still
// bringing up the next incarnation.
void poll_ready(self_ptr self, std::uint64_t seq) {
  auto& st = self->state;
  self->request(st.engine, engine_timeout(st, st.opts.coordinator.timeouts_ms.describe),
                status_atom::value)
    .then(
      [self, seq](engine_status& s) {
        if (!run_goes_on(self, seq))
          return;
        auto& st = self->state;
        if (s.conn() == connection_state::idle)
          return step_schedule(self, seq);
        if (s.gave_up)
          return finish(self, make_refit_error(errc::restart_limit, "runtime",
                                               "the runtime supervisor gave up: " + s.last_error));
        if (clock_type::now() >= st.run->ready_deadline)
          return finish(self, make_refit_error(errc::not_attached, "runtime",
                                               "the runtime did not become ready within "
                                                 + std::to_string(st.opts.ready_wait_ms)
                                                 + " ms (last error: " + s.last_error + ")"));
        self->delayed_send(self, poll_interval, restart_atom::value, seq);
      },
      [self, seq](caf::error& err) { fail_run(self, seq, err); });
}

// A rank left while the SyncCoordinator runs the publication: wait until the coordinator
// failed it (the gate fails at once for a gone rank, and the coordinator poisons the runtime),
// then end the epoch's coordinator so that it does not republish without the rank.
void watch_coordinator(self_ptr self, std::uint64_t seq) {
  auto& st = self->state;
  self->request(st.run->coordinator, std::chrono::seconds(10), status_atom::value)
    .then(
      [self, seq](coordinator_status& s) {
        auto& st = self->state;
        if (!st.run || st.run->seq != seq)
          return;
        if (s.failures > st.run->failures_before) {
          retire(st.run->coordinator);
          return finish(self, lost_error(*st.run, "the publication failed: " + s.last_error
                                                    + "; the runtime was poisoned and restarts"));
        }
        self->delayed_send(self, poll_interval, restart_atom::value, seq);
      },
      [self, seq](caf::error&) {
        // The coordinator is gone already (or stuck): its answer, or our publish timeout, ends it.
        auto& st = self->state;
        if (st.run && st.run->seq == seq)
          self->delayed_send(self, poll_interval, restart_atom::value, seq);
      });
}

void wake_kv_and_finish(self_ptr self, std::uint64_t seq, publication_result res) {
  auto& st = self->state;
  self->request(st.engine, engine_timeout(st, st.opts.coordinator.timeouts_ms.wake_up),
                wake_atom::value, wake_tags::only_kv_cache())
    .then(
      [self, seq, res](engine_status&) {
        if (self->state.run && self->state.run->seq == seq)
          finish(self, res);
      },
      [self, seq, res](caf::error& err) {
        // The version is committed; the KV cache wakes with the next request that needs it.
        auto& st = self->state;
        if (!st.run || st.run->seq != seq)
          return;
        st.log("wake(kv_cache) after version " + std::to_string(res.model_version)
               + " failed: " + render(err));
        finish(self, res);
      });
}

void send_publish(self_ptr self, std::uint64_t seq) {
  auto& st = self->state;
  auto& run = *st.run;
  run.coordinator = st.coordinator;
  if (!run.coordinator)
    return finish(self, make_refit_error(errc::invalid_state, "publish",
                                         "no complete membership to publish in"));
  // The coordinator's failure count, so that a rank loss can tell when it failed this run.
  self->request(run.coordinator, std::chrono::seconds(10), status_atom::value)
    .then(
      [self, seq](coordinator_status& s) {
        if (!run_goes_on(self, seq))
          return;
        auto& st = self->state;
        st.run->failures_before = s.failures;
        st.run->publish_sent = true;
        self->request(st.run->coordinator, std::chrono::milliseconds(st.opts.publish_timeout_ms),
                      publish_atom::value, st.run->version)
          .then(
            [self, seq](publication_result& res) {
              if (self->state.run && self->state.run->seq == seq)
                wake_kv_and_finish(self, seq, std::move(res));
            },
            [self, seq](caf::error& err) {
              auto& st = self->state;
              if (!st.run || st.run->seq != seq)
                return;
              if (err == caf::sec::request_timeout) {
                // The coordinator overran its bound: it goes, and the runtime with it.
                retire(st.run->coordinator);
                if (st.run->coordinator == st.coordinator && st.complete) {
                  std::vector<trainer_rank_actor> ranks;
                  for (const auto& [r, m] : st.members)
                    ranks.push_back(m.rank);
                  st.coordinator = self->spawn(sync_coordinator, st.opts.coordinator, st.engine,
                                               st.gate, ranks);
                }
                self->request(st.engine, std::chrono::seconds(30), poison_atom::value,
                              std::string("the publication overran serve.publish_timeout_ms"))
                  .then([](engine_status&) {}, [](caf::error&) {});
              }
              fail_run(self, seq, err);
            });
      },
      [self, seq](caf::error& err) { fail_run(self, seq, err); });
}

// The colocated schedule around the publication: sleep(2) -> wake(weights) -> publish.
void step_schedule(self_ptr self, std::uint64_t seq) {
  auto& st = self->state;
  self->request(st.engine, engine_timeout(st, st.opts.coordinator.timeouts_ms.sleep),
                sleep_atom::value, std::uint32_t{2})
    .then(
      [self, seq](engine_status&) {
        if (!run_goes_on(self, seq))
          return;
        auto& st = self->state;
        self->request(st.engine, engine_timeout(st, st.opts.coordinator.timeouts_ms.wake_up),
                      wake_atom::value, wake_tags::only_weights())
          .then(
            [self, seq](engine_status&) {
              if (!run_goes_on(self, seq))
                return;
              send_publish(self, seq);
            },
            [self, seq](caf::error& err) { fail_run(self, seq, err); });
      },
      [self, seq](caf::error& err) { fail_run(self, seq, err); });
}

// Every rank asked for the same version: run it.
void start_run(self_ptr self) {
  auto& st = self->state;
  auto& run = *st.run;
  if (run.version <= st.committed_version)
    return finish(self, make_refit_error(errc::invalid_argument, "publish.model_version",
                                         "model version " + std::to_string(run.version)
                                           + " is not above the committed version "
                                           + std::to_string(st.committed_version)));
  run.running = true;
  run.ready_deadline = clock_type::now() + std::chrono::milliseconds(st.opts.ready_wait_ms);
  st.log("every rank publishes version " + std::to_string(run.version) + " (epoch "
         + std::to_string(run.epoch) + ")");
  poll_ready(self, run.seq);
}

// Rank `r` left (its rank or host actor went down).
void on_lost(self_ptr self, std::uint32_t r, const std::string& reason) {
  auto& st = self->state;
  auto it = st.members.find(r);
  if (it == st.members.end())
    return;
  self->demonitor(it->second.rank.address());
  self->demonitor(it->second.host.address());
  auto pid = it->second.info.pid;
  st.members.erase(it);
  ++st.rank_losses;
  st.complete = false;
  st.last_change = "rank " + std::to_string(r) + " left (" + reason + ")";
  st.log("rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") left: " + reason);
  // The epoch's coordinator goes, unless it is running a publication: that one ends first.
  bool running_on_it = st.run && st.run->publish_sent && st.run->coordinator == st.coordinator;
  if (!running_on_it)
    retire(st.coordinator);
  st.coordinator = nullptr;
  if (st.run && !st.run->lost_rank) {
    auto& run = *st.run;
    run.lost_rank = r;
    run.lost_reason = reason;
    if (!run.running)
      finish(self, lost_error(run, "nothing was published"));
    else if (run.publish_sent)
      watch_coordinator(self, run.seq);
    // Otherwise the schedule step in flight sees lost_rank and ends the run.
  }
  push_members(self);
}

} // namespace

rank_registry_state::~rank_registry_state() {
  if (run)
    retire(run->coordinator);
  retire(coordinator);
}

rank_registry_impl::behavior_type rank_registry(self_ptr self, rank_registry_options opts,
                                                rollout_engine_actor engine,
                                                consensus_gate_actor gate) {
  auto& st = self->state;
  st.opts = std::move(opts);
  st.engine = std::move(engine);
  st.gate = std::move(gate);
  self->request(st.engine, std::chrono::seconds(30), status_atom::value)
    .then([self](engine_status& s) {
            auto& st = self->state;
            st.committed_version = std::max(st.committed_version, s.committed_version);
          },
          [](caf::error&) {});
  self->set_down_handler([self](caf::down_msg& dm) {
    auto& st = self->state;
    for (const auto& [r, member] : st.members)
      if (member.rank.address() == dm.source || member.host.address() == dm.source) {
        auto rank = r;
        on_lost(self, rank, render(dm.reason));
        return;
      }
  });
  return {
    [=](hello_atom, std::uint32_t version,
        const std::string& token) -> caf::result<welcome, consensus_gate_actor> {
      auto& st = self->state;
      if (version != st.opts.protocol_version)
        return refuse(self, errc::protocol_mismatch, "hello.protocol_version",
                      "this coordinator speaks refit wire protocol "
                        + std::to_string(st.opts.protocol_version) + ", the trainer process "
                        + std::to_string(version),
                      "protocol version " + std::to_string(version) + " (this coordinator: "
                        + std::to_string(st.opts.protocol_version) + ")");
      if (!token_ok(st, token))
        return refuse(self, errc::unauthorized, "hello.token",
                      "wrong or missing shared secret (serve.token / serve.token_env)",
                      token.empty() ? "missing token" : "wrong token");
      welcome w;
      w.protocol_version = st.opts.protocol_version;
      w.world = st.opts.world;
      w.committed_version = st.committed_version;
      w.coordinator = st.opts.identity;
      return caf::result<welcome, consensus_gate_actor>(std::move(w), st.gate);
    },
    [=](join_atom, const join_request& req, trainer_rank_actor rank,
        trainer_host_actor host) -> caf::result<join_ack> {
      auto& st = self->state;
      auto where = "join of rank " + std::to_string(req.rank);
      if (req.protocol_version != st.opts.protocol_version)
        return refuse(self, errc::protocol_mismatch, "join.protocol_version",
                      "this coordinator speaks refit wire protocol "
                        + std::to_string(st.opts.protocol_version) + ", the trainer process "
                        + std::to_string(req.protocol_version),
                      where + ": protocol version " + std::to_string(req.protocol_version));
      if (!token_ok(st, req.token))
        return refuse(self, errc::unauthorized, "join.token",
                      "wrong or missing shared secret (serve.token / serve.token_env)",
                      where + ": " + (req.token.empty() ? "missing token" : "wrong token"));
      if (req.world != st.opts.world)
        return refuse(self, errc::join_refused, "join.world",
                      "this coordinator serves " + std::to_string(st.opts.world)
                        + " trainer ranks, the process was started for "
                        + std::to_string(req.world),
                      where + ": world " + std::to_string(req.world));
      if (req.rank >= st.opts.world)
        return refuse(self, errc::join_refused, "join.rank",
                      "rank " + std::to_string(req.rank) + " is out of range for "
                        + std::to_string(st.opts.world) + " trainer ranks",
                      where + ": out of range");
      if (auto it = st.members.find(req.rank); it != st.members.end())
        return refuse(self, errc::join_refused, "join.rank",
                      "rank " + std::to_string(req.rank) + " is already joined by pid "
                        + std::to_string(it->second.info.pid) + " on "
                        + it->second.info.hostname,
                      where + ": already joined");
      if (req.manifest_fingerprint != st.opts.manifest_fingerprint)
        return refuse(self, errc::join_refused, "join.manifest_fingerprint",
                      "the rank's model (manifest " + req.manifest_fingerprint.substr(0, 12)
                        + ") differs from the coordinator's (manifest "
                        + st.opts.manifest_fingerprint.substr(0, 12) + ")",
                      where + ": another model");
      if (!rank || !host)
        return refuse(self, errc::invalid_argument, "join", "the join carries no rank or host actor",
                      where + ": no actor handles");
      if (req.collective_endpoint.empty() || req.pid <= 0)
        return refuse(self, errc::invalid_argument, "join.collective_endpoint",
                      "the join carries no all-gather endpoint or pid", where + ": no endpoint");
      registry_member m;
      m.info.rank = req.rank;
      m.info.pid = req.pid;
      m.info.hostname = req.hostname;
      m.info.device = req.device;
      m.info.device_uuid = req.device_uuid;
      m.info.collective_endpoint = req.collective_endpoint;
      m.rank = rank;
      m.host = host;
      self->monitor(rank);
      self->monitor(host);
      st.members.emplace(req.rank, m);
      st.last_change = "rank " + std::to_string(req.rank) + " joined";
      st.log("rank " + std::to_string(req.rank) + " joined: pid " + std::to_string(req.pid) + " on "
             + req.hostname + ", " + req.device + " (" + sender_of(self) + ")");
      if (st.members.size() == st.opts.world && !(st.run && st.run->running))
        start_epoch(self);
      else
        push_members(self);
      return join_ack{req.rank, st.opts.world, st.committed_version};
    },
    [=](publish_atom, const publish_request& req) -> caf::result<publication_result> {
      auto& st = self->state;
      auto it = st.members.find(req.rank);
      if (it == st.members.end() || !self->current_sender()
          || self->current_sender()->address() != it->second.host.address())
        return refuse(self, errc::unauthorized, "publish",
                      "only the trainer process that joined as rank " + std::to_string(req.rank)
                        + " may publish for it",
                      "publish for rank " + std::to_string(req.rank) + " from a non-member");
      if (!st.complete || req.epoch != st.epoch)
        return make_refit_error(errc::rank_lost, "publish.epoch",
                                "the membership changed (the request is for epoch "
                                  + std::to_string(req.epoch) + ", now "
                                  + std::to_string(st.epoch)
                                  + (st.complete ? ", complete" : ", incomplete") + "): "
                                  + st.last_change);
      if (st.run && st.run->running)
        return make_refit_error(errc::busy, "publish",
                                "the publication of version " + std::to_string(st.run->version)
                                  + " is running");
      if (st.run && st.run->version != req.model_version) {
        std::vector<std::uint32_t> others;
        for (const auto& [r, rp] : st.run->waiting)
          others.push_back(r);
        auto err = make_refit_error(errc::invalid_argument, "publish.model_version",
                                    "rank " + std::to_string(req.rank) + " publishes version "
                                      + std::to_string(req.model_version) + " while rank(s) "
                                      + ranks_text(others) + " publish version "
                                      + std::to_string(st.run->version));
        finish(self, err);
        return err;
      }
      if (st.run && st.run->waiting.count(req.rank))
        return make_refit_error(errc::busy, "publish",
                                "rank " + std::to_string(req.rank)
                                  + " already waits to publish version "
                                  + std::to_string(req.model_version));
      if (!st.run) {
        publish_run run;
        run.seq = st.next_seq++;
        run.version = req.model_version;
        run.epoch = st.epoch;
        st.run = std::move(run);
        self->delayed_send(self, std::chrono::milliseconds(st.opts.publish_barrier_ms),
                           deadline_atom::value, st.run->seq);
      }
      auto rp = self->make_response_promise<publication_result>();
      st.run->waiting.emplace(req.rank, rp);
      if (st.run->waiting.size() == st.opts.world)
        start_run(self);
      return rp;
    },
    [=](status_atom, const std::string& token) -> caf::result<registry_status> {
      auto& st = self->state;
      if (!token_ok(st, token))
        return refuse(self, errc::unauthorized, "status.token",
                      "wrong or missing shared secret (serve.token / serve.token_env)",
                      "status: wrong token");
      auto out = std::make_shared<registry_status>();
      out->world = st.opts.world;
      out->epoch = st.epoch;
      out->complete = st.complete;
      out->members = table(st).members;
      out->committed_version = st.committed_version;
      out->publications = st.publications;
      out->failures = st.failures;
      out->rank_losses = st.rank_losses;
      out->refusals = st.refusals + (st.opts.external_refusals ? st.opts.external_refusals() : 0);
      out->last_error = st.last_error;
      if (st.run) {
        out->publishing = st.run->running;
        out->barrier_version = st.run->version;
        for (const auto& [r, rp] : st.run->waiting)
          out->waiting_ranks.push_back(r);
      }
      auto rp = self->make_response_promise<registry_status>();
      auto with_engine = [self, out, rp]() mutable {
        self->request(self->state.engine, std::chrono::seconds(5), status_atom::value)
          .then([out, rp](engine_status& s) mutable {
                  out->engine = s;
                  rp.deliver(*out);
                },
                [out, rp](caf::error&) mutable { rp.deliver(*out); });
      };
      auto c = st.run && st.run->coordinator ? st.run->coordinator : st.coordinator;
      if (!c) {
        with_engine();
        return rp;
      }
      self->request(c, std::chrono::seconds(5), status_atom::value)
        .then([out, with_engine](coordinator_status& s) mutable {
                out->coordinator = s;
                with_engine();
              },
              [with_engine](caf::error&) mutable { with_engine(); });
      return rp;
    },
    [=](generate_atom, rollout_generate& req) { return registry_generate(self, req); },
    [=](sleep_atom, const rollout_sleep& req) { return registry_sleep(self, req); },
    [=](wake_atom, const rollout_wake& req) { return registry_wake(self, req); },
    [=](collective_id_atom, const std::string& token, std::uint32_t rank,
        const std::string& publication_id, const std::string& offered) {
      return registry_collective_id(self, token, rank, publication_id, offered);
    },
    [=](deadline_atom, std::uint64_t seq) {
      auto& st = self->state;
      if (!st.run || st.run->seq != seq || st.run->running)
        return;
      std::vector<std::uint32_t> missing;
      for (std::uint32_t r = 0; r < st.opts.world; ++r)
        if (!st.run->waiting.count(r))
          missing.push_back(r);
      finish(self, make_refit_error(errc::barrier_timeout, "publish",
                                    "rank(s) " + ranks_text(missing)
                                      + " did not call publish(" + std::to_string(st.run->version)
                                      + ") within serve.publish_barrier_ms = "
                                      + std::to_string(st.opts.publish_barrier_ms) + " ms"));
    },
    [=](restart_atom, std::uint64_t seq) {
      auto& st = self->state;
      if (!st.run || st.run->seq != seq)
        return;
      if (st.run->publish_sent)
        watch_coordinator(self, seq);
      else
        poll_ready(self, seq);
    },
  };
}

} // namespace refit
