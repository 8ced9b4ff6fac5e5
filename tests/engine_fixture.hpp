// Shared by the bf16-engine tests (test_bf16_engine on the CPU, test_gpu_engine on a GPU): a
// tiny synthetic model, its TP-1 residents, raw forwards of either compute dtype and a
// log-softmax helper. Memory placement is the caller's (`place` copies host bytes to where
// the forward reads them and returns the pointer).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <vector>

#include "model_configs.hpp"
#include "runtime/inference/forward.hpp"
#include "runtime/inference/reference.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/model/synthetic.hpp"

namespace refit::testing {

// Canonical bf16 tensors of a synthetic step (init scale 0.1 so every part moves the logits).
struct engine_weights {
  std::vector<model::param_meta> params;
  std::vector<std::vector<std::byte>> bytes;
  std::vector<const std::byte*> pointers() const {
    std::vector<const std::byte*> out;
    for (const auto& b : bytes)
      out.push_back(b.data());
    return out;
  }
};

// A model the fused CUDA kernels accept (head_dim 64, 4 q heads per KV head, 16 experts).
inline model::model_config small_model() {
  model::model_config c = tiny_model(512);
  c.hidden_size = 256;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.num_experts = 16;
  c.num_experts_per_tok = 4;
  c.moe_intermediate_size = 128;
  return c;
}

inline engine_weights engine_synthetic(const model::model_config& cfg, std::uint64_t step = 0,
                                       std::uint64_t seed = 11) {
  engine_weights w;
  w.params = model::expected_key_stream(cfg);
  model::synthetic_weights s;
  s.seed = seed;
  s.init_scale = 0.1f;
  s.lr = 0.05f; // one step moves the weights visibly
  for (const auto& p : w.params) {
    std::vector<std::byte> b(p.nbytes());
    model::fill_synthetic(p, s, step, 0, p.numel(), b.data());
    w.bytes.push_back(std::move(b));
  }
  return w;
}

inline std::vector<std::int32_t> engine_prompt(std::size_t length, std::int32_t salt = 0,
                                               std::int32_t vocab = 256) {
  std::vector<std::int32_t> tokens;
  for (std::size_t i = 0; i < length; ++i)
    tokens.push_back(
      static_cast<std::int32_t>((i * 37 + 11 + std::size_t(salt) * 101) % std::size_t(vocab)));
  return tokens;
}

// log_softmax of each row of `logits` (rows of `vocab`).
inline std::vector<double> log_softmax_rows(const std::vector<float>& logits, std::size_t vocab) {
  std::vector<double> out(logits.size());
  for (std::size_t r = 0; r * vocab < logits.size(); ++r) {
    const float* row = logits.data() + r * vocab;
    const double m = *std::max_element(row, row + vocab);
    double total = 0.0;
    for (std::size_t i = 0; i < vocab; ++i)
      total += std::exp(double(row[i]) - m);
    for (std::size_t i = 0; i < vocab; ++i)
      out[r * vocab + i] = double(row[i]) - m - std::log(total);
  }
  return out;
}

inline double max_abs_delta(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// The mean of |a[i] - b[i]| (accumulated as sum of |delta| / n).
inline double mean_abs_delta(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  const std::size_t n = std::min(a.size(), b.size());
  double mean = 0.0;
  for (std::size_t i = 0; i < n; ++i)
    mean += std::fabs(a[i] - b[i]) / double(n);
  return mean;
}

// Log-softmax rows of the fp32 reference forward over the TP-1 residents of `w`: what every
// engine test measures its gap against.
inline std::vector<double> reference_logprobs(const model::model_config& cfg,
                                              const engine_weights& w,
                                              const std::vector<std::int32_t>& tokens) {
  const auto residents = inference::scatter_residents(cfg, 1, 0, w.params, w.pointers());
  return log_softmax_rows(inference::reference_logits(cfg, residents.pointers(), tokens),
                          cfg.vocab_size);
}

// A TP-1 forward over residents placed by `place`, with its own KV arena of `blocks` blocks
// (allocated by `alloc`).
struct engine_rig {
  using place_fn = std::function<const std::byte*(const std::vector<std::byte>&)>;
  using alloc_fn = std::function<std::byte*(std::size_t)>;

  engine_rig(const model::model_config& cfg, const engine_weights& w, model::dtype compute,
             std::uint32_t block_size, std::uint32_t blocks, int cuda_device, place_fn place,
             alloc_fn alloc, bool graphs = true, bool fused = true)
    : cfg_(cfg), comm_() {
    host_ = inference::scatter_residents(cfg, 1, 0, w.params, w.pointers());
    std::vector<const std::byte*> residents;
    for (const auto& r : host_.storage)
      residents.push_back(place(r));
    const model::tp_layout layout(cfg, 1);
    inference::rank_forward_options o;
    o.model = cfg;
    o.weights = inference::bind_weights(cfg, layout, residents);
    o.comm = &comm_;
    o.kv = inference::kv_geometry::of(cfg, 1, block_size,
                                      compute == model::dtype::bfloat16 ? 2 : 4);
    o.kv_blocks = blocks;
    o.cuda_device = cuda_device;
    o.compute_dtype = compute;
    o.cuda_graphs = graphs;
    o.fused_kernels = fused;
    arena = alloc(std::size_t{blocks} * o.kv.block_bytes());
    forward = inference::make_rank_forward(o);
  }

  // Logits of every position of `tokens`: a prefill of the first `split` tokens, then one
  // decode step per token (blocks 0.. of the arena).
  std::vector<float> logits(const std::vector<std::int32_t>& tokens, std::uint32_t split,
                            std::uint32_t block_size) {
    const std::size_t blocks = (tokens.size() + block_size - 1) / block_size;
    std::vector<std::uint32_t> table(blocks);
    std::iota(table.begin(), table.end(), 0u);
    auto rows = forward->forward({{table.data(), blocks, 0, tokens.data(), split}}, arena,
                                 inference::logits_rows::every_token);
    for (std::uint32_t t = split; t < tokens.size(); ++t) {
      auto row = forward->forward({{table.data(), blocks, t, tokens.data() + t, 1}}, arena,
                                  inference::logits_rows::last_token);
      rows.insert(rows.end(), row.begin(), row.end());
    }
    return rows;
  }

  // Last-token logits of a prefill of tokens[0, split) and then of one decode step per token,
  // over the blocks of `table` (for placement tests: the table's order must not matter).
  std::vector<float> logits_over(const std::vector<std::uint32_t>& table,
                                 const std::vector<std::int32_t>& tokens, std::uint32_t split) {
    std::vector<float> rows = forward->forward({{table.data(), table.size(), 0, tokens.data(), split}},
                                               arena, inference::logits_rows::last_token);
    for (std::uint32_t t = split; t < tokens.size(); ++t) {
      auto row = forward->forward({{table.data(), table.size(), t, tokens.data() + t, 1}}, arena,
                                  inference::logits_rows::last_token);
      rows.insert(rows.end(), row.begin(), row.end());
    }
    return rows;
  }

  model::model_config cfg_;
  inference::single_rank_comm comm_;
  inference::resident_set host_;
  std::byte* arena = nullptr;
  std::unique_ptr<inference::rank_forward> forward;
};

} // namespace refit::testing
