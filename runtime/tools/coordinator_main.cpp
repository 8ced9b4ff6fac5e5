// refit-coordinator: the main job, the colocated RL loop, or (`refit-coordinator serve`) the
// standalone coordinator of a multi-process deployment. With no arguments it runs the main
// job on the embedded default recipe (configs/tiny-cpu.yaml):
//   bootstrap: sleep(1) -> wake -> generate with the checkpoint weights (version 0)
//   K times:   synthetic optimizer step on every trainer rank -> sleep(2) -> wake(weights)
//              -> publish (version k) -> wake(kv_cache) -> generate
// After every generation the trainer's own unsharded reference recomputes the sampled
// tokens' log-probabilities from the trainer's full weights (parity check).
#include <algorithm>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <nlohmann/json.hpp>

#include "runtime/system/bootstrap.hpp"
#include "runtime/system/network.hpp"
#include "runtime/control/protocol_version.hpp"
#include "runtime/system/serve.hpp"
#include "runtime/control/process.hpp"
#include "runtime/job/job.hpp"
#include "runtime/trace/chrome_json.hpp"

namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

struct iteration_report {
  unsigned iteration = 0;
  std::uint64_t version = 0;
  double publish_ms = 0;
  double publish_gbps = 0;
  std::uint64_t publish_bytes = 0;
  std::uint32_t chunks = 0;
  std::uint32_t attempts = 0;      // > 1: the publication was republished after a failure
  std::string recovered;           // why the earlier attempts failed
  double generate_ms = 0;
  std::uint64_t tokens = 0;
  double tokens_per_s = 0;
  double mean_logprob = 0;
  double parity_max_abs = 0;
  bool parity_ok = false;
  std::vector<std::string> prompts;       // the job's prompts (text)
  std::vector<refit::sample> samples;     // what the runtime generated
  std::vector<std::string> texts;         // each sample's decoded completion
};

class main_job {
public:
  // `codec` is the recipe's tokenizer, loaded (and checked) once by the caller.
  main_job(caf::actor_system& sys, refit::config::refit_config cfg, refit::job::text_codec codec)
    : sys_(sys), self_(sys), cfg_(std::move(cfg)), codec_(std::move(codec)) {}

  // Returns a process exit code.
  int run(bool as_json) {
    try {
      rollout_ = refit::spawn_rollout(sys_, cfg_,
                                      refit::make_runtime_proxy_factory(cfg_, runtime_exe_));
    } catch (const std::exception& e) {
      return fail(e.what()); // the journal file cannot be written
    }
    refit::engine_status status;
    auto ready_within = std::chrono::milliseconds(cfg_.runtime.timeouts_ms.startup) + 10s;
    if (!refit::wait_until_ready(sys_, rollout_.engine, ready_within, &status)) {
      refit::shutdown_rollout(sys_, rollout_);
      return fail("the runtime did not become ready: " + status.last_error);
    }
    publication_ = refit::spawn_publication(sys_, cfg_, rollout_);
    int rc = loop(as_json);
    refit::shutdown_publication(publication_);
    refit::shutdown_rollout(sys_, rollout_);
    return rc;
  }

  void set_runtime_exe(std::string path) { runtime_exe_ = std::move(path); }

private:
  template <class T, class Handle, class... Ts>
  T ask(const Handle& h, const std::string& what, Ts&&... xs) {
    caf::expected<T> out{caf::error{}};
    self_->request(h, std::chrono::minutes(10), std::forward<Ts>(xs)...)
      .receive([&](T& x) { out = std::move(x); }, [&](caf::error& e) { out = std::move(e); });
    if (!out)
      throw std::runtime_error(what + " failed: " + refit::render(out.error()));
    return std::move(*out);
  }

  int fail(const std::string& what) {
    std::cerr << "refit-coordinator: " << what << std::endl;
    return 1;
  }

