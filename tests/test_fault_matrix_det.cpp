// The fault matrix on CAF's test_coordinator (CTest label `faults`): the real SyncCoordinator,
// ConsensusGate, RolloutEngine and RolloutSupervisor, scripted runtime proxies
// (tests/fake_proxy.hpp) and trainer ranks (tests/fake_rank.hpp), no processes, no threads, the
// test clock. Every publication transition point x fault kind of the issue: the runtime
// answers an error, hangs (request timeout), crashes (the proxy exits: DOWN), answers garbage
// (the proxy breaks with protocol_error) or a well-formed but wrong answer (typed validation
// error); one rank fails a phase or never reports it. Each case must
//   - fail the first attempt with nothing committed: the coordinator's and the engine's
//     version stay 0, the engine needs a publication and refuses generation, the poisoned
//     runtime is gone, every rank got the abort, and no rank was asked to materialize anything
//     of that publication after the first abort (the gate's proof);
//   - then restart the runtime and republish the same version, which commits on the fresh
//     runtime (attempts = 2), after which generation is stamped with the new version;
//   - and the whole run, recorded in the journal, replays deterministically (refit-replay).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <unistd.h>

#include "runtime/system/bootstrap.hpp"
#include "runtime/journal/journal_file.hpp"
#include "runtime/system/replay.hpp"
#include "tests/actor_fixture.hpp"
#include "tests/fake_proxy.hpp"
#include "tests/fake_rank.hpp"

namespace {

using namespace refit;
using namespace refit_test;
using std::chrono::milliseconds;

enum class fault_kind { error, hang, crash, corrupt, bad_answer, forged_receipt, rank_fails, rank_silent };

const char* name_of(fault_kind k) {
  switch (k) {
    case fault_kind::error: return "error";
    case fault_kind::hang: return "hang";
    case fault_kind::crash: return "crash";
    case fault_kind::corrupt: return "corrupt";
    case fault_kind::bad_answer: return "bad_answer";
    case fault_kind::forged_receipt: return "forged_receipt";
    case fault_kind::rank_fails: return "rank_fails";
    case fault_kind::rank_silent: return "rank_silent";
  }
  return "?";
}

struct matrix_case {
  std::string point;      // runtime command, or a rank phase
  std::uint32_t chunk;    // update_weights / materialize / transfer: which chunk
  fault_kind kind;
  std::string expect;     // in the first attempt's error
};

config::refit_config det_config(const std::string& journal_path) {
  auto cfg = config::load_file(std::string(REFIT_SOURCE_DIR) + "/configs/tiny-synthetic.yaml");
  cfg.publication.verify = false;          // the verifier's worker thread has no place here
  cfg.publication.memory_headroom_bytes = 0;
  cfg.publication.gate_deadline_ms = 500;
  cfg.publication.republish_attempts = 1;
  cfg.supervisor.backoff_initial_ms = 20;
  cfg.supervisor.backoff_max_ms = 100;
  cfg.runtime.kill_grace_ms = 10;
  cfg.journal.enabled = true;
  cfg.journal.path = journal_path;
  config::validate(cfg);
  return cfg;
}

class FaultMatrixDet : public actor_fixture, public ::testing::WithParamInterface<matrix_case> {
protected:
  FaultMatrixDet()
    : journal_path("/tmp/refit-det-matrix-" + std::to_string(::getpid()) + ".journal"),
      cfg(det_config(journal_path)),
      ranks_script(std::make_shared<rank_script>()) {}

  ~FaultMatrixDet() override { std::remove(journal_path.c_str()); }

  proxy_factory factory() {
    return [this](caf::actor_system& s, std::uint64_t n) -> runtime_proxy_actor {
      auto sc = std::make_shared<fake_script>();
      sc->incarnation = n;
      scripts.push_back(sc);
      auto p = s.spawn(fake_proxy, sc);
      track(p);
      return p;
    };
  }

