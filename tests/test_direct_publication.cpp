// Direct publication (publication.mode: direct) end to end with the real refit-runtime child:
// the runtime exports its resident arenas, every trainer rank writes the TP placements of the
// bytes it owns straight into them, and the byte-exact verifier checks every resident tensor.
// Uneven FSDP shards (rows not divisible by the world, a rank owning nothing), synthetic and
// registered (fused and per-expert) trainer layouts, TP 1/2/4, a permuted device order, and
// the direct faults: a failed copy on one rank, a rank gone mid-write, the runtime killed
// mid-write. Nothing committed after a failure, nothing left open.
#include "publication_fixture.hpp"
#include "registered_fixture.hpp"

#include "actors/trainer_rank.hpp"
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include "runtime/publication/backend.hpp"
#include "runtime/publication/direct_backend.hpp"
#include "runtime/publication/direct_plan.hpp"

using namespace refit;
using namespace refit::testing;

namespace {

// Uneven shapes: vocab 250 (not divisible by 4 ranks), 3 experts (router rows and fused
// expert parameters over 4 ranks: rank 3 owns nothing), KV heads replicated at TP 4.
config::refit_config direct_config(std::uint32_t tp) {
  auto cfg = tiny_config(tp);
  cfg.model.vocab_size = 250;
  cfg.model.num_experts = 3;
  cfg.publication.mode = "direct";
  cfg.publication.buffer_bytes = 64 << 10; // several chunks
  config::validate(cfg);
  return cfg;
}

std::uint64_t placed_total(const config::refit_config& cfg, std::uint32_t tp) {
  const model::tp_layout layout(cfg.model, tp);
  std::uint64_t total = 0;
  for (const auto& p : model::expected_key_stream(cfg.model))
    total += publication::placed_bytes(layout, p);
  return total;
}

class DirectPublication : public Publication {
protected:
  model::synthetic_weights w{11, 1e-2f, 0.02f, {}};
  std::vector<std::unique_ptr<fsdp_rank_tensors>> memory;
  fsdp_layout layout;

  void start_direct(config::refit_config c) {
    cfg = std::move(c);
    start();
  }

