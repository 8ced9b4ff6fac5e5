// End-to-end weight publication on CPU with the real refit-runtime child: TrainerRanks ->
// ConsensusGate -> SyncCoordinator -> RolloutEngine -> vLLMRuntimeProxy -> refit-runtime,
// packed memfd buffers, byte-exact verification of every resident tensor.
#include <chrono>
#include <dirent.h>
#include <memory>
#include <set>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <gtest/gtest.h>
#include <unistd.h>

#include "actors/sync_coordinator.hpp"
#include "runtime/bootstrap.hpp"
#include "runtime/process.hpp"

using namespace refit;
using namespace std::chrono_literals;

namespace {

std::set<std::string> shm_entries() {
  std::set<std::string> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (auto* e = ::readdir(d))
      out.insert(e->d_name);
    ::closedir(d);
  }
  return out;
}

config::refit_config tiny_config(std::uint32_t tp) {
  auto cfg = config::parse_yaml(config::embedded_default_yaml(), "<embedded>");
  cfg.runtime.tp_size = tp;
  cfg.runtime.devices.clear();
  for (std::uint32_t r = 0; r < tp; ++r)
    cfg.runtime.devices.push_back("cpu:" + std::to_string(r));
  cfg.runtime.kill_grace_ms = 300;
  cfg.supervisor.backoff_initial_ms = 20;
  cfg.supervisor.backoff_max_ms = 100;
  cfg.publication.verify = true;
  cfg.publication.memory_headroom_bytes = 1 << 20;
  config::validate(cfg);
  return cfg;
}

class Publication : public ::testing::Test {
protected:
  config::refit_config cfg = tiny_config(2);
  std::unique_ptr<caf::actor_system_config> sys_cfg;
  std::unique_ptr<caf::actor_system> sys;
  rollout_handles rollout;
  publication_handles pub;

  void start() {
    sys_cfg = std::make_unique<caf::actor_system_config>();
    configure(*sys_cfg);
    sys = std::make_unique<caf::actor_system>(*sys_cfg);
    rollout = spawn_rollout(*sys, cfg, make_runtime_proxy_factory(cfg, REFIT_RUNTIME_EXE));
    engine_status st;
    ASSERT_TRUE(wait_until_ready(*sys, rollout.engine, 20s, &st)) << st.last_error;
    pub = spawn_publication(*sys, cfg, rollout.engine);
  }

  void TearDown() override {
    if (sys) {
      shutdown_publication(pub);
      shutdown_rollout(*sys, rollout);
      pub = {};
      rollout = {};
      sys.reset();
    }
  }

  template <class T, class Handle, class... Ts>
  caf::expected<T> ask(const Handle& h, Ts&&... xs) {
    caf::scoped_actor self{*sys};
    caf::expected<T> out{caf::error{}};
    self->request(h, 120s, std::forward<Ts>(xs)...)
      .receive([&](T& x) { out = std::move(x); }, [&](caf::error& e) { out = std::move(e); });
    return out;
  }

  engine_status engine() { return *ask<engine_status>(rollout.engine, status_atom::value); }

  // The colocated schedule around a publication: sleep(2) -> wake(weights) -> publish ->
  // wake(kv_cache).
  caf::expected<publication_result> publish(std::uint64_t version) {
    auto s = ask<engine_status>(rollout.engine, sleep_atom::value, std::uint32_t{2});
    if (!s)
      return s.error();
    s = ask<engine_status>(rollout.engine, wake_atom::value, wake_tags::only_weights());
    if (!s)
      return s.error();
    auto res = ask<publication_result>(pub.coordinator, publish_atom::value, version);
    if (!res)
      return res;
    s = ask<engine_status>(rollout.engine, wake_atom::value, wake_tags::only_kv_cache());
    if (!s)
      return s.error();
    return res;
  }

  void step_all() {
    for (const auto& r : pub.ranks)
      ASSERT_TRUE(ask<std::uint64_t>(r, step_atom::value));
  }

  std::uint64_t step_of_rank0() { return ask<rank_info>(pub.ranks[0], describe_atom::value)->step; }

  pid_t runtime_pid() {
    auto d = ask<runtime_description>(rollout.engine, describe_atom::value);
    return d ? static_cast<pid_t>(d->pid) : -1;
  }

