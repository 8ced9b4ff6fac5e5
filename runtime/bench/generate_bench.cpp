// refit-bench generate: generation speed of refit-runtime against the bytes a decode step
// must read, and the log-probability gap of what it generated to the fp32 forward.
//
//   refit-bench generate --config R --batch 1,16,64,256 --prompt-len P --max-tokens T
//                        [--temperature X] [--seed S] [--repeat N] [--json]
//
// It starts the rollout subtree (RolloutSupervisor -> vLLMRuntimeProxy -> refit-runtime) as
// refit-bench publish does; the runtime loads version 0 itself (synthetic weights from
// job.seed / trainer.init_scale, or model.path). No trainer side: nothing is published.
// One untimed warm-up request (the smallest batch), then per batch size B, --repeat times:
// reset the prefix cache, send one GenerateRequest of B prompts of P token ids drawn from
// (seed, B, repetition) (n = 1, max_tokens T, no stop tokens, top_k 0, top_p 1), and take the
// runtime's GenerateStats (TP worker 0's clock: prefill, decode, first token, the decode
// steps' tokens, KV positions and distinct routed experts). Reported per batch size: medians
// over the repetitions.
//
// Roofline: the bytes of one decode step on one TP rank (decode_step_bytes: every attention
// weight, norm and router once, the lm_head rows once, the fed tokens' embedding rows, w13 +
// w2 of each distinct expert routed to in each layer, the KV positions attended and the KV
// written), averaged over the decode steps, divided by the mean decode step time, divided by
// the copy bound measured in the same run: a device-to-device copy on the runtime's first
// device (CUDA builds with cuda devices) or a single-threaded std::memcpy in this process
// (CPU), sampled right after every measured request. The bound counts the bytes read plus
// the bytes written (2 x bound_bytes per copy), as the decode figure counts KV written.
//
// Gap: the last repetition's sequences (prompt + generated tokens) are scored by the
// runtime's SCORE command (the fp32 forward on the same resident weights, teacher forced);
// with temperature 1 (or 0) and no top-k / top-p the generated tokens' reported logprobs are
// plain log-softmax values, so mean and max |generated - fp32| is the engine's numeric gap.
#include "runtime/bench/generate_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>

#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>

#include "runtime/bench/measure.hpp"
#include "runtime/bench/publish_bench.hpp"
#include "runtime/device/device.hpp"
#include "runtime/system/bootstrap.hpp"
#if REFIT_HAVE_CUDA
#include "runtime/cuda/cuda.hpp"
#endif

