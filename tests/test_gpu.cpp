// GPU data plane (REFIT_CUDA builds, CTest label `gpu`, run on the GPU machine): device
// kernels against their host twins, byte-exact publications over CUDA IPC for TP 1 and 2,
// UUID-keyed handles with permuted devices, producer buffers closed after release, sleep
// level 2 returning weight memory to the device, and a failed chunk on one rank poisoning the
// runtime without a hang.
#include <algorithm>
#include <cstring>
#include <random>

#include "gpu_fixture.hpp"
#include "runtime/cuda/cuda.hpp"
#include "runtime/model/digest.hpp"
#include "runtime/publication/backend.hpp"
#include "runtime/publication/shard.hpp"
#include "publication_fixture.hpp"
#include "runtime/publication/direct_backend.hpp"

namespace refit::testing {
namespace {

config::refit_config gpu_config(std::vector<std::string> devices) {
  auto cfg = tiny_config(static_cast<std::uint32_t>(devices.size()));
  cfg.runtime.devices = std::move(devices);
  cfg.publication.transport = "cuda_ipc";
  config::validate(cfg);
  return cfg;
}

std::vector<std::byte> to_host(int ordinal, const std::byte* device, std::uint64_t n) {
  std::vector<std::byte> out(n);
  cuda::copy_to_host(ordinal, out.data(), device, n);
  return out;
}

// ---------------------------------------------------------------- kernels vs host twins

TEST(GpuKernels, SyntheticWeightsAreBitIdenticalToTheHost) {
  REQUIRE_GPUS(1);
  const auto cfg = tiny_config(1);
  const model::synthetic_weights w{7, 1e-3f, 0.02f};
  for (const auto& p : model::expected_key_stream(cfg.model)) {
    const std::uint64_t n = p.numel();
    cuda::device_allocation dev(0, p.nbytes(), p.name);
    cuda::fill_synthetic(0, p, w, 0, 0, n, dev.data());
    for (std::uint64_t step = 1; step <= 2; ++step)
      cuda::apply_synthetic_step(0, p, w, step, 0, n, dev.data());
    std::vector<std::byte> host(p.nbytes());
    model::fill_synthetic(p, w, 2, 0, n, host.data());
    ASSERT_EQ(to_host(0, dev.data(), p.nbytes()), host) << p.name;
    // A sub-range starting mid-tensor (a shard) matches too.
    if (n > 3) {
      cuda::fill_synthetic(0, p, w, 2, n / 3, n - n / 3, dev.data());
      std::vector<std::byte> tail(p.nbytes() - n / 3 * model::dtype_size(p.dt));
      model::fill_synthetic(p, w, 2, n / 3, n - n / 3, tail.data());
      ASSERT_EQ(to_host(0, dev.data(), tail.size()), tail) << p.name << " from " << n / 3;
    }
  }
}

TEST(GpuKernels, DigestsMatchTheHostAndSeeOneFlippedBit) {
  REQUIRE_GPUS(1);
  std::mt19937_64 rng(3);
  for (std::uint32_t es : {2u, 4u}) {
    const std::uint64_t bytes = (1u << 20) + 6 * es; // not a multiple of a unit
    std::vector<std::byte> host(bytes);
    for (auto& b : host)
      b = static_cast<std::byte>(rng());
    cuda::device_allocation dev(0, bytes, "digest input");
    cuda::copy_to_device(0, dev.data(), host.data(), bytes);
    cuda::stream s(0);
    auto got = s.digests({{dev.data(), bytes / es, es}, {nullptr, bytes / es, es}});
    EXPECT_EQ(got[0], model::element_digest(host.data(), bytes, es));
    EXPECT_EQ(got[1], model::zero_digest(bytes / es));
    host[bytes / 2] ^= std::byte{1};
    cuda::copy_to_device(0, dev.data(), host.data(), bytes);
    auto flipped = s.digests({{dev.data(), bytes / es, es}});
    EXPECT_NE(flipped[0], got[0]);
    EXPECT_EQ(flipped[0], model::element_digest(host.data(), bytes, es));
  }
}

// n bytes of a pattern on the host and on the device, a zeroed device destination, and what
// that destination must hold after copies (computed on the host).
struct copy_rig {
  copy_rig(std::uint64_t n, unsigned mul, unsigned add)
    : src(n), dsrc(0, n, "copy source"), ddst(0, n, "copy destination"), want(n, std::byte{0}) {
    for (std::uint64_t i = 0; i < n; ++i)
      src[i] = static_cast<std::byte>(i * mul + add);
    cuda::copy_to_device(0, dsrc.data(), src.data(), n);
  }
  void expect(const cuda::copy_desc& c) {
    for (std::uint64_t r = 0; r < c.rows; ++r)
      std::memcpy(want.data() + (c.dst - ddst.data()) + r * c.dst_stride,
                  src.data() + (c.src - dsrc.data()) + r * c.src_stride, c.row_bytes);
  }
  std::vector<std::byte> got() const { return to_host(0, ddst.data(), want.size()); }
  std::vector<std::byte> src;
  cuda::device_allocation dsrc, ddst;
  std::vector<std::byte> want;
};

TEST(GpuKernels, BatchedCopiesMatchStridedHostCopies) {
  REQUIRE_GPUS(1);
  copy_rig rig(1 << 20, 131, 7);
  // Aligned 16-byte rows, odd 2-byte rows and a byte-granular copy, in one launch.
  std::vector<cuda::copy_desc> copies = {
    {rig.dsrc.data(), rig.ddst.data(), 4096, 2048, 1024, 100},
    {rig.dsrc.data() + 2, rig.ddst.data() + 300000, 1000, 998, 998, 50},
    {rig.dsrc.data() + 1, rig.ddst.data() + 500001, 0, 0, 333333, 1},
  };
  cuda::stream s(0);
  s.copy_batch(copies);
  s.synchronize();
  for (const auto& c : copies)
    rig.expect(c);
  EXPECT_EQ(rig.got(), rig.want);
}

// Batches planned once (direct publication's chunks): a batch launches whole or as a prefix of
// its copies, from descriptors uploaded at planning; contiguous copies of many units with a
// ragged tail go through the vector path.
TEST(GpuKernels, PlannedCopyBatchesLaunchWholeOrAsAPrefix) {
  REQUIRE_GPUS(1);
  copy_rig rig(4 << 20, 37, 11);
  std::byte* const src = rig.dsrc.data();
  std::byte* const dst = rig.ddst.data();
  const std::vector<std::vector<cuda::copy_desc>> batches = {
    {{src, dst, 0, 0, (1 << 20) + 48, 1},                   // 17 units
     {src + 4096, dst + (2 << 20), 8192, 4096, 4096, 64}},  // strided rows
    {{src + (3 << 20), dst + (3 << 20), 0, 0, 65536 * 3, 1},
     {src + 7, dst + (3 << 20) + 65536 * 4, 0, 0, 999, 1},  // bytes
     {src, dst + (3 << 20) + 65536 * 5, 0, 0, 4096, 1}},
  };
  cuda::copy_plan plan(0, batches);
  ASSERT_EQ(plan.batches(), 2u);
  EXPECT_EQ(plan.copies(1), 3u);
  cuda::stream s(0);
  s.copy_batch(plan, 1, 2);  // the first two copies of batch 1 only
  s.copy_batch(plan, 0, 99); // a limit past the end: all of batch 0
  s.synchronize();
  for (const auto& c : batches[0])
    rig.expect(c);
  rig.expect(batches[1][0]);
  rig.expect(batches[1][1]);
  EXPECT_EQ(rig.got(), rig.want);
  cuda::stream other(0);
  EXPECT_NO_THROW(other.copy_batch(plan, 1, 0)); // nothing to launch
  EXPECT_THROW(other.copy_batch(plan, 2, 1), std::out_of_range);
}

TEST(GpuKernels, ExpectedResidentDigestsMatchTheHostVerifier) {
  REQUIRE_GPUS(1);
  const auto cfg = tiny_config(1);
  const model::synthetic_weights w{11, 1e-3f, 0.02f};
  for (std::uint32_t tp : {1u, 2u, 4u}) {
    auto host = publication::expected_resident_digests(cfg.model, tp, w, 3);
    auto dev = publication::expected_resident_digests(cfg.model, tp, w, 3,
                                                      device::spec{device::kind::cuda, 0});
    EXPECT_EQ(dev, host) << "tp " << tp;
  }
}

TEST(GpuKernels, DeviceShardsEqualHostShards) {
  REQUIRE_GPUS(1);
  const auto cfg = tiny_config(2);
  const model::synthetic_weights w{5, 1e-3f, 0.02f};
  auto params = model::expected_key_stream(cfg.model);
  publication::shard_store host(params, 2, 1, w);
  publication::shard_store dev(params, 2, 1, w, device::spec{device::kind::cuda, 0});
  host.apply_step();
  dev.apply_step();
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto bytes = host.spec(i).padded_bytes();
    ASSERT_EQ(to_host(0, dev.data(i), bytes),
              std::vector<std::byte>(host.data(i), host.data(i) + bytes))
      << params[i].name;
  }
}

// ---------------------------------------------------------------- publications over CUDA IPC

class GpuPublication : public Publication {
protected:
  // Independent check of the receipts: the host verifier's digests of the trainer's weights.
  void expect_byte_exact(const publication_result& res, std::uint32_t tp) {
    auto want = publication::expected_resident_digests(
      cfg.model, tp, {cfg.job.seed, cfg.trainer.lr, cfg.trainer.init_scale}, step_of_rank0());
    ASSERT_EQ(res.receipts.size(), tp);
    for (std::uint32_t r = 0; r < tp; ++r) {
      const auto& got = res.receipts[r];
      EXPECT_EQ(got.device_uuid,
                cuda::device_uuid(device::parse(cfg.runtime.devices[r], "device").index));
      ASSERT_EQ(got.checksums.size(), want[r].size());
      for (std::size_t i = 0; i < want[r].size(); ++i)
        EXPECT_EQ(got.checksums[i].digest, model::digest_hex(want[r][i]))
          << "rank " << r << " " << got.checksums[i].name;
    }
  }

