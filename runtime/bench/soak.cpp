#include "runtime/bench/soak.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/sync_coordinator.hpp"
#include "runtime/system/bootstrap.hpp"
#include "runtime/job/job.hpp"
#include "runtime/model/qwen3_moe.hpp"
#include "runtime/control/process.hpp"
#include "runtime/publication/chunk_plan.hpp"

namespace refit::soak {

namespace {

using json = nlohmann::ordered_json;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

struct soak_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The runtime commands of one publication, in the order the runtime sees them.
const std::vector<std::string> publication_commands = {
  "init_weight_transfer", "start_weight_update", "update_weights", "finish_weight_update",
  "release_ipc"};
// Every fault kind that fails a publication (the fault matrix's kinds).
const std::vector<std::string> soak_fault_kinds = {"error",    "stall",     "exit",        "sigkill",
                                                   "bad_frame", "wrong_id", "wrong_result"};

// One runtime fault per incarnation 1..cycles (see soak.hpp): incarnation 1's fault fires in
// its first publication, every later one in its second (its first is the republish of the
// previous cycle's version).
std::vector<config::runtime_fault> plan_faults(unsigned cycles, std::uint64_t seed,
                                               std::uint32_t chunks) {
  std::mt19937_64 rng(seed);
  auto pick = [&](std::size_t n) {
    return static_cast<std::size_t>(std::uniform_int_distribution<std::uint64_t>(0, n - 1)(rng));
  };
  std::vector<config::runtime_fault> out;
  for (unsigned i = 1; i <= cycles; ++i) {
    config::runtime_fault f;
    f.command = publication_commands[pick(publication_commands.size())];
    f.kind = soak_fault_kinds[pick(soak_fault_kinds.size())];
    const std::uint32_t earlier = i == 1 ? 0 : 1; // publications before the faulted one
    f.after = f.command == "update_weights"
                ? earlier * chunks + static_cast<std::uint32_t>(pick(chunks))
                : earlier;
    f.incarnation = i;
    out.push_back(f);
  }
  return out;
}

// ------------------------------------------------------------------------ leak probes

std::set<std::string> shm_entries() {
  std::set<std::string> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (auto* e = ::readdir(d))
      if (std::string n = e->d_name; n != "." && n != "..")
        out.insert(n);
    ::closedir(d);
  }
  return out;
}

std::size_t new_entries(const std::set<std::string>& before, const std::set<std::string>& now) {
  std::size_t n = 0;
  for (const auto& e : now)
    n += before.count(e) == 0;
  return n;
}

std::size_t fd_count() { return proc::open_fds(::getpid()).size(); }

// Children of `parent` (from /proc/<pid>/stat); zombies count too (a child nobody reaped).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  DIR* d = ::opendir("/proc");
  if (!d)
    return out;
  while (auto* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos)
      continue;
    std::ifstream in("/proc/" + name + "/stat");
    std::string stat;
    if (!std::getline(in, stat))
      continue;
    auto close = stat.rfind(')');
    if (close == std::string::npos)
      continue;
    std::istringstream fields(stat.substr(close + 1));
    char state = 0;
    long ppid = 0;
    if (fields >> state >> ppid && ppid == parent)
      out.push_back(static_cast<pid_t>(std::stol(name)));
  }
  ::closedir(d);
  return out;
}

// Live processes in the groups of every runtime pid in `pids` (minus `except`).
std::size_t live_in_groups(const std::set<pid_t>& pids, pid_t except = 0) {
  std::size_t n = 0;
  for (pid_t p : pids)
    if (p > 0 && p != except)
      n += proc::processes_in_group(p).size();
  return n;
}

// `count()` until it is 0 or `within` has passed (threads and reapers settle asynchronously);
// the last value.
template <class F>
std::size_t settled(F count, std::chrono::milliseconds within = 2s) {
  auto until = clock_type::now() + within;
  for (;;) {
    std::size_t n = count();
    if (n == 0 || clock_type::now() >= until)
      return n;
    std::this_thread::sleep_for(10ms);
  }
}

// ------------------------------------------------------------------------ the soak

