// The bf16 engine (runtime/inference/torch_fast_forward.cpp) on the CPU: its logits against
// the fp32 reference forward, decode against prefill, paged attention over scattered blocks,
// device-side sampling against the host sampler on the same logits, and the generator's
// continuous batching (mixed lengths, stop tokens, a small batch and a tight KV arena give
// what one roomy batch gives; bitwise deterministic run to run).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "device_sampling_check.hpp"
#include "engine_fixture.hpp"
#include "runtime/inference/generator.hpp"
#include "runtime/inference/sampling.hpp"

namespace {

namespace inf = refit::inference;
namespace model = refit::model;
using refit::testing::engine_prompt;
using refit::testing::engine_rig;
using refit::testing::engine_synthetic;
using refit::testing::log_softmax_rows;
using refit::testing::max_abs_delta;
using refit::testing::mean_abs_delta;
using refit::testing::reference_logprobs;

struct host_memory {
  std::vector<std::vector<std::byte>> blocks;
  const std::byte* place(const std::vector<std::byte>& b) {
    blocks.push_back(b);
    return blocks.back().data();
  }
  std::byte* alloc(std::size_t n) {
    blocks.emplace_back(n);
    return blocks.back().data();
  }
};

engine_rig cpu_rig(host_memory& mem, const model::model_config& cfg,
                   const refit::testing::engine_weights& w, model::dtype dt,
                   std::uint32_t block_size, std::uint32_t blocks) {
  mem.blocks.reserve(4096); // stable pointers
  return engine_rig(cfg, w, dt, block_size, blocks, -1,
                    [&](const std::vector<std::byte>& b) { return mem.place(b); },
                    [&](std::size_t n) { return mem.alloc(n); });
}

TEST(Bf16Engine, LogitsTrackTheFp32ReferenceAndDecodeMatchesPrefill) {
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  const auto tokens = engine_prompt(37);
  host_memory mem;
  auto rig = cpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 8);
  const auto prefill = log_softmax_rows(rig.logits(tokens, 37, 8), cfg.vocab_size);
  const auto mixed = log_softmax_rows(rig.logits(tokens, 13, 8), cfg.vocab_size);
  const auto decode = log_softmax_rows(rig.logits(tokens, 1, 8), cfg.vocab_size);

  const auto reference = reference_logprobs(cfg, w, tokens);
  const double gap = max_abs_delta(prefill, reference);
  const double mean = mean_abs_delta(prefill, reference);
  double magnitude = 0.0;
  for (const double r : reference)
    magnitude = std::max(magnitude, std::fabs(r));
  std::cout << "[ measured ] mean gap " << mean << ", |log-softmax| up to " << magnitude << "\n";
  std::cout << "[ measured ] bf16 engine vs fp32 reference: max |log-softmax delta| " << gap
            << "; decode vs prefill " << max_abs_delta(decode, prefill) << "\n";
  // bf16 keeps ~3 significant digits: the typical entry moves by ~1e-2, the worst (a rare
  // token deep in the tail) by a few tenths.
  EXPECT_LT(mean, 0.02) << "bf16 drifted from the fp32 reference";
  EXPECT_LT(gap, 0.3) << "bf16 drifted from the fp32 reference";
  EXPECT_GT(gap, 0.0) << "the bf16 engine is expected to round (it must not be the fp32 path)";
  EXPECT_LT(max_abs_delta(mixed, prefill), 0.03);
  EXPECT_LT(max_abs_delta(decode, prefill), 0.03);
  // Greedy choices agree with the reference almost everywhere (ties within bf16 aside).
  std::size_t agree = 0;
  const std::size_t v = cfg.vocab_size;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const auto a = std::max_element(prefill.begin() + t * v, prefill.begin() + (t + 1) * v);
    const auto b = std::max_element(reference.begin() + t * v, reference.begin() + (t + 1) * v);
    agree += (a - prefill.begin()) == (b - reference.begin());
  }
  EXPECT_GE(agree, tokens.size() - 2);
}