  // Trainer ranks publishing their own (registered) memory.
  void start_registered(config::refit_config c, bool fused) {
    cfg = std::move(c);
    const auto tp = cfg.runtime.tp_size;
    layout.fused_experts = fused;
    layout.replicated = {"model.norm.weight", "model.layers.0.mlp.gate.weight"};
    sys_cfg = std::make_unique<caf::actor_system_config>();
    configure(*sys_cfg);
    sys = std::make_unique<caf::actor_system>(*sys_cfg);
    rollout = spawn_rollout(*sys, cfg, make_runtime_proxy_factory(cfg, REFIT_RUNTIME_EXE));
    engine_status st;
    ASSERT_TRUE(wait_until_ready(*sys, rollout.engine, 20s, &st)) << st.last_error;
    auto gate = spawn_gate(*sys, rollout.journal);
    std::vector<device::spec> devices;
    for (const auto& d : cfg.runtime.devices)
      devices.push_back(device::parse(d, "device"));
    auto collectives = publication::make_collective_registry(devices);
    std::vector<trainer_rank_actor> ranks;
    for (std::uint32_t r = 0; r < tp; ++r) {
      memory.push_back(make_rank_tensors(cfg.model, tp, r, w, 0, layout));
      auto reg = std::make_shared<publication::registered_weights>(cfg.model, tp, r, devices[r]);
      for (auto t : memory.back()->regs) {
        t.device = cfg.runtime.devices[r];
        reg->add(t);
      }
      reg->seal();
      auto o = registered_rank_options(cfg, r, devices[r], reg, collectives, gate);
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

  // After a committed direct publication: accounting and nothing left open on either side.
  void expect_direct_result(const publication_result& res) {
    const auto tp = cfg.runtime.tp_size;
    EXPECT_EQ(res.mode, "direct");
    EXPECT_EQ(res.peak_buffer_bytes, 0u) << "no packed buffer in direct mode";
    EXPECT_EQ(res.bytes_local + res.bytes_cross, placed_total(cfg, tp))
      << "every placed byte written exactly once";
    if (tp == 1)
      EXPECT_EQ(res.bytes_cross, 0u);
    else
      EXPECT_GT(res.bytes_cross, 0u) << "replicated and row-parallel bytes cross devices";
    EXPECT_GT(res.bytes_local, 0u);
    auto d = ask<runtime_description>(rollout.engine, describe_atom::value);
    ASSERT_TRUE(d);
    for (const auto& wi : d->workers) {
      EXPECT_EQ(wi.producer_buffers_open, 0u);
      EXPECT_TRUE(wi.resident_export.empty()) << "release_ipc closes the export";
    }
    EXPECT_EQ(open_targets_after_release(), 0u) << "every rank closed its mappings";
  }
};

class DirectSynthetic : public DirectPublication,
                        public ::testing::WithParamInterface<std::uint32_t> {};

TEST_P(DirectSynthetic, UnevenShardsArePublishedByteExact) {
  start_direct(direct_config(GetParam()));
  for (std::uint64_t v = 1; v <= 2; ++v) {
    auto res = publish(v);
    ASSERT_TRUE(res) << render(res.error());
    EXPECT_EQ(res->model_version, v);
    EXPECT_GT(res->chunks, 1u);
    expect_direct_result(*res);
    step_all();
  }
  EXPECT_EQ(engine().committed_version, 2u);
}

INSTANTIATE_TEST_SUITE_P(Tp, DirectSynthetic, ::testing::Values(1u, 2u, 4u),
                         [](const auto& info) { return "TP" + std::to_string(info.param); });

TEST_F(DirectPublication, ThePlanMovesLocallyWhatLinesUpAndCrossesTheRest) {
  // q_proj rows line up with both splits at TP = W = 2: every byte stays on its device; the
  // row-parallel o_proj and the replicated norms cross.
  const auto cfg2 = direct_config(2);
  const model::tp_layout layout(cfg2.model, 2);
  const auto offsets = publication::resident_offsets(layout);
  for (const auto& p : model::expected_key_stream(cfg2.model)) {
    std::uint64_t local = 0, cross = 0;
    for (std::uint32_t r = 0; r < 2; ++r) {
      const auto shard = publication::shard_of(p, 2, r);
      for (const auto& m : publication::plan_moves(
             layout, offsets, p, {shard.row_begin * shard.row_bytes, shard.real_bytes()}))
        (m.tp_rank == r ? local : cross) += m.bytes();
    }
    EXPECT_EQ(local + cross, publication::placed_bytes(layout, p)) << p.name;
    if (p.name.find("q_proj") != std::string::npos) {
      EXPECT_EQ(cross, 0u) << p.name;
    }
    if (p.name.find("o_proj") != std::string::npos || p.name == "model.norm.weight") {
      EXPECT_GT(cross, 0u) << p.name;
    }
  }
}

TEST_F(DirectPublication, PermutedDeviceOrderIsByteExact) {
  auto c = direct_config(4);
  c.runtime.devices = {"cpu:2", "cpu:0", "cpu:3", "cpu:1"};
  config::validate(c);
  start_direct(c);
  auto res = publish(1);
  ASSERT_TRUE(res) << render(res.error());
  expect_direct_result(*res);
  ASSERT_EQ(res->receipts.size(), 4u);
  EXPECT_EQ(res->receipts[0].device_uuid, publication::device_uuid({device::kind::cpu, 2}));
}

class DirectRegistered : public DirectPublication,
                         public ::testing::WithParamInterface<std::tuple<std::uint32_t, bool>> {};

TEST_P(DirectRegistered, TrainerMemoryIsWrittenInPlaceByteExact) {
  const auto [tp, fused] = GetParam();
  start_registered(direct_config(tp), fused);
  for (std::uint64_t v = 1; v <= 2; ++v) {
    for (std::uint32_t r = 0; r < tp; ++r)
      refill_rank(*memory[r], cfg.model, tp, r, w, v - 1, layout);
    auto res = publish(v);
    ASSERT_TRUE(res) << render(res.error());
    expect_direct_result(*res);
    expect_receipts(*res, v - 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, DirectRegistered,
                         ::testing::Combine(::testing::Values(1u, 2u, 4u), ::testing::Bool()),
                         [](const auto& info) {
                           return "TP" + std::to_string(std::get<0>(info.param))
                                  + (std::get<1>(info.param) ? "_fused" : "_per_expert");
                         });

// ---- faults ------------------------------------------------------------------------------

TEST_F(DirectPublication, AFailedCopyOnOneRankPoisonsAndNothingStaysOpen) {
  auto c = direct_config(2);
  c.trainer.faults = {{1, "fail_copy", "", 1, false}};
  config::validate(c);
  start_direct(c);
  const auto fds_before = fd_count();
  auto pid = runtime_pid();
  auto res = publish(1);
  expect_poisoned(res, errc::gate_failed, "injected copy failure", pid);
  EXPECT_EQ(open_targets_after_release(), 0u);
  auto again = publish(2);
  ASSERT_TRUE(again) << render(again.error());
  expect_direct_result(*again);
  auto until = std::chrono::steady_clock::now() + 2s;
  while (fd_count() > fds_before && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(10ms);
  EXPECT_LE(fd_count(), fds_before);
}

// Direct mode plans every chunk's moves in prepare by walking the exporter's stream against the
// plan; where the stream leaves the plan (a dropped tensor, a bent shape) planning stops and
// materialize names the tensor at that chunk, before anything of it is written. The runtime is
// poisoned, nothing stays open and the next publication commits.
TEST_F(DirectPublication, AnExporterThatLeavesThePlanIsNamedAtItsChunkAndPoisons) {
  const std::string tensor = "model.layers.1.mlp.experts.2.up_proj.weight";
  const std::pair<const char*, std::string> cases[] = {
    {"drop_tensor", "where the plan expects " + tensor},
    {"wrong_shape", tensor + ": emitted shape"},
  };
  for (const auto& [kind, message] : cases) {
    SCOPED_TRACE(kind);
    auto c = direct_config(2);
    c.trainer.faults = {{1, kind, tensor, 0, false}};
    config::validate(c);
    start_direct(c);
    auto pid = runtime_pid();
    expect_poisoned(publish(1), errc::gate_failed, message, pid);
    EXPECT_EQ(open_targets_after_release(), 0u);
    auto again = publish(2);
    ASSERT_TRUE(again) << render(again.error());
    expect_direct_result(*again);
    TearDown(); // a fresh runtime and ranks for the next case
  }
}

TEST_F(DirectPublication, TheRuntimeKilledMidWriteCommitsNothing) {
  auto c = direct_config(2);
  c.runtime.faults = {{"update_weights", "sigkill", 1, 1}};
  config::validate(c);
  start_direct(c);
  auto pid = runtime_pid();
  auto res = publish(1);
  expect_poisoned(res, errc::runtime_exited, "", pid);
  EXPECT_EQ(open_targets_after_release(), 0u);
  auto again = publish(2);
  ASSERT_TRUE(again) << render(again.error());
  expect_direct_result(*again);
}

TEST_F(DirectPublication, ATrainerRankGoneMidWriteCommitsNothing) {
  auto c = direct_config(2);
  // Rank 1 wrote chunk 0 and goes silent at chunk 1; then it is killed.
  c.trainer.faults = {{1, "never_report", "", 1, false}};
  c.publication.gate_deadline_ms = 20000;
  config::validate(c);
  start_direct(c);
  auto pid = runtime_pid();
  std::optional<caf::expected<publication_result>> res;
  std::thread publisher(
    [&] { res = ask<publication_result>(pub.coordinator, publish_atom::value, std::uint64_t{1}); });
  // Wait until rank 1 is silent in chunk 1, then kill it.
  auto until = std::chrono::steady_clock::now() + 10s;
  while (std::chrono::steady_clock::now() < until) {
    auto st = ask<coordinator_status>(pub.coordinator, status_atom::value);
    if (st && st->state == static_cast<std::uint8_t>(publication_state::loading))
      break;
    std::this_thread::sleep_for(5ms);
  }
  std::this_thread::sleep_for(100ms);
  caf::anon_send_exit(pub.ranks[1], caf::exit_reason::kill);
  publisher.join();
  ASSERT_TRUE(res.has_value());
  expect_poisoned(*res, errc::gate_failed, "gone", pid);
  EXPECT_EQ(open_targets_after_release(), 0u) << "the dead rank's mappings are closed";
}

TEST_F(DirectPublication, ARuntimeWithoutExportableWeightsRefusesDirectInit) {
  // A packed-mode runtime (private resident memory) is asked for a direct transfer.
  auto c = direct_config(1);
  c.publication.mode = "packed";
  start_direct(c);
  auto init = ask<engine_status>(rollout.engine, init_wt_atom::value,
                                 transfer_init{"shm", 1 << 20, 2, "direct"});
  ASSERT_FALSE(init);
  EXPECT_NE(render(init.error()).find("--publication-mode direct"), std::string::npos)
    << render(init.error());
}

} // namespace
