// The NCCL TP communicator of refit-runtime (runtime/cuda/nccl_tp_comm.hpp) on two GPUs (label
// gpu; every test skips with fewer): host and device collectives against exact sums, an
// abort and a missing rank ending a waiting rank in comm_error instead of a hang, reset()
// re-arming the group; and the bf16 engine at TP 2 over NCCL (device all-reduces, the device
// logits all-gather, CUDA graphs at tp > 1) against the same model at TP 1.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "engine_fixture.hpp"
#include "gpu_engine_fixture.hpp"
#include "gpu_fixture.hpp"
#include "runtime/cuda/cuda.hpp"
#include "runtime/cuda/nccl_tp_comm.hpp"
#include "runtime/inference/reference.hpp"
#include "runtime/inference/tp_comm.hpp"

namespace {

namespace inf = refit::inference;
namespace model = refit::model;
namespace cuda = refit::cuda;
using namespace std::chrono_literals;
using refit::testing::engine_prompt;
using refit::testing::engine_rig;
using refit::testing::engine_synthetic;
using refit::testing::gpu_memory;
using refit::testing::gpu_rig;
using refit::testing::log_softmax_rows;
using refit::testing::max_abs_delta;
using refit::testing::mean_abs_delta;
using refit::testing::reference_logprobs;

#define REQUIRE_TWO_GPUS() REQUIRE_GPUS(2)

// Runs body(rank) on one thread per rank; returns each rank's exception text ("" if none).
std::vector<std::string> on_ranks(std::uint32_t world,
                                  const std::function<void(std::uint32_t)>& body) {
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (std::uint32_t r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const inf::comm_error& e) {
        errors[r] = std::string("comm_error: ") + e.what();
      } catch (const std::exception& e) {
        errors[r] = std::string("other: ") + e.what();
      }
    });
  for (auto& t : threads)
    t.join();
  return errors;
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r)
    EXPECT_EQ(errors[r], "") << "rank " << r;
}

std::uint16_t to_bf16(float f) { // exact for the small integers used here
  std::uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<std::uint16_t>(bits >> 16);
}