TEST(Bf16Engine, PagedAttentionOverScatteredBlocksEqualsContiguousBlocks) {
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  const auto tokens = engine_prompt(29, 3);
  const std::uint32_t bs = 4; // 8 blocks: the context crosses 7 block boundaries
  host_memory mem;
  auto rig = cpu_rig(mem, cfg, w, model::dtype::bfloat16, bs, 32);
  const std::vector<std::uint32_t> contiguous = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<std::uint32_t> scattered = {31, 5, 17, 2, 29, 11, 23, 8};
  const auto a = rig.logits_over(contiguous, tokens, 10);
  const auto b = rig.logits_over(scattered, tokens, 10);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(a, b) << "where the blocks live must not change a single bit";
}

TEST(Bf16Engine, DeviceSamplingDrawsWhatTheHostSamplerDrawsFromTheSameLogits) {
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  host_memory mem;
  auto rig = cpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 64);
  refit::testing::expect_device_sampling_matches_host(rig, cfg);
}

// ---------------------------------------------------------------- continuous batching

struct engine_group {
  engine_group(const model::model_config& cfg, const refit::testing::engine_weights& w,
               model::dtype dt, std::uint64_t kv_bytes, std::uint32_t max_batch,
               bool pipeline_decode = true)
    : layout(std::make_shared<const model::tp_layout>(cfg, 1)),
      residents(inf::scatter_residents(cfg, 1, 0, w.params, w.pointers())),
      arena(kv_bytes) {
    inf::engine_options o;
    o.block_size = 8;
    o.compute_dtype = dt;
    o.max_batch = max_batch;
    o.pipeline_decode = pipeline_decode;
    engine = std::make_unique<inf::engine>(cfg, layout, 0, arena.data(), kv_bytes, o);
  }
  std::vector<inf::generation> generate(const inf::generate_input& in, inf::generate_stats* st) {
    return engine->generate(residents.pointers(), comm, in, 0, st);
  }
  std::shared_ptr<const model::tp_layout> layout;
  inf::resident_set residents;
  std::vector<std::byte> arena;
  inf::single_rank_comm comm;
  std::unique_ptr<inf::engine> engine;
};

inf::generate_input mixed_request(const model::model_config& cfg) {
  inf::generate_input in;
  for (std::int32_t i = 0; i < 9; ++i)
    in.prompts.push_back(engine_prompt(3 + static_cast<std::size_t>((i * 7) % 23), i));
  in.params.n = 2;
  in.params.max_tokens = 12;
  in.params.temperature = 0.9f;
  in.params.seed = 77;
  // Two frequent ids of the tiny model stop some samples early.
  in.params.stop_token_ids = {17, 200};
  (void)cfg;
  return in;
}

TEST(ContinuousBatching, ASmallBatchAndATightArenaGiveWhatOneRoomyBatchGives) {
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  const auto in = mixed_request(cfg);
  const std::uint64_t block = inf::kv_geometry::of(cfg, 1, 8).block_bytes();
  engine_group roomy(cfg, w, model::dtype::float32, 4u << 20, 256);
  engine_group tight(cfg, w, model::dtype::float32, 12 * block, 3); // 3 slots, 12 blocks
  inf::generate_stats a_st, b_st;
  const auto a = roomy.generate(in, &a_st);
  const auto b = tight.generate(in, &b_st);
  EXPECT_EQ(a_st.waves, 1u);
  EXPECT_GT(b_st.waves, 3u) << "prompts must be admitted as others finish";
  EXPECT_GT(a_st.max_live_samples, 12u); // all admitted at once (first-token stops aside)
  EXPECT_LE(b_st.max_live_samples, 3u);
  ASSERT_EQ(a.size(), b.size());
  std::size_t stopped = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].token_ids, b[i].token_ids) << "sample " << i;
    EXPECT_EQ(a[i].finish_reason, b[i].finish_reason) << "sample " << i;
    ASSERT_EQ(a[i].logprobs.size(), b[i].logprobs.size());
    for (std::size_t t = 0; t < a[i].logprobs.size(); ++t)
      EXPECT_NEAR(a[i].logprobs[t], b[i].logprobs[t], 1e-5) << "sample " << i << " token " << t;
    if (a[i].finish_reason == "stop") {
      ++stopped;
      EXPECT_TRUE(a[i].token_ids.back() == 17 || a[i].token_ids.back() == 200);
      EXPECT_LT(a[i].token_ids.size(), 12u);
    } else {
      EXPECT_EQ(a[i].token_ids.size(), 12u);
    }
  }
  EXPECT_GT(stopped, 0u) << "the request must exercise early stops";
  EXPECT_LT(stopped, a.size());
  EXPECT_EQ(tight.engine->available_blocks(), 12u) << "every block is released";
}

