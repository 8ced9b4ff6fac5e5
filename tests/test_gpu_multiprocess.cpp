// The multi-process deployment on a GPU (label gpu, REFIT_CUDA builds): refit-coordinator serve
// and one trainer process on cuda:0 (world 1). The trainer's NCCL communicator is created by
// refit in the trainer process from the unique id rank 0 offers through the coordinator (the
// RankRegistry's collective_id); its packed device buffers go to the runtime worker by CUDA IPC,
// keyed by the GPU's UUID. A trainer SIGKILLed mid-publication fails the round (rank_lost),
// the runtime is poisoned and restarted, and a fresh trainer process (a fresh communicator id)
// publishes again. World N on GPUs needs as many GPUs; the CPU world-N path is
// test_multiprocess.cpp.
#include "multiprocess_fixture.hpp"

#include "runtime/cuda/cuda.hpp"

namespace {

class GpuMultiProcess : public MultiProcess {
protected:
  void SetUp() override {
    if (refit::cuda::device_count() < 1)
      GTEST_SKIP() << "no CUDA device";
    MultiProcess::SetUp();
  }

  std::string write_gpu_recipe(const std::string& name, const std::string& trainer_faults = "") {
    std::string path = dir + name;
    std::ofstream(path)
      << "model: " << config::model_to_yaml(tiny.model) << "\n"
      << "runtime: {executable: " << REFIT_RUNTIME_EXE
      << ", tp_size: 1, devices: [cuda:0], kill_grace_ms: 300, kv_cache_bytes: 16777216}\n"
      << "supervisor: {max_restarts: 3, backoff_initial_ms: 20, backoff_max_ms: 100}\n"
      << "trainer: {lr: 0.001, init_scale: 0.02"
      << (trainer_faults.empty() ? "" : ", faults: " + trainer_faults) << "}\n"
      << "publication: {buffer_bytes: 65536, buffer_count: 2, transport: cuda_ipc, verify: true, "
         "gate_deadline_ms: 20000, memory_headroom_bytes: 1048576, republish_attempts: 1}\n"
      << "job: {seed: 1234}\n"
      << "serve: {host: 127.0.0.1, port: 0, token_env: REFIT_TEST_TOKEN, world_size: 1, "
         "embedded: false, publish_barrier_ms: 60000, join_timeout_ms: 10000}\n";
    return path;
  }

  // Committed `version`, TP worker 0 on this GPU, its resident bytes the trainer's at `step`
  // (digests computed here on the host, independently of the coordinator's verifier).
  void expect_gpu_byte_exact(const json& r, std::uint64_t version, std::uint64_t step) {
    ASSERT_TRUE(r.value("ok", false)) << r.dump();
    EXPECT_EQ(r["version"], version);
    EXPECT_EQ(r["trainer_ranks"], 1);
    EXPECT_EQ(r["tp"], 1);
    EXPECT_GT(r["chunks"].get<int>(), 1) << "64 KiB buffers force several chunks";
    ASSERT_EQ(r["receipts"].size(), 1u);
    const auto& got = r["receipts"][0];
    EXPECT_EQ(got["device_uuid"], refit::cuda::device_uuid(0));
    auto expected = expected_resident_checksums(
      tiny.model, 1, {tiny.job.seed, tiny.trainer.lr, tiny.trainer.init_scale}, step);
    ASSERT_EQ(got["checksums"].size(), expected[0].checksums.size());
    for (std::size_t i = 0; i < expected[0].checksums.size(); ++i)
      EXPECT_EQ(got["checksums"][i][1], expected[0].checksums[i].digest)
        << expected[0].checksums[i].name << " at step " << step;
  }
};

TEST_F(GpuMultiProcess, World1TrainerProcessPublishesThroughItsOwnNcclCommunicator) {
  auto recipe = write_gpu_recipe("gpu.yaml");
  start_coordinator(recipe);
  auto t0 = trainer(recipe, 0, {"--world", "1"});
  for (std::uint64_t v = 1; v <= 3; ++v) {
    EXPECT_EQ(command(*t0, "step")["step"], v);
    auto r = publish_all({t0.get()}, v);
    expect_gpu_byte_exact(r[0], v, v);
    EXPECT_EQ(r[0]["attempts"], 1);
  }
  quit_and_stop(t0);
}

TEST_F(GpuMultiProcess, World1TrainerKilledMidPublicationPoisonsTheRuntimeAndRejoins) {
  auto recipe = write_gpu_recipe("gpu.yaml");
  auto stalling = write_gpu_recipe("stalling.yaml", "[{rank: 0, kind: never_report, chunk: 1}]");
  start_coordinator(recipe);
  auto old_runtime = runtime_pid(coordinator->pid());
  raw_client client(plain_serve(token));
  auto registry = client.connect(port);
  ASSERT_TRUE(registry) << render(registry.error());

  auto t0 = trainer(stalling, 0, {"--world", "1"});
  command(*t0, "step");
  t0->send("publish 1");
  wait_status(client, *registry, token,
              [](const registry_status& s) {
                return s.publishing
                       && s.coordinator.state == static_cast<std::uint8_t>(publication_state::loading);
              },
              20s);
  std::this_thread::sleep_for(300ms);
  auto killed_at = std::chrono::steady_clock::now();
  t0->signal(SIGKILL);
  EXPECT_EQ(t0->wait(5s), 128 + SIGKILL);
  t0.reset();
  // The round failed for every rank, the runtime was poisoned and restarted once.
  auto st = wait_status(client, *registry, token,
                        [](const registry_status& s) {
                          return s.engine.incarnation == 2
                                 && s.engine.conn() == connection_state::idle;
                        },
                        30s);
  EXPECT_LT(std::chrono::steady_clock::now() - killed_at, 15s)
    << "the dead trainer is noticed at once, not at the 20 s gate deadline";
  EXPECT_EQ(st.rank_losses, 1u);
  EXPECT_EQ(st.committed_version, 0u);
  EXPECT_FALSE(st.complete);
  EXPECT_TRUE(gone_within(old_runtime, 5s)) << "the poisoned runtime was reaped";

  // A fresh trainer process (a fresh communicator id from its rank 0) publishes version 1.
  auto again = trainer(recipe, 0, {"--world", "1", "--start-step", "1"});
  auto r = publish_all({again.get()}, 1);
  expect_gpu_byte_exact(r[0], 1, 1);
  quit_and_stop(again);
}

} // namespace
