// The bf16 engine on a GPU (label gpu): logits against the fp32 reference and the CPU bf16
// engine, paged attention across block boundaries, CUDA-graph replay against eager steps,
// device sampling against the host sampler, and bitwise determinism of generation with
// continuous batching.
#include <gtest/gtest.h>

#include <iostream>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "engine_fixture.hpp"
#include "device_sampling_check.hpp"
#include "gpu_engine_fixture.hpp"
#include "gpu_fixture.hpp"
#include "runtime/cuda/cuda.hpp"
#include "runtime/inference/generator.hpp"

namespace {

namespace inf = refit::inference;
namespace model = refit::model;
namespace cuda = refit::cuda;
using refit::testing::engine_prompt;
using refit::testing::engine_rig;
using refit::testing::engine_synthetic;
using refit::testing::gpu_memory;
using refit::testing::gpu_rig;
using refit::testing::log_softmax_rows;
using refit::testing::max_abs_delta;
using refit::testing::mean_abs_delta;
using refit::testing::reference_logprobs;

#define REQUIRE_GPU() REQUIRE_GPUS(1)

// Environment variables set while it lives (the engine reads its knobs when it is built).
struct scoped_env {
  std::vector<std::string> names;
  explicit scoped_env(const std::vector<std::pair<std::string, std::string>>& vars) {
    for (const auto& [name, value] : vars) {
      ::setenv(name.c_str(), value.c_str(), 1);
      names.push_back(name);
    }
  }
  ~scoped_env() {
    for (const auto& n : names)
      ::unsetenv(n.c_str());
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;
};

using env_vars = std::vector<std::pair<std::string, std::string>>;

// The fused kernels (head_dim 64 reaches every one of them) against the ATen chains and the
// fp32 reference, over a prefill of 11 rows and 30 decode steps of one row crossing block
// boundaries, the fused engine built under `knobs` (the ATen rig ignores them). By default
// qkv / o_proj / the router of the prefill and of the decode rows take the dense tensor-core
// kernel, and the routed copies (44, then 4) the expert one.
void expect_fused_matches_aten(const env_vars& knobs, inf::forward_counters* counters = nullptr) {
  const auto cfg = refit::testing::small_model();
  const auto w = engine_synthetic(cfg);
  const auto tokens = engine_prompt(41, 2, 512);
  gpu_memory mem;
  const scoped_env env(knobs);
  auto fused = gpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 8, true, true);
  auto aten = gpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 8, true, false);
  const auto a = log_softmax_rows(fused.logits(tokens, 11, 8), cfg.vocab_size);
  const auto b = log_softmax_rows(aten.logits(tokens, 11, 8), cfg.vocab_size);
  const auto reference = reference_logprobs(cfg, w, tokens);
  const double mean_fused = mean_abs_delta(a, reference);
  const double mean_aten = mean_abs_delta(b, reference);
  const double between = max_abs_delta(a, b);
  const double max_fused = max_abs_delta(a, reference);
  const double max_aten = max_abs_delta(b, reference);
  std::string label;
  for (const auto& [name, value] : knobs)
    label += name + "=" + value + " ";
  std::cout << "[ measured ] " << (label.empty() ? "defaults " : label) << "fused vs ATen: max "
            << between << "; gap to fp32 (mean, max): fused " << mean_fused << ", " << max_fused
            << "; ATen " << mean_aten << ", " << max_aten << "\n";
  // The fused paths keep more in fp32 than the ATen chains (the split router, fp32 o_proj and
  // expert outputs), so they may differ from them by the ATen chains' own error: they must be
  // close to them, or else closer to the fp32 reference than they are.
  EXPECT_TRUE(between < 0.1 || max_fused < max_aten)
    << "fused vs ATen: max " << between << "; max gap to fp32: fused " << max_fused << ", ATen "
    << max_aten;
  EXPECT_LT(mean_fused, 0.02);
  EXPECT_LT(mean_fused, 1.5 * mean_aten + 1e-4) << "the fused kernels lose accuracy";
  EXPECT_GT(fused.forward->counters().decode_expert_loads, 0u);
  const double fused_loads = double(fused.forward->counters().decode_expert_loads);
  const double aten_loads = double(aten.forward->counters().decode_expert_loads);
  EXPECT_NEAR(fused_loads / aten_loads, 1.0, 0.05) << "both paths count the routed experts";
  if (counters != nullptr)
    *counters = fused.forward->counters();
}

