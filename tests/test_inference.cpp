// Unit tests of runtime/inference: sampling (hand-computed processed distributions, masks,
// determinism), the byte tokenizer, the in-process TP collectives (including abort and
// deadline), the Qwen3-MoE forward (against an independent naive double-precision
// implementation written here from the HF definition), TP = 1/2/4 parity with the unsharded
// reference, generation (stop tokens, truncation, n samples, KV capacity, waves) and the
// prefix cache across weight versions.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "engine_fixture.hpp"
#include "model_configs.hpp"
#include "runtime/inference/forward.hpp"
#include "runtime/inference/generator.hpp"
#include "runtime/inference/kv_cache.hpp"
#include "runtime/inference/reference.hpp"
#include "runtime/inference/sampling.hpp"
#include "runtime/inference/tokenizer.hpp"
#include "runtime/inference/tp_comm.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"

namespace {

namespace inf = refit::inference;
namespace model = refit::model;
using namespace std::chrono_literals;

const double neg_inf = -std::numeric_limits<double>::infinity();

// ------------------------------------------------------------------------------- sampling

inf::sampling_config params(float temperature, std::int32_t top_k = 0, float top_p = 1.0f) {
  inf::sampling_config p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  return p;
}

// logits {1, 2, 3, 0.5}; at T = 0.5 the scaled logits are {2, 4, 6, 1}.
const std::vector<float> four_logits = {1.0f, 2.0f, 3.0f, 0.5f};

TEST(Sampling, FullDistributionIsTheTemperatureSoftmax) {
  const auto d = inf::process_logits(four_logits.data(), 4, 0.5f, 0, 1.0f);
  const double total = std::exp(2.0) + std::exp(4.0) + std::exp(6.0) + std::exp(1.0);
  ASSERT_EQ(d.tokens.size(), 4u);
  EXPECT_NEAR(d.logprob_of(0), 2.0 - std::log(total), 1e-12);
  EXPECT_NEAR(d.logprob_of(1), 4.0 - std::log(total), 1e-12);
  EXPECT_NEAR(d.logprob_of(2), 6.0 - std::log(total), 1e-12);
  EXPECT_NEAR(d.logprob_of(3), 1.0 - std::log(total), 1e-12);
  EXPECT_NEAR(std::accumulate(d.probs.begin(), d.probs.end(), 0.0), 1.0, 1e-12);
  EXPECT_EQ(d.argmax, 2);
}

TEST(Sampling, TopKKeepsTheKMostProbableAndRenormalizes) {
  const auto d = inf::process_logits(four_logits.data(), 4, 0.5f, 2, 1.0f);
  const double kept = std::exp(6.0) + std::exp(4.0);
  EXPECT_EQ(d.tokens, (std::vector<std::int32_t>{2, 1}));
  EXPECT_NEAR(d.logprob_of(2), 6.0 - std::log(kept), 1e-12);
  EXPECT_NEAR(d.logprob_of(1), 4.0 - std::log(kept), 1e-12);
  EXPECT_EQ(d.logprob_of(0), neg_inf);
  EXPECT_EQ(d.logprob_of(3), neg_inf);
  EXPECT_NEAR(d.probs[0] + d.probs[1], 1.0, 1e-12);
}

TEST(Sampling, TopPKeepsTheShortestPrefixReachingP) {
  // Full distribution at T = 0.5: p(2) = 0.8618, p(1) = 0.1166, p(0) = 0.0158, p(3) = 0.0058.
  const double total = std::exp(2.0) + std::exp(4.0) + std::exp(6.0) + std::exp(1.0);
  ASSERT_LT(std::exp(6.0) / total, 0.9);
  auto d = inf::process_logits(four_logits.data(), 4, 0.5f, 0, 0.9f);
  EXPECT_EQ(d.tokens, (std::vector<std::int32_t>{2, 1})); // 0.8618 < 0.9 <= 0.9784
  EXPECT_NEAR(d.logprob_of(1), 4.0 - std::log(std::exp(6.0) + std::exp(4.0)), 1e-12);

  d = inf::process_logits(four_logits.data(), 4, 0.5f, 0, 0.85f);
  EXPECT_EQ(d.tokens, (std::vector<std::int32_t>{2})); // 0.8618 >= 0.85
  EXPECT_NEAR(d.logprob_of(2), 0.0, 1e-12);

  // top-p applies to the renormalized top-k distribution: after top-3 (mass e^6 + e^4 + e^2)
  // tokens {2, 1} hold 0.9841 >= 0.98, while on the full distribution they hold only 0.9784,
  // so top-p 0.98 alone also keeps token 0.
  d = inf::process_logits(four_logits.data(), 4, 0.5f, 3, 0.98f);
  EXPECT_EQ(d.tokens, (std::vector<std::int32_t>{2, 1}));
  d = inf::process_logits(four_logits.data(), 4, 0.5f, 0, 0.98f);
  EXPECT_EQ(d.tokens, (std::vector<std::int32_t>{2, 1, 0}));
  EXPECT_NEAR(d.logprob_of(0),
              2.0 - std::log(std::exp(6.0) + std::exp(4.0) + std::exp(2.0)), 1e-12);
}

TEST(Sampling, DisabledFiltersKeepEverything) {
  for (auto [k, p] : {std::pair<std::int32_t, float>{0, 0.0f}, {-1, 1.0f}, {4, 1.0f}, {99, 0.0f}}) {
    const auto d = inf::process_logits(four_logits.data(), 4, 1.0f, k, p);
    EXPECT_EQ(d.tokens.size(), 4u) << "top_k " << k << " top_p " << p;
  }
}

TEST(Sampling, TopKTiesKeepTheLowerTokenId) {
  const std::vector<float> logits = {1.0f, 5.0f, 5.0f, 5.0f, 0.0f};
  const auto d = inf::process_logits(logits.data(), logits.size(), 1.0f, 2, 1.0f);
  EXPECT_EQ(d.tokens, (std::vector<std::int32_t>{1, 2}));
  EXPECT_NEAR(d.logprob_of(1), std::log(0.5), 1e-12);
  EXPECT_EQ(d.argmax, 1);
}

TEST(Sampling, GreedyPicksTheArgmaxAndReportsUnderTemperatureOne) {
  auto p = params(0.0f);
  auto t = inf::sample_token(four_logits.data(), 4, p, 0, 0, 0);
  const double total = std::exp(1.0) + std::exp(2.0) + std::exp(3.0) + std::exp(0.5);
  EXPECT_EQ(t.token, 2);
  EXPECT_NEAR(t.logprob, 3.0 - std::log(total), 1e-6);

  p.top_k = 2; // greedy with top-k: the reported distribution is softmax over {2, 1}
  t = inf::sample_token(four_logits.data(), 4, p, 7, 3, 11);
  EXPECT_EQ(t.token, 2);
  EXPECT_NEAR(t.logprob, 3.0 - std::log(std::exp(3.0) + std::exp(2.0)), 1e-6);
  EXPECT_FLOAT_EQ(inf::processed_logprob(four_logits.data(), 4, p, 2), t.logprob);
  EXPECT_EQ(inf::processed_logprob(four_logits.data(), 4, p, 0), -INFINITY);
}

TEST(Sampling, ReportedLogprobIsTheProcessedLogprobOfTheSampledToken) {
  const auto p = params(0.7f, 3, 0.9f);
  for (std::uint64_t step = 0; step < 200; ++step) {
    const auto t = inf::sample_token(four_logits.data(), 4, p, 1, 2, step);
    EXPECT_FLOAT_EQ(t.logprob, inf::processed_logprob(four_logits.data(), 4, p, t.token));
    EXPECT_NE(t.logprob, -INFINITY);
  }
}

TEST(Sampling, SameCountersGiveTheSameTokenAndSeedsDiffer) {
  std::vector<float> logits(64);
  for (std::size_t i = 0; i < logits.size(); ++i)
    logits[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
  auto p = params(1.0f);
  const auto draw = [&](std::uint64_t seed, std::uint64_t prompt, std::uint64_t sample) {
    p.seed = seed;
    std::vector<std::int32_t> tokens;
    for (std::uint64_t step = 0; step < 48; ++step)
      tokens.push_back(
        inf::sample_token(logits.data(), logits.size(), p, prompt, sample, step).token);
    return tokens;
  };
  EXPECT_EQ(draw(5, 0, 0), draw(5, 0, 0));
  EXPECT_EQ(draw(5, 3, 1), draw(5, 3, 1));
  EXPECT_NE(draw(5, 0, 0), draw(6, 0, 0));
  EXPECT_NE(draw(5, 0, 0), draw(5, 1, 0));
  EXPECT_NE(draw(5, 0, 0), draw(5, 0, 1));
  EXPECT_EQ(inf::sampling_uniform(1, 2, 3, 4), inf::sampling_uniform(1, 2, 3, 4));
  EXPECT_NE(inf::sampling_uniform(1, 2, 3, 4), inf::sampling_uniform(1, 2, 3, 5));
}

TEST(Sampling, EmpiricalFrequenciesMatchTheProcessedDistribution) {
  const auto p = params(0.8f, 3, 0.93f); // top-3 renormalized: 0.7307, 0.2093, 0.0600
  const auto d = inf::process_logits(four_logits.data(), 4, p.temperature, p.top_k, p.top_p);
  ASSERT_EQ(d.tokens, (std::vector<std::int32_t>{2, 1})); // top-3 then top-p drops token 0
  std::map<std::int32_t, int> counts;
  constexpr int draws = 40000;
  double mean_u = 0.0;
  for (int i = 0; i < draws; ++i) {
    const auto step = static_cast<std::uint64_t>(i);
    ++counts[inf::sample_token(four_logits.data(), 4, p, 0, 0, step).token];
    const double u = inf::sampling_uniform(9, 0, 0, static_cast<std::uint64_t>(i));
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    mean_u += u / draws;
  }
  EXPECT_NEAR(mean_u, 0.5, 0.01);
  EXPECT_EQ(counts.count(0), 0u) << "masked by top-p";
  EXPECT_EQ(counts.count(3), 0u) << "masked by top-k";
  EXPECT_NEAR(counts[2] / double(draws), d.probs[0], 0.01);
  EXPECT_NEAR(counts[1] / double(draws), d.probs[1], 0.01);
}

TEST(Sampling, RejectsInvalidParameters) {
  EXPECT_THROW(inf::process_logits(four_logits.data(), 4, -0.5f, 0, 1.0f), std::invalid_argument);
  EXPECT_THROW(inf::process_logits(four_logits.data(), 4, 1.0f, 0, 1.5f), std::invalid_argument);
  EXPECT_THROW(inf::process_logits(four_logits.data(), 0, 1.0f, 0, 1.0f), std::invalid_argument);
}

TEST(Tokenizer, ByteLevelRoundTrip) {
  const std::string text = "Refit h\xC3\xA9llo\n";
  const auto ids = inf::byte_tokenizer::encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[0], 'R');
  EXPECT_EQ(ids[8], 0xA9);
  EXPECT_EQ(inf::byte_tokenizer::decode(ids), text);
  EXPECT_EQ(inf::byte_tokenizer::decode({'o', 300, 'k'}), "o\xEF\xBF\xBDk");
}

// ------------------------------------------------------------------------------- collectives

// Runs body(rank) on `world` threads; returns what each rank threw ("" if nothing).
std::vector<std::string> on_threads(std::uint32_t world,
                                    const std::function<void(std::uint32_t)>& body) {
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (std::uint32_t r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty())
          errors[r] = "?";
      }
    });
  for (auto& t : threads)
    t.join();
  return errors;
}