TEST(ContinuousBatching, TheBf16EngineIsBitwiseDeterministicRunToRun) {
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  const auto in = mixed_request(cfg);
  const std::uint64_t block = inf::kv_geometry::of(cfg, 1, 8, 2).block_bytes();
  engine_group group(cfg, w, model::dtype::bfloat16, 16 * block, 4);
  inf::generate_stats st;
  const auto first = group.generate(in, &st);
  group.engine->reset_prefix_cache();
  const auto second = group.generate(in, nullptr);
  ASSERT_EQ(first.size(), second.size());
  for (std::size_t i = 0; i < first.size(); ++i)
    EXPECT_TRUE(first[i] == second[i]) << "sample " << i;
  EXPECT_GT(st.waves, 1u);
  EXPECT_LE(st.max_live_samples, 4u);
  EXPECT_EQ(group.engine->available_blocks(), 16u);
  // The bf16 cache holds twice the positions of the fp32 one in the same bytes.
  inf::engine_options fp32_options;
  fp32_options.block_size = 8;
  EXPECT_EQ(inf::engine_kv_geometry(cfg, 1, fp32_options).block_bytes(), 2 * block);
}

// Pipelined decode (engine_options::pipeline_decode: step N + 1 begun before step N's tokens
// reach the host, its input tokens fed from step N's draws on the device) draws what the
// synchronous schedule draws, bit for bit: tokens, logprobs and finish reasons, with stop
// tokens mid-flight (their dropped rows), n > 1 and prompts admitted in waves (a step in
// flight only once every prompt is in); every block comes back, and the engine still counts
// one step per landed step.
TEST(ContinuousBatching, PipelinedDecodeDrawsWhatTheSynchronousScheduleDraws) {
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  const auto in = mixed_request(cfg);
  const std::uint64_t block = inf::kv_geometry::of(cfg, 1, 8, 2).block_bytes();
  for (const std::uint32_t slots : {4u, 64u}) {
    SCOPED_TRACE("max_batch " + std::to_string(slots));
    engine_group sync(cfg, w, model::dtype::bfloat16, 64 * block, slots, false);
    engine_group piped(cfg, w, model::dtype::bfloat16, 64 * block, slots, true);
    inf::generate_stats a_st, b_st;
    const auto a = sync.generate(in, &a_st);
    const auto b = piped.generate(in, &b_st);
    ASSERT_EQ(a.size(), b.size());
    std::size_t stopped = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(a[i] == b[i]) << "sample " << i; // tokens, finish reason, logprob bits
      stopped += a[i].finish_reason == "stop" && a[i].token_ids.size() < 12u;
    }
    EXPECT_GT(stopped, 0u) << "stops must land while a step is in flight";
    EXPECT_EQ(a_st.generated_tokens, b_st.generated_tokens);
    EXPECT_EQ(a_st.decode_tokens, b_st.decode_tokens) << "dropped rows are not tokens";
    EXPECT_EQ(a_st.decode_kv_positions, b_st.decode_kv_positions);
    EXPECT_EQ(a_st.waves, b_st.waves);
    // Rows of stopped samples can make a step the synchronous schedule does not run.
    EXPECT_EQ(b_st.forward_passes - a_st.forward_passes, b_st.decode_steps - a_st.decode_steps);
    EXPECT_GE(b_st.decode_steps, a_st.decode_steps);
    EXPECT_EQ(a_st.decode_steps_ahead, 0u);
    EXPECT_EQ(a_st.decode_rows_dropped, 0u);
    EXPECT_GT(b_st.decode_steps_ahead, 0u) << "the steps after the last admission run ahead";
    if (slots == 64u) { // every prompt admitted at once: the whole decode runs ahead
      EXPECT_GT(b_st.decode_steps_ahead, a_st.decode_steps / 2);
      EXPECT_GT(b_st.decode_rows_dropped, 0u) << "a stop must land with its next row in flight";
    }
    EXPECT_EQ(piped.engine->available_blocks(), 64u) << "every block is released";
    EXPECT_EQ(sync.engine->available_blocks(), 64u);
  }
}