TEST(GpuEngine, FusedKernelsComputeWhatTheAtenPathComputes) {
  REQUIRE_GPU();
  expect_fused_matches_aten({});
}

// The dense and expert GEMVs at the decode rows, the grouped GEMM and cuBLAS elsewhere.
TEST(GpuEngine, FusedKernelsWithoutTheTensorCoreKernelsComputeWhatTheAtenPathComputes) {
  REQUIRE_GPU();
  expect_fused_matches_aten({{"REFIT_EXPERT_GEMV_MAX_COPIES", "8"},
                             {"REFIT_EXPERT_MMA_MAX_COPIES", "0"},
                             {"REFIT_DENSE_GEMV_MAX_ROWS", "8"},
                             {"REFIT_DENSE_MMA_MAX_ROWS", "0"}});
}

TEST(GpuEngine, TensorCoreExpertsInEveryStepComputeWhatTheAtenPathComputes) {
  REQUIRE_GPU();
  expect_fused_matches_aten({{"REFIT_EXPERT_GEMV_MAX_COPIES", "0"},
                             {"REFIT_EXPERT_MMA_MAX_COPIES", "4096"}});
}

// The experts through the resident-warp kernel (k-split 1 forced, so every step takes it) and
// routing + the counting sort in one kernel at every row count up to 256.
TEST(GpuEngine, PersistentExpertsAndOneKernelRoutingComputeWhatTheAtenPathComputes) {
  REQUIRE_GPU();
  expect_fused_matches_aten({{"REFIT_EXPERT_MMA_PERSISTENT", "1"},
                             {"REFIT_EXPERT_MMA_KSPLIT", "1"},
                             {"REFIT_ROUTE_BUCKET_MAX_TOKENS", "256"}});
}

// The router from bf16 h with bf16 logits, the lm_head, o_proj and the experts' down rounded to
// bf16, attention on CUDA cores (the paths before the split router, the fp32 outputs and the
// tensor-core attention).
TEST(GpuEngine, FusedKernelsWithBf16OutputsAndCudaCoreAttentionComputeWhatTheAtenPathComputes) {
  REQUIRE_GPU();
  expect_fused_matches_aten({{"REFIT_ROUTER_SPLIT", "0"},
                             {"REFIT_LOGITS_FP32", "0"},
                             {"REFIT_RESIDUAL_FP32", "0"},
                             {"REFIT_ATTENTION_MMA", "0"}});
}

// Decode attention by default: mode 2 with its own q/k norm + RoPE + K/V writes (the one-row
// decode steps split each sequence: the split holding the last position writes it); here mode 2
// after the q/k kernel, and mode 1 (the query heads as the mma rows).
TEST(GpuEngine, TransposedAttentionAfterTheQkKernelAndModeOneComputeWhatTheAtenPathComputes) {
  REQUIRE_GPU();
  expect_fused_matches_aten({{"REFIT_ATTENTION_MMA", "2"}, {"REFIT_ATTENTION_FUSED_QK", "0"}});
  expect_fused_matches_aten({{"REFIT_ATTENTION_MMA", "1"}});
}

// The early mix (the default; hidden 256: a thread per 8 columns) reads the routing before its
// wait and sums in the same order: the same logits as the plain mix, bit for bit, over the
// prefill and every decode step.
// qkv, o_proj and the router's two parts of the prefill rows and the decode rows on the
// preloading GEMM (kernels::preload_gemm; the small model's hidden size 256 takes its small
// shapes), instead of dense_mma and cuBLAS.
const env_vars preload_knobs = {{"REFIT_PRELOAD_GEMM", "2"},
                                {"REFIT_DENSE_MMA_MAX_ROWS", "0"},
                                {"REFIT_ROUTER_MMA_MAX_ROWS", "0"}};

TEST(GpuEngine, ThePreloadingGemmComputesWhatTheAtenPathComputes) {
  REQUIRE_GPU();
  inf::forward_counters c;
  expect_fused_matches_aten(preload_knobs, &c);
  // At least the prefill's three projections in both layers.
  EXPECT_GE(c.preload_gemms, 3u * 2u);
}