  // Generates the batch and checks it against the trainer's reference at `step`.
  void generate_and_check(iteration_report& rep, std::uint64_t step) {
    auto sc = refit::job::sampling(cfg_.job, cfg_.job.seed);
    auto req = refit::job::batch(cfg_.job, sc, codec_);
    auto t0 = std::chrono::steady_clock::now();
    auto res = ask<refit::generate_result>(rollout_.engine, "generate", refit::generate_atom::value, req);
    rep.generate_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    double sum = 0;
    for (const auto& s : res.samples) {
      if (s.model_version != rep.version)
        throw std::runtime_error("a sample is stamped with version " + std::to_string(s.model_version)
                                 + ", the committed version is " + std::to_string(rep.version));
      rep.tokens += s.token_ids.size();
      for (float lp : s.logprobs)
        sum += lp;
    }
    rep.tokens_per_s = rep.generate_ms > 0 ? rep.tokens / (rep.generate_ms / 1000.0) : 0;
    rep.mean_logprob = rep.tokens ? sum / rep.tokens : 0;
    rep.prompts = cfg_.job.prompts;
    for (const auto& s : res.samples)
      rep.texts.push_back(codec_.decode(s.token_ids));
    rep.samples = res.samples;
    // Parity: the trainer's full weights at `step`, the same sampling processing.
    rep.parity_max_abs = refit::job::parity_max_abs(cfg_, step, res.samples, sc);
    rep.parity_ok = rep.parity_max_abs <= cfg_.job.parity_tolerance;
  }

  void print(const iteration_report& r, bool as_json) const {
    if (as_json) {
      json line = {{"iteration", r.iteration},       {"version", r.version},
                   {"publish_ms", r.publish_ms},     {"publish_gbps", r.publish_gbps},
                   {"publish_bytes", r.publish_bytes}, {"chunks", r.chunks},
                   {"publish_attempts", r.attempts}, {"recovered_error", r.recovered},
                   {"generate_ms", r.generate_ms},   {"tokens", r.tokens},
                   {"tokens_per_s", r.tokens_per_s}, {"mean_logprob", r.mean_logprob},
                   {"parity_max_abs", r.parity_max_abs}, {"parity_ok", r.parity_ok}};
      json samples = json::array();
      for (std::size_t i = 0; i < r.samples.size(); ++i) {
        const auto& s = r.samples[i];
        samples.push_back({{"prompt", s.prompt_index < r.prompts.size() ? r.prompts[s.prompt_index]
                                                                         : std::string()},
                           {"prompt_token_ids", s.prompt_token_ids},
                           {"token_ids", s.token_ids},
                           {"logprobs", s.logprobs},
                           {"text", r.texts[i]},
                           {"finish_reason", s.finish_reason}});
      }
      line["samples"] = std::move(samples);
      // Invalid UTF-8 in a decoded prefix of a multi-byte character becomes U+FFFD.
      std::cout << line.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
      return;
    }
    std::printf("iter %2u  version %2llu  publish %8.2f ms %7.3f GB/s (%u chunks)  generate "
                "%8.1f tok/s  mean logprob %8.4f  parity max|d| %.2e %s\n",
                r.iteration, static_cast<unsigned long long>(r.version), r.publish_ms,
                r.publish_gbps, r.chunks, r.tokens_per_s, r.mean_logprob, r.parity_max_abs,
                r.parity_ok ? "ok" : "FAIL");
    for (std::size_t i = 0; i < r.samples.size(); ++i) {
      const auto& s = r.samples[i];
      std::string prompt = s.prompt_index < r.prompts.size() ? r.prompts[s.prompt_index] : "";
      std::string text = r.texts[i];
      for (std::string* t : {&prompt, &text})
        for (auto& c : *t)
          if (c == '\n' || c == '\r' || c == '\t')
            c = ' ';
      std::printf("    [%zu] %s|%s  (%s)\n", i, prompt.c_str(), text.c_str(),
                  s.finish_reason.c_str());
    }
    if (r.attempts > 1)
      std::printf("         republished after %u failed attempt(s): %s\n", r.attempts - 1,
                  r.recovered.c_str());
    std::fflush(stdout);
  }

