#include "runtime/inference/generator.hpp"

#include "runtime/trace/trace.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <list>

namespace refit::inference {

bool operator==(const generation& a, const generation& b) {
  if (a.prompt_index != b.prompt_index || a.sample_index != b.sample_index
      || a.prompt_token_ids != b.prompt_token_ids || a.token_ids != b.token_ids
      || a.finish_reason != b.finish_reason || a.prompt_truncated != b.prompt_truncated
      || a.logprobs.size() != b.logprobs.size())
    return false;
  return a.logprobs.empty()
         || std::memcmp(a.logprobs.data(), b.logprobs.data(), a.logprobs.size() * sizeof(float))
              == 0;
}

std::uint64_t kv_blocks_needed(std::uint64_t prompt_tokens, std::uint32_t n,
                               std::uint32_t max_tokens, std::uint32_t block_size) {
  const std::uint64_t full = prompt_tokens / block_size;
  // The last sampled token is never fed back, so positions [0, prompt + max_tokens - 1).
  const std::uint64_t positions = prompt_tokens + max_tokens - 1;
  const std::uint64_t per_sample = (positions + block_size - 1) / block_size - full;
  return full + std::uint64_t{n} * per_sample;
}

request_plan plan_request(const model::model_config& cfg, const kv_geometry& kv,
                          std::uint64_t kv_cache_bytes, const generate_input& input) {
  const sampling_config& p = input.params;
  if (input.prompts.empty())
    throw request_error("prompts", "the request has no prompts");
  if (p.n == 0)
    throw request_error("params.n", "n must be at least 1 (got 0)");
  if (p.max_tokens == 0)
    throw request_error("params.max_tokens", "max_tokens must be at least 1 (got 0)");
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    throw request_error("params.temperature",
                        "temperature must be a finite number >= 0 (got "
                          + std::to_string(p.temperature) + ")");
  if (!(p.top_p >= 0.0f && p.top_p <= 1.0f))
    throw request_error("params.top_p", "top_p must be in [0, 1] (0 and 1 disable it; got "
                                          + std::to_string(p.top_p) + ")");

  request_plan plan;
  const std::uint64_t block_bytes = kv.block_bytes();
  const std::uint64_t capacity = block_bytes == 0 ? 0 : kv_cache_bytes / block_bytes;
  plan.capacity_blocks = static_cast<std::uint32_t>(
    std::min<std::uint64_t>(capacity, std::numeric_limits<std::uint32_t>::max()));
  const auto capacity_text = [&] {
    return "the KV cache of each TP worker holds " + std::to_string(plan.capacity_blocks)
           + " blocks of " + std::to_string(kv.block_size) + " positions (kv_cache_bytes="
           + std::to_string(kv_cache_bytes) + ", " + std::to_string(block_bytes)
           + " bytes per block)";
  };

  std::vector<std::uint64_t>& needs = plan.needs;
  for (std::size_t i = 0; i < input.prompts.size(); ++i) {
    const auto& prompt = input.prompts[i];
    const std::string where = "prompts[" + std::to_string(i) + "].token_ids";
    if (prompt.empty())
      throw request_error(where, "prompt " + std::to_string(i) + " has no tokens");
    for (std::size_t j = 0; j < prompt.size(); ++j)
      if (prompt[j] < 0 || static_cast<std::uint32_t>(prompt[j]) >= cfg.vocab_size)
        throw request_error(where + "[" + std::to_string(j) + "]",
                            "token id " + std::to_string(prompt[j])
                              + " is outside the vocabulary [0, "
                              + std::to_string(cfg.vocab_size) + ")");
    const bool truncate = p.max_prompt_length > 0 && prompt.size() > p.max_prompt_length;
    plan.prompts.emplace_back(truncate ? prompt.end() - p.max_prompt_length : prompt.begin(),
                              prompt.end());
    plan.truncated.push_back(truncate);

    const std::uint64_t length = plan.prompts.back().size();
    constexpr auto max_positions =
      static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max());
    if (length + p.max_tokens > max_positions)
      throw request_error("params.max_tokens",
                          "prompt " + std::to_string(i) + " (" + std::to_string(length)
                            + " tokens) plus max_tokens " + std::to_string(p.max_tokens)
                            + " exceeds the position range");
    const std::uint64_t need = kv_blocks_needed(length, p.n, p.max_tokens, kv.block_size);
    if (need > capacity) {
      const std::uint64_t prompt_only = (length + kv.block_size - 1) / kv.block_size;
      const std::uint64_t single = kv_blocks_needed(length, 1, p.max_tokens, kv.block_size);
      const std::string field = prompt_only > capacity ? where
                                : single > capacity    ? std::string("params.max_tokens")
                                                       : std::string("params.n");
      throw request_error(field, "prompt " + std::to_string(i) + " (" + std::to_string(length)
                                   + " tokens) with n=" + std::to_string(p.n)
                                   + " and max_tokens=" + std::to_string(p.max_tokens)
                                   + " needs up to " + std::to_string(need) + " KV blocks ("
                                   + std::to_string(need * block_bytes) + " bytes), but "
                                   + capacity_text());
    }
    needs.push_back(need);
  }

