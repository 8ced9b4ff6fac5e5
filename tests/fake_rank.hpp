// A scripted stand-in for a TrainerRank on CAF's test_coordinator: no threads, no buffers, no
// collective. It answers `describe` and `step` like a rank on fake_device_uuids()[rank], and
// reports every publication phase to the gate with what a real rank would report (the chunk
// plan's tensor metas, a handle per chunk, the expected manifest), unless the shared
// `rank_script` makes it fail or stay silent in one phase. Every message any fake rank
// receives is logged in order, so a test can check what the ranks were asked to do after a
// failure.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/interfaces.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/publication/chunk_plan.hpp"
#include "tests/fake_proxy.hpp"

namespace refit_test {

struct rank_event {
  std::uint32_t rank = 0;
  std::string publication;
  std::string what; // describe, step, prepare, materialize, transferred, manifest, final, abort
  std::uint32_t chunk = 0;
};

struct rank_script {
  // One-shot faults: the first publication that reaches (rank, phase, chunk) fails there
  // (`silent`: the rank never reports; otherwise it reports !ok).
  struct fault {
    std::uint32_t rank = 0;
    refit::phase_kind phase = refit::phase_kind::prepare;
    std::uint32_t chunk = 0;
    bool silent = false;
    bool spent = false;
  };
  std::vector<fault> faults;
  std::vector<rank_event> log; // every message any fake rank received, in order

