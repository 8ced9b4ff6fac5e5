#include "actors/trainer_rank.hpp"
#include "actors/trainer_rank_parts.hpp"

#include <unistd.h>

#include <algorithm>

#include <caf/actor_cast.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "runtime/device/device.hpp"
#include "runtime/trace/trace.hpp"

namespace refit {

using self_ptr = trainer_rank_impl::stateful_pointer<trainer_rank_state>;

rank_info trainer_rank_state::info(std::uint64_t free_bytes) const {
  rank_info out;
  out.rank = opts.rank;
  out.world = opts.world;
  out.device = opts.device;
  out.device_uuid = uuid;
  out.free_bytes = free_bytes;
  out.step = step;
  out.shard_bytes = opts.registered ? opts.registered->bytes() : shards ? shards->bytes() : 0;
  out.peak_materialized_bytes = peak_materialized_bytes;
  out.pid = static_cast<std::uint32_t>(::getpid());
  out.weight_source = opts.registered ? "registered" : "synthetic";
  return out;
}

namespace trainer_rank_parts {

const config::trainer_fault* find_fault(const rank_session& s, const std::string& kind) {
  for (const auto& f : s.faults)
    if (f.kind == kind)
      return &f;
  return nullptr;
}

rank_report failed(rank_report r, std::string error) {
  r.ok = false;
  r.error = std::move(error);
  return r;
}

emitted_tensor emitted_at(const source_view& shards, const rank_session& s, std::size_t pos) {
  emitted_tensor out;
  const auto& meta = shards.params()[s.stream[pos]];
  const auto* wrong_shape = find_fault(s, "wrong_shape");
  if (wrong_shape && wrong_shape->tensor == meta.name && !meta.shape.empty()) {
    out.bent = meta;
    out.bent.shape[0] += 1;
  } else {
    out.meta = &meta;
  }
  return out;
}

namespace {

std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

} // namespace

std::string emission_error(const model::param_meta& emitted, const model::param_meta& planned) {
  if (emitted.name != planned.name)
    return "emitted " + emitted.name + " where the plan expects " + planned.name;
  if (emitted.shape != planned.shape || emitted.dt != planned.dt)
    return planned.name + ": emitted shape " + shape_string(emitted.shape) + " "
           + model::dtype_name(emitted.dt) + ", the plan expects " + shape_string(planned.shape)
           + " " + model::dtype_name(planned.dt);
  return {};
}

} // namespace trainer_rank_parts

namespace {

using namespace trainer_rank_parts;

rank_report make_report(const trainer_rank_state& st, const std::string& pub, phase_kind kind,
                        std::uint32_t chunk) {
  rank_report r;
  r.phase = phase_id{pub, static_cast<std::uint8_t>(kind), chunk};
  r.rank = st.opts.rank;
  r.ok = true;
  return r;
}

source_view view_of(const trainer_rank_options& o,
                    const std::shared_ptr<publication::shard_store>& shards) {
  return {shards.get(), o.registered.get()};
}

// Worker-thread side of `prepare`: independent re-planning and buffer allocation.
rank_report run_prepare(const trainer_rank_options& o, const source_view& shards,
                        const std::string& storage_error, rank_session& s, rank_report r) {
  trace::span traced(trace::tracks::trainer_rank(o.rank), "prepare");
  try {
    if (!shards.ready())
      return failed(r, "this rank's shards could not be allocated: " + storage_error);
    if (s.spec.world != o.world)
      return failed(r, "publication is for " + std::to_string(s.spec.world)
                         + " trainer ranks, this rank is one of " + std::to_string(o.world));
    auto expected = model::expected_key_stream(o.model);
    auto fingerprint = model::structural_manifest(expected);
    if (fingerprint != s.spec.manifest_fingerprint || expected.size() != s.spec.tensor_count)
      return failed(r, "this rank's expected schema (" + std::to_string(expected.size())
                         + " tensors, manifest " + fingerprint.substr(0, 12)
                         + ") differs from the publication's (" + std::to_string(s.spec.tensor_count)
                         + " tensors, manifest " + s.spec.manifest_fingerprint.substr(0, 12) + ")");
    // Direct mode groups canonical tensors by their own bytes (no gather slots).
    s.plan = publication::plan_chunks(expected, s.spec.buffer_bytes,
                                      s.spec.mode == "direct" ? 1 : o.world);
    if (s.plan.chunks.size() != s.spec.chunk_count)
      return failed(r, "this rank plans " + std::to_string(s.plan.chunks.size())
                         + " chunks, the coordinator " + std::to_string(s.spec.chunk_count));
    // The exporter's stream: every shard in canonical order, minus test-only drops.
    const auto* drop = find_fault(s, "drop_tensor");
    for (std::size_t i = 0; i < shards.params().size(); ++i)
      if (!drop || shards.params()[i].name != drop->tensor)
        s.stream.push_back(i);
    s.manifest = std::make_unique<model::manifest_stream>(s.spec.tensor_count);
    if (s.spec.mode == "direct") {
      // Direct mode: no packed buffers; every TP worker's resident arena, opened once, and
      // every chunk's moves planned.
      r = prepare_direct(o, shards, s, std::move(r));
      if (!r.ok)
        return r;
    } else {
      s.pool = publication::make_buffer_pool(shards.device(), s.spec.buffer_count,
                                             s.spec.buffer_bytes);
    }
    auto deadline = std::chrono::steady_clock::now()
                    + std::chrono::milliseconds(o.collective_timeout_ms);
    if (auto status = s.coll->prepare(o.rank, deadline); !status.ok)
      return failed(r, "collective: " + status.error);
    return r;
  } catch (const std::exception& e) {
    return failed(r, std::string("prepare: ") + e.what());
  }
}

// Worker-thread side of `materialize`: every emitted tensor of the chunk checked against the
// plan before anything is written (a failing rank must not strand the others inside the
// collective); then, packed, one grouped all-gather straight into the packed buffer, or,
// direct, the chunk's planned copies started, the chunk's metadata recorded while they run,
// and their completion awaited.
rank_report run_materialize(const trainer_rank_options& o, const std::string& uuid,
                            const source_view& shards, rank_session& s,
                            std::uint32_t k, rank_report r) {
  trace::span traced(trace::tracks::trainer_rank(o.rank), "materialize", {{"chunk", k}});
  if (k >= s.plan.chunks.size())
    return failed(r, "chunk " + std::to_string(k) + " is not in the plan ("
                       + std::to_string(s.plan.chunks.size()) + " chunks)");
  if (const auto* f = find_fault(s, "fail_materialize"); f && f->chunk == k)
    return failed(r, "injected materialization failure at chunk " + std::to_string(k));
  const auto& chunk = s.plan.chunks[k];
  std::vector<emitted_tensor> emitted; // what the exporter emits for the chunk, checked first
  emitted.reserve(chunk.tensors.size());
  for (std::size_t j = 0; j < chunk.tensors.size(); ++j) {
    const auto& planned = chunk.tensors[j].meta;
    if (s.cursor + j >= s.stream.size())
      return failed(r, "the exporter ran out of tensors where the plan expects " + planned.name);
    emitted.push_back(emitted_at(shards, s, s.cursor + j));
    if (auto why = emission_error(emitted.back().get(), planned); !why.empty())
      return failed(r, why);
  }
  const bool direct = s.spec.mode == "direct";
  const auto copy_start = trace::start();
  if (direct) {
    r = start_direct(s, k, std::move(r));
    if (!r.ok)
      return r;
  }
  auto slot = direct ? 0 : k % s.pool->count();
  std::byte* buffer = direct ? nullptr : s.pool->data(slot);
  std::vector<publication::gather_item> items;
  std::string record_error;
  try {
    for (std::size_t j = 0; j < chunk.tensors.size(); ++j) {
      const auto& planned = chunk.tensors[j];
      const auto index = s.stream[s.cursor++];
      s.emitted.push_back(emitted[j].get());
      s.manifest->add(emitted[j].get());
      if (!direct)
        items.push_back(shards.item(index, buffer + planned.offset));
      tensor_meta tm;
      tm.name = planned.meta.name;
      tm.shape = planned.meta.shape;
      tm.dtype = static_cast<std::uint8_t>(planned.meta.dt);
      tm.offset = direct ? 0 : planned.offset;
      tm.nbytes = planned.meta.nbytes();
      r.tensors.push_back(std::move(tm));
    }
  } catch (const std::exception& e) {
    record_error = e.what();
  }
  if (direct) {
    r = finish_direct(s, k, std::move(r)); // waited for even when recording failed
    trace::complete(trace::tracks::trainer_rank(o.rank), "copy", copy_start,
                    {{"chunk", k}, {"copies", s.direct[k].copies}, {"ok", r.ok}});
  }
  if (!record_error.empty())
    return failed(r, "chunk " + std::to_string(k) + "'s tensor metadata: " + record_error);
  if (direct)
    return r;
  auto deadline = std::chrono::steady_clock::now()
                  + std::chrono::milliseconds(o.collective_timeout_ms);
  const auto gather_start = trace::start();
  auto status = s.coll->all_gather(o.rank, items, deadline);
  trace::complete(trace::tracks::trainer_rank(o.rank), "gather", gather_start,
                  {{"chunk", k}, {"tensors", items.size()}, {"ok", status.ok}});
  if (!status.ok)
    return failed(r, "all-gather of chunk " + std::to_string(k) + ": " + status.error);
  buffer_handle h;
  h.device_uuid = uuid;
  h.buffer_index = slot;
  h.handle = s.pool->handle(slot);
  h.size = s.pool->bytes();
  r.handles.push_back(std::move(h));
  return r;
}

// --trace: the packed bytes this rank holds (one series per rank: double buffering shows as
// two chunks held at once).
void trace_packed(std::uint32_t rank, const std::map<std::uint32_t, std::uint64_t>& packed) {
  if (!trace::enabled())
    return;
  std::uint64_t held = 0;
  for (const auto& [chunk, b] : packed)
    held += b;
  trace::counter(trace::tracks::trainer_rank(rank), "packed bytes rank " + std::to_string(rank),
                 {{"bytes", held}});
}

void report(self_ptr self, rank_report r) {
  self->send(self->state.opts.gate, report_atom::value, std::move(r));
}

} // namespace

trainer_rank_impl::behavior_type trainer_rank(self_ptr self, trainer_rank_options opts) {
  auto& st = self->state;
  st.opts = std::move(opts);
  auto dev = device::parse(st.opts.device, "trainer device");
  if (!st.opts.device_uuid.empty())
    st.uuid = st.opts.device_uuid;
  else if (dev.k == device::kind::cpu)
    st.uuid = publication::device_uuid(dev);
  else
    throw std::invalid_argument(st.opts.device + ": trainer_rank_options.device_uuid must be "
                                "resolved by the spawner for CUDA devices");
  if (st.opts.registered) {
    const auto& reg = *st.opts.registered;
    if (!reg.sealed() || reg.world() != st.opts.world || reg.rank() != st.opts.rank)
      throw std::invalid_argument("trainer rank " + std::to_string(st.opts.rank)
                                  + ": registered weights must be sealed, for this rank and world");
  } else {
    st.shards = std::make_shared<publication::shard_store>(
      model::expected_key_stream(st.opts.model), st.opts.world, st.opts.rank, st.opts.weights,
      dev, /*allocate_now=*/false);
  }
  for (const auto& f : st.opts.faults)
    st.faults.push_back({f, false});
  st.worker = std::make_unique<worker_thread>();
  // The shards' storage (on a GPU: a large cudaMalloc and one kernel per tensor) is built on
  // the worker thread, before any job that reads it; a failure is reported by prepare.
  if (st.shards)
    st.worker->post([shards = st.shards, error = st.storage_error] {
      try {
        shards->allocate();
      } catch (const std::exception& e) {
        *error = e.what();
      }
    });
  // Worker results come back as messages; the thread holds only a weak reference.
  caf::actor_addr weak = self->address();
  auto post_back = [weak](auto... xs) {
    if (auto hdl = caf::actor_cast<trainer_rank_impl>(weak))
      caf::anon_send(hdl, xs...);
  };
  return {
    [=](describe_atom) -> caf::result<rank_info> {
      // Free device memory is read on the worker thread (on a GPU: cudaMemGetInfo, which may
      // create the CUDA context), never on a scheduler thread.
      auto& st = self->state;
      auto rp = self->make_response_promise<rank_info>();
      auto job = st.next_job++;
      st.describes.emplace(job, rp);
      st.worker->post([device = st.opts.device, job, post_back] {
        std::uint64_t free = 0;
        try {
          free = publication::device_free_bytes(device::parse(device, "trainer device"));
        } catch (const std::exception&) {
          free = 0; // reported as no free memory: preflight refuses the publication
        }
        post_back(done_atom::value, job, free);
      });
      return rp;
    },
    [=](step_atom) -> caf::result<std::uint64_t> {
      auto& st = self->state;
      if (st.session)
        return make_refit_error(errc::invalid_state, "step",
                                "an optimizer step during publication '"
                                  + st.session->spec.publication_id
                                  + "' would change weights that are being published");
      if (st.opts.registered) // the trainer stepped its own tensors: count it
        return ++st.step;
      auto rp = self->make_response_promise<std::uint64_t>();
      auto job = st.next_job++;
      st.steps.emplace(job, rp);
      st.worker->post([shards = st.shards, job, post_back] {
        if (shards->ready())
          shards->apply_step(); // otherwise prepare reports the allocation failure
        post_back(done_atom::value, job, shards->step());
      });
      return rp;
    },
    [=](done_atom, std::uint32_t job, std::uint64_t value) {
      auto& st = self->state;
      if (auto it = st.steps.find(job); it != st.steps.end()) {
        st.step = value;
        it->second.deliver(value);
        st.steps.erase(it);
      } else if (auto d = st.describes.find(job); d != st.describes.end()) {
        d->second.deliver(st.info(value));
        st.describes.erase(d);
      }
    },
    [=](prepare_atom, const publication_spec& spec) {
      auto& st = self->state;
      auto r = make_report(st, spec.publication_id, phase_kind::prepare, 0);
      if (st.session && st.session->spec.publication_id != spec.publication_id) {
        report(self, failed(r, "publication '" + st.session->spec.publication_id
                                 + "' is still open on this rank"));
        return;
      }
      auto session = std::make_shared<rank_session>();
      session->spec = spec;
      session->coll = st.opts.collectives->for_publication(spec.publication_id);
      // Arm this rank's test-only faults; one-shot faults are spent by this publication.
      for (auto& f : st.faults)
        if (f.fault.repeat || !f.spent) {
          session->faults.push_back(f.fault);
          f.spent = true;
        }
      st.session = session;
      st.last_transferred = -1;
      st.last_requested = -1;
      st.packed.clear();
      st.worker->post([o = st.opts, shards = st.shards, error = st.storage_error, session, r,
                       post_back]() mutable {
        post_back(done_atom::value,
                  run_prepare(o, view_of(o, shards), *error, *session, std::move(r)));
      });
    },
    [=](materialize_atom, const std::string& pub, std::uint32_t k) {
      auto& st = self->state;
      auto r = make_report(st, pub, phase_kind::materialize, k);
      if (!st.session || st.session->spec.publication_id != pub) {
        report(self, failed(r, "no open publication '" + pub + "' on this rank"));
        return;
      }
      // Chunks in order; bounded memory: with B buffers, chunk k is materialized only after
      // chunk k - B was transferred (its buffer, k mod B, is free again). B = 2 is double
      // buffering: chunk k + 1 is gathered while the runtime loads chunk k.
      const auto buffers = static_cast<std::int64_t>(st.session->spec.buffer_count);
      if (static_cast<std::int64_t>(k) != st.last_requested + 1
          || static_cast<std::int64_t>(k) > st.last_transferred + buffers) {
        report(self, failed(r, "materialize[" + std::to_string(k) + "] requested after chunk "
                                 + std::to_string(st.last_requested) + " with "
                                 + std::to_string(st.last_transferred)
                                 + " the last transferred chunk and "
                                 + std::to_string(buffers) + " buffers"));
        return;
      }
      st.last_requested = k;
      if (const auto* f = find_fault(*st.session, "never_report"); f && f->chunk == k)
        return; // test-only: this rank stays silent; the gate's deadline must catch it
      st.worker->post([o = st.opts, uuid = st.uuid, shards = st.shards, session = st.session, k,
                       r, post_back]() mutable {
        post_back(done_atom::value,
                  run_materialize(o, uuid, view_of(o, shards), *session, k, std::move(r)));
      });
    },
    [=](done_atom, rank_report& r) {
      auto& st = self->state;
      if (!st.session || st.session->spec.publication_id != r.phase.publication_id)
        return; // aborted meanwhile: the gate already failed this publication
      if (r.ok && r.phase.k() == phase_kind::materialize && st.session->spec.mode != "direct") {
        std::uint64_t bytes = 0;
        for (const auto& t : r.tensors)
          bytes = std::max<std::uint64_t>(bytes, t.offset + t.nbytes);
        st.packed[r.phase.chunk] = bytes;
        std::uint64_t held = 0;
        for (const auto& [chunk, b] : st.packed)
          held += b;
        st.peak_materialized_bytes = std::max(st.peak_materialized_bytes, held);
        trace_packed(st.opts.rank, st.packed);
      }
      report(self, std::move(r));
    },
    [=](transferred_atom, const std::string& pub, std::uint32_t k) {
      auto& st = self->state;
      auto r = make_report(st, pub, phase_kind::transfer, k);
      if (!st.session || st.session->spec.publication_id != pub) {
        report(self, failed(r, "no open publication '" + pub + "' on this rank"));
        return;
      }
      if (static_cast<std::int64_t>(k) != st.last_transferred + 1
          || static_cast<std::int64_t>(k) > st.last_requested) {
        report(self, failed(r, "transferred[" + std::to_string(k) + "] out of order (last "
                                 "transferred " + std::to_string(st.last_transferred) + ")"));
        return;
      }
      st.last_transferred = k;
      // The runtime finished reading chunk k's buffer.
      st.packed.erase(k);
      trace::instant(trace::tracks::trainer_rank(st.opts.rank), "transferred", {{"chunk", k}});
      trace_packed(st.opts.rank, st.packed);
      report(self, std::move(r));
    },
    [=](manifest_atom, const std::string& pub) {
      auto& st = self->state;
      auto r = make_report(st, pub, phase_kind::manifest, 0);
      if (!st.session || st.session->spec.publication_id != pub) {
        report(self, failed(r, "no open publication '" + pub + "' on this rank"));
        return;
      }
      bool forge = find_fault(*st.session, "wrong_manifest") != nullptr;
      bool forge_terms = find_fault(*st.session, "wrong_digest_terms") != nullptr;
      st.worker->post([session = st.session, r, forge, forge_terms, post_back,
                       model = st.opts.model, registered = st.opts.registered,
                       rank = st.opts.rank]() mutable {
        trace::span traced(trace::tracks::trainer_rank(rank), "manifest");
        try {
          // Hashed chunk by chunk already; the whole stream again only where it is not the
          // planned count (and for the test-only forged manifest).
          auto streamed = session->manifest->finish();
          if (forge && !session->emitted.empty()) {
            auto emitted = session->emitted;
            emitted.pop_back();
            r.fingerprint = model::structural_manifest(emitted);
            r.tensor_count = emitted.size();
          } else {
            r.fingerprint = streamed ? *streamed : model::structural_manifest(session->emitted);
            r.tensor_count = session->emitted.size();
          }
        } catch (const std::exception& e) {
          r = failed(r, std::string("manifest: ") + e.what());
        }
        if (registered && session->spec.verify) {
          // The verifier's share of this rank: digest terms of the bytes it contributed, read
          // again from the registered memory after the gather (memory the trainer changed
          // during the publication shows up as a verification failure).
          try {
            const model::tp_layout layout(model, session->spec.tp);
            const std::vector<std::size_t> sent(session->stream.begin(),
                                                session->stream.begin() + session->cursor);
            r.digest_terms = registered->partial_digests(layout, sent);
            if (forge_terms && !r.digest_terms.empty())
              r.digest_terms.front() += 1; // test-only: memory that changed after the gather
          } catch (const std::exception& e) {
            r = failed(r, std::string("digest terms: ") + e.what());
          }
        }
        post_back(done_atom::value, std::move(r));
      });
    },
    [=](final_atom, const publication_result& res) {
      auto& st = self->state;
      auto r = make_report(st, res.publication_id, phase_kind::final, 0);
      if (!st.session || st.session->spec.publication_id != res.publication_id) {
        report(self, failed(r, "no open publication '" + res.publication_id + "' on this rank"));
        return;
      }
      const auto& spec = st.session->spec;
      if (find_fault(*st.session, "reject_final"))
        r = failed(r, "injected rejection of the final result");
      else if (res.model_version != spec.model_version)
        r = failed(r, "committed version " + std::to_string(res.model_version)
                        + ", this rank published " + std::to_string(spec.model_version));
      else if (res.manifest_fingerprint != spec.manifest_fingerprint)
        r = failed(r, "committed manifest differs from the one this rank published");
      st.session.reset(); // buffers released: nothing outlives the publication
      trace::instant(trace::tracks::trainer_rank(st.opts.rank), "final", {{"ok", r.ok}});
      report(self, std::move(r));
    },
    [=](abort_atom, const gate_failure& failure) {
      auto& st = self->state;
      if (!st.session || st.session->spec.publication_id != failure.phase.publication_id)
        return;
      // Wake a worker stuck in the collective; the session (buffers) dies with the last job.
      if (st.session->coll)
        st.session->coll->abort("publication failed at " + to_string(failure.phase) + " (rank "
                                + std::to_string(failure.rank) + "): " + failure.error);
      st.session.reset();
      st.packed.clear();
      trace::instant(trace::tracks::trainer_rank(st.opts.rank), "abort",
                     {{"error", failure.error}});
    },
  };
}

} // namespace refit