TEST(TpComm, AllReduceAndAllGatherAreExactOnEveryRankAndReusable) {
  constexpr std::uint32_t world = 4;
  inf::inproc_comm comm(world, 10s);
  std::vector<std::vector<float>> reduced(world), gathered(world);
  const auto errors = on_threads(world, [&](std::uint32_t rank) {
    for (int round = 0; round < 200; ++round) {
      std::vector<float> data = {float(rank + 1), float(round), 0.5f * float(rank)};
      comm.all_reduce_sum(rank, data.data(), data.size());
      if (data != std::vector<float>{10.0f, 4.0f * float(round), 3.0f})
        throw std::runtime_error("bad all_reduce result in round " + std::to_string(round));
      std::vector<float> in = {float(rank), float(round)};
      std::vector<float> out(world * in.size());
      comm.all_gather(rank, in.data(), in.size(), out.data());
      for (std::uint32_t r = 0; r < world; ++r)
        if (out[2 * r] != float(r) || out[2 * r + 1] != float(round))
          throw std::runtime_error("bad all_gather result");
      reduced[rank] = data;
      gathered[rank] = out;
    }
  });
  for (const auto& e : errors)
    EXPECT_EQ(e, "");
  for (std::uint32_t r = 1; r < world; ++r) {
    EXPECT_EQ(reduced[r], reduced[0]);
    EXPECT_EQ(gathered[r], gathered[0]);
  }
  EXPECT_EQ(comm.barriers_completed(), 200u * 4u);
}