struct cycle_record {
  unsigned cycle = 0;
  std::uint64_t version = 0;
  config::runtime_fault fault;
  std::uint32_t attempts = 0;
  std::optional<std::uint64_t> committed;
  std::vector<std::string> recovered;
  std::uint32_t chunks = 0;
  double publish_seconds = 0;
  double seconds = 0;
  std::uint64_t incarnation_after = 0;
  pid_t runtime_pid = 0;
  std::size_t samples = 0;
  double parity_max_abs = 0;
  bool stale = false;
  std::string stale_reason;
  std::size_t fds = 0; // this process's fd count at the end of the cycle (informational)
  std::string error;   // non-empty: the cycle failed and the soak stopped
};

class soak_run {
public:
  soak_run(const soak_options& o, config::refit_config cfg, std::string exe)
    : opts_(o), cfg_(std::move(cfg)), exe_(std::move(exe)), codec_(cfg_) {}

  json run();

private:
  template <class T, class Handle, class... Ts>
  T ask(const std::string& what, const Handle& h, caf::timespan timeout, Ts&&... xs) {
    caf::scoped_actor self{*sys_};
    std::optional<T> out;
    std::string error = "no answer";
    self->request(h, timeout, std::forward<Ts>(xs)...)
      .receive([&](T& x) { out = std::move(x); },
               [&](caf::error& e) { error = refit::render(e); });
    if (!out)
      throw soak_error(what + " failed: " + error);
    return std::move(*out);
  }

  template <class... Ts>
  engine_status engine_cmd(const std::string& what, Ts&&... xs) {
    return ask<engine_status>(what, rollout_.engine, caf::timespan{5min}, std::forward<Ts>(xs)...);
  }

  pid_t runtime_pid() {
    auto d = ask<runtime_description>("describe", rollout_.engine, caf::timespan{1min},
                                      describe_atom::value);
    return static_cast<pid_t>(d.pid);
  }

  void configure();
  void start();
  void stop();
  void run_cycle(cycle_record& c);
  void check_generation(cycle_record& c, std::uint64_t step);

  soak_options opts_;
  config::refit_config cfg_;
  std::string exe_;
  job::text_codec codec_;
  std::uint32_t chunks_ = 0;
  std::vector<config::runtime_fault> plan_;
  std::unique_ptr<caf::actor_system_config> sys_cfg_;
  std::unique_ptr<caf::actor_system> sys_;
  rollout_handles rollout_;
  publication_handles pub_;
  bool started_ = false;
  std::set<pid_t> runtime_pids_;
  std::set<std::string> shm_before_;
  std::size_t midrun_leaked_processes_ = 0;
  std::size_t midrun_leaked_shm_ = 0;
};

// The soak's copy of the recipe: short publication command timeouts (stalls are quick),
// a short kill grace, small supervisor backoff, a restart budget for every cycle, at least
// one republish, and the fault plan (the recipe's own test faults are dropped).
void soak_run::configure() {
  auto& t = cfg_.runtime.timeouts_ms;
  for (auto* ms : {&t.init_weight_transfer, &t.start_weight_update, &t.update_weights,
                   &t.finish_weight_update, &t.release_ipc})
    *ms = opts_.command_timeout_ms;
  cfg_.runtime.kill_grace_ms = std::min<std::uint32_t>(cfg_.runtime.kill_grace_ms, 300);
  cfg_.supervisor.backoff_initial_ms = 20;
  cfg_.supervisor.backoff_max_ms = 100;
  cfg_.supervisor.max_restarts = std::max<std::uint32_t>(cfg_.supervisor.max_restarts,
                                                         opts_.cycles + 5);
  cfg_.publication.republish_attempts = std::max<std::uint32_t>(cfg_.publication.republish_attempts, 1);
  cfg_.trainer.faults.clear();
  auto plan = publication::plan_chunks(model::expected_key_stream(cfg_.model),
                                       cfg_.publication.buffer_bytes, cfg_.runtime.tp_size);
  chunks_ = static_cast<std::uint32_t>(plan.chunks.size());
  if (chunks_ == 0)
    throw soak_error("the recipe's publication plan has no chunks");
  plan_ = plan_faults(opts_.cycles, opts_.seed, chunks_);
  cfg_.runtime.faults = plan_;
  config::validate(cfg_);
}