  bool wait_incarnation(std::uint64_t n) {
    auto until = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < until) {
      auto st = engine();
      if (st.incarnation >= n && st.conn() == connection_state::idle)
        return true;
      std::this_thread::sleep_for(10ms);
    }
    return false;
  }

  // Asserts the publication failed with `code`, nothing was committed, and the runtime was
  // poisoned: its process group is gone and the supervisor brought up a fresh one.
  void expect_poisoned(const caf::expected<publication_result>& res, errc code,
                       const std::string& message_part, pid_t old_pid) {
    ASSERT_FALSE(res) << "publication unexpectedly committed";
    EXPECT_EQ(static_cast<errc>(res.error().code()), code) << render(res.error());
    EXPECT_NE(render(res.error()).find(message_part), std::string::npos) << render(res.error());
    auto status = *ask<coordinator_status>(pub.coordinator, status_atom::value);
    EXPECT_EQ(status.committed_version, 0u);
    EXPECT_EQ(status.state, static_cast<std::uint8_t>(publication_state::idle));
    ASSERT_FALSE(status.transitions.empty());
    EXPECT_EQ(status.transitions[status.transitions.size() - 2], "Poisoned");
    EXPECT_EQ(engine().committed_version, 0u);
    ASSERT_TRUE(wait_incarnation(2)) << "the supervisor restarts the poisoned runtime";
    EXPECT_TRUE(proc::processes_in_group(old_pid).empty());
    EXPECT_TRUE(engine().needs_publication);
  }
};

class PublicationTp : public Publication, public ::testing::WithParamInterface<std::uint32_t> {};

TEST_P(PublicationTp, KPublicationsAreByteExactAndMonotonic) {
  cfg = tiny_config(GetParam());
  auto shm_before = shm_entries();
  start();
  std::vector<std::string> previous;
  for (std::uint64_t v = 1; v <= 3; ++v) {
    auto res = publish(v);
    ASSERT_TRUE(res) << "version " << v << ": " << render(res.error());
    EXPECT_EQ(res->model_version, v);
    EXPECT_EQ(res->tp, GetParam());
    EXPECT_EQ(res->trainer_ranks, GetParam());
    EXPECT_GT(res->chunks, 1u) << "the tiny recipe's 64 KiB buffer forces several chunks";
    ASSERT_EQ(res->receipts.size(), GetParam());
    // The coordinator already compared every resident checksum with the trainer's weights;
    // check it independently here.
    auto expected = expected_resident_checksums(cfg.model, GetParam(),
                                                {cfg.job.seed, cfg.trainer.lr,
                                                 cfg.trainer.init_scale},
                                                step_of_rank0());
    std::vector<std::string> sums;
    for (std::uint32_t r = 0; r < GetParam(); ++r) {
      const auto& got = res->receipts[r];
      EXPECT_EQ(got.tp_rank, r);
      EXPECT_EQ(got.model_version, v);
      ASSERT_EQ(got.checksums.size(), expected[r].checksums.size());
      for (std::size_t i = 0; i < got.checksums.size(); ++i) {
        EXPECT_EQ(got.checksums[i].name, expected[r].checksums[i].name);
        EXPECT_EQ(got.checksums[i].sha256, expected[r].checksums[i].sha256)
          << "rank " << r << " " << got.checksums[i].name;
        sums.push_back(got.checksums[i].sha256);
      }
    }
    if (!previous.empty())
      EXPECT_NE(sums, previous) << "an optimizer step changed the published weights";
    previous = sums;
    auto st = engine();
    EXPECT_EQ(st.committed_version, v);
    EXPECT_FALSE(st.needs_publication);
    auto d = ask<runtime_description>(rollout.engine, describe_atom::value);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->model_version, v);
    EXPECT_TRUE(d->weights_valid);
    auto cs = *ask<coordinator_status>(pub.coordinator, status_atom::value);
    EXPECT_EQ(cs.transitions,
              (std::vector<std::string>{"Idle", "Initialized", "Started", "Loading", "Finalizing",
                                        "Committed", "Released", "Idle"}));
    step_all();
  }
  // A version that is not above the committed one is refused before anything happens.
  auto stale = ask<publication_result>(pub.coordinator, publish_atom::value, std::uint64_t{3});
  ASSERT_FALSE(stale);
  EXPECT_EQ(static_cast<errc>(stale.error().code()), errc::invalid_argument);
  EXPECT_EQ(shm_entries(), shm_before) << "packed buffers are memfds: nothing in /dev/shm";
}

INSTANTIATE_TEST_SUITE_P(Ranks, PublicationTp, ::testing::Values(1u, 2u, 4u),
                         [](const auto& info) { return "N" + std::to_string(info.param); });