TEST(TpComm, AMissingRankTimesOutInsteadOfHanging) {
  inf::inproc_comm comm(3, 200ms);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_threads(3, [&](std::uint32_t rank) {
    if (rank == 2)
      return; // never joins the collective
    float x = 1.0f;
    comm.all_reduce_sum(rank, &x, 1);
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_NE(errors[0].find("ranks; the group is aborted"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1], "");
  EXPECT_EQ(errors[2], "");
  EXPECT_LT(elapsed, 5s);
  EXPECT_TRUE(comm.aborted());

  comm.reset(); // reusable once every rank left
  const auto again = on_threads(3, [&](std::uint32_t rank) {
    float x = float(rank);
    comm.all_reduce_sum(rank, &x, 1);
    if (x != 3.0f)
      throw std::runtime_error("bad sum after reset");
  });
  for (const auto& e : again)
    EXPECT_EQ(e, "");
}

TEST(TpComm, AbortFromAFailingRankReleasesTheOthersAtOnce) {
  inf::inproc_comm comm(4, 60s);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_threads(4, [&](std::uint32_t rank) {
    if (rank == 1) {
      std::this_thread::sleep_for(50ms);
      comm.abort("rank 1 failed: out of memory");
      throw std::runtime_error("out of memory");
    }
    float x = 1.0f;
    comm.all_reduce_sum(rank, &x, 1);
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  for (std::uint32_t r : {0u, 2u, 3u})
    EXPECT_EQ(errors[r], "rank 1 failed: out of memory");
  // Later collectives fail too, until reset.
  float y = 0.0f;
  EXPECT_THROW(comm.all_reduce_sum(0, &y, 1), inf::comm_error);
}

TEST(TpComm, MismatchedCollectivesFailOnEveryRank) {
  inf::inproc_comm comm(2, 10s);
  const auto errors = on_threads(2, [&](std::uint32_t rank) {
    std::vector<float> data(rank == 0 ? 3 : 4, 1.0f);
    comm.all_reduce_sum(rank, data.data(), data.size());
  });
  for (const auto& e : errors)
    EXPECT_NE(e.find("collective mismatch"), std::string::npos) << e;
}


// The host-memory communicators have no device collectives: on_device() says so and every
// device call is refused with a comm_error naming the call, without touching the group (a
// host collective still works afterwards).
TEST(TpComm, HostCommunicatorsRefuseDeviceCollectivesNamingTheCall) {
  inf::inproc_comm comm(2, 10s);
  inf::single_rank_comm single;
  for (inf::tp_comm* c : {static_cast<inf::tp_comm*>(&comm), static_cast<inf::tp_comm*>(&single)}) {
    EXPECT_FALSE(c->on_device());
    EXPECT_EQ(c->device_epoch(), 0u);
    float buffer[4] = {1, 2, 3, 4};
    float out[8] = {};
    const auto message = [](const std::function<void()>& call) {
      try {
        call();
      } catch (const inf::comm_error& e) {
        return std::string(e.what());
      }
      return std::string("no comm_error");
    };
    const std::string reduce = message([&] {
      c->all_reduce_sum_device(0, buffer, 4, inf::device_dtype::float32, nullptr);
    });
    EXPECT_NE(reduce.find("all_reduce_sum_device"), std::string::npos) << reduce;
    EXPECT_NE(reduce.find("not a device communicator"), std::string::npos) << reduce;
    const std::string gather = message([&] {
      c->all_gather_device(0, buffer, 4, inf::device_dtype::bfloat16, out, nullptr);
    });
    EXPECT_NE(gather.find("all_gather_device"), std::string::npos) << gather;
    EXPECT_NE(gather.find("not a device communicator"), std::string::npos) << gather;
    const std::string wait = message([&] { c->wait_device(0, nullptr); });
    EXPECT_NE(wait.find("wait_device"), std::string::npos) << wait;
    // The buffers were not touched.
    EXPECT_EQ(buffer[0], 1.0f);
    EXPECT_EQ(out[0], 0.0f);
  }
  // Neither communicator was aborted by the refusals.
  EXPECT_FALSE(comm.aborted());
  const auto errors = on_threads(2, [&](std::uint32_t rank) {
    float v = static_cast<float>(rank + 1);
    comm.all_reduce_sum(rank, &v, 1);
    if (v != 3.0f)
      throw std::runtime_error("sum " + std::to_string(v));
  });
  for (const auto& e : errors)
    EXPECT_EQ(e, "") << e;
  float one = 5.0f;
  single.all_reduce_sum(0, &one, 1);
  EXPECT_EQ(one, 5.0f);
}

// reset() through the interface re-arms an aborted group (the server holds a tp_comm).
TEST(TpComm, ResetThroughTheInterfaceReArmsAnAbortedGroup) {
  inf::single_rank_comm single;
  inf::tp_comm& c = single;
  c.abort("test abort");
  float v = 1.0f;
  EXPECT_THROW(c.all_reduce_sum(0, &v, 1), inf::comm_error);
  c.reset();
  EXPECT_NO_THROW(c.all_reduce_sum(0, &v, 1));
  inf::inproc_comm comm(1, 1s);
  inf::tp_comm& d = comm;
  d.abort("test abort");
  EXPECT_THROW(d.all_reduce_sum(0, &v, 1), inf::comm_error);
  d.reset();
  EXPECT_NO_THROW(d.all_reduce_sum(0, &v, 1));
}
// ------------------------------------------------------------------------------- tiny model

model::model_config tiny_config(std::uint32_t vocab = 256, bool tied = false) {
  return refit::testing::tiny_model(vocab, tied);
}

// Full canonical bf16 tensors of a synthetic optimizer step (init scale 0.1, so attention,
// routing and experts all move the logits noticeably), readable as floats.
struct canonical : refit::testing::engine_weights {
  std::vector<float> floats(const std::string& name) const {
    for (std::size_t i = 0; i < params.size(); ++i)
      if (params[i].name == name) {
        std::vector<float> out(params[i].numel());
        for (std::size_t j = 0; j < out.size(); ++j) {
          std::uint16_t b;
          std::memcpy(&b, bytes[i].data() + 2 * j, 2);
          out[j] = model::bf16_to_float(b);
        }
        return out;
      }
    throw std::runtime_error("no tensor " + name);
  }
};

canonical synthetic(const model::model_config& cfg, std::uint64_t step, std::uint64_t seed = 11) {
  canonical w;
  static_cast<refit::testing::engine_weights&>(w) = refit::testing::engine_synthetic(cfg, step, seed);
  return w;
}

// An independent, naive double-precision Qwen3-MoE forward over the canonical HF tensors,
// written from the HF modeling code (no KV cache, no TP): logits of every position.
std::vector<double> naive_logits(const model::model_config& c, const canonical& w,
                                 const std::vector<std::int32_t>& tokens) {
  const std::size_t T = tokens.size(), H = c.hidden_size, hd = c.head_dim,
                    heads = c.num_attention_heads, kvh = c.num_key_value_heads,
                    I = c.moe_intermediate_size, E = c.num_experts, V = c.vocab_size;
  const auto matvec = [](const std::vector<float>& W, const std::vector<double>& x,
                         std::size_t rows) {
    const std::size_t cols = x.size();
    std::vector<double> y(rows, 0.0);
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t k = 0; k < cols; ++k)
        y[r] += double(W[r * cols + k]) * x[k];
    return y;
  };
  const auto rms = [&](std::vector<double> x, const std::vector<float>& g, std::size_t off,
                       std::size_t n) {
    double ss = 0.0;
    for (std::size_t i = 0; i < n; ++i)
      ss += x[off + i] * x[off + i];
    const double scale = 1.0 / std::sqrt(ss / double(n) + c.rms_norm_eps);
    for (std::size_t i = 0; i < n; ++i)
      x[off + i] = x[off + i] * scale * double(g[i]);
    return x;
  };
  const auto embed = w.floats("model.embed_tokens.weight");
  std::vector<std::vector<double>> x(T, std::vector<double>(H));
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t i = 0; i < H; ++i)
      x[t][i] = embed[std::size_t(tokens[t]) * H + i];

  for (std::uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const auto wq = w.floats(p + "self_attn.q_proj.weight");
    const auto wk = w.floats(p + "self_attn.k_proj.weight");
    const auto wv = w.floats(p + "self_attn.v_proj.weight");
    const auto wo = w.floats(p + "self_attn.o_proj.weight");
    const auto qn = w.floats(p + "self_attn.q_norm.weight");
    const auto kn = w.floats(p + "self_attn.k_norm.weight");
    const auto gate = w.floats(p + "mlp.gate.weight");
    const auto in_norm = w.floats(p + "input_layernorm.weight");
    const auto post_norm = w.floats(p + "post_attention_layernorm.weight");
    std::vector<std::vector<double>> q(T), k(T), v(T);
    for (std::size_t t = 0; t < T; ++t) {
      const auto h = rms(x[t], in_norm, 0, H);
      q[t] = matvec(wq, h, heads * hd);
      k[t] = matvec(wk, h, kvh * hd);
      v[t] = matvec(wv, h, kvh * hd);
      for (std::size_t a = 0; a < heads; ++a)
        q[t] = rms(q[t], qn, a * hd, hd);
      for (std::size_t a = 0; a < kvh; ++a)
        k[t] = rms(k[t], kn, a * hd, hd);
      const auto rotate = [&](std::vector<double>& vec, std::size_t nheads) {
        for (std::size_t a = 0; a < nheads; ++a)
          for (std::size_t i = 0; i < hd / 2; ++i) {
            const double inv = 1.0 / std::pow(c.rope_theta, double(2 * i) / double(hd));
            const double ang = double(t) * inv;
            const double x1 = vec[a * hd + i], x2 = vec[a * hd + i + hd / 2];
            vec[a * hd + i] = x1 * std::cos(ang) - x2 * std::sin(ang);
            vec[a * hd + i + hd / 2] = x2 * std::cos(ang) + x1 * std::sin(ang);
          }
      };
      rotate(q[t], heads);
      rotate(k[t], kvh);
    }
    for (std::size_t t = 0; t < T; ++t) {
      std::vector<double> attn(heads * hd, 0.0);
      for (std::size_t a = 0; a < heads; ++a) {
        const std::size_t g = a / (heads / kvh);
        std::vector<double> s(t + 1);
        double m = -1e300;
        for (std::size_t j = 0; j <= t; ++j) {
          double dot = 0.0;
          for (std::size_t i = 0; i < hd; ++i)
            dot += q[t][a * hd + i] * k[j][g * hd + i];
          s[j] = dot / std::sqrt(double(hd));
          m = std::max(m, s[j]);
        }
        double z = 0.0;
        for (auto& e : s) {
          e = std::exp(e - m);
          z += e;
        }
        for (std::size_t j = 0; j <= t; ++j)
          for (std::size_t i = 0; i < hd; ++i)
            attn[a * hd + i] += s[j] / z * v[j][g * hd + i];
      }
      const auto o = matvec(wo, attn, H);
      for (std::size_t i = 0; i < H; ++i)
        x[t][i] += o[i];

      const auto h = rms(x[t], post_norm, 0, H);
      auto router = matvec(gate, h, E);
      double m = *std::max_element(router.begin(), router.end()), z = 0.0;
      for (auto& r : router) {
        r = std::exp(r - m);
        z += r;
      }
      for (auto& r : router)
        r /= z;
      std::vector<std::size_t> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t a, std::size_t b) { return router[a] > router[b]; });
      double top_sum = 0.0;
      for (std::size_t j = 0; j < c.num_experts_per_tok; ++j)
        top_sum += router[order[j]];
      for (std::size_t j = 0; j < c.num_experts_per_tok; ++j) {
        const std::size_t e = order[j];
        const double weight = c.norm_topk_prob ? router[e] / top_sum : router[e];
        const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
        const auto g = matvec(w.floats(ep + "gate_proj.weight"), h, I);
        const auto u = matvec(w.floats(ep + "up_proj.weight"), h, I);
        std::vector<double> act(I);
        for (std::size_t i = 0; i < I; ++i)
          act[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
        const auto d = matvec(w.floats(ep + "down_proj.weight"), act, H);
        for (std::size_t i = 0; i < H; ++i)
          x[t][i] += weight * d[i];
      }
    }
  }
  const auto final_norm = w.floats("model.norm.weight");
  const auto lm = w.floats(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
  std::vector<double> logits;
  for (std::size_t t = 0; t < T; ++t) {
    const auto row = matvec(lm, rms(x[t], final_norm, 0, H), V);
    logits.insert(logits.end(), row.begin(), row.end());
  }
  return logits;
}

std::vector<std::int32_t> test_prompt(std::size_t length, std::int32_t salt = 0,
                                      std::int32_t vocab = 256) {
  std::vector<std::int32_t> tokens;
  for (std::size_t i = 0; i < length; ++i)
    tokens.push_back(
      static_cast<std::int32_t>((i * 37 + 11 + std::size_t(salt) * 101) % std::size_t(vocab)));
  return tokens;
}

float max_abs_delta(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0.0f;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

TEST(Forward, ReferenceMatchesANaiveDoublePrecisionImplementation) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied embeddings" : "separate lm_head");
    const auto cfg = tiny_config(256, tied);
    const auto w = synthetic(cfg, 0);
    const auto residents = inf::scatter_residents(cfg, 1, 0, w.params, w.pointers());
    const auto tokens = test_prompt(23);
    const auto got = inf::reference_logits(cfg, residents.pointers(), tokens);
    const auto want = naive_logits(cfg, w, tokens);
    ASSERT_EQ(got.size(), want.size());
    double max_delta = 0.0, spread = 0.0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      max_delta = std::max(max_delta, std::fabs(double(got[i]) - want[i]));
      spread = std::max(spread, std::fabs(want[i]));
    }
    EXPECT_LT(max_delta, 2e-5) << "fp32 forward vs double naive";
    EXPECT_GT(spread, 0.3) << "logits must not be degenerate";
    std::cout << "[ measured ] max |fp32 reference - naive double| logit delta: " << max_delta
              << " (logit magnitude up to " << spread << ")\n";
  }
}