TEST(GpuEngine, TheEarlyMixGivesTheSameLogitsBitwise) {
  REQUIRE_GPU();
  const auto cfg = refit::testing::small_model();
  const auto w = engine_synthetic(cfg);
  const auto tokens = engine_prompt(41, 2, 512);
  gpu_memory mem;
  std::vector<float> want;
  {
    const scoped_env env(env_vars{{"REFIT_MIX_EARLY", "0"}});
    auto plain = gpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 8, true, true);
    want = plain.logits(tokens, 11, 8);
  }
  auto early = gpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 8, true, true);
  const auto got = early.logits(tokens, 11, 8);
  ASSERT_EQ(got.size(), want.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    differ += got[i] != want[i] ? 1 : 0;
  EXPECT_EQ(differ, 0u) << "of " << got.size() << " logits";
}

// The resident-warp expert kernels' stage copies by whole row segments
// (REFIT_EXPERT_MMA_LINES) over 20 sequences: a prefill of 4 tokens each (80 rows; its logits)
// and 6 sampled decode steps of 20 rows (captured and replayed as CUDA graphs; their tokens and
// log-probabilities), gate_up sorting in the kernel: the same bits as without them.
TEST(GpuEngine, LineCopiesOfTheExpertWeightsGiveTheSameLogitsAndDrawsBitwise) {
  REQUIRE_GPU();
  const auto cfg = refit::testing::small_model();
  const auto w = engine_synthetic(cfg);
  constexpr std::uint32_t seqs = 20, prompt = 4, steps = 6, per_seq = 2, block = 8;
  const env_vars experts = {{"REFIT_EXPERT_MMA_PERSISTENT", "1"},
                            {"REFIT_EXPERT_MMA_KSPLIT", "1"},
                            {"REFIT_EXPERT_GEMV_MAX_COPIES", "0"},
                            {"REFIT_EXPERT_MMA_MAX_COPIES", "4096"}};
  gpu_memory mem;
  struct result {
    std::vector<float> logits; // the prefill's
    std::vector<inf::sampled_token> draws;
    inf::forward_counters counters;
  };
  const auto run = [&](bool lines) {
    env_vars knobs = experts;
    knobs.emplace_back("REFIT_EXPERT_MMA_LINES", lines ? "1" : "0");
    const scoped_env env(knobs);
    auto rig = gpu_rig(mem, cfg, w, model::dtype::bfloat16, block, seqs * per_seq, true, true);
    std::vector<std::vector<std::uint32_t>> tables(seqs);
    std::vector<std::vector<std::int32_t>> tokens(seqs);
    std::vector<inf::forward_item> items;
    for (std::uint32_t i = 0; i < seqs; ++i) {
      for (std::uint32_t b = 0; b < per_seq; ++b)
        tables[i].push_back(i * per_seq + b);
      tokens[i] = engine_prompt(prompt + steps, static_cast<std::int32_t>(i), 512);
      items.push_back({tables[i].data(), per_seq, 0, tokens[i].data(), prompt});
    }
    result r;
    r.logits = rig.forward->forward(items, rig.arena, inf::logits_rows::last_token);
    inf::sampling_config p;
    p.temperature = 1.0f;
    p.seed = 9;
    for (std::uint32_t step = 0; step < steps; ++step) { // teacher-forced: the prompt's tokens
      std::vector<inf::sample_draw> draws;
      for (std::uint32_t i = 0; i < seqs; ++i) {
        items[i] = {tables[i].data(), per_seq, prompt + step, tokens[i].data() + prompt + step, 1};
        draws.push_back({i, i, 0, step});
      }
      const auto got = rig.forward->forward_sample(items, rig.arena, p, draws);
      r.draws.insert(r.draws.end(), got.begin(), got.end());
    }
    r.counters = rig.forward->counters();
    return r;
  };
  const result want = run(false);
  const result got = run(true);
  ASSERT_EQ(got.logits.size(), std::size_t{seqs} * cfg.vocab_size);
  ASSERT_EQ(got.logits.size(), want.logits.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < got.logits.size(); ++i)
    differ += got.logits[i] != want.logits[i] ? 1 : 0;
  EXPECT_EQ(differ, 0u) << "of " << got.logits.size() << " prefill logits";
  ASSERT_EQ(got.draws.size(), std::size_t{seqs} * steps);
  ASSERT_EQ(got.draws.size(), want.draws.size());
  for (std::size_t i = 0; i < got.draws.size(); ++i) {
    EXPECT_EQ(got.draws[i].token, want.draws[i].token) << "draw " << i;
    EXPECT_EQ(got.draws[i].logprob, want.draws[i].logprob) << "draw " << i;
  }
  EXPECT_EQ(got.counters.graph_replays, std::uint64_t{steps});
}