  void progress(unsigned it, const char* step) const {
    if (!show_progress_)
      return;
    std::fprintf(stderr, "\r[%u/%u] %-16s", it, cfg_.job.iterations, step);
    std::fflush(stderr);
  }

  int loop(bool as_json) {
    show_progress_ = !as_json && ::isatty(STDERR_FILENO);
    bool parity_failed = false;
    try {
      // Bootstrap: level 1 keeps the checkpoint weights for the first rollout.
      iteration_report boot;
      ask<refit::engine_status>(rollout_.engine, "sleep(1)", refit::sleep_atom::value, std::uint32_t{1});
      ask<refit::engine_status>(rollout_.engine, "wake", refit::wake_atom::value, refit::wake_tags::all());
      generate_and_check(boot, 0);
      print(boot, as_json);
      parity_failed |= !boot.parity_ok;
      for (unsigned it = 1; it <= cfg_.job.iterations; ++it) {
        iteration_report rep;
        rep.iteration = it;
        progress(it, "optimizer step");
        std::uint64_t step = 0;
        for (const auto& r : publication_.ranks)
          step = ask<std::uint64_t>(r, "optimizer step", refit::step_atom::value);
        progress(it, "sleep(2)");
        ask<refit::engine_status>(rollout_.engine, "sleep(2)", refit::sleep_atom::value, std::uint32_t{2});
        progress(it, "wake(weights)");
        ask<refit::engine_status>(rollout_.engine, "wake(weights)", refit::wake_atom::value,
                                  refit::wake_tags::only_weights());
        progress(it, "publish");
        auto pub = ask<refit::publication_result>(publication_.coordinator, "publish",
                                                  refit::publish_atom::value, std::uint64_t{it});
        rep.version = pub.model_version;
        rep.publish_ms = pub.seconds * 1000.0;
        rep.publish_bytes = pub.bytes;
        rep.chunks = pub.chunks;
        rep.attempts = pub.attempts;
        for (const auto& e : pub.recovered_errors)
          rep.recovered += (rep.recovered.empty() ? "" : "; ") + e;
        rep.publish_gbps = pub.seconds > 0 ? pub.bytes / pub.seconds / 1e9 : 0;
        progress(it, "wake(kv_cache)");
        ask<refit::engine_status>(rollout_.engine, "wake(kv_cache)", refit::wake_atom::value,
                                  refit::wake_tags::only_kv_cache());
        progress(it, "generate");
        generate_and_check(rep, step);
        if (show_progress_)
          std::fprintf(stderr, "\r%40s\r", "");
        print(rep, as_json);
        parity_failed |= !rep.parity_ok;
      }
    } catch (const std::exception& e) {
      if (show_progress_)
        std::fprintf(stderr, "\n");
      return fail(e.what());
    }
    if (parity_failed)
      return fail("parity check failed: runtime log-probabilities differ from the trainer's "
                  "reference by more than job.parity_tolerance = "
                  + std::to_string(cfg_.job.parity_tolerance));
    return 0;
  }

  caf::actor_system& sys_;
  caf::scoped_actor self_;
  refit::config::refit_config cfg_;
  refit::job::text_codec codec_;
  std::string runtime_exe_;
  refit::rollout_handles rollout_;
  refit::publication_handles publication_;
  bool show_progress_ = false;
};

