#include "actors/sync_coordinator.hpp"

#include <algorithm>
#include <random>

#include <caf/actor_cast.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "runtime/model/digest.hpp"
#include "runtime/control/protocol_version.hpp"
#include "runtime/device/device.hpp"
#include "runtime/publication/backend.hpp"
#include "runtime/publication/shard.hpp"
#include "runtime/trace/trace.hpp"

namespace refit {

using self_ptr = sync_coordinator_impl::stateful_pointer<sync_coordinator_state>;
using clock_type = std::chrono::steady_clock;

coordinator_status sync_coordinator_state::status() const {
  coordinator_status s;
  s.state = static_cast<std::uint8_t>(state);
  s.committed_version = committed_version;
  s.publication_id = last_publication_id;
  s.publications = publications;
  s.failures = failures;
  s.last_error = last_error;
  s.transitions = transitions;
  return s;
}

namespace {

std::string random_publication_id() {
  std::random_device rd;
  std::uniform_int_distribution<std::uint32_t> dist;
  char buf[40];
  std::snprintf(buf, sizeof(buf), "pub-%08x%08x%08x%08x", dist(rd), dist(rd), dist(rd), dist(rd));
  return buf;
}

void enter(self_ptr self, publication_state s) {
  self->state.state = s;
  self->state.transitions.emplace_back(to_string(s));
}

std::chrono::milliseconds engine_timeout(const sync_coordinator_state& st, std::uint32_t cmd_ms) {
  // The engine's own bound (command + startup + kill grace + margin) plus a margin of ours.
  return std::chrono::milliseconds(cmd_ms) + std::chrono::milliseconds(st.opts.timeouts_ms.startup)
         + std::chrono::milliseconds(st.opts.kill_grace_ms) + std::chrono::seconds(10);
}

std::chrono::milliseconds gate_timeout(const sync_coordinator_state& st) {
  return std::chrono::milliseconds(st.opts.publication.gate_deadline_ms) + std::chrono::seconds(5);
}

// Any failure: Poisoned. The runtime is poisoned (killed, restarted by its supervisor), every
// rank drops its buffers, and the coordinator is Idle again with the committed version
// unchanged. With republish attempts left, it waits for the fresh runtime and publishes the
// same weights again (same model version); otherwise the caller gets `err`.
void poison(self_ptr self, caf::error err) {
  auto& st = self->state;
  auto ctx = st.ctx;
  if (!ctx || st.state == publication_state::poisoned)
    return;
  enter(self, publication_state::poisoned);
  ++st.failures;
  st.last_error = render(err);
  trace::complete(trace::tracks::sync_coordinator(), "publication (failed)", ctx->trace_start_ns,
                  {{"version", ctx->version}, {"attempt", ctx->attempt}, {"error", st.last_error}});
  gate_failure g{ctx->current, 0, st.last_error};
  for (const auto& r : st.ranks) {
    journal::note_send(self, st.opts.journal, r, abort_atom::value, g);
    self->send(r, abort_atom::value, g);
  }
  st.ctx.reset();
  enter(self, publication_state::idle);
  bool retry = ctx->attempt <= st.opts.publication.republish_attempts;
  pending_republish next;
  if (retry) {
    next.version = ctx->version;
    next.rp = ctx->rp;
    next.next_attempt = ctx->attempt + 1;
    next.errors = ctx->recovered_errors;
    next.errors.push_back(st.last_error);
    next.last_error = err;
    next.deadline = clock_type::now() + std::chrono::milliseconds(st.opts.restart_wait_ms);
    st.retry = std::move(next);
  } else {
    ctx->rp.deliver(err);
  }
  self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.shutdown), poison_atom::value,
                "publication " + ctx->id + " failed: " + st.last_error)
    .then(
      [self, retry](engine_status& s) {
        auto& st = self->state;
        if (retry && st.retry) {
          st.retry->failed_incarnation = s.incarnation;
          self->send(self, restart_atom::value);
        }
      },
      [self, retry](caf::error&) {
        // The engine could not poison (its runtime is already gone): the failed incarnation is
        // the one it reports now, before the supervisor attaches the next.
        auto& st = self->state;
        if (!retry || !st.retry)
          return;
        self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.describe), status_atom::value)
          .then(
            [self](engine_status& s) {
              if (auto& r = self->state.retry; r && s.conn() != connection_state::idle)
                r->failed_incarnation = s.incarnation;
              self->send(self, restart_atom::value);
            },
            [self](caf::error&) { self->send(self, restart_atom::value); });
      });
}