TEST(GpuEngine, Bf16LogitsTrackTheFp32ReferenceAndTheCpuEngine) {
  REQUIRE_GPU();
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  const auto tokens = engine_prompt(37);
  gpu_memory mem;
  auto rig = gpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 8);
  const auto gpu = log_softmax_rows(rig.logits(tokens, 13, 8), cfg.vocab_size);
  const auto reference = reference_logprobs(cfg, w, tokens);
  const double mean = mean_abs_delta(gpu, reference);
  const double gap = max_abs_delta(gpu, reference);
  std::cout << "[ measured ] GPU bf16 engine vs fp32 reference: max " << gap << " mean " << mean
            << "\n";
  EXPECT_LT(mean, 0.02);
  EXPECT_LT(gap, 0.3);
  EXPECT_GT(gap, 0.0);
}

TEST(GpuEngine, PagedAttentionAcrossBlockBoundaries) {
  REQUIRE_GPU();
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  const auto tokens = engine_prompt(29, 3);
  gpu_memory mem;
  auto rig = gpu_rig(mem, cfg, w, model::dtype::bfloat16, 4, 32);
  EXPECT_EQ(rig.logits_over({0, 1, 2, 3, 4, 5, 6, 7}, tokens, 10),
            rig.logits_over({31, 5, 17, 2, 29, 11, 23, 8}, tokens, 10));
}

// Five prefilled sequences, then decode steps sampled through forward_sample.
struct decode_fixture {
  explicit decode_fixture(engine_rig& r) : rig(r) {
    for (std::uint32_t i = 0; i < 5; ++i) {
      prompts.push_back(engine_prompt(6 + 5 * i, static_cast<std::int32_t>(i)));
      tables.emplace_back();
      for (std::uint32_t b = 0; b < 6; ++b)
        tables.back().push_back(i * 6 + b);
    }
  }
  // Prefill, then `steps` sampled decode steps; returns every sampled token and logprob.
  std::vector<inf::sampled_token> run(const inf::sampling_config& p, std::uint32_t steps) {
    auto seqs = prompts;
    for (std::uint32_t i = 0; i < 5; ++i)
      rig.forward->forward({{tables[i].data(), 6, 0, seqs[i].data(),
                             static_cast<std::uint32_t>(seqs[i].size() - 1)}},
                           rig.arena, inf::logits_rows::last_token);
    std::vector<inf::sampled_token> out;
    for (std::uint32_t s = 0; s < steps; ++s) {
      std::vector<inf::forward_item> items;
      std::vector<inf::sample_draw> draws;
      for (std::uint32_t i = 0; i < 5; ++i) {
        draws.push_back({i, i, 0, s});
        items.push_back({tables[i].data(), 6, static_cast<std::uint32_t>(seqs[i].size() - 1),
                         &seqs[i].back(), 1});
      }
      const auto got = rig.forward->forward_sample(items, rig.arena, p, draws);
      for (std::uint32_t i = 0; i < 5; ++i) // teacher-forced: every step compares alone
        seqs[i].push_back(static_cast<std::int32_t>((s * 31 + i * 7 + 3) % 256));
      out.insert(out.end(), got.begin(), got.end());
    }
    return out;
  }
  engine_rig& rig;
  std::vector<std::vector<std::int32_t>> prompts;
  std::vector<std::vector<std::uint32_t>> tables;
};