TEST_F(Publication, MemoryIsBoundedByThePlannedChunk) {
  start();
  auto res = publish(1);
  ASSERT_TRUE(res) << render(res.error());
  EXPECT_GT(res->chunks, 2u);
  EXPECT_LE(res->peak_buffer_bytes, cfg.publication.buffer_bytes);
  EXPECT_LT(res->peak_buffer_bytes, res->bytes * cfg.runtime.tp_size);
  for (const auto& r : pub.ranks) {
    auto info = ask<rank_info>(r, describe_atom::value);
    ASSERT_TRUE(info);
    EXPECT_GT(info->peak_materialized_bytes, 0u);
    EXPECT_LE(info->peak_materialized_bytes, cfg.publication.buffer_bytes)
      << "a rank never holds more than one planned chunk before its transfer passed";
  }
}

TEST_F(Publication, ExpertDroppedOnEveryRankIsCaughtAgainstTheIndependentPlan) {
  const std::string dropped = "model.layers.1.mlp.experts.2.up_proj.weight";
  cfg.trainer.faults = {{0, "drop_tensor", dropped, 0}, {1, "drop_tensor", dropped, 0}};
  start();
  auto pid = runtime_pid();
  expect_poisoned(publish(1), errc::gate_failed, "where the plan expects " + dropped, pid);
}

TEST_F(Publication, TensorDroppedOnOneRankFailsEveryRank) {
  cfg.trainer.faults = {{1, "drop_tensor", "model.layers.0.self_attn.k_norm.weight", 0}};
  start();
  auto pid = runtime_pid();
  expect_poisoned(publish(1), errc::gate_failed, "model.layers.0.self_attn.k_norm.weight", pid);
}

TEST_F(Publication, WrongShapeIsRejectedWithTheTensorName) {
  cfg.trainer.faults = {{0, "wrong_shape", "model.layers.1.self_attn.o_proj.weight", 0}};
  start();
  auto pid = runtime_pid();
  expect_poisoned(publish(1), errc::gate_failed, "model.layers.1.self_attn.o_proj.weight: emitted shape", pid);
}

TEST_F(Publication, ManifestMismatchPoisonsBeforeFinish) {
  cfg.trainer.faults = {{1, "wrong_manifest", "", 0}};
  start();
  auto pid = runtime_pid();
  expect_poisoned(publish(1), errc::manifest_mismatch, "rank 1", pid);
}

TEST_F(Publication, RankThatNeverReportsFailsAtTheGateDeadline) {
  cfg.publication.gate_deadline_ms = 500;
  cfg.trainer.faults = {{1, "never_report", "", 1}};
  start();
  auto pid = runtime_pid();
  auto t0 = std::chrono::steady_clock::now();
  auto res = publish(1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "a silent rank is a typed error, not a hang";
  // Rank 0 waits for rank 1 inside the all-gather of chunk 1 and names it as the absent peer.
  expect_poisoned(res, errc::gate_failed, "rank 1 did not arrive", pid);
}

TEST_F(Publication, UuidOrderMismatchIsRejectedInPreflight) {
  cfg.trainer.devices = {"cpu:1", "cpu:0"};
  start();
  auto pid = runtime_pid();
  auto res = publish(1);
  expect_poisoned(res, errc::preflight_failed, "trainer rank 0 is on", pid);
  for (const auto& r : pub.ranks)
    EXPECT_EQ(ask<rank_info>(r, describe_atom::value)->peak_materialized_bytes, 0u)
      << "nothing was materialized";
}

TEST_F(Publication, TensorLargerThanTheBufferIsRejectedInPreflight) {
  cfg.publication.buffer_bytes = 16384; // embed_tokens needs 32 KiB
  start();
  auto pid = runtime_pid();
  auto res = publish(1);
  expect_poisoned(res, errc::preflight_failed, "model.embed_tokens.weight", pid);
  for (const auto& r : pub.ranks)
    EXPECT_EQ(ask<rank_info>(r, describe_atom::value)->peak_materialized_bytes, 0u);
}

TEST_F(Publication, RankRejectingTheFinalResultPoisons) {
  cfg.trainer.faults = {{0, "reject_final", "", 0}};
  start();
  auto pid = runtime_pid();
  auto res = publish(1);
  ASSERT_FALSE(res);
  EXPECT_EQ(static_cast<errc>(res.error().code()), errc::gate_failed) << render(res.error());
  EXPECT_NE(render(res.error()).find("final"), std::string::npos);
  ASSERT_TRUE(wait_incarnation(2));
  EXPECT_TRUE(proc::processes_in_group(pid).empty());
}

} // namespace

namespace {

TEST_F(Publication, ForgedReceiptIsCaughtAndNothingIsCommitted) {
  cfg.runtime.faults = {{"finish_weight_update", "forge_receipt", 0}};
  start();
  auto pid = runtime_pid();
  expect_poisoned(publish(1), errc::validation_failed, "receipts[1].device_uuid", pid);
}

} // namespace