  // After release_ipc every worker has closed every IPC handle it opened.
  void expect_handles_closed(std::uint64_t* opened_so_far) {
    auto d = ask<runtime_description>(rollout.engine, describe_atom::value);
    ASSERT_TRUE(d);
    std::uint64_t opened = 0;
    for (const auto& w : d->workers) {
      EXPECT_EQ(w.producer_buffers_open, 0u) << "TP worker " << w.rank;
      opened += w.producer_buffers_opened;
    }
    EXPECT_GT(opened, *opened_so_far) << "the publication opened IPC handles";
    EXPECT_LE(opened - *opened_so_far, d->workers.size() * cfg.publication.buffer_count)
      << "each buffer is opened once per publication";
    *opened_so_far = opened;
  }

  void publish_three_times(std::uint32_t tp) {
    std::uint64_t opened = 0;
    for (std::uint64_t v = 1; v <= 3; ++v) {
      if (v > 1)
        step_all();
      auto res = publish(v);
      ASSERT_TRUE(res) << "version " << v << ": " << render(res.error());
      EXPECT_EQ(res->model_version, v);
      EXPECT_GT(res->chunks, 1u);
      expect_byte_exact(*res, tp);
      expect_handles_closed(&opened);
      EXPECT_EQ(engine().committed_version, v);
    }
  }
};

TEST_F(GpuPublication, ByteExactTp1) {
  REQUIRE_GPUS(1);
  cfg = gpu_config({"cuda:0"});
  start();
  publish_three_times(1);
}

TEST_F(GpuPublication, ByteExactTp2) {
  REQUIRE_GPUS(2);
  cfg = gpu_config({"cuda:0", "cuda:1"});
  start();
  publish_three_times(2);
}

// FSDP4 -> TP4, the seed's validated world size (machines with 4 GPUs; skipped on fewer).
TEST_F(GpuPublication, ByteExactTp4) {
  REQUIRE_GPUS(4);
  cfg = gpu_config({"cuda:0", "cuda:1", "cuda:2", "cuda:3"});
  start();
  publish_three_times(4);
}

// Trainer rank 0 and TP worker 0 on cuda:1: handles are found by UUID, not by ordinal. (CTest
// also runs this binary's publications under CUDA_VISIBLE_DEVICES=1,0.)
TEST_F(GpuPublication, PermutedDevicesFindTheirHandlesByUuid) {
  REQUIRE_GPUS(2);
  cfg = gpu_config({"cuda:1", "cuda:0"});
  start();
  auto d = ask<runtime_description>(rollout.engine, describe_atom::value);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->workers[0].device_uuid, cuda::device_uuid(1));
  EXPECT_EQ(d->workers[1].device_uuid, cuda::device_uuid(0));
  EXPECT_NE(cuda::device_uuid(0), cuda::device_uuid(1));
  publish_three_times(2);
}