void soak_run::start() {
  sys_cfg_ = std::make_unique<caf::actor_system_config>();
  refit::configure(*sys_cfg_);
  sys_ = std::make_unique<caf::actor_system>(*sys_cfg_);
  rollout_ = spawn_rollout(*sys_, cfg_, make_runtime_proxy_factory(cfg_, exe_));
  started_ = true;
  engine_status st;
  auto timeout = std::chrono::milliseconds(cfg_.runtime.timeouts_ms.startup) + 10s;
  if (!wait_until_ready(*sys_, rollout_.engine, timeout, &st))
    throw soak_error("the runtime did not become ready: "
                     + (st.last_error.empty() ? std::string("no error reported") : st.last_error));
  pub_ = spawn_publication(*sys_, cfg_, rollout_);
  runtime_pids_.insert(runtime_pid());
}

void soak_run::stop() {
  if (!started_)
    return;
  if (pub_.coordinator)
    shutdown_publication(pub_);
  shutdown_rollout(*sys_, rollout_);
  pub_ = {};
  rollout_ = {};
  sys_.reset();
  sys_cfg_.reset();
  started_ = false;
}

// A generation is stale if a sample is stamped with another version than the committed one,
// or if its logprobs differ from the trainer's reference at `step` by more than the recipe's
// job.parity_tolerance.
void soak_run::check_generation(cycle_record& c, std::uint64_t step) {
  const auto& jc = cfg_.job;
  auto sc = job::sampling(jc, jc.seed + c.cycle); // other samples every cycle
  auto req = job::batch(jc, sc, codec_);
  auto res = ask<generate_result>("generate after version " + std::to_string(c.version),
                                  rollout_.engine, caf::timespan{5min}, generate_atom::value, req);
  c.samples = res.samples.size();
  auto stale = [&](std::string why) {
    if (!c.stale)
      c.stale_reason = std::move(why);
    c.stale = true;
  };
  if (res.samples.empty())
    stale("the generation returned no samples");
  if (res.model_version != c.version)
    stale("the generation is stamped with version " + std::to_string(res.model_version));
  for (const auto& s : res.samples)
    if (s.model_version != c.version)
      stale("a sample is stamped with version " + std::to_string(s.model_version));
  double worst = job::parity_max_abs(cfg_, step, res.samples, sc);
  if (std::isinf(worst))
    stale("the samples have logprobs the trainer reference cannot match");
  c.parity_max_abs = worst;
  if (!(worst <= jc.parity_tolerance))
    stale("logprobs differ from the trainer reference at step " + std::to_string(step) + " by "
          + std::to_string(worst) + " > " + std::to_string(jc.parity_tolerance));
}

// optimizer step -> sleep(2) -> wake(weights) -> publish(i) (the planned fault fires, the
// coordinator republishes on the next incarnation) -> wake(kv_cache) -> generate + parity.
void soak_run::run_cycle(cycle_record& c) {
  const std::string v = "version " + std::to_string(c.version);
  std::uint64_t step = 0;
  for (std::size_t r = 0; r < pub_.ranks.size(); ++r) {
    auto s = ask<std::uint64_t>("optimizer step of rank " + std::to_string(r), pub_.ranks[r],
                                caf::timespan{5min}, step_atom::value);
    if (r > 0 && s != step)
      throw soak_error("trainer ranks are at different steps after the optimizer step");
    step = s;
  }
  engine_cmd("sleep(2) before " + v, sleep_atom::value, std::uint32_t{2});
  engine_cmd("wake(weights) before " + v, wake_atom::value, wake_tags::only_weights());
  auto res = ask<publication_result>("publication of " + v, pub_.coordinator, caf::timespan{10min},
                                     publish_atom::value, c.version);
  c.attempts = res.attempts;
  c.committed = res.model_version;
  c.recovered = res.recovered_errors;
  c.chunks = res.chunks;
  c.publish_seconds = res.seconds;
  engine_cmd("wake(kv_cache) after " + v, wake_atom::value, wake_tags::only_kv_cache());
  check_generation(c, step);
  auto st = engine_cmd("engine status after " + v, status_atom::value);
  c.incarnation_after = st.incarnation;
  c.runtime_pid = runtime_pid();
  runtime_pids_.insert(c.runtime_pid);
  // Cycle boundary: every earlier runtime's process group is gone, no /dev/shm entry is left.
  midrun_leaked_processes_ = std::max(
    midrun_leaked_processes_, settled([&] { return live_in_groups(runtime_pids_, c.runtime_pid); }));
  midrun_leaked_shm_ = std::max(
    midrun_leaked_shm_, settled([&] { return new_entries(shm_before_, shm_entries()); }));
  c.fds = fd_count();
  if (res.model_version != c.version)
    throw soak_error("the publication of " + v + " committed version "
                     + std::to_string(res.model_version));
  if (res.chunks != chunks_)
    throw soak_error("the publication had " + std::to_string(res.chunks)
                     + " chunks, the fault plan assumed " + std::to_string(chunks_));
  if (res.attempts != 2 || res.recovered_errors.size() != 1)
    throw soak_error("the planned fault " + c.fault.command + ":" + c.fault.kind + ":"
                     + std::to_string(c.fault.after) + " did not fail exactly one attempt ("
                     + std::to_string(res.attempts) + " attempts)");
  if (st.incarnation != c.cycle + 1)
    throw soak_error("runtime incarnation " + std::to_string(st.incarnation) + " after cycle "
                     + std::to_string(c.cycle) + ", expected " + std::to_string(c.cycle + 1));
}