// A bf16 CPU forward that pipelines, with a 5-token prompt in two blocks: its prefill, the
// one-token step after it and one draw.
class PipelinedSteps : public ::testing::Test {
protected:
  void SetUp() override { ASSERT_TRUE(f.pipelines_samples()); }
  model::model_config cfg = refit::testing::tiny_model();
  refit::testing::engine_weights w = engine_synthetic(cfg);
  host_memory mem;
  engine_rig rig = cpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 8);
  inf::rank_forward& f = *rig.forward;
  std::byte* arena = rig.arena;
  std::vector<std::int32_t> prompt = engine_prompt(5);
  std::vector<std::uint32_t> blocks = {0, 1};
  std::vector<inf::forward_item> prefill{{blocks.data(), 2, 0, prompt.data(), 5}};
  std::vector<inf::forward_item> step{{blocks.data(), 2, 5, prompt.data() + 4, 1}};
  std::vector<inf::sample_draw> one{{0, 0, 0, 0}};
  inf::sampling_config params;
  // `call` throws an error whose text names `words`.
  static void refused(const std::function<void()>& call, const std::string& words) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected an error naming " << words;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
};

// begin_sample's protocol errors are refused with what was wrong: a feed of the wrong length,
// a feed into a prompt of several tokens, a feed with nothing begun before, finish_sample
// with nothing begun, and a synchronous step while a begun one is not finished.
TEST_F(PipelinedSteps, RefuseBrokenFeedsNamingThem) {
  refused([&] { f.begin_sample(prefill, arena, params, one, {0, 0}); }, "2 feed entries");
  refused([&] { f.begin_sample(prefill, arena, params, one, {0}); }, "an item of 5 tokens");
  refused([&] { (void)f.finish_sample(); }, "without a begun step");
  refused([&] { f.begin_sample(step, arena, params, one, {0}); }, "no begun step");
  f.begin_sample(prefill, arena, params, one, {-1});
  refused([&] { f.begin_sample(step, arena, params, one, {3}); }, "drew 1 tokens");
  refused([&] { (void)f.forward_sample(step, arena, params, one); }, "not finished");
  f.begin_sample(step, arena, params, one, {0}); // the prefill's draw feeds the step
  const auto first = f.finish_sample();
  const auto second = f.finish_sample();
  ASSERT_EQ(first.size(), 1u);
  ASSERT_EQ(second.size(), 1u);
  // The same two steps synchronously, the first draw's token fed by hand.
  std::vector<std::int32_t> fed = {first[0].token};
  const std::vector<inf::forward_item> by_hand = {{blocks.data(), 2, 5, fed.data(), 1}};
  EXPECT_EQ(f.forward_sample(prefill, arena, params, one)[0].token, first[0].token);
  const auto again = f.forward_sample(by_hand, arena, params, one);
  EXPECT_EQ(again[0].token, second[0].token);
  EXPECT_EQ(again[0].logprob, second[0].logprob);
}

// drop_samples (what the generator calls when a request fails with steps in flight) forgets
// every begun step: nothing is left to finish, a feed has nothing to feed from, a synchronous
// step runs again, and the same two steps begun afresh draw what they drew before the drop.
TEST_F(PipelinedSteps, DroppedStepsLeaveNothingBehind) {
  params.temperature = 0.8f;
  params.seed = 5;
  const auto run_two = [&] {
    f.begin_sample(prefill, arena, params, one, {-1});
    f.begin_sample(step, arena, params, one, {0});
    const auto a = f.finish_sample();
    const auto b = f.finish_sample();
    return std::vector<inf::sampled_token>{a.at(0), b.at(0)};
  };
  const auto before = run_two();
  f.begin_sample(prefill, arena, params, one, {-1});
  f.begin_sample(step, arena, params, one, {0});
  f.drop_samples();
  refused([&] { (void)f.finish_sample(); }, "without a begun step"); // nothing to finish
  refused([&] { f.begin_sample(step, arena, params, one, {0}); }, "no begun step"); // no feed
  EXPECT_EQ(f.forward_sample(prefill, arena, params, one).at(0).token, before[0].token)
    << "a synchronous step runs after the drop";
  f.drop_samples(); // nothing begun: a no-op
  const auto after = run_two();
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(after[i].token, before[i].token) << "step " << i;
    EXPECT_EQ(after[i].logprob, before[i].logprob) << "step " << i;
  }
}

} // namespace