  void start() {
    rollout = spawn_rollout(sys, cfg, factory());
    track(rollout.engine);
    track(rollout.supervisor);
    sched.run();
    auto gate = spawn_gate(sys, rollout.journal);
    track(gate);
    std::vector<trainer_rank_actor> ranks;
    for (std::uint32_t r = 0; r < cfg.runtime.tp_size; ++r) {
      auto h = sys.spawn(fake_rank, r, cfg.runtime.tp_size, cfg.model, gate, ranks_script);
      track(h);
      ranks.push_back(h);
    }
    pub = spawn_coordinator(sys, cfg, rollout.engine, gate, ranks, rollout.journal);
    track(pub.coordinator);
    sched.run();
  }

  // Arms the case's fault in the first runtime (after its attach describe) or in the ranks.
  void arm(const matrix_case& c) {
    auto& sc = *scripts.at(0);
    auto injected = make_refit_error(errc::runtime_injected, c.point, "injected by the test");
    switch (c.kind) {
      case fault_kind::error: sc.fail[c.point] = injected; break;
      case fault_kind::hang: sc.hold.insert(c.point); break;
      case fault_kind::crash:
        sc.die[c.point] = make_refit_error(errc::runtime_exited, c.point,
                                           "the runtime process killed by signal 9");
        break;
      case fault_kind::corrupt:
        sc.die[c.point] = make_refit_error(errc::protocol_error, "frame",
                                           "bad magic 0x00000000 (runtime killed by signal 9)");
        break;
      case fault_kind::bad_answer:
        if (c.point == "describe")
          sc.tamper_describe = [](runtime_description& d) {
            d.workers[1].device_uuid = d.workers[0].device_uuid;
          };
        else if (c.point == "init_weight_transfer")
          sc.tamper_init = [](std::string& t) { t = "cuda_ipc"; };
        else if (c.point == "start_weight_update")
          sc.tamper_start = [](std::string& id) { id += "-other"; };
        else if (c.point == "update_weights")
          sc.tamper_ack = [n = std::make_shared<std::uint32_t>(0), k = c.chunk](chunk_ack& a) {
            if ((*n)++ == k)
              a.tensors_loaded += 1;
          };
        else if (c.point == "finish_weight_update")
          sc.tamper_commit = [](commit_result& r) { r.prefix_cache_reset = false; };
        break;
      case fault_kind::forged_receipt:
        sc.tamper_commit = [](commit_result& r) {
          r.receipts.back().device_uuid = "GPU-forged";
        };
        break;
      case fault_kind::rank_fails:
      case fault_kind::rank_silent: {
        rank_script::fault f;
        f.rank = 1;
        f.phase = c.point == "prepare"       ? phase_kind::prepare
                  : c.point == "materialize" ? phase_kind::materialize
                  : c.point == "transfer"    ? phase_kind::transfer
                  : c.point == "manifest"    ? phase_kind::manifest
                                             : phase_kind::final;
        f.chunk = c.chunk;
        f.silent = c.kind == fault_kind::rank_silent;
        ranks_script->faults.push_back(f);
        break;
      }
    }
    if (c.point == "update_weights")
      sc.skip[c.point] = c.chunk; // the (chunk+1)-th update_weights
  }

  // Advances the test clock in 20 ms steps until `pred` holds (at most `limit`, more than the
  // engine's longest request timeout: command + startup + kill grace + 5 s).
  template <class Pred>
  bool run_until(Pred pred, milliseconds limit = milliseconds(180000)) {
    sched.run();
    for (milliseconds t{0}; t < limit; t += milliseconds(20)) {
      if (pred())
        return true;
      advance(milliseconds(20));
    }
    return pred();
  }

  engine_status engine() { return ask<engine_status>(rollout.engine, status_atom::value)->value; }
  coordinator_status coordinator() {
    return ask<coordinator_status>(pub.coordinator, status_atom::value)->value;
  }