json soak_run::run() {
  configure();
  const auto t_start = clock_type::now();
  shm_before_ = shm_entries();
  const std::size_t fds_before = fd_count();
  const pid_t self_pid = ::getpid();
  std::vector<cycle_record> cycles;
  std::string error;
  std::uint64_t final_incarnation = 0;
  try {
    start();
    for (unsigned i = 1; i <= opts_.cycles; ++i) {
      cycle_record c;
      c.cycle = i;
      c.version = i;
      c.fault = plan_[i - 1];
      auto c0 = clock_type::now();
      try {
        run_cycle(c);
      } catch (const std::exception& e) {
        c.error = e.what();
      }
      c.seconds = std::chrono::duration<double>(clock_type::now() - c0).count();
      if (!opts_.as_json)
        std::fprintf(stderr, "refit-bench soak: cycle %u/%u: %s:%s:%u -> %s\n", i, opts_.cycles,
                     c.fault.command.c_str(), c.fault.kind.c_str(), c.fault.after,
                     c.error.empty() ? (c.stale ? "committed, STALE generation" : "committed")
                                     : c.error.c_str());
      cycles.push_back(c);
      if (!c.error.empty()) {
        error = "cycle " + std::to_string(i) + ": " + c.error;
        break;
      }
    }
    final_incarnation = engine_cmd("final engine status", status_atom::value).incarnation;
  } catch (const std::exception& e) {
    if (error.empty())
      error = e.what();
  }
  stop();
  const double seconds = std::chrono::duration<double>(clock_type::now() - t_start).count();

  // Leaks, with the actor system gone: every runtime's process group, this process's children,
  // /dev/shm entries and fds (transient fds and reaps settle for up to 2 s).
  const std::size_t leaked_processes = settled(
    [&] { return live_in_groups(runtime_pids_) + children_of(self_pid).size(); });
  const std::size_t leaked_shm = settled([&] { return new_entries(shm_before_, shm_entries()); });
  const std::size_t leaked_fds = settled([&] {
    auto n = fd_count();
    return n > fds_before ? n - fds_before : 0;
  });

  std::size_t commits = 0, faults = 0, stale = 0;
  json per_cycle = json::array();
  for (const auto& c : cycles) {
    commits += c.committed && *c.committed == c.version;
    faults += !c.recovered.empty();
    stale += c.stale;
    json j;
    j["cycle"] = c.cycle;
    j["version"] = c.version;
    j["fault"] = {{"incarnation", c.fault.incarnation},
                  {"command", c.fault.command},
                  {"kind", c.fault.kind},
                  {"after", c.fault.after}};
    j["attempts"] = c.attempts;
    j["committed_version"] = c.committed ? json(*c.committed) : json(nullptr);
    j["recovered_errors"] = c.recovered;
    j["incarnation_after"] = c.incarnation_after;
    j["runtime_pid"] = c.runtime_pid;
    j["publish_seconds"] = c.publish_seconds;
    j["cycle_seconds"] = c.seconds;
    j["samples"] = c.samples;
    j["parity_max_abs"] = std::isfinite(c.parity_max_abs) ? json(c.parity_max_abs) : json(nullptr);
    j["stale"] = c.stale;
    if (c.stale)
      j["stale_reason"] = c.stale_reason;
    j["fds"] = c.fds;
    if (!c.error.empty())
      j["error"] = c.error;
    per_cycle.push_back(std::move(j));
  }

  json out;
  out["benchmark"] = "soak";
  out["config"] = opts_.config_path;
  out["seed"] = opts_.seed;
  out["cycles"] = opts_.cycles;
  out["cycles_run"] = cycles.size();
  out["chunks"] = chunks_;
  out["faults"] = faults;
  out["restarts"] = final_incarnation > 0 ? final_incarnation - 1 : 0;
  out["commits"] = commits;
  out["stale_generations"] = stale;
  out["leaked_processes"] = leaked_processes;
  out["leaked_shm"] = leaked_shm;
  out["leaked_fds"] = leaked_fds;
  out["midrun_leaked_processes"] = midrun_leaked_processes_;
  out["midrun_leaked_shm"] = midrun_leaked_shm_;
  out["runtime_pids_seen"] = runtime_pids_.size();
  out["fds_before"] = fds_before;
  out["seconds"] = seconds;
  out["settings"] = {{"publication_command_timeout_ms", opts_.command_timeout_ms},
                     {"kill_grace_ms", cfg_.runtime.kill_grace_ms},
                     {"backoff_initial_ms", cfg_.supervisor.backoff_initial_ms},
                     {"backoff_max_ms", cfg_.supervisor.backoff_max_ms},
                     {"max_restarts", cfg_.supervisor.max_restarts},
                     {"restart_window_ms", cfg_.supervisor.restart_window_ms},
                     {"republish_attempts", cfg_.publication.republish_attempts},
                     {"verify", cfg_.publication.verify},
                     {"parity_tolerance", cfg_.job.parity_tolerance}};
  out["per_cycle"] = std::move(per_cycle);
  if (!error.empty())
    out["error"] = error;
  out["ok"] = false;
  out["ok"] = passed(out);
  return out;
}

} // namespace