// A response handler for `T` that runs `next` only if `ctx` is still the publication in
// flight (a late answer for a poisoned publication is dropped).
template <class T, class F>
auto guarded(self_ptr self, std::shared_ptr<publication_ctx> ctx, F next) {
  return [self, ctx, next](T& x) mutable {
    if (self->state.ctx != ctx)
      return;
    next(x);
  };
}

auto on_error(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  return [self, ctx](caf::error& err) {
    if (self->state.ctx == ctx)
      poison(self, err);
  };
}

// Opens the gate for `phase`, then tells every rank to do `xs...`; `next` gets all reports.
template <class Next, class... Ts>
void phase(self_ptr self, std::shared_ptr<publication_ctx> ctx, phase_kind kind,
           std::uint32_t chunk, Next next, Ts... xs) {
  auto& st = self->state;
  ctx->current = phase_id{ctx->id, static_cast<std::uint8_t>(kind), chunk};
  self->request(st.gate, gate_timeout(st), open_atom::value, ctx->current,
                static_cast<std::uint32_t>(st.ranks.size()), st.opts.publication.gate_deadline_ms)
    .then(guarded<std::vector<rank_report>>(self, ctx, next), on_error(self, ctx));
  for (const auto& r : st.ranks) {
    journal::note_send(self, st.opts.journal, r, xs...);
    self->send(r, xs...);
  }
}

void finalize(self_ptr self, std::shared_ptr<publication_ctx> ctx);

void check_verification(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  if (!ctx->verify_error.empty())
    return poison(self, make_refit_error(errc::verification_failed, "verifier", ctx->verify_error));
  const auto& got = ctx->commit.receipts;
  if (got.size() != ctx->expected_checksums.size())
    return poison(self, make_refit_error(errc::verification_failed, "receipts",
                                         std::to_string(got.size()) + " receipts, the verifier has "
                                           + std::to_string(ctx->expected_checksums.size())
                                           + " TP ranks"));
  for (std::size_t r = 0; r < ctx->expected_checksums.size(); ++r) {
    const auto& want = ctx->expected_checksums[r].checksums;
    const auto& have = got[r].checksums;
    if (have.size() != want.size())
      return poison(self, make_refit_error(errc::verification_failed,
                                           "receipts[" + std::to_string(r) + "].checksums",
                                           std::to_string(have.size()) + " checksums, expected "
                                             + std::to_string(want.size())));
    for (std::size_t i = 0; i < want.size(); ++i)
      if (have[i].name != want[i].name || have[i].digest != want[i].digest)
        return poison(self, make_refit_error(errc::verification_failed, want[i].name,
                                             "TP worker " + std::to_string(r)
                                               + " holds bytes that differ from the trainer's "
                                                 "weights (digest "
                                               + have[i].digest + " != "
                                               + want[i].digest + ")"));
  }
  finalize(self, ctx);
}

void finish(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  auto& st = self->state;
  enter(self, publication_state::finalizing);
  const auto traced = trace::start();
  self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.finish_weight_update),
                finish_upd_atom::value, finish_request{ctx->id, ctx->version})
    .then(guarded<commit_result>(self, ctx,
                  [self, ctx, traced](commit_result& res) {
                    trace::complete(trace::tracks::sync_coordinator(), "commit", traced,
                                    {{"version", ctx->version}});
                    // The timed window ends here: the runtime committed the version.
                    ctx->seconds = journal::draw(
                      self, self->state.opts.journal, "seconds",
                      std::chrono::duration<double>(clock_type::now() - ctx->first_chunk).count());
                    ctx->commit = std::move(res);
                    enter(self, publication_state::committed);
                    if (!ctx->verify)
                      return finalize(self, ctx);
                    if (ctx->verify_done)
                      return check_verification(self, ctx);
                    ctx->commit_waiting_for_verify = true;
                  }),
          on_error(self, ctx));
}