namespace refit::bench {

using json = nlohmann::ordered_json;
using namespace std::chrono_literals;

decode_bytes decode_step_bytes(const model::model_config& m, std::uint32_t tp, double tokens,
                               double expert_loads, double kv_positions,
                               double kv_bytes_per_position) {
  const double e = static_cast<double>(model::dtype_size(m.torch_dtype));
  const double hidden = m.hidden_size, hd = m.head_dim, layers = m.num_hidden_layers;
  const double q_heads = m.num_attention_heads / tp;
  const double kv_heads = std::max<std::uint32_t>(1, m.num_key_value_heads / tp);
  const double inter = m.moe_intermediate_size / tp;
  const double vocab_rows = (std::uint64_t{m.vocab_size} + tp - 1) / tp;
  decode_bytes b;
  b.attention = layers * ((q_heads + 2 * kv_heads) * hd * hidden + hidden * q_heads * hd) * e;
  b.norms = (layers * (2 * hd + 2 * hidden) + hidden) * e;
  b.router = layers * double(m.num_experts) * hidden * e;
  b.lm_head = vocab_rows * hidden * e;
  b.embedding = tokens * hidden * e;
  b.experts = expert_loads * 3 * inter * hidden * e; // w13 (2 I rows) + w2 (I columns)
  b.kv_read = kv_positions * kv_bytes_per_position;
  b.kv_write = tokens * kv_bytes_per_position;
  return b;
}

namespace {

constexpr const char* program = "refit-bench";

std::uint64_t mix64(std::uint64_t x) { // splitmix64's finalizer: portable prompt ids
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// B prompts of P ids in [0, vocab), a function of (seed, B, repetition) only.
std::vector<std::vector<std::int32_t>> random_prompts(std::uint64_t seed, std::uint32_t batch,
                                                      std::uint32_t rep, std::uint32_t len,
                                                      std::uint32_t vocab) {
  std::vector<std::vector<std::int32_t>> out(batch, std::vector<std::int32_t>(len));
  for (std::uint32_t b = 0; b < batch; ++b)
    for (std::uint32_t t = 0; t < len; ++t)
      out[b][t] = static_cast<std::int32_t>(
        mix64(mix64(mix64(seed ^ (std::uint64_t{batch} << 32) ^ rep) + b) + t) % vocab);
  return out;
}

double median_of(std::vector<double> xs) { return xs.empty() ? NAN : median(std::move(xs)); }

json number_or_null(double x) { return std::isfinite(x) ? json(x) : json(nullptr); }

struct measured {
  generation_stats st;
  double request_seconds = 0;
  std::uint64_t generated = 0; // tokens in the samples
  bool all_length = true;      // every sample ran to max_tokens
};

class generate_bench {
public:
  generate_bench(const generate_options& o, config::refit_config cfg, std::string runtime_exe)
    : o_(o), cfg_(std::move(cfg)), exe_(std::move(runtime_exe)) {}
  ~generate_bench() { stop(); }

  json run();

private:
  template <class T, class... Ts>
  T ask(const std::string& what, caf::timespan timeout, Ts&&... xs) {
    caf::scoped_actor self{*sys_};
    std::optional<T> out;
    std::string error;
    self->request(rollout_.engine, timeout, std::forward<Ts>(xs)...)
      .receive([&](T& x) { out = std::move(x); },
               [&](caf::error& e) { error = refit::render(e); });
    if (!out)
      throw bench_error(what + " failed: " + error);
    return std::move(*out);
  }

  caf::timespan request_timeout() const {
    return std::chrono::milliseconds(cfg_.runtime.timeouts_ms.generate) + 10s;
  }

  generate_request request(std::uint32_t batch, std::uint32_t rep) const {
    generate_request req;
    req.prompts = random_prompts(o_.seed, batch, rep, o_.prompt_len, cfg_.model.vocab_size);
    req.params.n = 1;
    req.params.max_tokens = o_.max_tokens;
    req.params.temperature = o_.temperature;
    req.params.top_k = 0;
    req.params.top_p = 1.0f;
    req.params.seed = o_.seed;
    return req;
  }

  measured generate_once(std::uint32_t batch, std::uint32_t rep, generate_result* keep) {
    const std::string what = "generate (batch " + std::to_string(batch) + ")";
    ask<std::uint64_t>("reset_prefix_cache before " + what, 1min, reset_pc_atom::value);
    const auto t0 = std::chrono::steady_clock::now();
    auto res = ask<generate_result>(what, request_timeout(), generate_atom::value,
                                    request(batch, rep));
    measured m;
    m.request_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    m.st = res.stats;
    for (const auto& s : res.samples) {
      m.generated += s.token_ids.size();
      m.all_length = m.all_length && s.finish_reason == "length";
    }
    if (keep)
      *keep = std::move(res);
    return m;
  }

  void sample_bound() {
#if REFIT_HAVE_CUDA
    if (cuda_ordinal_ >= 0) {
      for (double s : refit::cuda::device_copy_seconds(cuda_ordinal_, o_.bound_bytes, o_.bound_reps))
        bound_seconds_.push_back(s);
      return;
    }
#endif
    if (!memcpy_)
      memcpy_ = std::make_unique<memcpy_bound>(o_.bound_bytes);
    memcpy_->sample(o_.bound_reps);
    bound_seconds_ = memcpy_->seconds();
  }

  json gap_of(const generate_result& res);
  json batch_report(std::uint32_t batch, const std::vector<measured>& runs, const json& gap,
                    double bound_gbps);
  void start();
  void stop();

  generate_options o_;
  config::refit_config cfg_;
  std::string exe_;
  std::unique_ptr<caf::actor_system_config> sys_cfg_;
  std::unique_ptr<caf::actor_system> sys_;
  rollout_handles rollout_;
  bool started_ = false;
  int cuda_ordinal_ = -1;
  std::unique_ptr<memcpy_bound> memcpy_;
  std::vector<double> bound_seconds_;
};

void generate_bench::start() {
  sys_cfg_ = std::make_unique<caf::actor_system_config>();
  refit::configure(*sys_cfg_);
  sys_cfg_->set("scheduler.policy", caf::atom("sharing"));
  sys_ = std::make_unique<caf::actor_system>(*sys_cfg_);
  rollout_ = spawn_rollout(*sys_, cfg_, make_runtime_proxy_factory(cfg_, exe_));
  started_ = true;
  engine_status st;
  const auto timeout = std::chrono::milliseconds(cfg_.runtime.timeouts_ms.startup) + 10s;
  if (!wait_until_ready(*sys_, rollout_.engine, timeout, &st))
    throw bench_error("the runtime did not become ready within "
                      + std::to_string(timeout.count() / 1000) + " s: "
                      + (st.last_error.empty() ? std::string("no error reported") : st.last_error));
}

void generate_bench::stop() {
  if (!started_)
    return;
  shutdown_rollout(*sys_, rollout_);
  rollout_ = {};
  sys_.reset();
  started_ = false;
}

json generate_bench::gap_of(const generate_result& res) {
  json g;
  if (!o_.gap) {
    g["compared"] = false;
    g["reason"] = "--no-gap";
    return g;
  }
  if (o_.temperature != 0.0f && o_.temperature != 1.0f) {
    g["compared"] = false;
    g["reason"] = "the reported logprobs are under temperature " + std::to_string(o_.temperature)
                  + "; the fp32 score is the plain log-softmax (use --temperature 1 or 0)";
    return g;
  }
  score_request req;
  req.start = o_.prompt_len;
  for (const auto& s : res.samples) {
    auto seq = s.prompt_token_ids;
    seq.insert(seq.end(), s.token_ids.begin(), s.token_ids.end());
    req.sequences.push_back(std::move(seq));
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto scored = ask<score_result>("score (the fp32 reference of the generated tokens)",
                                        request_timeout(), score_atom::value, req);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double sum = 0, worst = 0;
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < res.samples.size(); ++i) {
    const auto& lp = res.samples[i].logprobs;
    for (std::size_t t = 0; t < lp.size(); ++t) {
      const double d = std::fabs(double(lp[t]) - double(scored.logprobs.at(i).at(t)));
      sum += d;
      worst = std::max(worst, d);
      ++n;
    }
  }
  g["compared"] = true;
  g["tokens"] = n;
  g["mean_abs"] = n ? sum / n : 0.0;
  g["max_abs"] = worst;
  g["score_seconds"] = seconds;
  g["reference"] = "runtime SCORE: the fp32 forward (compute_dtype float32, no fp32 weight "
                   "copy) on the same resident weights, teacher forced, log-softmax";
  return g;
}

json generate_bench::batch_report(std::uint32_t batch, const std::vector<measured>& runs,
                                  const json& gap, double bound_gbps) {
  const auto& m = cfg_.model;
  const std::uint32_t tp = cfg_.runtime.tp_size;
  std::vector<double> prefill_s, prefill_tps, ttft, decode_s, decode_tps, step_s, request_s,
    bytes_step, gbps, ratio;
  json all = json::array();
  json breakdown;
  bool counted = true;
  for (const auto& r : runs) {
    const auto& st = r.st;
    counted = counted && st.expert_loads_counted;
    prefill_s.push_back(st.prefill_seconds);
    prefill_tps.push_back(st.prefill_seconds > 0 ? st.computed_prompt_tokens / st.prefill_seconds : NAN);
    ttft.push_back(st.first_token_seconds);
    request_s.push_back(r.request_seconds);
    json run = {{"request_seconds", r.request_seconds},
                {"prefill_seconds", st.prefill_seconds},
                {"first_token_seconds", st.first_token_seconds},
                {"decode_seconds", st.decode_seconds},
                {"decode_steps", st.decode_steps},
                {"decode_tokens", st.decode_tokens},
                {"decode_steps_ahead", st.decode_steps_ahead},
                {"decode_rows_dropped", st.decode_rows_dropped},
                {"decode_kv_positions", st.decode_kv_positions},
                {"decode_expert_loads", st.decode_expert_loads},
                {"expert_loads_counted", st.expert_loads_counted},
                {"generated_tokens", r.generated},
                {"waves", st.waves},
                {"max_live_samples", st.max_live_samples},
                {"graph_replays", st.graph_replays},
                {"graph_captures", st.graph_captures},
                {"peak_workspace_bytes", st.peak_workspace_bytes},
                {"preload_gemms", st.preload_gemms}};
    if (st.decode_steps > 0 && st.decode_seconds > 0) {
      const double steps = double(st.decode_steps);
      const double tokens = st.decode_tokens / steps;
      // Without counts: every token's top-k experts distinct (capped at num_experts).
      const double loads = st.expert_loads_counted
                             ? st.decode_expert_loads / steps
                             : m.num_hidden_layers
                                 * std::min<double>(m.num_experts, tokens * m.num_experts_per_tok);
      const decode_bytes b = decode_step_bytes(m, tp, tokens, loads, st.decode_kv_positions / steps,
                                               double(st.kv_bytes_per_position));
      const double step = st.decode_seconds / steps;
      decode_s.push_back(st.decode_seconds);
      decode_tps.push_back(st.decode_tokens / st.decode_seconds);
      step_s.push_back(step);
      bytes_step.push_back(b.total());
      gbps.push_back(b.total() / step / 1e9);
      ratio.push_back(b.total() / step / 1e9 / bound_gbps);
      breakdown = {{"total", b.total()},         {"attention", b.attention},
                   {"norms", b.norms},           {"router", b.router},
                   {"lm_head", b.lm_head},       {"embedding", b.embedding},
                   {"experts", b.experts},       {"kv_read", b.kv_read},
                   {"kv_write", b.kv_write},     {"tokens", tokens},
                   {"expert_loads", loads},      {"kv_positions", st.decode_kv_positions / steps},
                   {"kv_bytes_per_position", st.kv_bytes_per_position}};
      run["decode_bytes_per_step"] = b.total();
      run["roofline_ratio"] = ratio.back();
    }
    all.push_back(run);
  }
  const auto& last = runs.back();
  json out;
  out["batch"] = batch;
  out["samples"] = batch;
  out["generated_tokens"] = last.generated;
  out["expected_tokens"] = std::uint64_t{batch} * o_.max_tokens;
  out["all_finished_by_length"] = last.all_length;
  out["prompt_tokens"] = last.st.prompt_tokens;
  out["computed_prompt_tokens"] = last.st.computed_prompt_tokens;
  out["waves"] = last.st.waves;
  out["decode_steps"] = last.st.decode_steps;
  out["decode_tokens"] = last.st.decode_tokens;
  out["prefill_seconds"] = median_of(prefill_s);
  out["prefill_tok_s"] = number_or_null(median_of(prefill_tps));
  out["ttft_seconds"] = median_of(ttft);
  out["decode_seconds"] = number_or_null(median_of(decode_s));
  out["decode_tok_s"] = number_or_null(median_of(decode_tps));
  out["decode_step_seconds"] = number_or_null(median_of(step_s));
  out["request_seconds"] = median_of(request_s);
  out["decode_bytes_per_step"] = number_or_null(median_of(bytes_step));
  out["decode_gbps"] = number_or_null(median_of(gbps));
  out["roofline_ratio"] = number_or_null(median_of(ratio));
  out["expert_loads_source"] = counted ? "counted by the forward (distinct experts per layer and step)"
                                       : "upper bound: min(num_experts, tokens x top_k) per layer "
                                         "(the forward does not count its routing)";
  out["decode_bytes_breakdown"] = breakdown.is_null() ? json(nullptr) : breakdown;
  out["logprob_gap"] = gap;
  out["runs"] = all;
  return out;
}

json generate_bench::run() {
  if (o_.batches.empty() || o_.prompt_len == 0 || o_.max_tokens == 0 || o_.repeat == 0)
    throw bench_error("--batch, --prompt-len, --max-tokens and --repeat must be >= 1");
  const auto first = device::parse(cfg_.runtime.devices.at(0), "runtime.devices[0]");
#if REFIT_HAVE_CUDA
  if (first.k == device::kind::cuda)
    cuda_ordinal_ = first.index;
#else
  if (first.k == device::kind::cuda)
    throw bench_error("runtime.devices are CUDA devices: the copy bound needs a refit-bench "
                      "built with REFIT_CUDA=ON");
#endif
  json batches = json::array();
  runtime_description d;
  try {
    start();
    d = ask<runtime_description>("describe", 1min, describe_atom::value);
    // Warm-up (untimed): the smallest batch, its own prompts.
    const std::uint32_t smallest = *std::min_element(o_.batches.begin(), o_.batches.end());
    generate_once(smallest, 0xffffffffu, nullptr);
    for (std::uint32_t batch : o_.batches) {
      std::vector<measured> runs;
      generate_result last;
      const std::size_t bound_before = bound_seconds_.size();
      for (unsigned rep = 0; rep < o_.repeat; ++rep) {
        runs.push_back(generate_once(batch, rep, rep + 1 == o_.repeat ? &last : nullptr));
        sample_bound();
      }
      const json gap = gap_of(last);
      const std::vector<double> mine(bound_seconds_.begin() + bound_before, bound_seconds_.end());
      const double bound_gbps = 2.0 * o_.bound_bytes / median(mine) / 1e9;
      json rep = batch_report(batch, runs, gap, bound_gbps);
      rep["bound_gbps"] = bound_gbps;
      if (!o_.as_json)
        std::fprintf(stderr, "%s: batch %u: decode %.1f tok/s, roofline %.3f\n", program, batch,
                     rep["decode_tok_s"].is_null() ? 0.0 : rep["decode_tok_s"].get<double>(),
                     rep["roofline_ratio"].is_null() ? 0.0 : rep["roofline_ratio"].get<double>());
      batches.push_back(std::move(rep));
    }
  } catch (...) {
    stop();
    throw;
  }
  stop();

  const auto& m = cfg_.model;
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const decode_bytes fixed = decode_step_bytes(m, cfg_.runtime.tp_size, 0, 0, 0, 0);
  json out;
  out["benchmark"] = "generate";
  out["config"] = o_.config_path;
  out["host"] = host;
  out["model_type"] = m.model_type;
  out["model"] = {{"num_hidden_layers", m.num_hidden_layers}, {"hidden_size", m.hidden_size},
                  {"num_experts", m.num_experts}, {"num_experts_per_tok", m.num_experts_per_tok},
                  {"moe_intermediate_size", m.moe_intermediate_size},
                  {"vocab_size", m.vocab_size}, {"torch_dtype", model::dtype_name(m.torch_dtype)}};
  out["weights"] = d.checkpoint_path.empty() ? std::string("synthetic") : d.checkpoint_path;
  out["tp"] = cfg_.runtime.tp_size;
  out["devices"] = cfg_.runtime.devices;
  // The engine's tuning knobs that were set (the runtime inherits this environment), so a
  // result says which kernels it measured (docs/operations.md).
  out["engine_env"] = json::object();
  for (const char* knob :
       {"REFIT_PDL", "REFIT_TP_COMM", "REFIT_EXPERT_GEMV_MAX_COPIES", "REFIT_EXPERT_MMA_MAX_COPIES",
        "REFIT_EXPERT_MMA_KSPLIT", "REFIT_EXPERT_MMA_CHUNKS", "REFIT_EXPERT_MMA_EVICT_FIRST",
        "REFIT_DENSE_GEMV_MAX_ROWS", "REFIT_DENSE_MMA_MAX_ROWS", "REFIT_FUSED_SAMPLING",
        "REFIT_ROUTER_SPLIT", "REFIT_LOGITS_FP32", "REFIT_RESIDUAL_FP32", "REFIT_ATTENTION_MMA",
        "REFIT_ATTENTION_SPLITS", "REFIT_ATTENTION_WARPS", "REFIT_EXPERT_MMA_STAGES",
        "REFIT_EXPERT_MMA_EARLY", "REFIT_EXPERT_MMA_PERSISTENT", "REFIT_EXPERT_SELF_SORT",
        "REFIT_ROUTE_BUCKET_MAX_TOKENS", "REFIT_ROUTER_MMA_MAX_ROWS", "REFIT_ATTENTION_FUSED_QK",
        "REFIT_MIX_EARLY", "REFIT_PRELOAD_GEMM", "REFIT_MIX_TRIGGER_EARLY", "REFIT_EXPERT_MMA_LINES"})
    if (const char* v = std::getenv(knob); v != nullptr)
      out["engine_env"][knob] = v;
  out["compute_dtype"] = cfg_.runtime.compute_dtype;
  // Device memory of TP worker 0: weights and KV arena (describe), and the engine's peak
  // workspace beyond them (the largest of the requests').
  std::uint64_t workspace = 0;
  for (const auto& b : batches)
    for (const auto& r : b["runs"])
      workspace = std::max<std::uint64_t>(workspace, r["peak_workspace_bytes"].get<std::uint64_t>());
  if (!d.workers.empty())
    out["memory"] = {{"weight_bytes", d.workers.front().weight_bytes_resident},
                     {"kv_cache_bytes", d.workers.front().kv_cache_bytes_resident},
                     {"peak_workspace_bytes", workspace},
                     {"total_bytes", d.workers.front().weight_bytes_resident
                                       + d.workers.front().kv_cache_bytes_resident + workspace}};
  out["prompt_len"] = o_.prompt_len;
  out["max_tokens"] = o_.max_tokens;
  out["temperature"] = o_.temperature;
  out["top_k"] = 0;
  out["top_p"] = 1.0;
  out["seed"] = o_.seed;
  out["repeat"] = o_.repeat;
  out["warmup_requests"] = 1;
  out["bound_method"]
    = (cuda_ordinal_ >= 0 ? "cudaMemcpyAsync device-to-device of bound_bytes on cuda:"
                              + std::to_string(cuda_ordinal_)
                          : std::string("single-threaded std::memcpy of bound_bytes between two "
                                        "pre-faulted buffers in this process"))
      + ", " + std::to_string(o_.bound_reps)
      + " copies after every measured request, median per batch size; gbps counts bytes read "
        "+ written (2 x bound_bytes per copy)";
  out["bound_bytes"] = o_.bound_bytes;
  out["bound_seconds_all"] = bound_seconds_;
  out["bytes_model"] = {
    {"per_rank", "TP rank 0's resident share; dtype " + std::string(model::dtype_name(m.torch_dtype))},
    {"fixed_per_step", fixed.total()},
    {"attention", fixed.attention}, {"norms", fixed.norms}, {"router", fixed.router},
    {"lm_head", fixed.lm_head},
    {"per_token", "embedding row + KV write (kv_bytes_per_position)"},
    {"per_expert_load", decode_step_bytes(m, cfg_.runtime.tp_size, 0, 1, 0, 0).experts},
    {"per_kv_position", "kv_bytes_per_position (runtime)"}};
  out["batches"] = batches;
  return out;
}

} // namespace

json run_generate(const generate_options& o, const config::refit_config& cfg,
                  const std::string& runtime_exe) {
  generate_bench b{o, cfg, runtime_exe};
  return b.run();
}

void print_generate_table(const json& r) {
  std::printf("refit-bench generate  %s (%s, tp %u, weights %s)\n",
              r["config"].get<std::string>().c_str(), r["model_type"].get<std::string>().c_str(),
              r["tp"].get<unsigned>(), r["weights"].get<std::string>().c_str());
  std::printf("  prompt %u tokens, %u new tokens, temperature %g, %u repetitions (median)\n",
              r["prompt_len"].get<unsigned>(), r["max_tokens"].get<unsigned>(),
              r["temperature"].get<double>(), r["repeat"].get<unsigned>());
  std::printf("  %6s %12s %10s %12s %12s %14s %10s %9s %12s\n", "batch", "prefill t/s", "ttft s",
              "decode t/s", "step ms", "bytes/step", "bound GB/s", "roofline", "gap max");
  auto num = [](const json& x, double scale = 1) { return x.is_null() ? NAN : x.get<double>() * scale; };
  for (const auto& b : r["batches"]) {
    const auto& g = b["logprob_gap"];
    std::printf("  %6u %12.1f %10.4f %12.1f %12.3f %14.0f %10.2f %9.4f %12.3g\n",
                b["batch"].get<unsigned>(), num(b["prefill_tok_s"]), num(b["ttft_seconds"]),
                num(b["decode_tok_s"]), num(b["decode_step_seconds"], 1e3),
                num(b["decode_bytes_per_step"]), num(b["bound_gbps"]), num(b["roofline_ratio"]),
                g["compared"].get<bool>() ? g["max_abs"].get<double>() : NAN);
  }
}

} // namespace refit::bench
