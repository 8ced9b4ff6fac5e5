// End to end with the real refit-runtime child: trainer ranks whose weight source is their own
// registered memory (FSDP2 Shard(0) rows, fused experts, a replicated tensor), gathered zero
// copy into the packed buffers; the verifier checks the resident digests against the terms the
// ranks computed from that memory, and independently against the synthetic expectation the
// memory was filled with.
#include "publication_fixture.hpp"
#include "registered_fixture.hpp"

#include "actors/trainer_rank.hpp"
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include "runtime/publication/backend.hpp"

using namespace refit;
using namespace refit::testing;

namespace {

class RegisteredPublication : public Publication,
                              public ::testing::WithParamInterface<std::uint32_t> {
protected:
  model::synthetic_weights w{11, 1e-2f, 0.02f};
  fsdp_layout layout;
  std::vector<std::unique_ptr<fsdp_rank_tensors>> memory;

  void start_registered(std::uint32_t tp, const std::vector<config::trainer_fault>& faults = {}) {
    cfg = tiny_config(tp);
    cfg.trainer.faults = faults;
    layout.replicated = {"model.norm.weight"};
    sys_cfg = std::make_unique<caf::actor_system_config>();
    configure(*sys_cfg);
    sys = std::make_unique<caf::actor_system>(*sys_cfg);
    rollout = spawn_rollout(*sys, cfg, make_runtime_proxy_factory(cfg, REFIT_RUNTIME_EXE));
    engine_status st;
    ASSERT_TRUE(wait_until_ready(*sys, rollout.engine, 20s, &st)) << st.last_error;
    auto gate = spawn_gate(*sys, rollout.journal);
    std::vector<device::spec> devices(tp, device::spec{device::kind::cpu, 0});
    for (std::uint32_t r = 0; r < tp; ++r)
      devices[r].index = static_cast<int>(r);
    auto collectives = publication::make_collective_registry(devices);
    std::vector<trainer_rank_actor> ranks;
    for (std::uint32_t r = 0; r < tp; ++r) {
      memory.push_back(make_rank_tensors(cfg.model, tp, r, w, 0, layout));
      auto reg = std::make_shared<publication::registered_weights>(cfg.model, tp, r, devices[r]);
      for (const auto& t : memory.back()->regs)
        reg->add(t);
      reg->seal();
      auto o = registered_rank_options(cfg, r, devices[r], reg, collectives, gate);
      for (const auto& f : faults)
        if (f.rank == r)
          o.faults.push_back(f);
      ranks.push_back(sys->spawn(trainer_rank, std::move(o)));
    }
    pub = spawn_coordinator(*sys, cfg, rollout.engine, gate, std::move(ranks), rollout.journal);
  }

  void expect_receipts(const publication_result& res, std::uint64_t step) {
    const auto tp = static_cast<std::uint32_t>(res.receipts.size());
    auto expected = expected_resident_checksums(cfg.model, tp, w, step);
    for (std::uint32_t r = 0; r < tp; ++r) {
      ASSERT_EQ(res.receipts[r].checksums.size(), expected[r].checksums.size());
      for (std::size_t i = 0; i < expected[r].checksums.size(); ++i)
        EXPECT_EQ(res.receipts[r].checksums[i].digest, expected[r].checksums[i].digest)
          << "TP worker " << r << " " << expected[r].checksums[i].name;
    }
  }
};

TEST_P(RegisteredPublication, TrainerMemoryIsPublishedByteExactEveryStep) {
  const auto tp = GetParam();
  start_registered(tp);
  auto info = ask<rank_info>(pub.ranks[0], describe_atom::value);
  ASSERT_TRUE(info);
  EXPECT_EQ(info->weight_source, "registered");
  for (std::uint64_t v = 1; v <= 2; ++v) {
    // The trainer's optimizer step: it rewrites its own memory in place.
    for (std::uint32_t r = 0; r < tp; ++r)
      refill_rank(*memory[r], cfg.model, tp, r, w, v - 1, layout);
    auto res = publish(v);
    ASSERT_TRUE(res) << render(res.error());
    EXPECT_EQ(res->model_version, v);
    ASSERT_EQ(res->receipts.size(), tp);
    expect_receipts(*res, v - 1);
    step_all();
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, RegisteredPublication, ::testing::Values(1u, 2u, 4u),
                         [](const auto& info) { return "N" + std::to_string(info.param); });

TEST_F(RegisteredPublication, ThePublishedBytesAreTheTrainersMemory) {
  start_registered(2);
  // One flipped bit in rank 1's embedding rows: the verifier (terms from the ranks' memory)
  // passes, and the runtime's digests differ from the synthetic step-0 prediction: what is
  // published is the registered memory, not a recomputation.
  memory[1]->storage[0]->at(0) ^= std::byte{0x01};
  auto res = publish(1);
  ASSERT_TRUE(res) << render(res.error());
  auto expected = expected_resident_checksums(cfg.model, 2, w, 0);
  bool differs = false;
  for (std::uint32_t r = 0; r < 2; ++r)
    for (std::size_t i = 0; i < expected[r].checksums.size(); ++i)
      differs |= res->receipts[r].checksums[i].digest != expected[r].checksums[i].digest;
  EXPECT_TRUE(differs) << "the flipped bit of rank 1's embedding rows reached the runtime";
}

TEST_F(RegisteredPublication, DigestTermsThatDisagreeWithTheRuntimeFailVerification) {
  config::trainer_fault f;
  f.rank = 1;
  f.kind = "wrong_digest_terms";
  start_registered(2, {f});
  const auto old_pid = runtime_pid();
  auto res = publish(1);
  expect_poisoned(res, errc::verification_failed, "differ from the trainer's weights", old_pid);
  // The fault was one-shot: the next publication verifies and commits on the fresh runtime.
  auto again = publish(1);
  ASSERT_TRUE(again) << render(again.error());
  expect_receipts(*again, 0);
}

TEST(ExpectedFromTerms, TermsThatDoNotFitTheLayoutAreNamed) {
  rank_report r;
  r.rank = 1;
  r.digest_terms = {1, 2, 3};
  try {
    expected_from_terms(tiny_config(2).model, 2, {r});
    FAIL() << "accepted 3 terms";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 reported 3 digest terms"), std::string::npos)
      << e.what();
  }
}

} // namespace