// Direct publication over CUDA IPC: the runtime exports its resident arena, the trainer rank
// opens it on its own GPU and writes every placement with one batched copy per chunk.
class GpuDirectPublication : public GpuPublication {
protected:
  void publish_direct(std::uint32_t tp) {
    for (std::uint64_t v = 1; v <= 3; ++v) {
      if (v > 1)
        step_all();
      auto res = publish(v);
      ASSERT_TRUE(res) << "version " << v << ": " << render(res.error());
      EXPECT_EQ(res->mode, "direct");
      EXPECT_GT(res->chunks, 1u);
      EXPECT_EQ(res->peak_buffer_bytes, 0u);
      if (tp == 1) {
        EXPECT_EQ(res->bytes_local, res->bytes) << "one copy per byte at world 1";
        EXPECT_EQ(res->bytes_cross, 0u);
      }
      expect_byte_exact(*res, tp);
      auto d = ask<runtime_description>(rollout.engine, describe_atom::value);
      ASSERT_TRUE(d);
      for (const auto& w : d->workers) {
        EXPECT_EQ(w.producer_buffers_open, 0u);
        EXPECT_TRUE(w.resident_export.empty());
      }
      EXPECT_EQ(open_targets_after_release(), 0u) << "IPC handles closed";
      EXPECT_EQ(cuda::ipc_view::open_count(), 0u);
    }
  }
};