namespace {

// SCORE on an engine whose cache is bf16: the fp32 forward reuses each bf16 block as an fp32
// block of half the positions, so teacher forcing still matches the fp32 reference, and the
// engine's blocks all come back.
TEST(Bf16Engine, ScoreOnTheBf16ArenaIsTheFp32Reference) {
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  const std::uint64_t block = inf::kv_geometry::of(cfg, 1, 8, 2).block_bytes();
  engine_group group(cfg, w, model::dtype::bfloat16, 24 * block, 8);
  std::vector<std::vector<std::int32_t>> sequences = {engine_prompt(19, 1), engine_prompt(33, 2),
                                                      engine_prompt(7, 3)};
  const auto scored = group.engine->score(group.residents.pointers(), group.comm, sequences, 3);
  ASSERT_EQ(scored.size(), sequences.size());
  inf::sampling_config plain;
  std::vector<inf::scored_sequence> seqs;
  for (const auto& s : sequences)
    seqs.push_back({{s.begin(), s.begin() + 3}, {s.begin() + 3, s.end()}});
  const auto want = inf::reference_logprobs(cfg, w.params, w.pointers(), seqs, plain);
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    ASSERT_EQ(scored[i].size(), sequences[i].size() - 3) << "sequence " << i;
    for (std::size_t t = 0; t < scored[i].size(); ++t)
      EXPECT_NEAR(scored[i][t], want[i][t], 1e-5) << "sequence " << i << " token " << t;
  }
  EXPECT_EQ(group.engine->available_blocks(), 24u);
  // A sequence longer than the arena holds in fp32 blocks is refused naming it.
  EXPECT_THROW(group.engine->score(group.residents.pointers(), group.comm,
                                   {engine_prompt(24 * 4 + 2, 4)}, 1),
               inf::request_error);
}

} // namespace

namespace {

// The engine's tuning knobs are environment variables read when an engine is built: each of
// `bad` must be refused with a message naming `name`=value and saying `why`; each of `good`
// must be taken (the engine then computes logits).
void expect_engine_knob(const char* name, std::vector<const char*> bad, const std::string& why,
                        std::vector<const char*> good) {
  const auto cfg = refit::testing::tiny_model();
  const auto w = engine_synthetic(cfg);
  struct env_guard {
    const char* name;
    ~env_guard() { ::unsetenv(name); }
  } guard{name};
  for (const char* value : bad) {
    ::setenv(name, value, 1);
    host_memory mem;
    try {
      auto rig = cpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 8);
      ADD_FAILURE() << name << "=" << value << " was taken";
    } catch (const std::exception& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(std::string(name) + "=" + value + why), std::string::npos) << what;
    }
  }
  for (const char* value : good) {
    ::setenv(name, value, 1);
    host_memory mem;
    auto rig = cpu_rig(mem, cfg, w, model::dtype::bfloat16, 8, 8);
    EXPECT_EQ(rig.logits(engine_prompt(9), 9, 8).size(), std::size_t{9} * cfg.vocab_size)
      << name << "=" << value;
  }
}

} // namespace

// REFIT_PDL (programmatic dependent launch of the CUDA kernels) is 0 or 1, on CPU as on GPU.
TEST(Bf16Engine, AProgrammaticLaunchKnobThatIsNotZeroOrOneIsRefused) {
  expect_engine_knob("REFIT_PDL", {"yes", "2", "1 "}, " is not 0 or 1", {"0", "1"});
}