// Parses one --fault spec into the config (validated with the rest of the config).
void add_fault(refit::config::refit_config& cfg, const std::string& spec) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (std::size_t colon; (colon = spec.find(':', start)) != std::string::npos; start = colon + 1)
    parts.push_back(spec.substr(start, colon - start));
  parts.push_back(spec.substr(start));
  auto number = [&](const std::string& text, const char* what) -> std::uint32_t {
    if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos)
      throw std::invalid_argument("'" + spec + "': " + what + " '" + text + "' is not a number");
    return static_cast<std::uint32_t>(std::stoul(text));
  };
  if (parts.size() >= 3 && parts.size() <= 5 && parts[0] == "runtime") {
    refit::config::runtime_fault f;
    f.command = parts[1];
    f.kind = parts[2];
    if (parts.size() > 3)
      f.after = number(parts[3], "AFTER");
    if (parts.size() > 4)
      f.incarnation = number(parts[4], "INCARNATION");
    cfg.runtime.faults.push_back(f);
    return;
  }
  if (parts.size() >= 3 && parts.size() <= 4 && parts[0] == "trainer") {
    refit::config::trainer_fault f;
    f.rank = number(parts[1], "RANK");
    f.kind = parts[2];
    if (parts.size() > 3) {
      if (f.kind == "drop_tensor" || f.kind == "wrong_shape")
        f.tensor = parts[3];
      else
        f.chunk = number(parts[3], "CHUNK");
    }
    cfg.trainer.faults.push_back(f);
    return;
  }
  throw std::invalid_argument("'" + spec + "' is neither runtime:COMMAND:KIND[:AFTER[:INCARNATION]] "
                              "nor trainer:RANK:KIND[:TENSOR|CHUNK]");
}

// The recipe at `path`, or the embedded default (configs/tiny-cpu.yaml) when it is empty.
refit::config::refit_config load_recipe(const std::string& path) {
  if (!path.empty())
    return refit::config::load_file(path);
  return refit::config::parse_yaml(refit::config::embedded_default_yaml(),
                                   "<embedded tiny-cpu.yaml>", refit::config::embedded_base_dir());
}