float from_bf16(std::uint16_t h) {
  const std::uint32_t bits = std::uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Host collectives (the fp32 reference's path) and device collectives (float32 and bfloat16,
// enqueued on a stream, then wait_device) give the exact sums and gathers on both ranks,
// round after round.
TEST(NcclTpComm, HostAndDeviceCollectivesAreExactOnBothRanks) {
  REQUIRE_TWO_GPUS();
  auto comm = cuda::make_nccl_tp_comm({0, 1}, 60000ms);
  ASSERT_TRUE(comm->on_device());
  EXPECT_EQ(comm->world_size(), 2u);
  constexpr std::size_t n = 1000;
  expect_no_errors(on_ranks(2, [&](std::uint32_t rank) {
    const int dev = static_cast<int>(rank);
    cuda::stream stream(dev);
    cuda::device_allocation f32(dev, n * 4, "f32"), bf(dev, n * 2, "bf16"),
      gathered(dev, 2 * n * 2, "gathered");
    for (int round = 0; round < 5; ++round) {
      // Host.
      std::vector<float> host(n), in(n), out(2 * n);
      for (std::size_t i = 0; i < n; ++i) {
        host[i] = float(rank + 1) * float(i) + float(round);
        in[i] = float(rank * 10000 + i);
      }
      comm->all_reduce_sum(rank, host.data(), n);
      comm->all_gather(rank, in.data(), n, out.data());
      for (std::size_t i = 0; i < n; ++i) {
        if (host[i] != 3.0f * float(i) + 2.0f * float(round))
          throw std::runtime_error("host all_reduce_sum wrong at " + std::to_string(i));
        if (out[i] != float(i) || out[n + i] != float(10000 + i))
          throw std::runtime_error("host all_gather wrong at " + std::to_string(i));
      }
      // Device, float32 and bfloat16 (small integers: exact in both).
      std::vector<float> values(n);
      std::vector<std::uint16_t> halves(n);
      for (std::size_t i = 0; i < n; ++i) {
        values[i] = float((i % 50) * (rank + 1) + round);
        halves[i] = to_bf16(float((i % 20) + rank * 3));
      }
      cuda::copy_to_device(dev, f32.data(), reinterpret_cast<const std::byte*>(values.data()), n * 4);
      cuda::copy_to_device(dev, bf.data(), reinterpret_cast<const std::byte*>(halves.data()), n * 2);
      comm->all_reduce_sum_device(rank, f32.data(), n, inf::device_dtype::float32, stream.native());
      comm->all_gather_device(rank, bf.data(), n, inf::device_dtype::bfloat16, gathered.data(),
                              stream.native());
      comm->all_reduce_sum_device(rank, bf.data(), n, inf::device_dtype::bfloat16,
                                  stream.native());
      comm->wait_device(rank, stream.native());
      std::vector<float> reduced(n);
      std::vector<std::uint16_t> reduced_bf(n), all_bf(2 * n);
      cuda::copy_to_host(dev, reinterpret_cast<std::byte*>(reduced.data()), f32.data(), n * 4);
      cuda::copy_to_host(dev, reinterpret_cast<std::byte*>(reduced_bf.data()), bf.data(), n * 2);
      cuda::copy_to_host(dev, reinterpret_cast<std::byte*>(all_bf.data()), gathered.data(), 2 * n * 2);
      for (std::size_t i = 0; i < n; ++i) {
        if (reduced[i] != float((i % 50) * 3 + 2 * round))
          throw std::runtime_error("device f32 all-reduce wrong at " + std::to_string(i));
        if (from_bf16(reduced_bf[i]) != float(2 * (i % 20) + 3))
          throw std::runtime_error("device bf16 all-reduce wrong at " + std::to_string(i));
        if (from_bf16(all_bf[i]) != float(i % 20) || from_bf16(all_bf[n + i]) != float(i % 20 + 3))
          throw std::runtime_error("device bf16 all-gather wrong at " + std::to_string(i));
      }
    }
  }));
}

// abort() from another thread ends a rank that waits for a collective its peer never joins:
// comm_error with the reason, long before the (60 s) timeout; the peer's later call fails
// too; reset() re-creates the communicators (new epoch) and the group works again.
TEST(NcclTpComm, AbortEndsAWaitingRankAndResetReArmsTheGroup) {
  REQUIRE_TWO_GPUS();
  auto comm = cuda::make_nccl_tp_comm({0, 1}, 60000ms);
  const std::uint64_t epoch = comm->device_epoch();
  std::string waiting_error;
  double waited_s = 0.0;
  std::thread rank0([&] {
    cuda::stream stream(0);
    cuda::device_allocation buf(0, 4096, "buf");
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->all_reduce_sum_device(0, buf.data(), 1024, inf::device_dtype::float32, stream.native());
      comm->wait_device(0, stream.native()); // rank 1 never joins
      waiting_error = "wait_device returned";
    } catch (const inf::comm_error& e) {
      waiting_error = e.what();
    }
    waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
  std::this_thread::sleep_for(300ms); // rank 0 is (most likely) polling by now; either way it fails
  comm->abort("test: TP worker 1 failed");
  rank0.join();
  EXPECT_NE(waiting_error.find("test: TP worker 1 failed"), std::string::npos) << waiting_error;
  EXPECT_LT(waited_s, 30.0) << "the abort did not end the wait";
  {
    cuda::stream stream(1);
    cuda::device_allocation buf(1, 4096, "buf");
    try {
      comm->all_reduce_sum_device(1, buf.data(), 1024, inf::device_dtype::float32, stream.native());
      ADD_FAILURE() << "a collective of an aborted group was accepted";
    } catch (const inf::comm_error& e) {
      EXPECT_NE(std::string(e.what()).find("test: TP worker 1 failed"), std::string::npos)
        << e.what();
    }
  }
  comm->reset();
  EXPECT_NE(comm->device_epoch(), epoch);
  expect_no_errors(on_ranks(2, [&](std::uint32_t rank) {
    float v = float(rank + 1);
    comm->all_reduce_sum(rank, &v, 1);
    if (v != 3.0f)
      throw std::runtime_error("sum after reset " + std::to_string(v));
  }));
}

// A rank whose peer never arrives waits the timeout, not forever: comm_error naming the wait,
// and the group is aborted for the peer too.
TEST(NcclTpComm, AMissingPeerTimesOutAndAbortsTheGroup) {
  REQUIRE_TWO_GPUS();
  auto comm = cuda::make_nccl_tp_comm({0, 1}, 1500ms);
  std::string error;
  {
    cuda::stream stream(0);
    cuda::device_allocation buf(0, 4096, "buf");
    try {
      comm->all_reduce_sum_device(0, buf.data(), 1024, inf::device_dtype::float32, stream.native());
      comm->wait_device(0, stream.native());
      error = "wait_device returned";
    } catch (const inf::comm_error& e) {
      error = e.what();
    }
  }
  // Waiting for the collective, or (connections are set up lazily) for NCCL to enqueue it.
  EXPECT_NE(error.find("1500 ms"), std::string::npos) << error;
  EXPECT_NE(error.find("TP rank 0 on cuda:0"), std::string::npos) << error;
  EXPECT_NE(error.find("the group is aborted"), std::string::npos) << error;
  float v = 1.0f;
  try {
    comm->all_reduce_sum(1, &v, 1);
    ADD_FAILURE() << "rank 1 ran a collective of an aborted group";
  } catch (const inf::comm_error& e) {
    EXPECT_NE(std::string(e.what()).find("1500 ms"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------ the bf16 engine at TP 2

// One bf16 rank_forward per rank (rank r on cuda:r) over the NCCL comm; every call runs on
// both ranks at once.
struct tp2_rig {
  tp2_rig(const model::model_config& cfg, const refit::testing::engine_weights& w,
          inf::tp_comm& comm, std::uint32_t block_size, std::uint32_t blocks, bool graphs) {
    const model::tp_layout layout(cfg, 2);
    for (std::uint32_t r = 0; r < 2; ++r) {
      memory[r].dev = static_cast<int>(r);
      const auto host = inf::scatter_residents(cfg, 2, r, w.params, w.pointers());
      std::vector<const std::byte*> residents;
      for (const auto& t : host.storage)
        residents.push_back(memory[r].place(t));
      inf::rank_forward_options o;
      o.model = cfg;
      o.tp = 2;
      o.rank = r;
      o.weights = inf::bind_weights(cfg, layout, residents);
      o.comm = &comm;
      o.kv = inf::kv_geometry::of(cfg, 2, block_size, 2);
      o.kv_blocks = blocks;
      o.cuda_device = static_cast<int>(r);
      o.compute_dtype = model::dtype::bfloat16;
      o.cuda_graphs = graphs;
      arena[r] = memory[r].alloc(std::size_t{blocks} * o.kv.block_bytes());
      forward[r] = inf::make_rank_forward(o);
    }
  }

  // fn(rank) on both ranks at once; throws the first rank's error.
  void both(const std::function<void(std::uint32_t)>& fn) {
    const auto errors = on_ranks(2, fn);
    for (const auto& e : errors)
      if (!e.empty())
        throw std::runtime_error(e);
  }

  // engine_rig::logits on both ranks; checks that the ranks agree bitwise.
  std::vector<float> logits(const std::vector<std::int32_t>& tokens, std::uint32_t split,
                            std::uint32_t block_size) {
    std::vector<float> rows[2];
    both([&](std::uint32_t r) {
      const std::size_t blocks = (tokens.size() + block_size - 1) / block_size;
      std::vector<std::uint32_t> table(blocks);
      std::iota(table.begin(), table.end(), 0u);
      rows[r] = forward[r]->forward({{table.data(), blocks, 0, tokens.data(), split}}, arena[r],
                                    inf::logits_rows::every_token);
      for (std::uint32_t t = split; t < tokens.size(); ++t) {
        auto row = forward[r]->forward({{table.data(), blocks, t, tokens.data() + t, 1}},
                                       arena[r], inf::logits_rows::last_token);
        rows[r].insert(rows[r].end(), row.begin(), row.end());
      }
    });
    EXPECT_EQ(rows[0], rows[1]) << "the TP ranks gathered different logits";
    return rows[0];
  }

  gpu_memory memory[2];
  std::byte* arena[2] = {nullptr, nullptr};
  std::unique_ptr<inf::rank_forward> forward[2];
};

// Five prefilled sequences, then teacher-forced decode steps sampled through forward_sample
// (CUDA graphs when enabled), as test_gpu_engine's decode_fixture; `step` runs one forward
// of a rank.
struct decode_run {
  std::vector<std::vector<std::int32_t>> prompts;
  std::vector<std::vector<std::uint32_t>> tables;
  decode_run() {
    for (std::uint32_t i = 0; i < 5; ++i) {
      prompts.push_back(engine_prompt(6 + 5 * i, static_cast<std::int32_t>(i), 512));
      tables.emplace_back();
      for (std::uint32_t b = 0; b < 6; ++b)
        tables.back().push_back(i * 6 + b);
    }
  }
  std::vector<inf::sampled_token> run(inf::rank_forward& f, std::byte* arena,
                                      const inf::sampling_config& p, std::uint32_t steps) const {
    auto seqs = prompts;
    for (std::uint32_t i = 0; i < 5; ++i)
      f.forward({{tables[i].data(), 6, 0, seqs[i].data(),
                  static_cast<std::uint32_t>(seqs[i].size() - 1)}},
                arena, inf::logits_rows::last_token);
    std::vector<inf::sampled_token> out;
    for (std::uint32_t s = 0; s < steps; ++s) {
      std::vector<inf::forward_item> items;
      std::vector<inf::sample_draw> draws;
      for (std::uint32_t i = 0; i < 5; ++i) {
        draws.push_back({i, i, 0, s});
        items.push_back({tables[i].data(), 6, static_cast<std::uint32_t>(seqs[i].size() - 1),
                         &seqs[i].back(), 1});
      }
      const auto got = f.forward_sample(items, arena, p, draws);
      for (std::uint32_t i = 0; i < 5; ++i)
        seqs[i].push_back(static_cast<std::int32_t>((s * 31 + i * 7 + 3) % 512));
      out.insert(out.end(), got.begin(), got.end());
    }
    return out;
  }
};

// Prefill + decode logits at TP 2 (NCCL on the device) track TP 1 within the bf16 engine's
// tolerance against the fp32 reference (test_gpu_engine), and both ranks agree bitwise.
TEST(NcclTpEngine, Tp2LogitsTrackTp1AndTheFp32Reference) {
  REQUIRE_TWO_GPUS();
  const auto cfg = refit::testing::small_model();
  const auto w = engine_synthetic(cfg);
  const auto tokens = engine_prompt(37, 4, 512);
  auto comm = cuda::make_nccl_tp_comm({0, 1}, 60000ms);
  gpu_memory mem1;
  auto one = gpu_rig(mem1, cfg, w, model::dtype::bfloat16, 8, 8, true);
  tp2_rig two(cfg, w, *comm, 8, 8, true);
  const auto a = log_softmax_rows(one.logits(tokens, 13, 8), cfg.vocab_size);
  const auto b = log_softmax_rows(two.logits(tokens, 13, 8), cfg.vocab_size);
  const auto reference = reference_logprobs(cfg, w, tokens);
  const double mean_tp2 = mean_abs_delta(b, reference);
  const double mean_between = mean_abs_delta(a, b);
  const double between = max_abs_delta(a, b);
  const double gap = max_abs_delta(b, reference);
  std::cout << "[ measured ] TP-2 (NCCL) vs TP-1: max " << between << " mean " << mean_between
            << "; TP-2 vs fp32 reference: max " << gap << " mean " << mean_tp2 << "\n";
  EXPECT_LT(mean_tp2, 0.02);
  EXPECT_LT(gap, 0.3);
  EXPECT_LT(mean_between, 0.02);
  EXPECT_LT(between, 0.3);
}

// Sampled decode steps at TP 2 replay CUDA graphs (with the NCCL calls captured), pick what
// TP 1 picks (greedy and T=1, teacher-forced) within the graph-vs-eager tolerance, and the
// ranks draw identical tokens.
TEST(NcclTpEngine, Tp2DecodeReplaysCudaGraphsAndSamplesWhatTp1Samples) {
  REQUIRE_TWO_GPUS();
  const auto cfg = refit::testing::small_model();
  const auto w = engine_synthetic(cfg);
  auto comm = cuda::make_nccl_tp_comm({0, 1}, 60000ms);
  gpu_memory mem1;
  auto one = gpu_rig(mem1, cfg, w, model::dtype::bfloat16, 8, 64, true);
  tp2_rig two(cfg, w, *comm, 8, 64, true);
  const decode_run fixture;
  for (float temperature : {0.0f, 1.0f}) {
    SCOPED_TRACE(temperature == 0.0f ? "greedy" : "T=1");
    inf::sampling_config p;
    p.temperature = temperature;
    p.seed = 5;
    const auto a = fixture.run(*one.forward, one.arena, p, 20);
    std::vector<inf::sampled_token> b[2];
    two.both([&](std::uint32_t r) { b[r] = fixture.run(*two.forward[r], two.arena[r], p, 20); });
    ASSERT_EQ(a.size(), b[0].size());
    ASSERT_EQ(b[0].size(), b[1].size());
    std::size_t same = 0;
    float worst = 0.0f;
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(b[0][i].token, b[1][i].token) << "the TP ranks sampled differently at " << i;
      EXPECT_EQ(b[0][i].logprob, b[1][i].logprob) << "at " << i;
      same += a[i].token == b[0][i].token;
      if (a[i].token == b[0][i].token)
        worst = std::max(worst, std::fabs(a[i].logprob - b[0][i].logprob));
    }
    std::cout << "[ measured ] TP-2 graphs vs TP-1: " << same << "/" << a.size()
              << " tokens equal, max |logprob delta| " << worst << "\n";
    EXPECT_GE(same, a.size() * 9 / 10);
    EXPECT_LT(worst, 0.05f);
  }
  for (std::uint32_t r = 0; r < 2; ++r) {
    const auto c = two.forward[r]->counters();
    EXPECT_EQ(c.graph_replays, 40u) << "rank " << r; // 2 temperatures x 20 steps
    EXPECT_GE(c.graph_captures, 1u) << "rank " << r;
  }
}

// One rank steps alone (its peer is gone): the engine's first host synchronization waits
// for the NCCL collectives against the comm's deadline and throws comm_error instead of
// hanging; after reset() both ranks step together again and agree.
TEST(NcclTpEngine, ARankWhosePeerIsGoneFailsWithinTheTimeoutAndTheGroupRecovers) {
  REQUIRE_TWO_GPUS();
  const auto cfg = refit::testing::small_model();
  const auto w = engine_synthetic(cfg);
  const auto tokens = engine_prompt(21, 6, 512);
  auto comm = cuda::make_nccl_tp_comm({0, 1}, 2000ms);
  tp2_rig two(cfg, w, *comm, 8, 8, true);
  std::vector<std::uint32_t> table = {0, 1, 2};
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  try {
    two.forward[0]->forward({{table.data(), 3, 0, tokens.data(), 21}}, two.arena[0],
                            inf::logits_rows::last_token);
    error = "the lone rank's forward returned";
  } catch (const inf::comm_error& e) {
    error = e.what();
  }
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(error.find("2000 ms"), std::string::npos) << error;
  EXPECT_NE(error.find("TP rank 0 on cuda:0"), std::string::npos) << error;
  EXPECT_LT(waited, 60.0);
  comm->reset();
  const auto logits = two.logits(tokens, 13, 8); // both ranks; EXPECTs they agree
  EXPECT_EQ(logits.size(), tokens.size() * cfg.vocab_size);
}

} // namespace