  std::uint64_t wave_need = 0;
  for (std::uint32_t i = 0; i < needs.size(); ++i) {
    if (plan.waves.empty() || wave_need + needs[i] > capacity) {
      plan.waves.emplace_back();
      wave_need = 0;
    }
    plan.waves.back().push_back(i);
    wave_need += needs[i];
  }
  return plan;
}

kv_geometry engine_kv_geometry(const model::model_config& cfg, std::uint32_t tp,
                               const engine_options& options) {
  const std::uint32_t element = options.compute_dtype == model::dtype::bfloat16 ? 2 : 4;
  return kv_geometry::of(cfg, tp, options.block_size, element);
}

kv_geometry score_kv_geometry(const model::model_config& cfg, std::uint32_t tp,
                              const engine_options& options) {
  if (options.compute_dtype != model::dtype::bfloat16)
    return kv_geometry::of(cfg, tp, options.block_size, 4);
  if (options.block_size % 2 != 0)
    throw std::invalid_argument("engine: the bf16 engine needs an even block_size (scoring "
                                "reuses each block as an fp32 block of half the positions)");
  return kv_geometry::of(cfg, tp, options.block_size / 2, 4);
}

engine::engine(const model::model_config& cfg, std::shared_ptr<const model::tp_layout> layout,
               std::uint32_t rank, std::byte* kv_arena, std::uint64_t kv_bytes,
               engine_options options)
  : cfg_(cfg),
    layout_(std::move(layout)),
    rank_(rank),
    options_(options),
    kv_(engine_kv_geometry(cfg, layout_->tp(), options)),
    arena_(kv_arena),
    arena_bytes_(kv_bytes),
    pool_(static_cast<std::uint32_t>(std::min<std::uint64_t>(
            kv_bytes / kv_.block_bytes(), std::numeric_limits<std::uint32_t>::max())),
          options.block_size) {
  if (rank >= layout_->tp())
    throw std::invalid_argument("engine: rank " + std::to_string(rank) + " >= tp "
                                + std::to_string(layout_->tp()));
  if (options.max_batch == 0)
    throw std::invalid_argument("engine: max_batch must be at least 1");
}

std::uint64_t engine::reset_prefix_cache() {
  const std::uint64_t dropped = pool_.clear_prefix_cache();
  ++totals_.cache_resets;
  return dropped;
}

rank_forward_options engine::forward_options(const std::vector<const std::byte*>& residents,
                                             tp_comm& comm) const {
  rank_forward_options fo;
  fo.model = cfg_;
  fo.tp = layout_->tp();
  fo.rank = rank_;
  fo.weights = bind_weights(cfg_, *layout_, residents);
  fo.comm = &comm;
  fo.kv = kv_;
  fo.kv_blocks = pool_.capacity();
  fo.cache_fp32_weights = layout_->resident_bytes() <= options_.fp32_cache_limit_bytes;
  fo.compute_threads = options_.compute_threads;
  fo.cuda_device = options_.cuda_device;
  fo.compute_dtype = options_.compute_dtype;
  fo.cuda_graphs = options_.cuda_graphs;
  return fo;
}

rank_forward& engine::forward_for(const std::vector<const std::byte*>& residents, tp_comm& comm) {
  const bool keep = options_.compute_dtype == model::dtype::bfloat16;
  if (keep && forward_ && forward_residents_ == residents && forward_comm_ == &comm)
    return *forward_;
  forward_.reset();
  forward_ = make_rank_forward(forward_options(residents, comm));
  forward_residents_ = residents;
  forward_comm_ = &comm;
  return *forward_;
}