// One TP group of engines (or raw forwards) over threads, sharing an inproc_comm.
class tp_group {
public:
  tp_group(const model::model_config& cfg, std::uint32_t tp, const canonical& w,
           std::uint64_t kv_bytes = 4u << 20, std::uint32_t block_size = 16)
    : cfg_(cfg), tp_(tp), layout_(std::make_shared<const model::tp_layout>(cfg, tp)),
      comm_(tp, 30s) {
    for (std::uint32_t r = 0; r < tp; ++r) {
      arenas_.emplace_back(kv_bytes);
      inf::engine_options o;
      o.block_size = block_size;
      engines_.push_back(std::make_unique<inf::engine>(cfg, layout_, r, arenas_.back().data(),
                                                       kv_bytes, o));
    }
    load(w);
  }

  // Overwrites every rank's residents (what a publication does).
  void load(const canonical& w) {
    residents_.clear();
    for (std::uint32_t r = 0; r < tp_; ++r)
      residents_.push_back(inf::scatter_residents(cfg_, tp_, r, w.params, w.pointers()));
  }

  inf::engine& engine(std::uint32_t rank) { return *engines_[rank]; }
  // Makes `rank` fail before its first collective (its residents no longer bind).
  void break_rank(std::uint32_t rank) { residents_[rank].storage.clear(); }

