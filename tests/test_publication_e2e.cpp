// End-to-end weight publication on CPU with the real refit-runtime child: TrainerRanks ->
// ConsensusGate -> SyncCoordinator -> RolloutEngine -> vLLMRuntimeProxy -> refit-runtime,
// packed memfd buffers, byte-exact verification of every resident tensor.
#include "publication_fixture.hpp"

using namespace refit;
using namespace refit::testing;

namespace {

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
        EXPECT_EQ(got.checksums[i].digest, expected[r].checksums[i].digest)
          << "rank " << r << " " << got.checksums[i].name;
        sums.push_back(got.checksums[i].digest);
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
  const std::uint64_t buffers = cfg.publication.buffer_count * cfg.publication.buffer_bytes;
  EXPECT_LE(res->peak_buffer_bytes, buffers);
  EXPECT_LT(res->peak_buffer_bytes, res->bytes * cfg.runtime.tp_size);
  for (const auto& r : pub.ranks) {
    auto info = ask<rank_info>(r, describe_atom::value);
    ASSERT_TRUE(info);
    EXPECT_GT(info->peak_materialized_bytes, 0u);
    EXPECT_LE(info->peak_materialized_bytes, buffers)
      << "a rank never holds more chunks than it has buffers before their transfer passed";
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

TEST_F(Publication, ForgedReceiptIsCaughtAndNothingIsCommitted) {
  cfg.runtime.faults = {{"finish_weight_update", "forge_receipt", 0}};
  start();
  auto pid = runtime_pid();
  expect_poisoned(publish(1), errc::validation_failed, "receipts[1].device_uuid", pid);
}

TEST_F(Publication, RepublishAfterAFailureCommitsOnTheFreshRuntime) {
  cfg.publication.republish_attempts = 1;
  cfg.runtime.faults = {{"update_weights", "sigkill", 1, 1}};
  start();
  auto pid = runtime_pid();
  auto res = publish(1);
  ASSERT_TRUE(res) << render(res.error());
  EXPECT_EQ(res->attempts, 2u);
  ASSERT_EQ(res->recovered_errors.size(), 1u);
  EXPECT_NE(res->recovered_errors[0].find("runtime_exited"), std::string::npos)
    << res->recovered_errors[0];
  EXPECT_TRUE(proc::processes_in_group(pid).empty());
  auto st = engine();
  EXPECT_EQ(st.incarnation, 2u);
  EXPECT_EQ(st.committed_version, 1u);
  EXPECT_FALSE(st.needs_publication);
  auto cs = *ask<coordinator_status>(pub.coordinator, status_atom::value);
  EXPECT_EQ(cs.committed_version, 1u);
  EXPECT_EQ(cs.failures, 1u);
  EXPECT_EQ(cs.publications, 1u);
}

TEST_F(Publication, OneShotTrainerFaultIsRepublishedAway) {
  cfg.publication.republish_attempts = 1;
  cfg.trainer.faults = {{1, "fail_materialize", "", 2, false}};
  start();
  auto res = publish(1);
  ASSERT_TRUE(res) << render(res.error());
  EXPECT_EQ(res->attempts, 2u);
  EXPECT_NE(res->recovered_errors.at(0).find("injected materialization failure at chunk 2"),
            std::string::npos);
}

TEST_F(Publication, RepeatingFaultExhaustsTheRepublishBudget) {
  cfg.publication.republish_attempts = 2;
  cfg.trainer.faults = {{0, "wrong_manifest", "", 0, true}};
  start();
  auto res = publish(1);
  ASSERT_FALSE(res);
  EXPECT_EQ(static_cast<errc>(res.error().code()), errc::manifest_mismatch);
  auto cs = *ask<coordinator_status>(pub.coordinator, status_atom::value);
  EXPECT_EQ(cs.failures, 3u) << "1 attempt + 2 republishes";
  EXPECT_EQ(cs.committed_version, 0u);
}

} // namespace