TEST_F(GpuDirectPublication, ByteExactTp1) {
  REQUIRE_GPUS(1);
  cfg = gpu_config({"cuda:0"});
  cfg.publication.mode = "direct";
  config::validate(cfg);
  start();
  publish_direct(1);
}

TEST_F(GpuDirectPublication, ByteExactTp2) {
  REQUIRE_GPUS(2);
  cfg = gpu_config({"cuda:0", "cuda:1"});
  cfg.publication.mode = "direct";
  config::validate(cfg);
  start();
  publish_direct(2);
}

TEST_F(GpuDirectPublication, AFailedCopyPoisonsAndTheNextPublicationCommits) {
  REQUIRE_GPUS(1);
  cfg = gpu_config({"cuda:0"});
  cfg.publication.mode = "direct";
  cfg.trainer.faults = {{0, "fail_copy", "", 1, false}};
  config::validate(cfg);
  start();
  auto pid = runtime_pid();
  auto res = publish(1);
  expect_poisoned(res, errc::gate_failed, "injected copy failure", pid);
  EXPECT_EQ(open_targets_after_release(), 0u);
  auto again = publish(2);
  ASSERT_TRUE(again) << render(again.error());
  expect_byte_exact(*again, 1);
}

TEST_F(GpuPublication, FailedChunkOnOneRankPoisonsWithoutHang) {
  REQUIRE_GPUS(2);
  cfg = gpu_config({"cuda:0", "cuda:1"});
  // Rank 1 fails chunk 1 before entering the collective: rank 0 waits inside NCCL until the
  // gate's abort reaches it.
  cfg.trainer.faults = {{1, "fail_materialize", "", 1}};
  cfg.publication.gate_deadline_ms = 5000;
  start();
  const pid_t pid = runtime_pid();
  const auto t0 = std::chrono::steady_clock::now();
  auto res = publish(1);
  const double seconds
    = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  expect_poisoned(res, errc::gate_failed, "injected materialization failure", pid);
  EXPECT_LT(seconds, 5.0) << "the abort reached the rank inside the NCCL all-gather";
  // Fresh communicators and runtime: the next publication commits byte-exact.
  auto again = publish(2);
  ASSERT_TRUE(again) << render(again.error());
  expect_byte_exact(*again, 2);
}

// Sleep level 2 returns resident weight memory to the device; wake allocates it again. Uses
// the bench model (about 0.6 GiB of resident weights on one GPU) so the change is far above
// the allocator's granularity.
TEST_F(GpuPublication, SleepLevel2ReturnsWeightMemoryToTheDevice) {
  REQUIRE_GPUS(1);
  auto bench = config::load_file(std::string(REFIT_SOURCE_DIR) + "/configs/bench-cpu.yaml");
  cfg = gpu_config({"cuda:0"});
  cfg.model = bench.model;
  start();
  auto d = ask<runtime_description>(rollout.engine, describe_atom::value);
  ASSERT_TRUE(d);
  const std::uint64_t weights = d->workers[0].weight_bytes_resident;
  ASSERT_GT(weights, 256u << 20);
  const std::uint64_t awake = cuda::free_bytes(0);
  ASSERT_TRUE(ask<engine_status>(rollout.engine, sleep_atom::value, std::uint32_t{2}));
  const std::uint64_t asleep = cuda::free_bytes(0);
  EXPECT_GE(asleep, awake + weights * 95 / 100)
    << "sleep(2) freed " << (asleep - std::min(asleep, awake)) << " of " << weights << " bytes";
  ASSERT_TRUE(ask<engine_status>(rollout.engine, wake_atom::value, wake_tags::only_weights()));
  const std::uint64_t woken = cuda::free_bytes(0);
  EXPECT_LE(woken + weights * 95 / 100, asleep) << "wake(weights) allocates them again";
  d = ask<runtime_description>(rollout.engine, describe_atom::value);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->workers[0].weight_bytes_resident, weights);
  EXPECT_GT(d->workers[0].device_free_bytes, 0u);
}

} // namespace
} // namespace refit::testing