  // Runs generate on every rank; checks all ranks agree and returns rank 0's result.
  std::vector<inf::generation> generate(const inf::generate_input& in, std::uint64_t version,
                                        inf::generate_stats* stats = nullptr) {
    std::vector<std::vector<inf::generation>> out(tp_);
    std::vector<inf::generate_stats> st(tp_);
    const auto errors = on_threads(tp_, [&](std::uint32_t r) {
      try {
        out[r] = engines_[r]->generate(residents_[r].pointers(), comm_, in, version, &st[r]);
      } catch (...) {
        comm_.abort("rank " + std::to_string(r) + " failed");
        throw;
      }
    });
    comm_.reset();
    for (std::uint32_t r = 0; r < tp_; ++r)
      if (!errors[r].empty())
        throw std::runtime_error("rank " + std::to_string(r) + ": " + errors[r]);
    for (std::uint32_t r = 1; r < tp_; ++r) {
      EXPECT_TRUE(out[r] == out[0]) << "rank " << r << " disagrees with rank 0";
      EXPECT_EQ(st[r].prefix_hit_tokens, st[0].prefix_hit_tokens);
    }
    if (stats)
      *stats = st[0];
    return out[0];
  }

  // Logits of every position of `tokens` through the sharded forward (KV in a scratch arena).
  std::vector<float> logits(const std::vector<std::int32_t>& tokens) {
    std::vector<std::vector<float>> out(tp_);
    const auto errors = on_threads(tp_, [&](std::uint32_t r) {
      inf::rank_forward_options o;
      o.model = cfg_;
      o.tp = tp_;
      o.rank = r;
      o.weights = inf::bind_weights(cfg_, *layout_, residents_[r].pointers());
      o.comm = &comm_;
      o.kv = inf::kv_geometry::of(cfg_, tp_, 8);
      const std::size_t blocks = (tokens.size() + 7) / 8;
      std::vector<std::byte> arena(blocks * o.kv.block_bytes());
      std::vector<std::uint32_t> table(blocks);
      std::iota(table.begin(), table.end(), 0u);
      auto f = inf::make_rank_forward(o);
      // Prefill the first half, then the rest token by token (exercises the cache).
      const std::uint32_t half = static_cast<std::uint32_t>(tokens.size() / 2);
      auto rows = f->forward({{table.data(), blocks, 0, tokens.data(), half}}, arena.data(),
                             inf::logits_rows::every_token);
      for (std::uint32_t t = half; t < tokens.size(); ++t) {
        auto row = f->forward({{table.data(), blocks, t, tokens.data() + t, 1}}, arena.data(),
                              inf::logits_rows::last_token);
        rows.insert(rows.end(), row.begin(), row.end());
      }
      out[r] = rows;
    });
    comm_.reset();
    for (std::uint32_t r = 0; r < tp_; ++r)
      if (!errors[r].empty())
        throw std::runtime_error("rank " + std::to_string(r) + ": " + errors[r]);
    for (std::uint32_t r = 1; r < tp_; ++r)
      EXPECT_EQ(out[r], out[0]) << "rank " << r << " logits differ from rank 0";
    return out[0];
  }

private:
  model::model_config cfg_;
  std::uint32_t tp_;
  std::shared_ptr<const model::tp_layout> layout_;
  inf::inproc_comm comm_;
  std::vector<std::vector<std::byte>> arenas_;
  std::vector<std::unique_ptr<inf::engine>> engines_;
  std::vector<inf::resident_set> residents_;
};

// Greedy continuation by repeated full reference forwards (no KV cache, TP = 1).
std::vector<std::int32_t> reference_greedy(const model::model_config& cfg,
                                           const inf::resident_set& tp1,
                                           std::vector<std::int32_t> tokens, std::size_t count) {
  std::vector<std::int32_t> out;
  for (std::size_t i = 0; i < count; ++i) {
    const auto logits = inf::reference_logits(cfg, tp1.pointers(), tokens);
    const float* last = logits.data() + (tokens.size() - 1) * cfg.vocab_size;
    const auto next =
      static_cast<std::int32_t>(std::max_element(last, last + cfg.vocab_size) - last);
    out.push_back(next);
    tokens.push_back(next);
  }
  return out;
}

struct parity_case {
  std::uint32_t tp;
  std::uint32_t vocab;
  bool tied;
};

class TpParity : public ::testing::TestWithParam<parity_case> {};

TEST_P(TpParity, ShardedLogitsAndGreedyTokensMatchTheUnshardedReference) {
  const auto [tp, vocab, tied] = GetParam();
  const auto cfg = tiny_config(vocab, tied);
  const auto w = synthetic(cfg, 0);
  const auto tp1 = inf::scatter_residents(cfg, 1, 0, w.params, w.pointers());
  tp_group group(cfg, tp, w);

  const auto tokens = test_prompt(21, 0, static_cast<std::int32_t>(vocab));
  const auto want = inf::reference_logits(cfg, tp1.pointers(), tokens);
  const auto got = group.logits(tokens);
  ASSERT_EQ(got.size(), tokens.size() * vocab) << "padded vocab rows must be dropped";
  const float logit_delta = max_abs_delta(got, want);
  EXPECT_LT(logit_delta, 1e-4f);

  inf::generate_input in;
  in.prompts = {test_prompt(9, 1, static_cast<std::int32_t>(vocab)),
                test_prompt(20, 2, static_cast<std::int32_t>(vocab))};
  in.params = params(0.0f);
  in.params.max_tokens = 12;
  const auto out = group.generate(in, 0);
  ASSERT_EQ(out.size(), 2u);
  float logprob_delta = 0.0f;
  for (std::size_t i = 0; i < out.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    EXPECT_EQ(out[i].prompt_index, i);
    EXPECT_EQ(out[i].finish_reason, "length");
    EXPECT_EQ(out[i].token_ids, reference_greedy(cfg, tp1, in.prompts[i], 12));
    const auto ref = inf::reference_logprobs(cfg, tp1.pointers(),
                                             {{out[i].prompt_token_ids, out[i].token_ids}},
                                             in.params);
    logprob_delta = std::max(logprob_delta, max_abs_delta(out[i].logprobs, ref[0]));
    for (float lp : out[i].logprobs) {
      EXPECT_LT(lp, 0.0f);
      EXPECT_GT(lp, -std::log(float(vocab)) - 3.0f);
    }
  }
  EXPECT_LT(logprob_delta, inf::parity_tolerance);
  EXPECT_LT(logprob_delta, 1e-5f) << "fp32 drift is far below the documented tolerance";
  std::cout << "[ measured ] tp=" << tp << " vocab=" << vocab << (tied ? " tied" : "")
            << ": max |logit delta| " << logit_delta << ", max |greedy logprob delta| "
            << logprob_delta << "\n";
}

