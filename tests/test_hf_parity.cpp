// refit against HF transformers 5.17 on checkpoints HF wrote (tests/data/models, made by
// tests/data/hf/make_fixtures.py on the GPU machine): refit's own checkpoint loader and
// forward must reproduce HF's fp32 logits, teacher-forced log-probabilities and greedy ids.
//
// In process (TP 1 reference forward over the loaded canonical tensors) and through the main
// job (refit-coordinator --model DIR --iterations 0 --temperature 0 --json) at TP 1, 2 and 4,
// which also runs refit's tokenizer on the prompt text and the runtime's checkpoint load.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/checkpoint/source.hpp"
#include "runtime/inference/reference.hpp"
#include "run_command.hpp"

using namespace refit;
namespace inf = refit::inference;
using json = nlohmann::json;

namespace {

const std::string models = std::string(REFIT_SOURCE_DIR) + "/tests/data/models/";

json golden(const std::string& model) {
  std::ifstream in(models + model + "/golden.json");
  return json::parse(in);
}

struct loaded {
  model::model_config cfg;
  std::vector<model::param_meta> params;
  std::vector<std::vector<std::byte>> bytes;
  std::vector<const std::byte*> pointers() const {
    std::vector<const std::byte*> p;
    for (const auto& b : bytes)
      p.push_back(b.data());
    return p;
  }
};

loaded load(const std::string& model) {
  loaded l;
  l.cfg = checkpoint::read_model_config(models + model);
  const auto src = checkpoint::model_source::open(models + model, l.cfg);
  l.params = model::expected_key_stream(l.cfg);
  for (const auto& p : l.params) {
    l.bytes.emplace_back(p.nbytes());
    src->read(p, 0, p.nbytes(), l.bytes.back().data());
  }
  return l;
}

std::vector<double> log_softmax(const float* row, std::size_t n) {
  double mx = *std::max_element(row, row + n), sum = 0;
  for (std::size_t i = 0; i < n; ++i)
    sum += std::exp(double(row[i]) - mx);
  std::vector<double> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = double(row[i]) - mx - std::log(sum);
  return out;
}

const char* const all_models[] = {"tiny-qwen3-moe",        "tiny-qwen3-moe-topk",
                                  "tiny-qwen3-moe-per-expert", "tiny-qwen3-moe-fused",
                                  "tiny-qwen3",            "tiny-kjv"};

class HfGolden : public ::testing::TestWithParam<const char*> {};

TEST_P(HfGolden, ReferenceForwardGivesHfLogitsLogprobsAndGreedyIds) {
  const std::string model = GetParam();
  const auto l = load(model);
  const auto tp1 = inf::scatter_residents(l.cfg, 1, 0, l.params, l.pointers());
  const auto g = golden(model);
  const std::size_t V = l.cfg.vocab_size;
  double worst_logit = 0, worst_lp = 0;
  for (const auto& p : g["prompts"]) {
    SCOPED_TRACE(model + ": '" + p["text"].get<std::string>() + "'");
    std::vector<std::int32_t> ids = p["prompt_ids"].get<std::vector<std::int32_t>>();
    const auto logits = inf::reference_logits(l.cfg, tp1.pointers(), ids);
    ASSERT_EQ(logits.size(), ids.size() * V);
    const auto want_last = p["last_prompt_logits"].get<std::vector<float>>();
    ASSERT_EQ(want_last.size(), V);
    for (std::size_t v = 0; v < V; ++v)
      worst_logit = std::max(worst_logit,
                             std::fabs(double(logits[(ids.size() - 1) * V + v]) - want_last[v]));
    const auto want_plp = p["prompt_logprobs"].get<std::vector<double>>();
    ASSERT_EQ(want_plp.size(), ids.size() - 1);
    for (std::size_t t = 0; t + 1 < ids.size(); ++t)
      worst_lp = std::max(worst_lp, std::fabs(log_softmax(&logits[t * V], V)[ids[t + 1]]
                                              - want_plp[t]));
    // Greedy, one full forward per token as HF's golden loop did.
    const auto want_ids = p["generated_ids"].get<std::vector<std::int32_t>>();
    const auto want_lp = p["generated_logprobs"].get<std::vector<double>>();
    const auto margin = p["generated_top2_margin"].get<std::vector<double>>();
    for (std::size_t k = 0; k < want_ids.size(); ++k) {
      const auto lg = inf::reference_logits(l.cfg, tp1.pointers(), ids);
      const float* last = &lg[(ids.size() - 1) * V];
      const auto next = static_cast<std::int32_t>(std::max_element(last, last + V) - last);
      const auto lp = log_softmax(last, V);
      worst_lp = std::max(worst_lp, std::fabs(lp[want_ids[k]] - want_lp[k]));
      if (margin[k] < 1e-3) // a near-tie in HF's fp32 logits: either pick is right; stop here
        break;
      ASSERT_EQ(next, want_ids[k]) << "generated token " << k;
      ids.push_back(next);
    }
  }
  EXPECT_LT(worst_logit, 1e-4);
  EXPECT_LT(worst_lp, 1e-4);
  std::printf("[ measured ] %s: max |logit - HF| %.2e, max |logprob - HF| %.2e\n", model.c_str(),
              worst_logit, worst_lp);
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, HfGolden, ::testing::ValuesIn(all_models),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(HfLayouts, FusedAndPerExpertCheckpointsLoadToIdenticalResidentBytes) {
  const auto fused = load("tiny-qwen3-moe-fused"), per_expert = load("tiny-qwen3-moe-per-expert");
  ASSERT_EQ(fused.params, per_expert.params);
  for (std::uint32_t tp : {1u, 2u, 4u})
    for (std::uint32_t r = 0; r < tp; ++r) {
      const auto a = inf::scatter_residents(fused.cfg, tp, r, fused.params, fused.pointers());
      const auto b =
        inf::scatter_residents(per_expert.cfg, tp, r, per_expert.params, per_expert.pointers());
      ASSERT_EQ(a.storage.size(), b.storage.size());
      for (std::size_t i = 0; i < a.storage.size(); ++i)
        EXPECT_TRUE(a.storage[i] == b.storage[i]) << "tp " << tp << " rank " << r << " resident " << i;
    }
}

// The main job as a user runs it, at TP 1, 2 and 4.
std::string recipe_for(std::uint32_t tp) {
  std::ifstream in(std::string(REFIT_SOURCE_DIR) + "/configs/tiny-synthetic.yaml");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  auto set = [&text](const std::string& from, const std::string& to) {
    const auto pos = text.find(from);
    ASSERT_NE(pos, std::string::npos) << from;
    text.replace(pos, from.size(), to);
  };
  std::string devices = "[";
  for (std::uint32_t r = 0; r < tp; ++r)
    devices += (r ? ", cpu:" : "cpu:") + std::to_string(r);
  set("tp_size: 2", "tp_size: " + std::to_string(tp));
  set("devices: [cpu:0, cpu:1]", "devices: " + devices + "]");
  set("buffer_bytes: 65536", "buffer_bytes: 2097152");
  const std::string path = ::testing::TempDir() + "hf-parity-tp" + std::to_string(tp) + ".yaml";
  std::ofstream(path) << text;
  return path;
}

TEST(HfMainJob, GreedyIdsAndLogprobsOfHfThroughRefitCoordinatorAtTp124) {
  for (const char* model : {"tiny-qwen3-moe", "tiny-qwen3", "tiny-qwen3-moe-topk", "tiny-kjv"}) {
    const auto g = golden(model);
    const auto& p = g["prompts"][0];
    for (std::uint32_t tp : {1u, 2u, 4u}) {
      SCOPED_TRACE(std::string(model) + " tp " + std::to_string(tp));
      const std::string err_file = ::testing::TempDir() + "hf-parity.err";
      const auto r = refit::testing::run_command(
        std::string(REFIT_COORDINATOR_EXE) + " --config " + recipe_for(tp) + " --model " + models
        + model + " --iterations 0 --temperature 0 --max-tokens 12 --json --prompt '"
        + p["text"].get<std::string>() + "' 2>" + err_file);
      std::ifstream err_in(err_file);
      std::stringstream err;
      err << err_in.rdbuf();
      ASSERT_EQ(r.exit_code, 0) << err.str();
      const auto row = json::parse(r.out.substr(0, r.out.find('\n')));
      ASSERT_TRUE(row["parity_ok"].template get<bool>());
      const auto& s = row["samples"][0];
      EXPECT_EQ(s["prompt"], p["text"]);
      EXPECT_EQ(s["prompt_token_ids"], p["prompt_ids"]) << "refit's tokenizer vs HF's ids";
      const auto want = p["generated_ids"].get<std::vector<std::int32_t>>();
      const auto margin = p["generated_top2_margin"].get<std::vector<double>>();
      const auto want_lp = p["generated_logprobs"].get<std::vector<double>>();
      const auto got = s["token_ids"].template get<std::vector<std::int32_t>>();
      const auto got_lp = s["logprobs"].template get<std::vector<double>>();
      ASSERT_FALSE(got.empty());
      for (std::size_t k = 0; k < got.size() && k < want.size(); ++k) {
        EXPECT_NEAR(got_lp[k], want_lp[k], 1e-4) << "token " << k;
        if (margin[k] < 1e-3)
          break; // near-tie: HF's and refit's fp32 may pick either
        ASSERT_EQ(got[k], want[k]) << "token " << k;
        if (got[k] == 2048) { // eos is a stop token for refit (HF's golden loop ignored it)
          EXPECT_EQ(s["finish_reason"], "stop");
          break;
        }
      }
    }
  }
}

} // namespace