// Committed -> (every rank checks the result: validation point 7) -> release -> Released ->
// Idle. The version counts as committed, for the coordinator and the engine, only once the
// IPC imports are released: a failure before that poisons and leaves it unchanged.
void finalize(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  publication_result res;
  res.publication_id = ctx->id;
  res.model_version = ctx->version;
  res.manifest_fingerprint = ctx->fingerprint;
  res.tensors = ctx->expected.size();
  res.bytes = ctx->plan.total_tensor_bytes;
  res.chunks = static_cast<std::uint32_t>(ctx->plan.chunks.size());
  res.trainer_ranks = static_cast<std::uint32_t>(self->state.ranks.size());
  res.tp = ctx->runtime.tp_world_size;
  res.seconds = ctx->seconds;
  res.peak_buffer_bytes = ctx->peak_bytes;
  res.receipts = ctx->commit.receipts;
  res.attempts = ctx->attempt;
  res.recovered_errors = ctx->recovered_errors;
  res.mode = ctx->direct ? "direct" : "packed";
  res.bytes_local = ctx->bytes_local;
  res.bytes_cross = ctx->bytes_cross;
  phase(self, ctx, phase_kind::final, 0,
        [self, ctx, res](std::vector<rank_report>&) {
          auto& st = self->state;
          const auto traced = trace::start();
          self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.release_ipc),
                        release_atom::value)
            .then(guarded<engine_status>(self, ctx,
                                         [self, ctx, res, traced](engine_status&) {
                                           auto& st = self->state;
                                           trace::complete(trace::tracks::sync_coordinator(),
                                                           "release", traced);
                                           trace::complete(trace::tracks::sync_coordinator(),
                                                           "publication", ctx->trace_start_ns,
                                                           {{"version", ctx->version},
                                                            {"attempt", ctx->attempt},
                                                            {"chunks", res.chunks},
                                                            {"bytes", res.bytes}});
                                           enter(self, publication_state::released);
                                           st.committed_version = ctx->version;
                                           ++st.publications;
                                           ctx->rp.deliver(res);
                                           st.ctx.reset();
                                           enter(self, publication_state::idle);
                                         }),
                  on_error(self, ctx));
        },
        final_atom::value, res);
}

void check_manifests(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  phase(self, ctx, phase_kind::manifest, 0,
        [self, ctx](std::vector<rank_report>& reports) {
          for (const auto& r : reports)
            if (r.fingerprint != ctx->fingerprint || r.tensor_count != ctx->expected.size())
              return poison(self, make_refit_error(
                                    errc::manifest_mismatch, "rank " + std::to_string(r.rank),
                                    "emitted " + std::to_string(r.tensor_count)
                                      + " tensors with manifest " + r.fingerprint.substr(0, 16)
                                      + ", the independent plan has "
                                      + std::to_string(ctx->expected.size())
                                      + " tensors with manifest "
                                      + ctx->fingerprint.substr(0, 16)));
          if (ctx->verify && ctx->ranks.front().weight_source == "registered") {
            // Registered weights: the expected digests are the ranks' terms, computed from
            // their own memory after the gather, added to the zero digests.
            try {
              ctx->expected_checksums
                = expected_from_terms(self->state.opts.model, ctx->runtime.tp_world_size, reports);
            } catch (const std::exception& e) {
              ctx->verify_error = e.what();
            }
            ctx->verify_done = true;
          }
          finish(self, ctx);
        },
        manifest_atom::value, ctx->id);
}

void pump(self_ptr self, std::shared_ptr<publication_ctx> ctx);