INSTANTIATE_TEST_SUITE_P(Inference, TpParity,
                         ::testing::Values(parity_case{1, 256, false}, parity_case{2, 256, false},
                                           parity_case{4, 256, false}, parity_case{4, 250, false},
                                           parity_case{2, 256, true}),
                         [](const auto& info) {
                           return "tp" + std::to_string(info.param.tp) + "_vocab"
                                  + std::to_string(info.param.vocab)
                                  + (info.param.tied ? "_tied" : "");
                         });

TEST(Generate, SampledTokensAgreeAcrossTpAndLogprobsMatchTheReference) {
  const auto cfg = tiny_config();
  const auto w = synthetic(cfg, 0);
  const auto tp1 = inf::scatter_residents(cfg, 1, 0, w.params, w.pointers());
  inf::generate_input in;
  in.prompts = {test_prompt(5, 3), test_prompt(18, 4), test_prompt(33, 5)};
  in.params = params(0.8f, 40, 0.9f);
  in.params.n = 3;
  in.params.max_tokens = 10;
  in.params.seed = 2024;

  std::vector<std::vector<inf::generation>> by_tp;
  for (std::uint32_t tp : {1u, 2u, 4u}) {
    SCOPED_TRACE("tp " + std::to_string(tp));
    tp_group group(cfg, tp, w);
    const auto out = group.generate(in, 0);
    ASSERT_EQ(out.size(), 9u);
    std::vector<inf::scored_sequence> seqs;
    for (const auto& g : out)
      seqs.push_back({g.prompt_token_ids, g.token_ids});
    const auto ref = inf::reference_logprobs(cfg, tp1.pointers(), seqs, in.params);
    float delta = 0.0f;
    for (std::size_t i = 0; i < out.size(); ++i) {
      EXPECT_EQ(out[i].prompt_index, i / 3);
      EXPECT_EQ(out[i].sample_index, i % 3);
      EXPECT_EQ(out[i].token_ids.size(), 10u);
      delta = std::max(delta, max_abs_delta(out[i].logprobs, ref[i]));
      for (float lp : out[i].logprobs)
        EXPECT_LE(lp, 0.0f);
    }
    EXPECT_LT(delta, inf::parity_tolerance);
    std::cout << "[ measured ] sampled tp=" << tp << ": max |logprob delta| vs reference " << delta
              << "\n";
    by_tp.push_back(out);
  }
  for (std::size_t i = 0; i < by_tp[0].size(); ++i) {
    EXPECT_EQ(by_tp[1][i].token_ids, by_tp[0][i].token_ids) << "tp2 sample " << i;
    EXPECT_EQ(by_tp[2][i].token_ids, by_tp[0][i].token_ids) << "tp4 sample " << i;
  }
  // The n samples of a prompt are different draws.
  EXPECT_NE(by_tp[0][0].token_ids, by_tp[0][1].token_ids);
  EXPECT_NE(by_tp[0][1].token_ids, by_tp[0][2].token_ids);
}

TEST(Generate, SameSeedSameOutputOtherSeedOtherOutput) {
  const auto cfg = tiny_config();
  const auto w = synthetic(cfg, 0);
  tp_group group(cfg, 2, w);
  inf::generate_input in;
  in.prompts = {test_prompt(7), test_prompt(12, 1)};
  in.params = params(1.0f);
  in.params.n = 2;
  in.params.max_tokens = 16;
  in.params.seed = 99;
  const auto first = group.generate(in, 0);
  group.engine(0).reset_prefix_cache();
  group.engine(1).reset_prefix_cache();
  const auto second = group.generate(in, 0);
  ASSERT_EQ(first.size(), second.size());
  for (std::size_t i = 0; i < first.size(); ++i)
    EXPECT_TRUE(first[i] == second[i]) << "sample " << i << " is not bitwise reproducible";
  in.params.seed = 100;
  const auto other = group.generate(in, 0);
  std::size_t differing = 0;
  for (std::size_t i = 0; i < first.size(); ++i)
    differing += other[i].token_ids != first[i].token_ids;
  EXPECT_GE(differing, 3u);
}

TEST(Generate, StopTokenEndsTheSampleAndIsIncluded) {
  const auto cfg = tiny_config();
  const auto w = synthetic(cfg, 0);
  tp_group group(cfg, 2, w);
  inf::generate_input in;
  in.prompts = {test_prompt(10, 6)};
  in.params = params(0.0f);
  in.params.max_tokens = 12;
  const auto free_run = group.generate(in, 0)[0];
  ASSERT_EQ(free_run.token_ids.size(), 12u);
  const std::int32_t stop = free_run.token_ids[5];
  const auto& ids = free_run.token_ids;
  const auto first =
    static_cast<std::size_t>(std::find(ids.begin(), ids.end(), stop) - ids.begin());
  std::int32_t unused = 0;
  while (std::find(free_run.token_ids.begin(), free_run.token_ids.end(), unused)
         != free_run.token_ids.end())
    ++unused;
  in.params.stop_token_ids = {unused, stop};
  // Drop the cache so both runs compute the same way (bitwise comparable).
  group.engine(0).reset_prefix_cache();
  group.engine(1).reset_prefix_cache();
  const auto stopped = group.generate(in, 0)[0];
  EXPECT_EQ(stopped.finish_reason, "stop");
  ASSERT_EQ(stopped.token_ids.size(), first + 1);
  EXPECT_EQ(stopped.token_ids.back(), stop);
  EXPECT_EQ(stopped.token_ids, std::vector<std::int32_t>(ids.begin(), ids.begin() + first + 1));
  EXPECT_EQ(stopped.logprobs,
            std::vector<float>(free_run.logprobs.begin(), free_run.logprobs.begin() + first + 1));
}