namespace {

// A sample (or a prompt being prefilled) and the KV blocks it holds.
struct sequence {
  std::uint32_t prompt = 0;
  std::uint32_t sample = 0;
  std::vector<std::uint32_t> blocks;
  std::vector<std::int32_t> tokens; // prompt followed by generated tokens
  generation* result = nullptr;
  bool done = false;
  std::uint32_t pending = 0;  // tokens of begun steps not landed yet (pipelined decode)
  std::int64_t feed_row = -1; // its row in the step begun last, while pending
};

// Releases blocks, deepest first (a chain's leaves are evicted before its parents).
void release_blocks(block_pool& pool, std::vector<std::uint32_t>& blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it)
    pool.release(*it);
  blocks.clear();
}

// Every block still held by live sequences goes back to the pool, also when generate throws.
struct live_set {
  explicit live_set(block_pool& p) : pool(p) {}
  ~live_set() {
    for (auto& s : samples)
      release_blocks(pool, s.blocks);
    for (auto& s : prefilling)
      release_blocks(pool, s.blocks);
  }
  block_pool& pool;
  std::list<sequence> samples;       // decoding, in admission order
  std::vector<sequence> prefilling;  // the prompts of the current admission round
};

// The phase timings and traffic counters of generate_stats, kept out of the loop's logic.
class phase_meter {
public:
  using clock = std::chrono::steady_clock;
  explicit phase_meter(generate_stats& st) : st_(st), start_(clock::now()) {}
  void begin() { t0_ = clock::now(); }
  void end_prefill() {
    st_.prefill_seconds += since(t0_);
    if (!first_token_) {
      st_.first_token_seconds = since(start_);
      first_token_ = true;
    }
  }
  // After a decode step whose `tokens` rows were kept, attending over `kv_positions` in all.
  void decode_step(std::uint64_t tokens, std::uint64_t kv_positions) {
    ++st_.decode_steps;
    st_.decode_tokens += tokens;
    st_.decode_kv_positions += kv_positions;
  }
  void end_decode() { st_.decode_seconds += since(t0_); }

private:
  static double since(clock::time_point t) {
    return std::chrono::duration<double>(clock::now() - t).count();
  }
  generate_stats& st_;
  const clock::time_point start_;
  clock::time_point t0_;
  bool first_token_ = false;
};

} // namespace

