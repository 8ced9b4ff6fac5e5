// refit-bench: benchmarks of refit's hot paths on a recipe (configs/*.yaml).
//
//   refit-bench publish --config configs/bench-cpu.yaml [--iterations N] [--verify] [--json]
//   refit-bench soak --config configs/tiny-synthetic.yaml --cycles N [--seed S] [--json]
//   refit-bench tokenize --tokenizer DIR --corpus FILE.jsonl [--seconds S] [--json]
//   refit-bench generate --config R --batch 1,16,64,256 --prompt-len P --max-tokens T [--json]
//   any of them with --trace FILE: a Chrome trace-event JSON of the run (Perfetto)
//
// `publish` (runtime/bench/publish_bench.hpp) times whole publications against a bound
// measured in the same run. `soak` (runtime/bench/soak.hpp) runs N publish/fault/restart
// cycles with seeded random runtime faults in one actor system, checks every generation
// against the trainer's reference and reports leaked processes, /dev/shm entries and fds; it
// exits 1 unless all N cycles committed with nothing stale and nothing leaked.
// This file only parses flags and prints.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/bench/generate_bench.hpp"
#include "runtime/bench/publish_bench.hpp"
#include "runtime/bench/soak.hpp"
#include "runtime/config/config.hpp"
#include "runtime/control/process.hpp"
#include "runtime/tokenizer/tokenize_bench.hpp"
#include "runtime/trace/chrome_json.hpp"

