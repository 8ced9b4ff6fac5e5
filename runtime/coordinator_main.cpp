// refit-coordinator: the main job. With no arguments it runs the embedded default recipe
// (configs/tiny-cpu.yaml): start the TP runtime under its supervisor, describe it, then for
// each iteration run the colocated sleep/wake schedule
//   sleep(1) [bootstrap, first iteration only] / sleep(2) -> wake(weights) -> wake(kv_cache)
// reporting the runtime's memory after every step, and shut everything down cleanly.
#include <cstdio>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <nlohmann/json.hpp>

#include "runtime/bootstrap.hpp"
#include "runtime/process.hpp"

namespace {

using json = nlohmann::json;

json to_json(const refit::runtime_description& d) {
  json workers = json::array();
  for (const auto& w : d.workers)
    workers.push_back({{"rank", w.rank},
                       {"device_index", w.device_index},
                       {"device_uuid", w.device_uuid},
                       {"weight_bytes_resident", w.weight_bytes_resident},
                       {"weight_bytes_offloaded", w.weight_bytes_offloaded},
                       {"kv_cache_bytes_resident", w.kv_cache_bytes_resident},
                       {"resident_tensor_count", w.resident_tensor_count}});
  return {{"runtime_kind", d.runtime_kind},       {"runtime_version", d.runtime_version},
          {"tp_world_size", d.tp_world_size},     {"sleep_level", d.sleep_level},
          {"weights_awake", d.weights_awake},     {"kv_cache_awake", d.kv_cache_awake},
          {"weights_valid", d.weights_valid},     {"model_version", d.model_version},
          {"pid", d.pid},                         {"workers", workers}};
}

std::string mib(std::uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", bytes / 1048576.0);
  return buf;
}

struct reporter {
  bool as_json = false;

  void step(unsigned iteration, const std::string& name, const refit::runtime_description& d,
            double ms) const {
    if (as_json) {
      json line = {{"iteration", iteration}, {"step", name}, {"ms", ms}, {"runtime", to_json(d)}};
      std::cout << line.dump() << std::endl;
      return;
    }
    std::uint64_t weights = 0, offloaded = 0, kv = 0;
    for (const auto& w : d.workers) {
      weights += w.weight_bytes_resident;
      offloaded += w.weight_bytes_offloaded;
      kv += w.kv_cache_bytes_resident;
    }
    std::printf("[iter %u] %-16s %7.2f ms  sleep_level=%u weights %s (offloaded %s, valid=%s)  "
                "kv %s  version=%llu\n",
                iteration, name.c_str(), ms, d.sleep_level, mib(weights).c_str(),
                mib(offloaded).c_str(), d.weights_valid ? "yes" : "no", mib(kv).c_str(),
                static_cast<unsigned long long>(d.model_version));
    std::fflush(stdout);
  }
};

int fail(const std::string& what) {
  std::cerr << "refit-coordinator: " << what << std::endl;
  return 1;
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"refit-coordinator: runs refit's main job on a recipe (default: the embedded "
               "configs/tiny-cpu.yaml). It starts the refit-runtime TP runtime under its "
               "supervisor, describes it, runs the colocated sleep/wake schedule for the "
               "configured iterations and shuts down cleanly."};
  std::string config_path;
  bool as_json = false;
  unsigned iterations = 0;
  app.add_option("-c,--config", config_path,
                 "YAML recipe (see configs/); default: the embedded configs/tiny-cpu.yaml")
    ->check(CLI::ExistingFile);
  app.add_flag("--json", as_json, "print one JSON object per step instead of text lines");
  app.add_option("-n,--iterations", iterations,
                 "number of sleep/wake iterations (overrides job.iterations)")
    ->check(CLI::Range(1u, 1000000u));
  CLI11_PARSE(app, argc, argv);

  refit::config::refit_config cfg;
  try {
    cfg = config_path.empty()
            ? refit::config::parse_yaml(refit::config::embedded_default_yaml(), "<embedded tiny-cpu.yaml>")
            : refit::config::load_file(config_path);
  } catch (const refit::config::config_error& e) {
    return fail(std::string("bad config: ") + e.what());
  }
  if (iterations > 0)
    cfg.job.iterations = iterations;
  std::string runtime_exe;
  try {
    runtime_exe = refit::proc::resolve_executable(cfg.runtime.executable);
  } catch (const std::exception& e) {
    return fail(std::string("bad config: runtime.executable: ") + e.what());
  }

  caf::actor_system_config sys_cfg;
  refit::configure(sys_cfg);
  int rc = 0;
  {
    caf::actor_system sys{sys_cfg};
    auto handles = refit::spawn_rollout(sys, cfg, refit::make_runtime_proxy_factory(cfg, runtime_exe));
    reporter out{as_json};
    caf::scoped_actor self{sys};
    auto timeout = std::chrono::milliseconds(cfg.runtime.timeouts_ms.startup) + std::chrono::seconds(10);
    refit::engine_status status;
    if (!refit::wait_until_ready(sys, handles.engine, timeout, &status)) {
      rc = fail("the runtime did not become ready: " + status.last_error);
    } else {
      auto run = [&](unsigned it, const std::string& name, auto&&... msg) {
        auto t0 = std::chrono::steady_clock::now();
        bool ok = false;
        self->request(handles.engine, std::chrono::minutes(10), msg...)
          .receive([&](refit::engine_status&) { ok = true; },
                   [&](caf::error& err) { rc = fail(name + " failed: " + refit::render(err)); });
        if (!ok)
          return false;
        refit::runtime_description d;
        self->request(handles.engine, std::chrono::minutes(1), refit::describe_atom::value)
          .receive([&](refit::runtime_description& x) { d = x; },
                   [&](caf::error& err) { ok = false, rc = fail("describe failed: " + refit::render(err)); });
        auto ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (ok)
          out.step(it, name, d, ms);
        return ok;
      };
      refit::runtime_description first;
      self->request(handles.engine, std::chrono::minutes(1), refit::describe_atom::value)
        .receive([&](refit::runtime_description& x) { first = x; },
                 [&](caf::error& err) { rc = fail("describe failed: " + refit::render(err)); });
      if (rc == 0) {
        out.step(0, "describe", first, 0.0);
        for (unsigned it = 1; it <= cfg.job.iterations && rc == 0; ++it) {
          // Bootstrap sleep keeps checkpoint weights in host memory; steady state discards them.
          std::uint32_t level = it == 1 ? 1u : 2u;
          if (!run(it, "sleep(" + std::to_string(level) + ")", refit::sleep_atom::value, level))
            break;
          if (!run(it, "wake(weights)", refit::wake_atom::value, refit::wake_tags::only_weights()))
            break;
          // (A weight publication goes here: the CPU publication path plugs in at this step.)
          if (!run(it, "wake(kv_cache)", refit::wake_atom::value, refit::wake_tags::only_kv_cache()))
            break;
        }
      }
    }
    refit::shutdown_rollout(sys, handles);
  }
  if (rc == 0 && !as_json)
    std::printf("refit-coordinator: runtime shut down cleanly\n");
  return rc;
}