std::vector<generation> engine::generate(const std::vector<const std::byte*>& residents,
                                         tp_comm& comm, const generate_input& input,
                                         std::uint64_t weights_version, generate_stats* stats) {
  const request_plan plan = plan_request(cfg_, kv_, arena_bytes_, input);
  const sampling_config& params = input.params;
  const std::uint32_t n = params.n;
  const std::uint32_t block_size = kv_.block_size;

  generate_stats st;
  phase_meter meter(st);
  st.model_version = weights_version;
  st.kv_bytes_per_position = kv_.block_bytes() / block_size;
  if (cache_version_ && *cache_version_ != weights_version && pool_.prefix_entries() != 0)
    st.stale_entries_dropped = reset_prefix_cache();
  cache_version_ = weights_version;

  rank_forward& model = forward_for(residents, comm);
  const forward_counters before = model.counters();

  std::vector<generation> results(plan.prompts.size() * n);
  const auto is_stop = [&params](std::int32_t token) {
    return std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token)
           != params.stop_token_ids.end();
  };
  const std::vector<std::uint64_t>& need = plan.needs;
  std::vector<std::uint32_t> running(plan.prompts.size(), 0); // samples not finished per prompt

  live_set live(pool_);
  // Pipelined decode: the samples of the rows of the step begun and not landed. If generate
  // throws, that step is waited for and forgotten before the blocks go back.
  const bool pipelined = options_.pipeline_decode && model.pipelines_samples();
  std::vector<sequence*> flying;
  struct flight_guard {
    rank_forward& model;
    const std::vector<sequence*>& flying;
    ~flight_guard() {
      if (!flying.empty())
        try {
          model.drop_samples();
        } catch (...) { // already unwinding: the error that got here is the one to report
        }
    }
  } guard{model, flying};
  std::uint32_t next_prompt = 0;
  std::uint64_t reserved = 0; // worst-case blocks of the admitted prompts still running
  std::uint64_t live_samples = 0;

  const auto accept = [&](sequence& s, const sampled_token& t) {
    s.result->token_ids.push_back(t.token);
    s.result->logprobs.push_back(t.logprob);
    s.tokens.push_back(t.token);
    ++st.generated_tokens;
    if (is_stop(t.token)) {
      s.result->finish_reason = "stop";
    } else if (s.result->token_ids.size() >= params.max_tokens) {
      s.result->finish_reason = "length";
    } else {
      return;
    }
    s.done = true;
  };
  // The tokens of the step in flight reach the host: each row's sample takes its token, unless
  // it stopped at the step before (its row ran on a token that ends it: dropped).
  const auto land = [&] {
    const std::vector<sampled_token> next = model.finish_sample();
    std::uint64_t kept = 0, kv_positions = 0;
    for (std::size_t i = 0; i < flying.size(); ++i) {
      sequence& s = *flying[i];
      --s.pending;
      if (s.done) {
        ++st.decode_rows_dropped;
        continue;
      }
      kv_positions += s.tokens.size(); // the row's position + 1
      ++kept;
      accept(s, next[i]);
    }
    flying.clear();
    meter.decode_step(kept, kv_positions);
  };

  for (;;) {
    // ---- admission: prompts in order, while their worst case fits and slots are free
    std::vector<std::uint32_t> admitted;
    while (next_prompt < plan.prompts.size()) {
      const bool idle = live_samples == 0 && admitted.empty();
      if (reserved + need[next_prompt] > plan.capacity_blocks)
        break;
      if (!idle && live_samples + (admitted.size() + 1) * std::uint64_t{n} > options_.max_batch)
        break;
      reserved += need[next_prompt];
      admitted.push_back(next_prompt++);
    }
    if (!admitted.empty()) {
      meter.begin();
      trace::span traced("prefill", {{"prompts", admitted.size()}, {"live", live_samples}});
      ++st.waves;
      auto& prompts = live.prefilling;
      prompts.assign(admitted.size(), sequence{});
      // Prefix-cache lookup for every prompt first, then allocation (so allocating for one
      // prompt cannot evict the cached prefix of the next).
      std::vector<std::uint32_t> cached(admitted.size());
      for (std::size_t i = 0; i < admitted.size(); ++i) {
        sequence& s = prompts[i];
        s.prompt = admitted[i];
        s.tokens = plan.prompts[s.prompt];
        // Keep at least one prompt token to compute: its logits give the first sample token.
        const std::size_t reusable = (s.tokens.size() - 1) / block_size;
        s.blocks = pool_.match_prefix(s.tokens.data(), reusable);
        cached[i] = static_cast<std::uint32_t>(s.blocks.size() * block_size);
        st.prefix_hit_blocks += s.blocks.size();
        st.prefix_hit_tokens += cached[i];
      }
      std::vector<forward_item> items;
      for (std::size_t i = 0; i < admitted.size(); ++i) {
        sequence& s = prompts[i];
        while (s.blocks.size() * block_size < s.tokens.size())
          s.blocks.push_back(pool_.allocate());
        st.prompt_tokens += s.tokens.size();
        st.computed_prompt_tokens += s.tokens.size() - cached[i];
        items.push_back({s.blocks.data(), s.blocks.size(), cached[i], s.tokens.data() + cached[i],
                         static_cast<std::uint32_t>(s.tokens.size() - cached[i])});
      }
      std::vector<sample_draw> draws;
      for (std::uint32_t i = 0; i < admitted.size(); ++i)
        for (std::uint32_t sample = 0; sample < n; ++sample)
          draws.push_back({i, prompts[i].prompt, sample, 0});
      const std::vector<sampled_token> first = model.forward_sample(items, arena_, params, draws);
      ++st.forward_passes;
      for (const sequence& s : prompts)
        pool_.insert_prefix(s.tokens.data(), s.tokens.size() / block_size, s.blocks);

      // Fork the samples of every prompt.
      for (std::size_t i = 0; i < admitted.size(); ++i) {
        sequence& prompt = prompts[i];
        const std::size_t full = prompt.tokens.size() / block_size;
        running[prompt.prompt] = n;
        for (std::uint32_t sample = 0; sample < n; ++sample) {
          sequence& s = live.samples.emplace_back();
          s.prompt = prompt.prompt;
          s.sample = sample;
          s.tokens = prompt.tokens;
          if (sample + 1 < n) {
            for (std::size_t b = 0; b < full; ++b) {
              pool_.retain(prompt.blocks[b]);
              s.blocks.push_back(prompt.blocks[b]);
            }
            if (prompt.blocks.size() > full) { // private copy of the partial block
              const std::uint32_t copy = pool_.allocate();
              s.blocks.push_back(copy);
              std::byte* dst = arena_ + copy * kv_.block_bytes();
              const std::byte* src = arena_ + prompt.blocks[full] * kv_.block_bytes();
              if (options_.copy_kv_block)
                options_.copy_kv_block(dst, src, kv_.block_bytes());
              else
                std::memcpy(dst, src, kv_.block_bytes());
            }
          } else {
            s.blocks = std::move(prompt.blocks);
            prompt.blocks.clear();
          }
          generation& g = results[std::size_t{s.prompt} * n + sample];
          g.prompt_index = s.prompt;
          g.sample_index = sample;
          g.prompt_token_ids = prompt.tokens;
          g.prompt_truncated = plan.truncated[s.prompt];
          s.result = &g;
          accept(s, first[i * n + sample]);
          ++live_samples;
        }
      }
      prompts.clear();
      meter.end_prefill();
    }

    // ---- retire finished samples: their blocks and slots free at once
    for (auto it = live.samples.begin(); it != live.samples.end();) {
      if (!it->done || it->pending > 0) {
        ++it;
        continue;
      }
      release_blocks(pool_, it->blocks);
      if (--running[it->prompt] == 0)
        reserved -= need[it->prompt];
      --live_samples;
      it = live.samples.erase(it);
    }
    if (live.samples.empty()) {
      if (next_prompt == plan.prompts.size())
        break;
      continue; // nothing running: the next admission succeeds (each prompt fits alone)
    }
    // ---- decode: one batched step over every live sample that still draws (pipelined: a
    // sample's token in flight is its input, fed on the device, and its position one further)
    st.max_live_samples = std::max<std::uint64_t>(st.max_live_samples, live_samples);
    meter.begin();
    std::vector<forward_item> items;
    std::vector<sample_draw> draws;
    std::vector<sequence*> order;
    std::vector<std::int64_t> feed;
    std::uint64_t kv_positions = 0;
    for (auto& s : live.samples) {
      const std::uint64_t drawn = s.result->token_ids.size() + s.pending;
      if (s.done || drawn >= params.max_tokens) // stopped, or its last token is in flight
        continue;
      const auto position = static_cast<std::uint32_t>(s.tokens.size() - 1 + s.pending);
      while (s.blocks.size() * block_size <= position)
        s.blocks.push_back(pool_.allocate());
      feed.push_back(s.pending > 0 ? s.feed_row : -1);
      draws.push_back({static_cast<std::uint32_t>(items.size()), s.prompt, s.sample, drawn});
      items.push_back({s.blocks.data(), s.blocks.size(), position, &s.tokens.back(), 1});
      kv_positions += std::uint64_t{position} + 1;
      order.push_back(&s);
    }
    if (items.empty()) { // every running sample's last token is in flight
      land();
      meter.end_decode();
      continue;
    }
    trace::span traced("decode_step", {{"batch", items.size()}});
    const std::uint64_t replays = model.graph_replays();
    ++st.forward_passes;
    if (pipelined && next_prompt == plan.prompts.size()) { // no admission can come between
      model.begin_sample(items, arena_, params, draws, feed);
      traced.arg("cuda_graph", model.graph_replays() != replays);
      if (!flying.empty()) {
        ++st.decode_steps_ahead;
        land();
      }
      for (std::size_t i = 0; i < order.size(); ++i) {
        ++order[i]->pending;
        order[i]->feed_row = static_cast<std::int64_t>(i);
      }
      flying = std::move(order);
      meter.end_decode();
      continue;
    }
    if (!flying.empty()) // a step in flight only once every prompt is admitted
      throw std::logic_error("generate: a synchronous decode step while one is in flight");
    const std::vector<sampled_token> next = model.forward_sample(items, arena_, params, draws);
    traced.arg("cuda_graph", model.graph_replays() != replays);
    meter.decode_step(items.size(), kv_positions);
    meter.end_decode();
    for (std::size_t i = 0; i < order.size(); ++i)
      accept(*order[i], next[i]);
  }

  const forward_counters after = model.counters();
  st.graph_replays = after.graph_replays - before.graph_replays;
  st.graph_captures = after.graph_captures - before.graph_captures;
  st.peak_workspace_bytes = after.peak_workspace_bytes;
  st.preload_gemms = after.preload_gemms - before.preload_gemms;
  st.expert_loads_counted = after.counts_experts;
  st.decode_expert_loads = after.decode_expert_loads - before.decode_expert_loads;
  st.prompts = plan.prompts.size();
  st.samples = results.size();
  ++totals_.requests;
  totals_.prefix_hit_blocks += st.prefix_hit_blocks;
  totals_.prefix_hit_tokens += st.prefix_hit_tokens;
  if (stats)
    *stats = st;
  return results;
}

} // namespace refit::inference