// Materialize phase of chunk k on every rank; its packed tensors and handles become ctx->ready[k].
void materialize_chunk(self_ptr self, std::shared_ptr<publication_ctx> ctx, std::uint32_t k) {
  ctx->materializing = true;
  phase(self, ctx, phase_kind::materialize, k,
        [self, ctx, k](std::vector<rank_report>& reports) {
          weight_chunk chunk;
          chunk.publication_id = ctx->id;
          chunk.chunk_index = k;
          chunk.is_first = k == 0;
          chunk.is_last = k + 1 == ctx->plan.chunks.size();
          chunk.tensors = reports.front().tensors;
          std::uint64_t bytes = 0; // packed bytes held (none in direct mode)
          if (!ctx->direct)
            for (const auto& t : chunk.tensors)
              bytes = std::max<std::uint64_t>(bytes, t.offset + t.nbytes);
          if (ctx->direct) {
            // Every placed byte of the chunk written exactly once, by whichever rank owns it:
            // the ranks' totals must add up to what the TP layout places.
            std::uint64_t moved = 0;
            for (const auto& r : reports)
              moved += r.moved_local + r.moved_cross;
            if (moved != ctx->direct_placed.at(k))
              return poison(self, make_refit_error(
                                    errc::gate_failed, "materialize[" + std::to_string(k) + "]",
                                    "the ranks wrote " + std::to_string(moved)
                                      + " placed bytes of chunk " + std::to_string(k)
                                      + ", the TP layout places " 
                                      + std::to_string(ctx->direct_placed.at(k))));
            for (const auto& r : reports) {
              ctx->bytes_local += r.moved_local;
              ctx->bytes_cross += r.moved_cross;
            }
          }
          for (const auto& r : reports) {
            if (r.tensors.size() != chunk.tensors.size()
                || !std::equal(r.tensors.begin(), r.tensors.end(), chunk.tensors.begin(),
                               [](const tensor_meta& a, const tensor_meta& b) {
                                 return a.name == b.name && a.shape == b.shape
                                        && a.dtype == b.dtype && a.offset == b.offset
                                        && a.nbytes == b.nbytes;
                               }))
              return poison(self, make_refit_error(errc::gate_failed,
                                                   "materialize[" + std::to_string(k) + "]",
                                                   "rank " + std::to_string(r.rank)
                                                     + " packed other tensors than rank 0"));
            chunk.handles.insert(chunk.handles.end(), r.handles.begin(), r.handles.end());
          }
          ctx->held[k] = bytes;
          std::uint64_t held = 0;
          for (const auto& [chunk_index, b] : ctx->held)
            held += b;
          ctx->peak_bytes = std::max(ctx->peak_bytes, held);
          ctx->ready.emplace(k, std::move(chunk));
          ctx->materializing = false;
          ++ctx->next_materialize;
          pump(self, ctx);
        },
        materialize_atom::value, ctx->id, k);
}

// update_weights of chunk k, then the transfer phase: every rank may reuse its buffer.
void send_chunk(self_ptr self, std::shared_ptr<publication_ctx> ctx, std::uint32_t k) {
  auto& st = self->state;
  ctx->updating = true;
  auto chunk = std::move(ctx->ready.at(k));
  ctx->ready.erase(k);
  const auto traced = trace::start();
  self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.update_weights),
                update_atom::value, std::move(chunk))
    .then(guarded<chunk_ack>(self, ctx,
                             [self, ctx, k, traced](chunk_ack&) {
                               trace::complete(trace::tracks::sync_coordinator(),
                                               "update_weights", traced, {{"chunk", k}});
                               phase(self, ctx, phase_kind::transfer, k,
                                     [self, ctx, k](std::vector<rank_report>&) {
                                       ctx->held.erase(k);
                                       ctx->updating = false;
                                       ++ctx->transferred;
                                       pump(self, ctx);
                                     },
                                     transferred_atom::value, ctx->id, k);
                             }),
          on_error(self, ctx));
}