// `refit-coordinator serve`: hosts the rollout subtree, the ConsensusGate and the RankRegistry
// (published on serve.host:serve.port) until SIGTERM or SIGINT; trainer processes join it and
// publish through it. Returns a process exit code.
int serve_main(const std::string& config_path, const std::string& host, int port) {
  auto fail = [](const std::string& what) {
    std::cerr << "refit-coordinator serve: " << what << std::endl;
    return 1;
  };
  refit::config::refit_config cfg;
  std::string runtime_exe;
  try {
    cfg = load_recipe(config_path);
    if (!host.empty())
      cfg.serve.host = host;
    if (port >= 0)
      cfg.serve.port = static_cast<std::uint32_t>(port);
    refit::config::validate(cfg);
    if (!cfg.serve.present)
      throw refit::config::config_error("serve", "the recipe has no serve section (host, port, "
                                                 "token_env, world_size, ...)");
    if (cfg.serve.embedded)
      throw refit::config::config_error(
        "serve.embedded", "is true: rank 0's trainer process hosts the coordinator; "
                          "refit-coordinator serve is the standalone one");
    refit::config::resolve_token(cfg.serve);
  } catch (const refit::config::config_error& e) {
    return fail(std::string("bad config: ") + e.what());
  }
  try {
    runtime_exe = refit::proc::resolve_executable(cfg.runtime.executable);
  } catch (const std::exception& e) {
    return fail(std::string("bad config: runtime.executable: ") + e.what());
  }
  try {
    (void)refit::config::trainer_weights(cfg); // the whole checkpoint, before anything runs
  } catch (const std::exception& e) {
    return fail(std::string("bad model: ") + e.what());
  }
  // SIGTERM/SIGINT are taken with sigwait below: block them before any thread exists, so that
  // every CAF thread inherits the mask.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  caf::actor_system_config sys_cfg;
  refit::configure(sys_cfg);
  try {
    refit::net::configure_network(sys_cfg, cfg.serve);
  } catch (const refit::config::config_error& e) {
    return fail(std::string("bad config: ") + e.what());
  }
  auto log = [prefix = "refit-coordinator[" + std::to_string(::getpid()) + "]: "](const std::string& line) {
    std::cerr << prefix + line + "\n" << std::flush;
  };
  int rc = 0;
  {
    caf::actor_system sys{sys_cfg};
    auto services = refit::serve::start_coordinator(sys, cfg, runtime_exe,
                                                    static_cast<std::uint16_t>(cfg.serve.port), log);
    if (!services) {
      rc = fail(refit::render(services.error()));
    } else {
      std::printf("refit-coordinator: serving %u trainer ranks on %s:%u (refit wire protocol %u, "
                  "tls %s)\n",
                  refit::config::serve_world(cfg), cfg.serve.host.c_str(),
                  static_cast<unsigned>(services->port), refit::wire::serve_protocol_version,
                  cfg.serve.tls.enabled ? "on" : "off");
      std::fflush(stdout);
      int sig = 0;
      sigwait(&stop_signals, &sig);
      log(std::string("shutting down on ") + (sig == SIGINT ? "SIGINT" : "SIGTERM"));
      refit::serve::stop_coordinator(sys, *services);
    }
  }
  if (rc == 0)
    log("runtime shut down cleanly");
  return rc;
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"refit-coordinator: runs refit's main job, the colocated RL loop, on a recipe "
               "(default: the embedded configs/tiny-cpu.yaml). It starts the refit-runtime TP "
               "runtime under its supervisor and the trainer ranks, then for each iteration: "
               "synthetic optimizer step -> sleep(2) -> wake(weights) -> publish -> "
               "wake(kv_cache) -> generate, and checks the generated log-probabilities against "
               "the trainer's own unsharded reference. Exits 1 on any failure, including a "
               "parity check outside job.parity_tolerance."};
  std::string config_path;
  bool as_json = false;
  app.add_option("-c,--config", config_path,
                 "YAML recipe (see configs/); default: the embedded configs/tiny-cpu.yaml")
    ->check(CLI::ExistingFile);
  app.add_flag("--json", as_json,
               "print one JSON object per iteration (version, publish_ms, publish_gbps, "
               "tokens_per_s, mean_logprob, parity_max_abs, ...) instead of text lines");
  std::optional<unsigned> iterations_opt;
  app.add_option("-n,--iterations", iterations_opt,
                 "iterations of the loop (overrides job.iterations); 0 runs only the bootstrap "
                 "generation with the checkpoint weights")
    ->check(CLI::Range(0u, 1000000u));
  std::string model_dir;
  app.add_option("--model", model_dir,
                 "a Hugging Face model directory (config.json, model.safetensors[.index.json], "
                 "tokenizer.json): serve it instead of the recipe's model (sets model.path)")
    ->check(CLI::ExistingDirectory);
  std::vector<std::string> prompts;
  app.add_option("--prompt", prompts, "a prompt as text (repeatable; replaces job.prompts)");
  std::optional<float> temperature;
  app.add_option("--temperature", temperature, "sampling temperature, 0 = greedy (job.temperature)");
  std::optional<unsigned> max_tokens;
  app.add_option("--max-tokens", max_tokens, "tokens to generate per sample (job.max_tokens)");
  std::optional<std::uint64_t> seed;
  app.add_option("--seed", seed, "sampling and synthetic-weight seed (job.seed)");
  std::vector<std::string> faults;
  app.add_option("--fault", faults,
                 "test-only fault injection (repeatable): runtime:COMMAND:KIND[:AFTER[:INCARNATION]] "
                 "(e.g. runtime:update_weights:sigkill:2) or trainer:RANK:KIND[:TENSOR|CHUNK] "
                 "(e.g. trainer:1:never_report:0); see configs/tiny-cpu.yaml and docs/operations.md "
                 "for the kinds. With publication.republish_attempts > 0 the coordinator "
                 "republishes on the restarted runtime.");
  std::string journal_path;
  app.add_option("--journal", journal_path,
                 "record the actor journal of the coordinator-side actors to FILE (sets "
                 "journal.enabled and journal.path); check it with refit-replay FILE");
  auto* serve = app.add_subcommand(
    "serve",
    "standalone coordinator of a multi-process deployment: hosts the refit-runtime TP runtime "
    "under its supervisor, the ConsensusGate and the RankRegistry, published on serve.host:"
    "serve.port through CAF's middleman (TLS with serve.tls). Trainer processes (embedding API, "
    "see examples/) join as ranks with the shared secret and publish collectively. Prints "
    "'refit-coordinator: serving N trainer ranks on HOST:PORT ...' once listening; runs until "
    "SIGTERM or SIGINT, then shuts the runtime down.");
  std::string serve_config;
  std::string serve_host;
  int serve_port = -1;
  serve->add_option("-c,--config", serve_config,
                    "YAML recipe with a serve section; default: the embedded configs/tiny-cpu.yaml")
    ->check(CLI::ExistingFile);
  serve->add_option("--host", serve_host, "listen address (overrides serve.host)");
  serve->add_option("--port", serve_port, "listen port, 0 = a free one (overrides serve.port)")
    ->check(CLI::Range(0, 65535));
  std::string trace_path;
  const char* trace_help =
    "write a Chrome trace-event JSON of the run to FILE when it ends (open it in Perfetto or "
    "chrome://tracing): one track per trainer rank of this process and per TP worker "
    "(materialize, gather, load, copy per chunk), the gate rounds, commit and release, the "
    "runtime's control requests and generate requests";
  app.add_option("--trace", trace_path, trace_help)->type_name("FILE");
  serve->add_option("--trace", trace_path, trace_help)->type_name("FILE");
  CLI11_PARSE(app, argc, argv);
  refit::trace::tool_trace traced("refit-coordinator"); // written when main returns
  if (!trace_path.empty()) {
    try {
      traced.open(trace_path); // before anything runs: an unwritable path is refused here
    } catch (const std::exception& e) {
      std::cerr << "refit-coordinator: bad command line: --trace: " << e.what() << std::endl;
      return 1;
    }
  }
  if (*serve)
    return serve_main(serve_config, serve_host, serve_port);

  refit::config::refit_config cfg;
  try {
    cfg = load_recipe(config_path);
    if (!model_dir.empty())
      refit::config::use_model_dir(cfg, model_dir);
  } catch (const std::exception& e) {
    std::cerr << "refit-coordinator: bad config: " << e.what() << std::endl;
    return 1;
  }
  if (iterations_opt)
    cfg.job.iterations = *iterations_opt;
  if (!prompts.empty())
    cfg.job.prompts = prompts;
  if (temperature)
    cfg.job.temperature = *temperature;
  if (max_tokens)
    cfg.job.max_tokens = *max_tokens;
  if (seed)
    cfg.job.seed = *seed;
  if (!journal_path.empty()) {
    cfg.journal.enabled = true;
    cfg.journal.path = journal_path;
  }
  try {
    for (const auto& f : faults)
      add_fault(cfg, f);
    refit::config::validate(cfg);
  } catch (const std::exception& e) {
    std::cerr << "refit-coordinator: bad command line: " << e.what() << std::endl;
    return 1;
  }
  std::string runtime_exe;
  try {
    runtime_exe = refit::proc::resolve_executable(cfg.runtime.executable);
  } catch (const std::exception& e) {
    std::cerr << "refit-coordinator: bad config: runtime.executable: " << e.what() << std::endl;
    return 1;
  }
  // A checkpoint is checked whole (every tensor, shape, dtype, byte range) before anything
  // is spawned: a bad one is one error naming file and tensor, and nothing is served.
  std::optional<refit::job::text_codec> codec;
  try {
    (void)refit::config::trainer_weights(cfg);
    codec.emplace(cfg);
  } catch (const std::exception& e) {
    std::cerr << "refit-coordinator: bad model: " << e.what() << std::endl;
    return 1;
  }
  caf::actor_system_config sys_cfg;
  refit::configure(sys_cfg);
  int rc = 0;
  try {
    caf::actor_system sys{sys_cfg};
    main_job job{sys, cfg, std::move(*codec)};
    job.set_runtime_exe(runtime_exe);
    rc = job.run(as_json);
  } catch (const std::exception& e) { // the actor system or the job itself
    std::cerr << "refit-coordinator: " << e.what() << std::endl;
    return 1;
  }
  if (rc == 0 && !as_json)
    std::printf("refit-coordinator: %u iterations, parity ok, runtime shut down cleanly\n",
                cfg.job.iterations);
  return rc;
}