json run(const soak_options& opts, config::refit_config cfg, const std::string& runtime_exe) {
  if (opts.cycles == 0)
    throw std::runtime_error("--cycles must be at least 1");
  soak_run s{opts, std::move(cfg), runtime_exe};
  return s.run();
}

bool passed(const json& r) {
  auto n = [&](const char* key) { return r.value(key, std::uint64_t{1}); };
  return !r.contains("error") && n("cycles_run") == n("cycles") && n("commits") == n("cycles")
         && n("faults") == n("cycles") && n("stale_generations") == 0
         && n("leaked_processes") == 0 && n("leaked_shm") == 0 && n("leaked_fds") == 0
         && n("midrun_leaked_processes") == 0 && n("midrun_leaked_shm") == 0;
}

void print_table(const json& r) {
  std::printf("refit-bench soak  %s  (seed %llu)\n", r["config"].get<std::string>().c_str(),
              r["seed"].get<unsigned long long>());
  for (const auto& c : r["per_cycle"]) {
    std::printf("  cycle %3u  %-20s %-12s after %-3u  attempts %u  committed %s  parity %s%s\n",
                c["cycle"].get<unsigned>(), c["fault"]["command"].get<std::string>().c_str(),
                c["fault"]["kind"].get<std::string>().c_str(),
                c["fault"]["after"].get<unsigned>(), c["attempts"].get<unsigned>(),
                c["committed_version"].is_null() ? "-" : c["committed_version"].dump().c_str(),
                c["parity_max_abs"].is_null() ? "n/a" : c["parity_max_abs"].dump().c_str(),
                c["stale"].get<bool>() ? "  STALE" : "");
    if (c.contains("error"))
      std::printf("             error: %s\n", c["error"].get<std::string>().c_str());
  }
  std::printf("  cycles %u, faults %zu, restarts %zu, commits %zu, stale generations %zu\n",
              r["cycles"].get<unsigned>(), r["faults"].get<std::size_t>(),
              r["restarts"].get<std::size_t>(), r["commits"].get<std::size_t>(),
              r["stale_generations"].get<std::size_t>());
  std::printf("  leaked: processes %zu, shm %zu, fds %zu (mid-run: processes %zu, shm %zu)\n",
              r["leaked_processes"].get<std::size_t>(), r["leaked_shm"].get<std::size_t>(),
              r["leaked_fds"].get<std::size_t>(), r["midrun_leaked_processes"].get<std::size_t>(),
              r["midrun_leaked_shm"].get<std::size_t>());
  std::printf("  %.1f s, %s\n", r["seconds"].get<double>(),
              r["ok"].get<bool>() ? "ok" : "FAILED");
  if (r.contains("error"))
    std::printf("  error: %s\n", r["error"].get<std::string>().c_str());
}

} // namespace refit::soak