  std::string journal_path;
  config::refit_config cfg;
  std::shared_ptr<rank_script> ranks_script;
  std::vector<std::shared_ptr<fake_script>> scripts;
  rollout_handles rollout;
  publication_handles pub;
};

TEST_P(FaultMatrixDet, FailsStopsRepublishesAndReplays) {
  const auto c = GetParam();
  start();
  ASSERT_EQ(state_of(engine()), "IDLE");
  ASSERT_TRUE(ask<engine_status>(rollout.engine, sleep_atom::value, std::uint32_t{2})->ok());
  ASSERT_TRUE(ask<engine_status>(rollout.engine, wake_atom::value, wake_tags::only_weights())->ok());
  arm(c);
  auto res = send_request<publication_result>(pub.coordinator, publish_atom::value,
                                              std::uint64_t{1});

  // -- the failed attempt: wait for the first abort to reach a rank, then let everything that
  //    does not need the clock settle (the restart and the republish poll wait on timers).
  ASSERT_TRUE(run_until([&] {
    auto first = ranks_script->first_publication();
    return !first.empty() && ranks_script->first_abort(first) < ranks_script->log.size();
  })) << "the fault never failed the publication";
  sched.run();
  ASSERT_FALSE(res->done) << "the caller is answered only after the republish";
  const auto failed_id = ranks_script->first_publication();
  auto cs = coordinator();
  EXPECT_EQ(cs.failures, 1u);
  EXPECT_EQ(cs.committed_version, 0u);
  EXPECT_EQ(cs.publications, 0u);
  EXPECT_NE(std::find(cs.transitions.begin(), cs.transitions.end(), "Poisoned"),
            cs.transitions.end());
  EXPECT_THAT(cs.last_error, ::testing::HasSubstr(c.expect));
  auto es = engine();
  EXPECT_EQ(es.committed_version, 0u) << "the engine's version is unchanged";
  EXPECT_TRUE(es.needs_publication);
  EXPECT_NE(state_of(es), "IDLE");
  auto gen = ask<generate_result>(rollout.engine, generate_atom::value, generate_request{{{1, 2, 3}}, {}});
  EXPECT_TRUE(gen->done && gen->error) << "generation is refused until a publication commits";
  EXPECT_FALSE(scripts.at(0)->alive) << "the poisoned runtime is gone";
  EXPECT_TRUE(scripts.at(0)->releases.empty() || c.point == "release_ipc");
  // The gate's proof: after the first abort no rank is asked to materialize anything more of
  // the failed publication, and every rank got the abort.
  auto first_abort = ranks_script->first_abort(failed_id);
  std::vector<bool> aborted(cfg.runtime.tp_size, false);
  for (std::size_t i = 0; i < ranks_script->log.size(); ++i) {
    const auto& e = ranks_script->log[i];
    if (e.publication != failed_id)
      continue;
    if (e.what == "abort")
      aborted.at(e.rank) = true;
    if (i > first_abort)
      EXPECT_NE(e.what, "materialize")
        << "rank " << e.rank << " was asked to materialize chunk " << e.chunk << " after the abort";
    if (e.what == "materialize" && c.point == "materialize")
      EXPECT_LE(e.chunk, c.chunk) << "no later chunk after the failing one";
    // Double buffering: while chunk k loads, chunk k + 1 (and no later one) is materialized.
    if (e.what == "materialize" && c.point == "update_weights")
      EXPECT_LE(e.chunk, c.chunk + cfg.publication.buffer_count - 1)
        << "no chunk beyond the free buffers after the failing one";
  }
  if (c.point == "update_weights") {
    const bool overlapped = std::any_of(
      ranks_script->log.begin(), ranks_script->log.end(), [&](const auto& e) {
        return e.publication == failed_id && e.what == "materialize" && e.chunk == c.chunk + 1;
      });
    EXPECT_TRUE(overlapped) << "chunk " << c.chunk + 1 << " is materialized while chunk "
                            << c.chunk << " loads (double buffering)";
  }
  for (std::uint32_t r = 0; r < cfg.runtime.tp_size; ++r)
    EXPECT_TRUE(aborted[r]) << "rank " << r << " got no abort";

  // -- restart + republish on the fresh runtime.
  ASSERT_TRUE(run_until([&] { return res->done; })) << "the republish never answered";
  ASSERT_TRUE(res->ok()) << render(res->error);
  EXPECT_EQ(res->value.attempts, 2u);
  EXPECT_EQ(res->value.model_version, 1u);
  ASSERT_EQ(res->value.recovered_errors.size(), 1u);
  EXPECT_THAT(res->value.recovered_errors[0], ::testing::HasSubstr(c.expect));
  EXPECT_NE(res->value.publication_id, failed_id);
  es = engine();
  EXPECT_EQ(es.committed_version, 1u);
  EXPECT_EQ(es.incarnation, 2u);
  EXPECT_FALSE(es.needs_publication);
  cs = coordinator();
  EXPECT_EQ(cs.committed_version, 1u);
  EXPECT_EQ(cs.publications, 1u);
  ASSERT_EQ(scripts.size(), 2u);
  EXPECT_EQ(scripts[1]->releases, std::vector<std::string>{res->value.publication_id});
  ASSERT_TRUE(ask<engine_status>(rollout.engine, wake_atom::value, wake_tags::only_kv_cache())->ok());
  generate_request req{{{1, 2, 3}, {4, 5}}, {}};
  req.params.n = 2;
  gen = ask<generate_result>(rollout.engine, generate_atom::value, req);
  ASSERT_TRUE(gen->ok()) << render(gen->error);
  ASSERT_EQ(gen->value.samples.size(), 4u);
  for (const auto& s : gen->value.samples)
    EXPECT_EQ(s.model_version, 1u) << "generation is stamped with the republished version";

  // -- the recorded run replays deterministically.
  auto rec = std::dynamic_pointer_cast<journal::recorder>(rollout.journal);
  ASSERT_NE(rec, nullptr);
  rec->flush();
  auto j = journal::read_file(journal_path);
  EXPECT_GT(j.entries.size(), 100u);
  auto rr = replay::run(j, journal_path);
  EXPECT_TRUE(rr.ok) << rr.divergence;
  EXPECT_EQ(rr.publications, 1u);
  EXPECT_EQ(rr.failures, 1u);
}

std::vector<matrix_case> matrix() {
  std::vector<matrix_case> out;
  struct point {
    const char* command;
    std::uint32_t chunk;
  };
  const point points[] = {{"describe", 0},       {"init_weight_transfer", 0},
                          {"start_weight_update", 0}, {"update_weights", 0},
                          {"update_weights", 2}, {"finish_weight_update", 0},
                          {"release_ipc", 0}};
  for (const auto& p : points) {
    out.push_back({p.command, p.chunk, fault_kind::error, "runtime_injected"});
    out.push_back({p.command, p.chunk, fault_kind::hang, "request_timeout"});
    out.push_back({p.command, p.chunk, fault_kind::crash, "runtime_exited"});
    out.push_back({p.command, p.chunk, fault_kind::corrupt, "protocol_error"});
    if (std::string(p.command) != "release_ipc") // its answer is not validated
      out.push_back({p.command, p.chunk, fault_kind::bad_answer, "validation_failed"});
  }
  out.push_back({"finish_weight_update", 0, fault_kind::forged_receipt,
                 "receipts[1].device_uuid"});
  const point phases[] = {{"prepare", 0},  {"materialize", 0}, {"materialize", 2},
                          {"transfer", 1}, {"manifest", 0},    {"final", 0}};
  for (const auto& p : phases) {
    out.push_back({p.command, p.chunk, fault_kind::rank_fails, "injected failure of rank 1"});
    out.push_back({p.command, p.chunk, fault_kind::rank_silent, "rank 1 did not report"});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Matrix, FaultMatrixDet, ::testing::ValuesIn(matrix()),
                         [](const auto& info) {
                           return info.param.point + "_" + std::to_string(info.param.chunk) + "_"
                                  + name_of(info.param.kind);
                         });

} // namespace
