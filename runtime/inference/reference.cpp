#include "runtime/inference/reference.hpp"

#include <stdexcept>
#include <string>

#include "runtime/inference/forward.hpp"
#include "runtime/inference/tp_comm.hpp"

namespace refit::inference {

std::vector<const std::byte*> resident_set::pointers() const {
  std::vector<const std::byte*> out;
  out.reserve(storage.size());
  for (const auto& s : storage)
    out.push_back(s.data());
  return out;
}

resident_set scatter_residents(const model::model_config& cfg, std::uint32_t tp,
                               std::uint32_t rank, const std::vector<model::param_meta>& params,
                               const std::vector<const std::byte*>& canonical) {
  if (params.size() != canonical.size())
    throw std::invalid_argument("scatter_residents: " + std::to_string(params.size())
                                + " tensors but " + std::to_string(canonical.size())
                                + " byte pointers");
  const model::tp_layout layout(cfg, tp);
  resident_set set;
  std::vector<std::byte*> targets;
  for (const auto& r : layout.residents())
    set.storage.emplace_back(r.nbytes, std::byte{0});
  for (auto& s : set.storage)
    targets.push_back(s.data());
  for (std::size_t i = 0; i < params.size(); ++i)
    layout.scatter(params[i], canonical[i], rank, targets);
  return set;
}

namespace {

// Logits of positions [from, tokens.size()) of one sequence: positions before `from` are
// prefilled into the KV cache first (their logits are never materialized).
std::vector<float> logits_from(const model::model_config& cfg,
                               const std::vector<const std::byte*>& tp1_residents,
                               const std::vector<std::int32_t>& tokens, std::size_t from) {
  if (tokens.empty() || from >= tokens.size())
    throw std::invalid_argument("reference: no positions to score");
  const model::tp_layout layout(cfg, 1);
  constexpr std::uint32_t block_size = 64;
  single_rank_comm comm;
  rank_forward_options o;
  o.model = cfg;
  o.tp = 1;
  o.rank = 0;
  o.weights = bind_weights(cfg, layout, tp1_residents);
  o.comm = &comm;
  o.kv = kv_geometry::of(cfg, 1, block_size);
  const std::size_t blocks = (tokens.size() + block_size - 1) / block_size;
  std::vector<std::byte> arena(blocks * o.kv.block_bytes());
  std::vector<std::uint32_t> table(blocks);
  for (std::size_t b = 0; b < blocks; ++b)
    table[b] = static_cast<std::uint32_t>(b);
  const auto model = make_rank_forward(o);
  if (from > 0)
    model->forward({forward_item{table.data(), table.size(), 0, tokens.data(),
                                 static_cast<std::uint32_t>(from)}},
                   arena.data(), logits_rows::last_token);
  const forward_item rest{table.data(), table.size(), static_cast<std::uint32_t>(from),
                          tokens.data() + from, static_cast<std::uint32_t>(tokens.size() - from)};
  return model->forward({rest}, arena.data(), logits_rows::every_token);
}

} // namespace

std::vector<float> reference_logits(const model::model_config& cfg,
                                    const std::vector<const std::byte*>& tp1_residents,
                                    const std::vector<std::int32_t>& tokens) {
  return logits_from(cfg, tp1_residents, tokens, 0);
}

std::vector<std::vector<float>> reference_logprobs(
  const model::model_config& cfg, const std::vector<const std::byte*>& tp1_residents,
  const std::vector<scored_sequence>& sequences, const sampling_config& params) {
  std::vector<std::vector<float>> out;
  out.reserve(sequences.size());
  const std::size_t vocab = cfg.vocab_size;
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    const auto& s = sequences[i];
    if (s.prompt_token_ids.empty())
      throw std::invalid_argument("reference_logprobs: sequence " + std::to_string(i)
                                  + " has an empty prompt");
    std::vector<float> lp;
    if (!s.token_ids.empty()) {
      // The last generated token is scored but never fed.
      std::vector<std::int32_t> tokens = s.prompt_token_ids;
      tokens.insert(tokens.end(), s.token_ids.begin(), s.token_ids.end() - 1);
      const std::size_t first = s.prompt_token_ids.size() - 1; // predicts token_ids[0]
      const std::vector<float> logits = logits_from(cfg, tp1_residents, tokens, first);
      for (std::size_t t = 0; t < s.token_ids.size(); ++t)
        lp.push_back(processed_logprob(logits.data() + t * vocab, vocab, params,
                                       s.token_ids[t]));
    }
    out.push_back(std::move(lp));
  }
  return out;
}

std::vector<std::vector<float>> reference_logprobs(const model::model_config& cfg,
                                                   const std::vector<model::param_meta>& params,
                                                   const std::vector<const std::byte*>& canonical,
                                                   const std::vector<scored_sequence>& sequences,
                                                   const sampling_config& sampling) {
  const resident_set residents = scatter_residents(cfg, 1, 0, params, canonical);
  return reference_logprobs(cfg, residents.pointers(), sequences, sampling);
}

} // namespace refit::inference