// The tensor-core expert knobs: REFIT_EXPERT_MMA_MAX_COPIES is a count of routed copies,
// REFIT_EXPERT_MMA_KSPLIT one of the k-splits the kernel has, REFIT_EXPERT_MMA_CHUNKS one of its
// register stagings, REFIT_EXPERT_MMA_EVICT_FIRST 0 or 1, REFIT_DENSE_MMA_MAX_ROWS a row count
// up to 64, REFIT_DENSE_GEMV_MAX_ROWS up to 8, REFIT_FUSED_SAMPLING, REFIT_ATTENTION_FUSED_QK,
// REFIT_ROUTER_SPLIT, REFIT_LOGITS_FP32 and REFIT_RESIDUAL_FP32 0 or 1, REFIT_ATTENTION_MMA 0,
// 1 or 2, REFIT_EXPERT_MMA_STAGES 0, 4 or 8, REFIT_EXPERT_MMA_EARLY and
// REFIT_EXPERT_MMA_PERSISTENT 0, 1 or 2, REFIT_EXPERT_SELF_SORT 0 or 1,
// REFIT_ROUTE_BUCKET_MAX_TOKENS up to 256,
// REFIT_ROUTER_MMA_MAX_ROWS up to 128 and REFIT_ATTENTION_SPLITS up to 16.
TEST(Bf16Engine, ExpertMmaKnobsOutsideTheirRangesAreRefusedNamingTheVariable) {
  expect_engine_knob("REFIT_EXPERT_MMA_MAX_COPIES", {"many", "-4", "4096 "}, " is not a count",
                     {"0", "4096"});
  expect_engine_knob("REFIT_EXPERT_MMA_KSPLIT", {"3", "16", "-1", "two"},
                     " is not 0, 1, 2, 4 or 8", {"0", "4"});
  expect_engine_knob("REFIT_EXPERT_MMA_CHUNKS", {"0", "3", "8"}, " is not 1, 2 or 4", {"2"});
  expect_engine_knob("REFIT_EXPERT_MMA_EVICT_FIRST", {"2", "yes", "-1"}, " is not 0 or 1",
                     {"0", "1"});
  expect_engine_knob("REFIT_DENSE_MMA_MAX_ROWS", {"65", "x", "-1"}, " is not a count of rows",
                     {"0", "64"});
  expect_engine_knob("REFIT_DENSE_GEMV_MAX_ROWS", {"9", "eight"}, " is not a count of rows",
                     {"0", "8"});
  expect_engine_knob("REFIT_FUSED_SAMPLING", {"2", "on"}, " is not 0 or 1", {"0", "1"});
  expect_engine_knob("REFIT_ATTENTION_FUSED_QK", {"2", "qk"}, " is not 0 or 1", {"0", "1"});
  expect_engine_knob("REFIT_ROUTER_SPLIT", {"2", "split"}, " is not 0 or 1", {"0", "1"});
  expect_engine_knob("REFIT_LOGITS_FP32", {"fp32", "-1"}, " is not 0 or 1", {"0", "1"});
  expect_engine_knob("REFIT_RESIDUAL_FP32", {"2", "yes"}, " is not 0 or 1", {"0", "1"});
  expect_engine_knob("REFIT_ATTENTION_MMA", {"mma", "3"}, " is not 0, 1 or 2", {"0", "1", "2"});
  expect_engine_knob("REFIT_EXPERT_MMA_STAGES", {"2", "16", "four"}, " is not 0, 4 or 8",
                     {"0", "4", "8"});
  expect_engine_knob("REFIT_EXPERT_MMA_EARLY", {"2", "early"}, " is not 0 or 1", {"0", "1"});
  expect_engine_knob("REFIT_EXPERT_MMA_PERSISTENT", {"3", "yes"}, " is not 0, 1 or 2",
                     {"0", "1", "2"});
  expect_engine_knob("REFIT_EXPERT_SELF_SORT", {"2", "sort"}, " is not 0 or 1", {"0", "1"});
  expect_engine_knob("REFIT_ROUTE_BUCKET_MAX_TOKENS", {"257", "all", "-1"},
                     " is not a count of tokens", {"0", "64", "256"});
  expect_engine_knob("REFIT_ROUTER_MMA_MAX_ROWS", {"129", "rows", "-1"},
                     " is not a count of rows", {"0", "128"});
  expect_engine_knob("REFIT_ATTENTION_SPLITS", {"17", "auto", "-2"}, " is not a count of splits",
                     {"0", "1", "16"});
  expect_engine_knob("REFIT_PIPELINE_DECODE", {"2", "on"}, " is not 0 or 1", {"0", "1"});
}

// The expert-GEMV tuning knob (REFIT_EXPERT_GEMV_MAX_COPIES) is a count of routed copies.
TEST(Bf16Engine, AnExpertGemvKnobThatIsNotACountIsRefusedNamingTheVariable) {
  expect_engine_knob("REFIT_EXPERT_GEMV_MAX_COPIES", {"eight", "-1", "12x", "1000001"},
                     " is not a count", {"0"});
}