// Advances the chunk pipeline: chunks load in order, one update at a time; up to
// buffer_count chunks are materialized ahead of the last transferred one, so with two
// buffers chunk k + 1 is gathered while the runtime loads chunk k.
void pump(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  const auto n = static_cast<std::uint32_t>(ctx->plan.chunks.size());
  if (ctx->transferred == n)
    return check_manifests(self, ctx);
  if (!ctx->updating && ctx->ready.count(ctx->transferred))
    send_chunk(self, ctx, ctx->transferred);
  const std::uint32_t buffers = std::max<std::uint32_t>(1, ctx->buffer_count);
  if (!ctx->materializing && ctx->next_materialize < n
      && ctx->next_materialize < ctx->transferred + buffers)
    materialize_chunk(self, ctx, ctx->next_materialize);
}

void load_chunks(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  ctx->first_chunk = clock_type::now();
  enter(self, publication_state::loading);
  pump(self, ctx);
}

// start_weight_update, then the chunks (both modes, once the runtime is initialized).
void start_and_load(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  auto& st = self->state;
  self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.start_weight_update),
                start_upd_atom::value, ctx->header)
    .then(guarded<engine_status>(self, ctx,
                                 [self, ctx](engine_status&) {
                                   enter(self, publication_state::started);
                                   load_chunks(self, ctx);
                                 }),
          on_error(self, ctx));
}

void start_update(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  auto& st = self->state;
  const auto& pc = st.opts.publication;
  self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.init_weight_transfer),
                init_wt_atom::value, transfer_init{pc.transport, pc.buffer_bytes, pc.buffer_count})
    .then(guarded<engine_status>(self, ctx,
                  [self, ctx](engine_status&) {
                    enter(self, publication_state::initialized);
                    start_and_load(self, ctx);
                  }),
          on_error(self, ctx));
}

// Direct mode: the runtime exports its resident arenas first (init_weight_transfer), a
// describe reads their handles, and the ranks open them in prepare; then start and load.
void init_direct(self_ptr self, std::shared_ptr<publication_ctx> ctx, publication_spec spec) {
  auto& st = self->state;
  const auto& pc = st.opts.publication;
  self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.init_weight_transfer),
                init_wt_atom::value,
                transfer_init{pc.transport, pc.buffer_bytes, pc.buffer_count, "direct"})
    .then(guarded<engine_status>(self, ctx,
      [self, ctx, spec](engine_status&) mutable {
        auto& st = self->state;
        enter(self, publication_state::initialized);
        self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.describe),
                      describe_atom::value)
          .then(guarded<runtime_description>(self, ctx,
            [self, ctx, spec](runtime_description& d) mutable {
              if (d.pid == 0 || d.workers.size() != ctx->runtime.workers.size())
                return poison(self, make_refit_error(errc::validation_failed, "describe",
                                                     "the runtime's description changed after "
                                                     "init_weight_transfer"));
              for (const auto& w : d.workers) {
                if (w.resident_export.empty() || w.resident_export_bytes == 0
                    || w.device_uuid != ctx->runtime.workers[w.rank].device_uuid)
                  return poison(self, make_refit_error(
                                        errc::validation_failed,
                                        "describe.workers[" + std::to_string(w.rank) + "]",
                                        "TP worker " + std::to_string(w.rank)
                                          + " exports no resident arena after a direct "
                                            "init_weight_transfer"));
                buffer_handle h;
                h.device_uuid = w.device_uuid;
                h.buffer_index = w.rank;
                h.handle = w.resident_export;
                h.size = w.resident_export_bytes;
                spec.targets.push_back(std::move(h));
              }
              spec.runtime_pid = d.pid;
              phase(self, ctx, phase_kind::prepare, 0,
                    [self, ctx](std::vector<rank_report>&) { start_and_load(self, ctx); },
                    prepare_atom::value, spec);
            }),
            on_error(self, ctx));
      }),
      on_error(self, ctx));
}