  // Index of the first abort of `publication` in the log (log.size() if none).
  std::size_t first_abort(const std::string& publication) const {
    for (std::size_t i = 0; i < log.size(); ++i)
      if (log[i].what == "abort" && log[i].publication == publication)
        return i;
    return log.size();
  }
  // The first publication any rank heard of (prepare, or the abort of one that failed
  // before it prepared).
  std::string first_publication() const {
    for (const auto& e : log)
      if (!e.publication.empty())
        return e.publication;
    return {};
  }
};

struct fake_rank_state {
  static inline const char* name = "FakeTrainerRank";
  std::uint32_t rank = 0;
  std::uint32_t world = 1;
  refit::model::model_config model;
  refit::consensus_gate_actor gate;
  std::shared_ptr<rank_script> script;
  std::uint64_t step = 0;
  std::string session;
  refit::publication::chunk_plan plan;
  std::uint32_t buffer_count = 2;
};

using fake_rank_self = refit::trainer_rank_actor::stateful_pointer<fake_rank_state>;

namespace detail {

inline void rank_log(fake_rank_self self, const std::string& pub, const std::string& what,
                     std::uint32_t chunk = 0) {
  self->state.script->log.push_back({self->state.rank, pub, what, chunk});
}

// Reports `r` unless a fault of this rank at this phase says otherwise.
inline void rank_report_to_gate(fake_rank_self self, refit::rank_report r) {
  auto& st = self->state;
  for (auto& f : st.script->faults) {
    if (f.spent || f.rank != st.rank || f.phase != r.phase.k() || f.chunk != r.phase.chunk)
      continue;
    f.spent = true;
    if (f.silent)
      return;
    r.ok = false;
    r.error = "injected failure of rank " + std::to_string(st.rank) + " at "
              + refit::to_string(r.phase);
    r.tensors.clear();
    r.handles.clear();
    break;
  }
  self->send(st.gate, refit::report_atom::value, std::move(r));
}

inline refit::rank_report ok_report(fake_rank_self self, const std::string& pub,
                                    refit::phase_kind k, std::uint32_t chunk) {
  refit::rank_report r;
  r.phase = refit::phase_id{pub, static_cast<std::uint8_t>(k), chunk};
  r.rank = self->state.rank;
  r.ok = true;
  return r;
}

} // namespace detail

inline refit::trainer_rank_actor::behavior_type
fake_rank(fake_rank_self self, std::uint32_t rank, std::uint32_t world,
          refit::model::model_config model, refit::consensus_gate_actor gate,
          std::shared_ptr<rank_script> script) {
  using namespace refit;
  using detail::ok_report;
  using detail::rank_log;
  using detail::rank_report_to_gate;
  auto& st = self->state;
  st.rank = rank;
  st.world = world;
  st.model = std::move(model);
  st.gate = std::move(gate);
  st.script = std::move(script);
  return {
    [=](describe_atom) {
      auto& st = self->state;
      rank_log(self, st.session, "describe");
      rank_info ri;
      ri.rank = st.rank;
      ri.world = st.world;
      ri.device = "cpu:" + std::to_string(st.rank);
      ri.device_uuid = fake_device_uuids().at(st.rank);
      ri.free_bytes = std::uint64_t{1} << 40;
      ri.step = st.step;
      ri.shard_bytes = 1000;
      return ri;
    },
    [=](step_atom) -> caf::result<std::uint64_t> {
      auto& st = self->state;
      rank_log(self, st.session, "step");
      if (!st.session.empty())
        return make_refit_error(errc::invalid_state, "step", "a publication session is open");
      return ++st.step;
    },
    [=](prepare_atom, const publication_spec& spec) {
      auto& st = self->state;
      rank_log(self, spec.publication_id, "prepare");
      st.session = spec.publication_id;
      st.buffer_count = spec.buffer_count;
      st.plan = publication::plan_chunks(model::expected_key_stream(st.model), spec.buffer_bytes,
                                         st.world);
      auto r = ok_report(self, spec.publication_id, phase_kind::prepare, 0);
      if (spec.world != st.world || st.plan.chunks.size() != spec.chunk_count) {
        r.ok = false;
        r.error = "the spec does not match this rank's plan";
      }
      rank_report_to_gate(self, std::move(r));
    },
    [=](materialize_atom, const std::string& id, std::uint32_t k) {
      auto& st = self->state;
      rank_log(self, id, "materialize", k);
      auto r = ok_report(self, id, phase_kind::materialize, k);
      if (id != st.session || k >= st.plan.chunks.size()) {
        r.ok = false;
        r.error = "no session or chunk out of range";
      } else {
        for (const auto& t : st.plan.chunks[k].tensors) {
          tensor_meta tm;
          tm.name = t.meta.name;
          tm.shape = t.meta.shape;
          tm.dtype = static_cast<std::uint8_t>(t.meta.dt);
          tm.offset = t.offset;
          tm.nbytes = t.meta.nbytes();
          r.tensors.push_back(std::move(tm));
        }
        buffer_handle h;
        h.device_uuid = fake_device_uuids().at(st.rank);
        h.buffer_index = k % st.buffer_count;
        h.handle = "fake:" + std::to_string(st.rank) + ":" + std::to_string(k);
        h.size = st.plan.buffer_bytes;
        r.handles.push_back(std::move(h));
      }
      rank_report_to_gate(self, std::move(r));
    },
    [=](transferred_atom, const std::string& id, std::uint32_t k) {
      rank_log(self, id, "transferred", k);
      rank_report_to_gate(self, ok_report(self, id, phase_kind::transfer, k));
    },
    [=](manifest_atom, const std::string& id) {
      auto& st = self->state;
      rank_log(self, id, "manifest");
      auto r = ok_report(self, id, phase_kind::manifest, 0);
      auto expected = model::expected_key_stream(st.model);
      r.fingerprint = model::structural_manifest(expected);
      r.tensor_count = expected.size();
      rank_report_to_gate(self, std::move(r));
    },
    [=](final_atom, const publication_result& res) {
      auto& st = self->state;
      rank_log(self, res.publication_id, "final");
      st.session.clear();
      rank_report_to_gate(self, ok_report(self, res.publication_id, phase_kind::final, 0));
    },
    [=](abort_atom, const gate_failure& g) {
      auto& st = self->state;
      rank_log(self, g.phase.publication_id, "abort", g.phase.chunk);
      if (st.session == g.phase.publication_id)
        st.session.clear();
    },
  };
}

} // namespace refit_test