namespace {

using json = nlohmann::ordered_json;
constexpr const char* program = "refit-bench";

int fail(const std::string& what) {
  std::cerr << program << ": " << what << std::endl;
  return 1;
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"refit-bench: benchmarks refit's weight publication path on a recipe "
               "(configs/*.yaml)."};
  app.require_subcommand(1, 1);
  std::string trace_path;
  app.add_option("--trace", trace_path,
                 "write a Chrome trace-event JSON of the run to FILE (open it in Perfetto or "
                 "chrome://tracing): one track per trainer rank and TP worker (materialize, "
                 "gather, load, copy per chunk), the gate rounds, commit and release, the "
                 "runtime's control requests; accepted after the subcommand too")
    ->type_name("FILE");
  app.fallthrough(); // --trace after the subcommand
  refit::trace::tool_trace traced(program); // written when main returns
  refit::bench::publish_options o;
  auto* publish = app.add_subcommand(
    "publish",
    "Start the rollout runtime and the trainer side in this process, run --iterations timed "
    "publications (versions 1..N, a synthetic optimizer step on every rank between them, each "
    "inside the colocated sleep(2) -> wake(weights) -> publish -> wake(kv_cache) schedule, "
    "verifier off), and compare the median publication time (first chunk requested -> "
    "version committed) with a plain single-threaded memcpy of the same bytes. Prints tensors, "
    "bytes, chunks, trainer_ranks, tp, seconds, gbps, bound_gbps, ratio = gbps / bound_gbps, "
    "peak_extra_bytes and, with --verify, verified.");
  publish->add_option("-c,--config", o.config_path,
                      "YAML recipe to benchmark (required), e.g. configs/bench-cpu.yaml")
    ->required();
  publish->add_option("-n,--iterations", o.iterations,
                      "number of timed publications (default 5); `seconds` is their median")
    ->check(CLI::Range(1u, 1000u));
  publish->add_flag("--verify", o.verify,
                    "after the timed publications, run one more publication with "
                    "publication.verify = true (byte-exact SHA-256 of every resident tensor) "
                    "and report verified: true only if it committed");
  publish->add_flag("--json", o.as_json, "print one JSON object instead of a table");
  publish->add_option("--source", o.source,
                      "the trainer ranks' weights: synthetic (refit's shard store, default) or "
                      "registered (memory laid out as FSDP2 holds it: unpadded Shard(0) rows, "
                      "fused experts; published zero copy)")
    ->check(CLI::IsMember({"synthetic", "registered"}));
  publish->add_option("--rounds", o.rounds,
                      "with --source registered: rounds of (synthetic, registered) phases of "
                      "--iterations publications each in this run (default 1); the result's "
                      "`comparison` gives both medians, their spread, the ratio and whether "
                      "registered is within 5% of synthetic in every round")
    ->check(CLI::Range(1u, 100u));
  publish->add_option("--mode", o.mode,
                      "publication.mode of this run: packed (all-gather into packed buffers, "
                      "the runtime scatters) or direct (every rank writes its bytes straight "
                      "into the runtime's resident tensors); default: the recipe's")
    ->check(CLI::IsMember({"packed", "direct"}));
  publish->add_option("--bound-reps", o.bound_reps,
                      "memcpy repetitions timed for the bound right after each publication "
                      "(default 3); bound_gbps uses the median of all of them")
    ->check(CLI::Range(1u, 100u));
  publish->add_option("--scheduler", o.scheduler,
                      "CAF scheduler policy of this process (trainer ranks, coordinator, "
                      "engine): sharing (default: idle workers block) or stealing (CAF's "
                      "default: idle workers poll, competing with the copies on few cores)")
    ->check(CLI::IsMember({"sharing", "stealing"}));
  refit::soak::soak_options so;
  auto* soak = app.add_subcommand(
    "soak",
    "Run --cycles publish/fault/restart cycles in one process: every cycle injects a seeded "
    "random runtime fault (command x kind) into its publication, the coordinator republishes "
    "the same version on the supervisor's fresh runtime, then a generation is checked against "
    "the trainer's reference. Prints cycles, faults, restarts, commits, stale_generations, "
    "leaked_processes, leaked_shm, leaked_fds, seconds, seed and a per-cycle list; exits 1 "
    "unless every cycle committed with no stale generation and nothing leaked.");
  soak->add_option("-c,--config", so.config_path, "YAML recipe (required), e.g. configs/tiny-cpu.yaml")
    ->required();
  soak->add_option("-n,--cycles", so.cycles, "publish/fault/restart cycles (default 10)")
    ->check(CLI::Range(1u, 100000u));
  soak->add_option("--seed", so.seed, "seed of the fault plan (default 1)");
  soak->add_option("--command-timeout-ms", so.command_timeout_ms,
                   "timeout of the publication commands in the soak's copy of the recipe "
                   "(default 500), so that injected stalls are detected quickly")
    ->check(CLI::Range(1u, 3600000u));
  soak->add_flag("--json", so.as_json, "print one JSON object instead of a table");
  refit::bench::generate_options go;
  auto* generate = app.add_subcommand(
    "generate",
    "Start the rollout runtime on its version-0 weights (synthetic or model.path), run one "
    "warm-up request, then per --batch size --repeat GenerateRequests of that many random "
    "prompts (--prompt-len ids from --seed; n 1, --max-tokens, no stop tokens, top_k 0, top_p "
    "1). Prints per batch: prefill tok/s, time to first token, decode tok/s, decode step time, "
    "the bytes a decode step must read (model config, the experts the router chose, KV length) "
    "and roofline_ratio = (bytes/step / step time) / a copy bound measured in the same run "
    "(device-to-device on GPUs, memcpy on CPU); and the logprob gap of the generated tokens to "
    "the runtime's fp32 forward (SCORE). Medians over the repetitions.");
  generate->add_option("-c,--config", go.config_path, "YAML recipe (required)")->required();
  generate->add_option("--batch", go.batches, "batch sizes, comma separated (default 1,16,64,256)")
    ->delimiter(',')
    ->check(CLI::Range(1u, 1u << 20));
  generate->add_option("--prompt-len", go.prompt_len, "prompt tokens (default 128)")
    ->check(CLI::Range(1u, 1u << 24));
  generate->add_option("--max-tokens", go.max_tokens, "new tokens per prompt (default 64)")
    ->check(CLI::Range(1u, 1u << 24));
  generate->add_option("--temperature", go.temperature,
                       "sampling temperature (default 1; the gap is compared at 1 or 0 only)")
    ->check(CLI::Range(0.0f, 100.0f));
  generate->add_option("--seed", go.seed, "seed of the prompts and the sampling (default 1)");
  generate->add_option("--repeat", go.repeat, "measured requests per batch size (default 3)")
    ->check(CLI::Range(1u, 1000u));
  generate->add_option("--bound-bytes", go.bound_bytes,
                       "bytes of one bound copy (default 268435456)")
    ->check(CLI::Range(std::uint64_t{1} << 20, std::uint64_t{1} << 36));
  generate->add_option("--bound-reps", go.bound_reps,
                       "bound copies after every measured request (default 3)")
    ->check(CLI::Range(1u, 100u));
  std::string gen_model_dir;
  generate->add_option("--model", gen_model_dir,
                       "a Hugging Face model directory (config.json + safetensors) to load "
                       "instead of the recipe's model (sets model.path)");
  bool no_gap = false;
  generate->add_flag("--no-gap", no_gap, "skip scoring the generated tokens with the fp32 forward");
  generate->add_flag("--json", go.as_json, "print one JSON object instead of a table");
  std::string tok_path, corpus_path;
  double tok_seconds = 3.0;
  bool tok_json = false;
  auto* tokenize = app.add_subcommand(
    "tokenize",
    "Single-thread encode throughput (MB/s, MB = 1e6 bytes of UTF-8 input) of refit's tokenizer "
    "over a corpus of JSON lines {\"text\": ...}, repeated for at least --seconds; prints "
    "mb_per_s, tokens_per_pass and a digest of the ids (every pass must give the same ids).");
  tokenize->add_option("--tokenizer", tok_path, "tokenizer.json or a model directory")->required();
  tokenize->add_option("--corpus", corpus_path, "JSON lines with a \"text\" field")->required();
  tokenize->add_option("--seconds", tok_seconds, "minimum timed seconds (default 3)")
    ->check(CLI::Range(0.01, 600.0));
  tokenize->add_flag("--json", tok_json, "print one JSON object");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << program << ": bad arguments: " << e.what() << " (see --help)" << std::endl;
    return 2;
  }
  if (!trace_path.empty()) {
    try {
      traced.open(trace_path); // before anything runs: an unwritable path is refused here
    } catch (const std::exception& e) {
      std::cerr << program << ": bad arguments: --trace: " << e.what() << std::endl;
      return 2;
    }
  }

  if (tokenize->parsed()) {
    try {
      const auto tok = refit::tokenizer::tokenizer::load(tok_path);
      std::ifstream in(corpus_path);
      if (!in)
        return fail("cannot open corpus '" + corpus_path + "'");
      std::vector<std::string> texts;
      std::string line;
      for (std::size_t n = 1; std::getline(in, line); ++n) {
        if (line.empty())
          continue;
        const auto j = json::parse(line, nullptr, false);
        if (j.is_discarded() || !j.contains("text") || !j["text"].is_string())
          return fail(corpus_path + ":" + std::to_string(n) + ": not a JSON object with a \"text\" string");
        texts.push_back(j["text"].get<std::string>());
      }
      auto r = refit::tokenizer::run_tokenize_bench(tok, texts, tok_seconds);
      r["tokenizer"] = tok_path;
      r["corpus"] = corpus_path;
      if (tok_json)
        std::cout << r.dump(2) << std::endl;
      else
        std::printf("refit-bench tokenize  %s\n  %.2f MB/s single thread, %llu tokens per pass, "
                    "ids digest %s\n",
                    tok_path.c_str(), r["mb_per_s"].get<double>(),
                    static_cast<unsigned long long>(r["tokens_per_pass"].get<std::uint64_t>()),
                    r["ids_digest"].get<std::string>().c_str());
    } catch (const std::exception& e) {
      return fail(std::string("tokenize: ") + e.what());
    }
    return 0;
  }

  const bool soaking = soak->parsed();
  if (soaking)
    o.config_path = so.config_path;
  if (generate->parsed()) {
    o.config_path = go.config_path;
    go.gap = !no_gap;
  }
  refit::config::refit_config cfg;
  try {
    cfg = refit::config::load_file(o.config_path);
    if (generate->parsed() && !gen_model_dir.empty())
      refit::config::use_model_dir(cfg, gen_model_dir);
  } catch (const refit::config::config_error& e) {
    return fail(std::string("bad config: ") + e.what());
  } catch (const std::exception& e) {
    return fail("bad config '" + o.config_path + "': " + e.what());
  }
  std::string runtime_exe;
  try {
    runtime_exe = refit::proc::resolve_executable(cfg.runtime.executable);
  } catch (const std::exception& e) {
    return fail(std::string("bad config: runtime.executable: ") + e.what());
  }

  if (soaking) {
    nlohmann::ordered_json r;
    try {
      r = refit::soak::run(so, cfg, runtime_exe);
    } catch (const std::exception& e) {
      return fail(std::string("soak: ") + e.what());
    }
    if (so.as_json)
      std::cout << r.dump(2) << std::endl;
    else
      refit::soak::print_table(r);
    if (!refit::soak::passed(r)) {
      std::cerr << program << ": soak failed"
                << (r.contains("error") ? ": " + r["error"].get<std::string>() : std::string())
                << std::endl;
      return 1;
    }
    return 0;
  }

  if (generate->parsed()) {
    json r;
    try {
      r = refit::bench::run_generate(go, cfg, runtime_exe);
    } catch (const std::exception& e) {
      return fail(std::string("generate: ") + e.what());
    }
    if (go.as_json)
      std::cout << r.dump(2) << std::endl;
    else
      refit::bench::print_generate_table(r);
    return 0;
  }

  json result;
  try {
    result = refit::bench::run_publish(o, cfg, runtime_exe);
  } catch (const refit::bench::bench_error& e) {
    return fail(e.what());
  } catch (const std::exception& e) {
    return fail(std::string("unexpected failure: ") + e.what());
  }
  if (o.as_json)
    std::cout << result.dump(2) << std::endl;
  else
    refit::bench::print_publish_table(result);
  if (o.verify && !result["verified"].get<bool>()) {
    std::cerr << program << ": the verified publication failed: "
              << result["verify"].value("error", std::string("no resident checksums"))
              << std::endl;
    return 1;
  }
  return 0;
}