// Graphed against eager decode steps of five sequences, greedy and sampled, and graph replays
// against each other; `experts_on_mma`: every step's experts on the tensor-core kernel (the
// default), else the expert and dense GEMVs and the grouped GEMM.
void expect_graph_replay_equals_eager(bool experts_on_mma, const env_vars& more = {},
                                      const model::model_config& cfg = refit::testing::tiny_model(),
                                      inf::forward_counters* counters = nullptr) {
  const auto w = engine_synthetic(cfg);
  gpu_memory mem;
  env_vars knobs = experts_on_mma ? env_vars{{"REFIT_EXPERT_GEMV_MAX_COPIES", "0"},
                                             {"REFIT_EXPERT_MMA_MAX_COPIES", "4096"}}
                                  : env_vars{{"REFIT_EXPERT_GEMV_MAX_COPIES", "8"},
                                             {"REFIT_EXPERT_MMA_MAX_COPIES", "0"},
                                             {"REFIT_DENSE_GEMV_MAX_ROWS", "8"},
                                             {"REFIT_DENSE_MMA_MAX_ROWS", "0"}};
  knobs.insert(knobs.end(), more.begin(), more.end());
  const scoped_env env(knobs);
  auto graphed = gpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 64, true);
  auto eager = gpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 64, false);
  decode_fixture g(graphed), e(eager);
  for (float temperature : {0.0f, 1.0f}) {
    SCOPED_TRACE(temperature == 0.0f ? "greedy" : "T=1");
    inf::sampling_config p;
    p.temperature = temperature;
    p.seed = 5;
    const auto a = g.run(p, 20);
    const auto b = e.run(p, 20);
    const auto again = g.run(p, 20);
    ASSERT_EQ(a.size(), b.size());
    std::size_t same = 0;
    float worst = 0.0f;
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].token, again[i].token) << "graph replay is not deterministic at " << i;
      EXPECT_EQ(a[i].logprob, again[i].logprob) << "graph replay is not deterministic at " << i;
      same += a[i].token == b[i].token;
      if (a[i].token == b[i].token)
        worst = std::max(worst, std::fabs(a[i].logprob - b[i].logprob));
    }
    std::cout << "[ measured ] graph vs eager: " << same << "/" << a.size()
              << " tokens equal, max |logprob delta| " << worst << "\n";
    EXPECT_GE(same, a.size() * 9 / 10) << "graph replay must compute what eager steps compute";
    EXPECT_LT(worst, 0.05f);
  }
  const auto c = graphed.forward->counters();
  EXPECT_EQ(c.graph_replays, 80u); // 2 temperatures x 2 runs x 20 steps
  EXPECT_GE(c.graph_captures, 1u);
  EXPECT_EQ(eager.forward->counters().graph_replays, 0u);
  if (counters != nullptr)
    *counters = c;
}

// The device sampler of the fused engine (one kernel per step without top-k / top-p, the
// ATen chain with them; draws from a captured decode step) against the host sampler on the
// eager step's logits, at a vocabulary below one id per thread of the kernel and above it.
TEST(GpuEngine, DeviceSamplingDrawsWhatTheHostSamplerDrawsFromTheSameLogits) {
  REQUIRE_GPU();
  for (const std::uint32_t vocab : {256u, 5000u}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const auto cfg = refit::testing::tiny_model(vocab);
    const auto w = engine_synthetic(cfg);
    gpu_memory mem;
    auto rig = gpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 64);
    refit::testing::expect_device_sampling_matches_host(rig, cfg);
    EXPECT_GT(rig.forward->counters().graph_replays, 0u);
  }
}

TEST(GpuEngine, CudaGraphReplayEqualsEagerAndIsDeterministic) {
  REQUIRE_GPU();
  expect_graph_replay_equals_eager(false);
}

TEST(GpuEngine, CudaGraphReplayOfTensorCoreExpertsEqualsEagerAndIsDeterministic) {
  REQUIRE_GPU();
  expect_graph_replay_equals_eager(true);
}

// The same through the resident-warp expert kernel and one-kernel routing + sort.
TEST(GpuEngine, CudaGraphReplayOfPersistentExpertsEqualsEagerAndIsDeterministic) {
  REQUIRE_GPU();
  expect_graph_replay_equals_eager(true, {{"REFIT_EXPERT_MMA_PERSISTENT", "1"},
                                          {"REFIT_EXPERT_MMA_KSPLIT", "1"},
                                          {"REFIT_ROUTE_BUCKET_MAX_TOKENS", "256"}});
}

// The same with qkv, o_proj and the router on the preloading GEMM (the small model: its
// hidden size 256 fits the GEMM's small shapes), captured in the step's graph, the mix letting
// the next layer's qkv start before its wait (REFIT_MIX_TRIGGER_EARLY).
TEST(GpuEngine, CudaGraphReplayOfThePreloadingGemmEqualsEagerAndIsDeterministic) {
  REQUIRE_GPU();
  inf::forward_counters c;
  env_vars knobs = preload_knobs;
  knobs.emplace_back("REFIT_MIX_TRIGGER_EARLY", "1");
  const auto cfg = refit::testing::small_model();
  expect_graph_replay_equals_eager(true, knobs, cfg, &c);
  // Every replayed step ran at least qkv and o_proj of each layer on it (a graph's launches
  // are counted at each replay, not at its capture).
  EXPECT_GE(c.preload_gemms, c.graph_replays * 2u * cfg.num_hidden_layers);
}