TEST(Generate, LongPromptsKeepTheirLastTokens) {
  const auto cfg = tiny_config();
  const auto w = synthetic(cfg, 0);
  tp_group group(cfg, 1, w);
  const auto prompt = test_prompt(20, 7);
  inf::generate_input in;
  in.prompts = {prompt, {3, 4, 5}};
  in.params = params(0.0f);
  in.params.max_tokens = 6;
  in.params.max_prompt_length = 8;
  const auto out = group.generate(in, 0);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_TRUE(out[0].prompt_truncated);
  EXPECT_EQ(out[0].prompt_token_ids, std::vector<std::int32_t>(prompt.end() - 8, prompt.end()));
  EXPECT_FALSE(out[1].prompt_truncated);
  EXPECT_EQ(out[1].prompt_token_ids, (std::vector<std::int32_t>{3, 4, 5}));

  inf::generate_input direct;
  direct.prompts = {std::vector<std::int32_t>(prompt.end() - 8, prompt.end())};
  direct.params = in.params;
  direct.params.max_prompt_length = 0;
  const auto plain = group.generate(direct, 0);
  EXPECT_FALSE(plain[0].prompt_truncated);
  EXPECT_EQ(plain[0].token_ids, out[0].token_ids);
  EXPECT_LT(max_abs_delta(plain[0].logprobs, out[0].logprobs), 1e-5f);
}

template <class F>
inf::request_error catch_request_error(F&& f) {
  try {
    f();
  } catch (const inf::request_error& e) {
    return e;
  }
  ADD_FAILURE() << "expected a request_error";
  return inf::request_error("", "");
}

TEST(Generate, ValidatesTheRequestNamingTheField) {
  const auto cfg = tiny_config();
  const auto kv = inf::kv_geometry::of(cfg, 2, 16);
  const auto where = [&](inf::generate_input in) {
    return catch_request_error([&] { inf::plan_request(cfg, kv, 4u << 20, in); }).where;
  };
  inf::generate_input ok;
  ok.prompts = {{1, 2, 3}};
  ok.params.max_tokens = 4;
  EXPECT_NO_THROW(inf::plan_request(cfg, kv, 4u << 20, ok));

  auto in = ok;
  in.prompts.clear();
  EXPECT_EQ(where(in), "prompts");
  in = ok;
  in.prompts.push_back({});
  EXPECT_EQ(where(in), "prompts[1].token_ids");
  in = ok;
  in.prompts[0][2] = 256;
  EXPECT_EQ(where(in), "prompts[0].token_ids[2]");
  in = ok;
  in.prompts[0][0] = -1;
  EXPECT_EQ(where(in), "prompts[0].token_ids[0]");
  in = ok;
  in.params.n = 0;
  EXPECT_EQ(where(in), "params.n");
  in = ok;
  in.params.max_tokens = 0;
  EXPECT_EQ(where(in), "params.max_tokens");
  in = ok;
  in.params.temperature = -0.1f;
  EXPECT_EQ(where(in), "params.temperature");
  in = ok;
  in.params.temperature = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(where(in), "params.temperature");
  in = ok;
  in.params.top_p = 1.5f;
  EXPECT_EQ(where(in), "params.top_p");
}

TEST(Generate, KvNeedBeyondTheArenaIsRejectedNamingTheField) {
  const auto cfg = tiny_config();
  const auto kv = inf::kv_geometry::of(cfg, 2, 16);
  // tp=2: one KV head per rank, 2 layers: 2 * 2 * 1 * 16 * 16 * 4 = 4096 bytes per block.
  ASSERT_EQ(kv.block_bytes(), 4096u);
  const std::uint64_t arena = 10 * 4096; // 10 blocks
  inf::generate_input in;
  in.prompts = {test_prompt(40)};  // 2 full blocks + a partial one
  in.params.max_tokens = 8;        // positions < 47: 3 blocks
  in.params.n = 1;
  auto plan = inf::plan_request(cfg, kv, arena, in);
  EXPECT_EQ(plan.capacity_blocks, 10u);
  EXPECT_EQ(inf::kv_blocks_needed(40, 1, 8, 16), 3u);

  in.params.n = 9; // 2 shared + 9 * 1 = 11 blocks
  auto e = catch_request_error([&] { inf::plan_request(cfg, kv, arena, in); });
  EXPECT_EQ(e.where, "params.n");
  EXPECT_NE(std::string(e.what()).find("needs up to 11 KV blocks (45056 bytes)"), std::string::npos)
    << e.what();
  EXPECT_NE(std::string(e.what()).find("holds 10 blocks"), std::string::npos) << e.what();

  in.params.n = 1;
  in.params.max_tokens = 200;
  EXPECT_EQ(catch_request_error([&] { inf::plan_request(cfg, kv, arena, in); }).where,
            "params.max_tokens");
  in.prompts = {test_prompt(200)};
  in.params.max_tokens = 1;
  EXPECT_EQ(catch_request_error([&] { inf::plan_request(cfg, kv, arena, in); }).where,
            "prompts[0].token_ids");
  // Several prompts that do not fit together run in waves.
  in.prompts = {test_prompt(40, 1), test_prompt(40, 2), test_prompt(40, 3), test_prompt(40, 4)};
  in.params.max_tokens = 8;
  in.params.n = 2; // 2 + 2 * 1 = 4 blocks each
  plan = inf::plan_request(cfg, kv, arena, in);
  ASSERT_EQ(plan.waves.size(), 2u);
  EXPECT_EQ(plan.waves[0], (std::vector<std::uint32_t>{0, 1}));
  EXPECT_EQ(plan.waves[1], (std::vector<std::uint32_t>{2, 3}));
}

TEST(Generate, WavesInASmallArenaGiveTheSameResults) {
  const auto cfg = tiny_config();
  const auto w = synthetic(cfg, 0);
  inf::generate_input in;
  in.prompts = {test_prompt(30, 1), test_prompt(17, 2), test_prompt(25, 3)};
  in.params = params(0.9f, 0, 0.95f);
  in.params.n = 2;
  in.params.max_tokens = 9;
  in.params.seed = 5;
  tp_group roomy(cfg, 2, w);
  tp_group tight(cfg, 2, w, 5 * 4096); // 5 blocks: one prompt (2 + 2 * 2 blocks at most) per wave
  inf::generate_stats roomy_stats, tight_stats;
  const auto a = roomy.generate(in, 0, &roomy_stats);
  const auto b = tight.generate(in, 0, &tight_stats);
  EXPECT_EQ(roomy_stats.waves, 1u);
  EXPECT_EQ(tight_stats.waves, 3u);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].token_ids, b[i].token_ids) << "sample " << i;
    EXPECT_LT(max_abs_delta(a[i].logprobs, b[i].logprobs), 1e-5f);
  }
  EXPECT_EQ(tight.engine(0).available_blocks(), 5u) << "every block is released after a request";
}