void begin(self_ptr self, std::shared_ptr<publication_ctx> ctx) {
  auto& st = self->state;
  // Preflight inputs: the runtime's topology, then every rank's identity and memory.
  self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.describe), describe_atom::value)
    .then(guarded<runtime_description>(self, ctx,
                  [self, ctx](runtime_description& d) {
                    auto& st = self->state;
                    ctx->runtime = std::move(d);
                    ctx->ranks.assign(st.ranks.size(), rank_info{});
                    auto pending = std::make_shared<std::size_t>(st.ranks.size());
                    for (const auto& r : st.ranks)
                      journal::note_send(self, st.opts.journal, r, describe_atom::value);
                    for (std::size_t r = 0; r < st.ranks.size(); ++r)
                      self->request(st.ranks[r], gate_timeout(st), describe_atom::value)
                        .then(guarded<rank_info>(self, ctx,
                                      [self, ctx, pending, r](rank_info& info) {
                                        ctx->ranks[r] = std::move(info);
                                        if (--*pending > 0)
                                          return;
                                        if (auto err = preflight(self->state, *ctx))
                                          return poison(self, err);
                                        auto& st = self->state;
                                        auto& h = ctx->header;
                                        h.protocol_version = wire::protocol_version;
                                        h.transport = st.opts.publication.transport;
                                        h.publication_id = ctx->id;
                                        h.model_version = ctx->version;
                                        h.tp_world_size = ctx->runtime.tp_world_size;
                                        h.manifest_fingerprint = ctx->fingerprint;
                                        for (const auto& ri : ctx->ranks) {
                                          h.device_uuids.push_back(ri.device_uuid);
                                          h.producer_pids.push_back(ri.pid);
                                        }
                                        h.expected_tensor_count = ctx->expected.size();
                                        h.verify = ctx->verify;
                                        h.mode = ctx->direct ? "direct" : "packed";
                                        const bool registered
                                          = ctx->ranks.front().weight_source == "registered";
                                        if (ctx->verify && !registered
                                            && !journal::replaying(st.opts.journal)) {
                                          // Expected checksums from the trainer's full weights,
                                          // computed while the publication runs (in a replay
                                          // the journal brings the worker's answer).
                                          caf::actor_addr weak = self->address();
                                          st.worker->post([weak, id = ctx->id,
                                                           model = st.opts.model,
                                                           tp = h.tp_world_size,
                                                           w = st.opts.weights,
                                                           step = ctx->ranks.front().step,
                                                           device = ctx->ranks.front().device] {
                                            std::vector<receipt> sums;
                                            std::string error;
                                            try {
                                              sums = expected_resident_checksums(model, tp, w, step,
                                                                                              device);
                                            } catch (const std::exception& e) {
                                              error = e.what();
                                            }
                                            if (auto hdl = caf::actor_cast<sync_coordinator_impl>(weak))
                                              caf::anon_send(hdl, done_atom::value, id,
                                                             std::move(sums), std::move(error));
                                          });
                                        }
                                        publication_spec spec;
                                        spec.publication_id = ctx->id;
                                        spec.model_version = ctx->version;
                                        spec.manifest_fingerprint = ctx->fingerprint;
                                        spec.tensor_count = ctx->expected.size();
                                        spec.buffer_bytes = st.opts.publication.buffer_bytes;
                                        spec.buffer_count = st.opts.publication.buffer_count;
                                        spec.chunk_count
                                          = static_cast<std::uint32_t>(ctx->plan.chunks.size());
                                        spec.world = static_cast<std::uint32_t>(st.ranks.size());
                                        spec.tp = h.tp_world_size;
                                        spec.verify = ctx->verify;
                                        spec.mode = h.mode;
                                        if (ctx->direct)
                                          return init_direct(self, ctx, std::move(spec));
                                        phase(self, ctx, phase_kind::prepare, 0,
                                              [self, ctx](std::vector<rank_report>&) {
                                                start_update(self, ctx);
                                              },
                                              prepare_atom::value, spec);
                                      }),
                              on_error(self, ctx));
                  }),
          on_error(self, ctx));
}