// A GPU engine over the tiny model's residents (the bf16 engine, CUDA graphs on).
struct gpu_generator {
  gpu_generator(std::uint32_t max_batch, std::uint32_t blocks, bool pipeline)
    : cfg(refit::testing::tiny_model()), w(engine_synthetic(cfg)),
      layout(std::make_shared<const model::tp_layout>(cfg, 1)) {
    const auto host = inf::scatter_residents(cfg, 1, 0, w.params, w.pointers());
    for (const auto& r : host.storage)
      residents.push_back(mem.place(r));
    inf::engine_options o;
    o.block_size = 8;
    o.compute_dtype = model::dtype::bfloat16;
    o.max_batch = max_batch;
    o.cuda_device = 0;
    o.pipeline_decode = pipeline;
    o.copy_kv_block = [](std::byte* dst, const std::byte* src, std::uint64_t n) {
      std::vector<std::byte> bounce(n);
      cuda::copy_to_host(0, bounce.data(), src, n);
      cuda::copy_to_device(0, dst, bounce.data(), n);
    };
    const std::uint64_t kv_bytes = blocks * inf::engine_kv_geometry(cfg, 1, o).block_bytes();
    engine = std::make_unique<inf::engine>(cfg, layout, 0, mem.alloc(kv_bytes), kv_bytes, o);
  }
  std::vector<inf::generation> generate(const inf::generate_input& in, inf::generate_stats* st) {
    return engine->generate(residents, comm, in, 1, st);
  }
  model::model_config cfg;
  refit::testing::engine_weights w;
  std::shared_ptr<const model::tp_layout> layout;
  gpu_memory mem;
  std::vector<const std::byte*> residents;
  inf::single_rank_comm comm;
  std::unique_ptr<inf::engine> engine;
};

inf::generate_input twelve_prompts(std::uint64_t seed) {
  inf::generate_input in;
  for (std::int32_t i = 0; i < 12; ++i)
    in.prompts.push_back(engine_prompt(3 + static_cast<std::size_t>((i * 7) % 23), i));
  in.params.n = 2;
  in.params.max_tokens = 16;
  in.params.temperature = 1.0f;
  in.params.top_p = 0.9f;
  in.params.seed = seed;
  in.params.stop_token_ids = {17};
  return in;
}

TEST(GpuEngine, GenerationWithContinuousBatchingIsBitwiseDeterministic) {
  REQUIRE_GPU();
  gpu_generator g(5, 40, true);
  const auto in = twelve_prompts(3);
  inf::generate_stats st;
  const auto first = g.generate(in, &st);
  g.engine->reset_prefix_cache();
  const auto second = g.generate(in, nullptr);
  ASSERT_EQ(first.size(), second.size());
  for (std::size_t i = 0; i < first.size(); ++i)
    EXPECT_TRUE(first[i] == second[i]) << "sample " << i;
  EXPECT_GT(st.waves, 1u);
  EXPECT_LE(st.max_live_samples, 5u);
  EXPECT_GT(st.graph_replays, 0u);
  EXPECT_EQ(g.engine->available_blocks(), 40u);
}

// Pipelined decode on the GPU (step N + 1's graph replayed before step N's tokens reach the
// host, its tokens fed from step N's draws on the device) draws what the synchronous schedule
// draws: the same tokens, finish reasons and logprob bits, with stops landing while the next
// step is in flight; all samples at once and in waves of 5.
TEST(GpuEngine, PipelinedDecodeDrawsWhatTheSynchronousScheduleDraws) {
  REQUIRE_GPU();
  for (const std::uint32_t slots : {64u, 5u}) {
    SCOPED_TRACE("max_batch " + std::to_string(slots));
    gpu_generator sync(slots, 120, false), piped(slots, 120, true);
    const auto in = twelve_prompts(5);
    inf::generate_stats a_st, b_st;
    const auto a = sync.generate(in, &a_st);
    const auto b = piped.generate(in, &b_st);
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(a[i] == b[i]) << "sample " << i;
    EXPECT_EQ(a_st.decode_tokens, b_st.decode_tokens);
    EXPECT_EQ(a_st.decode_steps_ahead, 0u);
    EXPECT_GT(b_st.decode_steps_ahead, 0u);
    EXPECT_GT(b_st.graph_replays, 0u);
    if (slots == 64u)
      EXPECT_GT(b_st.decode_rows_dropped, 0u) << "a stop must land with its next row in flight";
    EXPECT_EQ(piped.engine->available_blocks(), 120u);
  }
}

} // namespace
