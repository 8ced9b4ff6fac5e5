// Shared by the CPU (test_bf16_engine) and GPU (test_gpu_engine) engine tests: the bf16
// engine's device-side sampling against the host sampler (sampling.hpp) on the same logits.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine_fixture.hpp"
#include "runtime/inference/sampling.hpp"

namespace refit::testing {

struct sampling_case {
  const char* name;
  float temperature;
  std::int32_t top_k;
  float top_p;
};

// Five sequences prefilled to different lengths, then one decode step drawn 3 times per
// sequence under six sampling settings and 8 seeds: every draw's token equals the host
// sampler's on the logits of the same step, its logprob within 1e-5, and sampled draws vary.
inline void expect_device_sampling_matches_host(engine_rig& rig, const model::model_config& cfg) {
  namespace inf = refit::inference;
  // Five sequences with prefilled prompts of different lengths.
  std::vector<std::vector<std::int32_t>> prompts;
  std::vector<std::vector<std::uint32_t>> tables;
  for (std::uint32_t i = 0; i < 5; ++i) {
    prompts.push_back(engine_prompt(6 + 5 * i, static_cast<std::int32_t>(i)));
    tables.emplace_back();
    for (std::uint32_t b = 0; b < 4; ++b)
      tables.back().push_back(i * 4 + b);
    rig.forward->forward({{tables[i].data(), 4, 0, prompts[i].data(),
                           static_cast<std::uint32_t>(prompts[i].size() - 1)}},
                         rig.arena, inf::logits_rows::last_token);
  }
  std::vector<inf::forward_item> items;
  for (std::uint32_t i = 0; i < 5; ++i)
    items.push_back({tables[i].data(), 4, static_cast<std::uint32_t>(prompts[i].size() - 1),
                     &prompts[i].back(), 1});
  const std::vector<float> logits = rig.forward->forward(items, rig.arena, inf::logits_rows::last_token);

  const sampling_case cases[] = {{"T=1", 1.0f, 0, 1.0f},        {"T=0.7 top_k=20", 0.7f, 20, 1.0f},
                                 {"T=1.3 top_p=0.8", 1.3f, 0, 0.8f}, {"top_k=5 top_p=0.6", 1.0f, 5, 0.6f},
                                 {"greedy", 0.0f, 0, 1.0f},     {"greedy top_k=3", 0.0f, 3, 1.0f}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    inf::sampling_config p;
    p.temperature = c.temperature;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    std::size_t distinct_tokens = 0;
    for (std::uint64_t seed = 1; seed <= 8; ++seed) {
      p.seed = seed;
      std::vector<inf::sample_draw> draws;
      for (std::uint32_t i = 0; i < 5; ++i)
        for (std::uint32_t s = 0; s < 3; ++s)
          draws.push_back({i, i, s, 7});
      const auto got = rig.forward->forward_sample(items, rig.arena, p, draws);
      ASSERT_EQ(got.size(), draws.size());
      std::vector<std::int32_t> seen;
      for (std::size_t d = 0; d < draws.size(); ++d) {
        const auto want = inf::sample_token(logits.data() + draws[d].row * cfg.vocab_size,
                                            cfg.vocab_size, p, draws[d].prompt, draws[d].sample,
                                            draws[d].step);
        EXPECT_EQ(got[d].token, want.token) << "draw " << d << " seed " << seed;
        EXPECT_NEAR(got[d].logprob, want.logprob, 1e-5) << "draw " << d << " seed " << seed;
        seen.push_back(got[d].token);
      }
      std::sort(seen.begin(), seen.end());
      distinct_tokens += std::unique(seen.begin(), seen.end()) - seen.begin();
    }
    if (c.temperature > 0.0f) {
      EXPECT_GT(distinct_tokens, 8u * 5u) << "draws must actually vary";
    }
  }
}

} // namespace refit::testing
