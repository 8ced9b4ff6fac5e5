// engine::score: teacher-forced log-probabilities of given token sequences with the fp32
// forward, on the rank's resident weights (the runtime's SCORE command; refit-bench generate
// compares them with the generated tokens' logprobs). Kept apart from the generation loop.
#include <algorithm>
#include <limits>
#include <string>

#include "runtime/inference/generator.hpp"

namespace refit::inference {

namespace {

// Blocks of positions [0, size - 1): the last token is scored, never fed.
std::uint64_t score_blocks(std::uint64_t size, std::uint32_t block_size) {
  return (size - 1 + block_size - 1) / block_size;
}

// Releases the scratch blocks of a wave (also when the forward throws).
class scratch_blocks {
public:
  explicit scratch_blocks(block_pool& pool) : pool_(pool) {}
  ~scratch_blocks() {
    for (auto& blocks : tables)
      for (auto it = blocks.rbegin(); it != blocks.rend(); ++it)
        pool_.release(*it);
  }
  scratch_blocks(const scratch_blocks&) = delete;
  scratch_blocks& operator=(const scratch_blocks&) = delete;
  std::vector<std::vector<std::uint32_t>> tables;

private:
  block_pool& pool_;
};

} // namespace

std::vector<std::vector<std::uint32_t>> plan_score(
  const model::model_config& cfg, const kv_geometry& kv, std::uint64_t kv_cache_bytes,
  const std::vector<std::vector<std::int32_t>>& sequences, std::uint32_t start) {
  if (sequences.empty())
    throw request_error("sequences", "the request has no sequences");
  if (start == 0)
    throw request_error("start", "start must be at least 1 (the token at position 0 has no "
                                 "context to be scored against)");
  const std::uint64_t block_bytes = kv.block_bytes();
  const std::uint64_t capacity = block_bytes == 0 ? 0 : kv_cache_bytes / block_bytes;
  std::vector<std::uint64_t> needs;
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    const auto& seq = sequences[i];
    const std::string where = "sequences[" + std::to_string(i) + "].token_ids";
    if (seq.size() <= start)
      throw request_error(where, "sequence " + std::to_string(i) + " has " + std::to_string(seq.size())
                                   + " tokens; start " + std::to_string(start)
                                   + " leaves none to score");
    if (seq.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
      throw request_error(where, "sequence " + std::to_string(i) + " exceeds the position range");
    for (std::size_t j = 0; j < seq.size(); ++j)
      if (seq[j] < 0 || static_cast<std::uint32_t>(seq[j]) >= cfg.vocab_size)
        throw request_error(where + "[" + std::to_string(j) + "]",
                            "token id " + std::to_string(seq[j]) + " is outside the vocabulary [0, "
                              + std::to_string(cfg.vocab_size) + ")");
    const std::uint64_t need = score_blocks(seq.size(), kv.block_size);
    if (need > capacity)
      throw request_error(where, "sequence " + std::to_string(i) + " (" + std::to_string(seq.size())
                                   + " tokens) needs " + std::to_string(need) + " KV blocks, but the KV "
                                   "cache of each TP worker holds " + std::to_string(capacity)
                                   + " blocks of " + std::to_string(kv.block_size) + " positions");
    needs.push_back(need);
  }
  std::vector<std::vector<std::uint32_t>> waves;
  std::uint64_t wave_need = 0;
  for (std::uint32_t i = 0; i < needs.size(); ++i) {
    if (waves.empty() || wave_need + needs[i] > capacity) {
      waves.emplace_back();
      wave_need = 0;
    }
    waves.back().push_back(i);
    wave_need += needs[i];
  }
  return waves;
}

std::vector<std::vector<float>> engine::score(const std::vector<const std::byte*>& residents,
                                              tp_comm& comm,
                                              const std::vector<std::vector<std::int32_t>>& sequences,
                                              std::uint32_t start) {
  const kv_geometry kv = score_kv_geometry(cfg_, layout_->tp(), options_);
  const auto waves = plan_score(cfg_, kv, arena_bytes_, sequences, start);
  const std::size_t vocab = cfg_.vocab_size;

  rank_forward_options fo = forward_options(residents, comm);
  fo.kv = kv;
  fo.cache_fp32_weights = false; // no full fp32 copy of the weights
  fo.compute_dtype = model::dtype::float32; // the reference, whatever generation computes in
  const std::unique_ptr<rank_forward> model = make_rank_forward(fo);

  sampling_config plain; // temperature 1, no top-k / top-p: the log-softmax
  plain.temperature = 1.0f;
  plain.top_k = 0;
  plain.top_p = 1.0f;

  std::vector<std::vector<float>> out(sequences.size());
  for (const auto& wave : waves) {
    scratch_blocks scratch(pool_);
    for (std::uint32_t i : wave) {
      scratch.tables.emplace_back();
      const std::uint64_t need = score_blocks(sequences[i].size(), kv.block_size);
      for (std::uint64_t b = 0; b < need; ++b)
        scratch.tables.back().push_back(pool_.allocate());
    }
    // Prefill [0, start): its last row predicts the token at `start`.
    std::vector<forward_item> items;
    for (std::size_t w = 0; w < wave.size(); ++w)
      items.push_back({scratch.tables[w].data(), scratch.tables[w].size(), 0,
                       sequences[wave[w]].data(), start});
    std::vector<float> logits = model->forward(items, arena_, logits_rows::last_token);
    for (std::size_t w = 0; w < wave.size(); ++w)
      out[wave[w]].push_back(
        processed_logprob(logits.data() + w * vocab, vocab, plain, sequences[wave[w]][start]));
    // One batched step per further position, as decode does.
    for (std::size_t k = std::size_t{start} + 1;; ++k) {
      items.clear();
      std::vector<std::size_t> active;
      for (std::size_t w = 0; w < wave.size(); ++w) {
        const auto& seq = sequences[wave[w]];
        if (seq.size() <= k)
          continue;
        active.push_back(w);
        items.push_back({scratch.tables[w].data(), scratch.tables[w].size(),
                         static_cast<std::uint32_t>(k - 1), seq.data() + k - 1, 1});
      }
      if (items.empty())
        break;
      logits = model->forward(items, arena_, logits_rows::last_token);
      for (std::size_t a = 0; a < active.size(); ++a) {
        const std::size_t w = active[a];
        out[wave[w]].push_back(
          processed_logprob(logits.data() + a * vocab, vocab, plain, sequences[wave[w]][k]));
      }
    }
  }
  return out;
}

} // namespace refit::inference