// One attempt of publishing `version` (attempt > 1: a republish after failures).
void start_attempt(self_ptr self, std::uint64_t version,
                   caf::typed_response_promise<publication_result> rp, std::uint32_t attempt,
                   std::vector<std::string> recovered) {
  auto& st = self->state;
  auto ctx = std::make_shared<publication_ctx>();
  ctx->id = journal::draw(self, st.opts.journal, "publication_id", random_publication_id());
  ctx->trace_start_ns = trace::start();
  ctx->version = version;
  ctx->rp = std::move(rp);
  ctx->attempt = attempt;
  ctx->recovered_errors = std::move(recovered);
  ctx->verify = st.opts.publication.verify;
  ctx->buffer_count = st.opts.publication.buffer_count;
  ctx->direct = st.opts.publication.mode == "direct";
  ctx->current = phase_id{ctx->id, static_cast<std::uint8_t>(phase_kind::prepare), 0};
  // The expected stream is planned from the config alone, independent of what the ranks emit.
  ctx->expected = model::expected_key_stream(st.opts.model);
  ctx->fingerprint = model::structural_manifest(ctx->expected);
  st.transitions.clear();
  st.transitions.emplace_back(to_string(publication_state::idle));
  st.ctx = ctx;
  st.last_publication_id = ctx->id;
  begin(self, ctx);
}

} // namespace

sync_coordinator_impl::behavior_type
sync_coordinator(self_ptr self, sync_coordinator_options opts, rollout_engine_actor engine,
                 consensus_gate_actor gate, std::vector<trainer_rank_actor> ranks) {
  auto& st = self->state;
  st.opts = std::move(opts);
  st.engine = std::move(engine);
  st.gate = std::move(gate);
  st.ranks = std::move(ranks);
  st.worker = std::make_unique<worker_thread>();
  return {
    [=](publish_atom, std::uint64_t version) -> caf::result<publication_result> {
      auto& st = self->state;
      if (st.ctx || st.retry)
        return make_refit_error(errc::busy, "publish",
                                st.ctx ? "publication '" + st.ctx->id + "' is in progress"
                                       : "a failed publication is being republished");
      if (version <= st.committed_version)
        return make_refit_error(errc::invalid_argument, "publish.model_version",
                                "model version " + std::to_string(version)
                                  + " is not above the committed version "
                                  + std::to_string(st.committed_version));
      if (st.ranks.empty())
        return make_refit_error(errc::invalid_state, "publish", "no trainer ranks");
      auto rp = self->make_response_promise<publication_result>();
      start_attempt(self, version, rp, 1, {});
      return rp;
    },
    [=](restart_atom) {
      // A republish waits for the supervisor to attach a fresh runtime.
      auto& st = self->state;
      if (!st.retry)
        return;
      self->request(st.engine, engine_timeout(st, st.opts.timeouts_ms.describe), status_atom::value)
        .then(
          [self](engine_status& s) {
            auto& st = self->state;
            if (!st.retry)
              return;
            auto& r = *st.retry;
            if (s.incarnation > r.failed_incarnation && s.conn() == connection_state::idle) {
              auto retry = std::move(r);
              st.retry.reset();
              start_attempt(self, retry.version, retry.rp, retry.next_attempt, retry.errors);
            } else if (s.gave_up
                       || journal::draw(self, st.opts.journal, "republish_deadline_passed",
                                        clock_type::now() > r.deadline)) {
              auto retry = std::move(r);
              st.retry.reset();
              retry.rp.deliver(retry.last_error);
            } else {
              self->delayed_send(self, std::chrono::milliseconds(20), restart_atom::value);
            }
          },
          [self](caf::error&) {
            auto& st = self->state;
            if (!st.retry)
              return;
            auto retry = std::move(*st.retry);
            st.retry.reset();
            retry.rp.deliver(retry.last_error);
          });
    },
    [=](status_atom) { return self->state.status(); },
    [=](done_atom, const std::string& id, std::vector<receipt>& sums, const std::string& error) {
      auto& st = self->state;
      auto ctx = st.ctx;
      if (!ctx || ctx->id != id)
        return;
      ctx->expected_checksums = std::move(sums);
      ctx->verify_error = error;
      ctx->verify_done = true;
      if (ctx->commit_waiting_for_verify)
        check_verification(self, ctx);
    },
  };
}

} // namespace refit