TEST(Generate, AFailingRankAbortsTheGroupInsteadOfHangingIt) {
  const auto cfg = tiny_config();
  const auto w = synthetic(cfg, 0);
  tp_group group(cfg, 4, w);
  inf::generate_input in;
  in.prompts = {test_prompt(20)};
  in.params = params(0.0f);
  in.params.max_tokens = 4;
  group.break_rank(2);
  const auto start = std::chrono::steady_clock::now();
  try {
    group.generate(in, 0);
    ADD_FAILURE() << "a broken rank must fail the request";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 failed"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s) << "the 30 s deadline was not needed";
  for (std::uint32_t r = 0; r < 4; ++r)
    EXPECT_EQ(group.engine(r).available_blocks(), group.engine(r).capacity_blocks())
      << "rank " << r << " released its KV blocks";
  group.load(w); // repaired: the same group (and comm) serves again
  const auto out = group.generate(in, 0);
  EXPECT_EQ(out[0].token_ids.size(), 4u);
}

// ------------------------------------------------------------------------------- prefix cache

TEST(BlockPool, CachedChainsAreReusedEvictedLeafFirstAndNeverReachedThroughANewParent) {
  inf::block_pool pool(4, 2);
  const std::vector<std::int32_t> a = {1, 2, 3, 4, 5, 6};
  std::vector<std::uint32_t> blocks = {pool.allocate(), pool.allocate(), pool.allocate()};
  pool.insert_prefix(a.data(), 3, blocks);
  EXPECT_EQ(pool.prefix_entries(), 3u);
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it)
    pool.release(*it);
  EXPECT_EQ(pool.available(), 4u);

  auto hit = pool.match_prefix(a.data(), 3);
  EXPECT_EQ(hit, blocks);
  for (auto it = hit.rbegin(); it != hit.rend(); ++it) // deepest first, as the engine does
    pool.release(*it);
  const std::vector<std::int32_t> b = {1, 2, 9, 9};
  hit = pool.match_prefix(b.data(), 2);
  EXPECT_EQ(hit, std::vector<std::uint32_t>{blocks[0]}) << "only the shared first block";
  pool.release(hit[0]);

  // Fill the pool: the free block first, then evictions (deepest cached block first).
  std::vector<std::uint32_t> taken;
  for (int i = 0; i < 2; ++i)
    taken.push_back(pool.allocate());
  EXPECT_EQ(pool.evictions(), 1u);
  EXPECT_EQ(pool.prefix_entries(), 2u);
  EXPECT_EQ(pool.match_prefix(a.data(), 3).size(), 2u) << "blocks 0 and 1 of the chain remain";
  EXPECT_THROW(pool.allocate(), std::logic_error);
  EXPECT_EQ(pool.clear_prefix_cache(), 2u);
}

TEST(PrefixCache, ReusesPromptKvWithinAVersionAndNeverAcrossPublications) {
  const auto cfg = tiny_config();
  const auto v0 = synthetic(cfg, 0);
  const auto v1 = synthetic(cfg, 1);
  tp_group group(cfg, 2, v0);
  inf::generate_input in;
  in.prompts = {test_prompt(40, 8)};
  in.params = params(0.0f);
  in.params.max_tokens = 8;

  // Version 0: the first request computes, the second reuses 2 full blocks (32 positions).
  inf::generate_stats s;
  const auto cold = group.generate(in, 0, &s);
  EXPECT_EQ(s.prefix_hit_tokens, 0u);
  EXPECT_EQ(s.computed_prompt_tokens, 40u);
  EXPECT_EQ(group.engine(0).prefix_cache_entries(), 2u);
  const auto warm = group.generate(in, 0, &s);
  EXPECT_EQ(s.prefix_hit_tokens, 32u);
  EXPECT_EQ(s.prefix_hit_blocks, 2u);
  EXPECT_EQ(s.computed_prompt_tokens, 8u);
  EXPECT_EQ(warm[0].token_ids, cold[0].token_ids);
  EXPECT_LT(max_abs_delta(warm[0].logprobs, cold[0].logprobs), 1e-5f);
  // A prompt sharing only the first block reuses that block.
  auto other = in;
  other.prompts[0][20] = 1;
  group.generate(other, 0, &s);
  EXPECT_EQ(s.prefix_hit_tokens, 16u);

  // Publication of version 1: the server resets the cache when it commits.
  group.load(v1);
  EXPECT_EQ(group.engine(0).reset_prefix_cache(), 3u);
  EXPECT_EQ(group.engine(1).reset_prefix_cache(), 3u);
  const auto hits_before = group.engine(0).lifetime().prefix_hit_tokens;
  const auto after = group.generate(in, 1, &s);
  EXPECT_EQ(s.prefix_hit_tokens, 0u) << "no KV of version 0 may be reused";
  EXPECT_EQ(group.engine(0).lifetime().prefix_hit_tokens, hits_before);
  tp_group fresh(cfg, 2, v1);
  const auto expected = fresh.generate(in, 1);
  EXPECT_TRUE(after[0] == expected[0]) << "must equal a fresh computation with the new weights";
  float moved = 0.0f;
  for (std::size_t i = 0; i < cold[0].logprobs.size(); ++i)
    moved = std::max(moved, std::fabs(after[0].logprobs[i] - cold[0].logprobs[i]));
  EXPECT_GT(moved, 1e-3f) << "the new weights must change the logprobs";
  // Reuse resumes within version 1.
  group.generate(in, 1, &s);
  EXPECT_EQ(s.prefix_hit_tokens, 32u);

  // Defence in depth: a version change without a reset still drops the stale entries.
  const auto v2 = synthetic(cfg, 2);
  group.load(v2);
  const auto unreset = group.generate(in, 2, &s);
  EXPECT_EQ(s.stale_entries_dropped, 2u);
  EXPECT_EQ(s.prefix_hit_tokens, 0u);
  tp_group fresh2(cfg, 2, v2);
  EXPECT_TRUE(unreset[0] == fresh2.generate(in, 2)[0]);
}

TEST(PrefixCache, SamplesOfOnePromptShareItsKv) {
  const auto cfg = tiny_config();
  const auto w = synthetic(cfg, 0);
  tp_group group(cfg, 1, w, 8 * 2048); // tp=1: 2 KV heads -> 8192 bytes per block; 2 blocks
  ASSERT_EQ(inf::kv_geometry::of(cfg, 1, 16).block_bytes(), 8192u);
  tp_group big(cfg, 1, w);
  inf::generate_input in;
  in.prompts = {test_prompt(16)};
  in.params = params(1.0f);
  in.params.n = 2;
  in.params.max_tokens = 1;   // positions < 16: one full shared block, no private ones
  in.params.seed = 3;
  inf::generate_stats s;
  const auto out = group.generate(in, 0, &s);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(s.computed_prompt_tokens, 16u) << "the prompt is prefilled once for both samples";
  EXPECT_EQ(out[0].token_ids.size(), 1u);
  const auto expected = big.generate(in, 0);
  EXPECT_TRUE(out[0] == expected[0]);
  EXPECT_TRUE(out[1] == expected[1]);
}

} // namespace
