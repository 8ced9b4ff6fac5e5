// refit-bench publish: weight publication throughput against a bound measured in the same run.
//
//   refit-bench publish --config configs/bench-cpu.yaml [--iterations N] [--verify] [--json]
//   refit-bench soak --config configs/tiny-cpu.yaml --cycles N [--seed S] [--json]
//
// `soak` (runtime/soak.hpp) runs N publish/fault/restart cycles with seeded random runtime
// faults in one actor system, checks every generation against the trainer's reference and
// reports leaked processes, /dev/shm entries and fds; it exits 1 unless all N cycles
// committed with nothing stale and nothing leaked.
//
// `publish` starts the rollout subtree (RolloutSupervisor -> vLLMRuntimeProxy -> refit-runtime)
// and the trainer side (TrainerRanks, ConsensusGate, SyncCoordinator) in this process from the
// recipe, exactly as refit-coordinator and the end-to-end tests do. Then, for versions 1..N,
// it runs the colocated schedule
//
//   [optimizer step on every rank, from version 2 on] -> sleep(2) -> wake(weights)
//     -> publish(v) -> wake(kv_cache)
//
// with the byte-exact verifier OFF (it would compete with the transfer for the cores). Only
// the publication itself is timed, and by the coordinator: publication_result.seconds is
// "first chunk requested -> version committed". The bound is a plain single-threaded memcpy
// of the same number of bytes (publication_result.bytes) between two pre-faulted buffers,
// sampled in the same run right after each timed publication (median of all samples).
// With --verify one more publication runs through a SyncCoordinator whose verifier is on;
// `verified` is true only if it committed with every resident tensor's SHA-256 matching the
// trainer's weights.
//
// On GPUs (transport cuda_ipc, REFIT_CUDA builds) the bound is NCCL: an all-gather of the
// same output bytes (publication_result.bytes on every rank) among the trainer ranks'
// devices, as `chunks` equal all-gathers, timed in this process after the publications; and
// peak_extra_device_bytes is the largest drop of cudaMemGetInfo's free bytes on any trainer
// device during a timed publication, sampled every 100 us from a thread of this process
// (device-wide: it sees the runtime child's allocations too).
//
// Memory: before each timed publication the bench resets the peak-RSS watermark (VmHWM, via
// /proc/<pid>/clear_refs) of this process (trainer ranks: packed buffers) and of the runtime
// child (its read-only mappings of those buffers), and reports the high-water mark minus the
// RSS at the reset. Both processes map the same memfd pages, so the sum counts those twice.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <atomic>
#include <thread>

#include <sys/mman.h>
#include <unistd.h>

#include <caf/actor_system.hpp>
#include <caf/after.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <nlohmann/json.hpp>

#include "actors/sync_coordinator.hpp"
#include "runtime/system/bootstrap.hpp"
#include "runtime/device/device.hpp"
#include "runtime/control/process.hpp"
#include "runtime/bench/fsdp_memory.hpp"
#include "runtime/bench/measure.hpp"
#include "runtime/bench/publish_bench.hpp"
#include "runtime/bench/source_compare.hpp"
#if REFIT_HAVE_CUDA
#include "runtime/cuda/cuda.hpp"
#endif

namespace refit::bench {
namespace {

using json = nlohmann::ordered_json;
using namespace std::chrono_literals;
using options = publish_options;
constexpr const char* program = "refit-bench";

// ------------------------------------------------------------------------ the bench


struct iteration_result {
  refit::publication_result res;
  double wall_seconds = 0; // publish request -> answer (includes prepare, release, final)
  std::optional<std::uint64_t> trainer_extra;
  std::optional<std::uint64_t> runtime_extra;
  std::optional<std::uint64_t> device_extra; // GPU publications
  std::string source;   // the weight source of its phase (synthetic / registered)
  unsigned round = 0;   // --source registered: the comparison round it belongs to
};

// What one phase's trainer ranks took in memory when they were spawned (before any
// publication): their own allocations on the trainer devices (cudaMemGetInfo, GPUs) and the
// registered FSDP2 arenas the bench allocated for them.
struct trainer_memory {
  std::string source;
  std::uint64_t arena_bytes = 0;       // registered: bytes of the FSDP2 arenas (all ranks)
  std::uint64_t registered_bytes = 0;  // registered: bytes of the registered tensors
  std::optional<std::uint64_t> arena_device_bytes; // GPU: free drop while the arenas were made
  std::optional<std::uint64_t> ranks_device_bytes; // GPU: free drop while the ranks started
};

class bench {
public:
  bench(const options& o, refit::config::refit_config cfg, std::string runtime_exe)
    : opts_(o), cfg_(std::move(cfg)), runtime_exe_(std::move(runtime_exe)) {}

  json run();

private:
  template <class T, class Handle, class... Ts>
  T ask(const std::string& what, const Handle& h, caf::timespan timeout, Ts&&... xs) {
    caf::scoped_actor self{*sys_};
    std::optional<T> out;
    std::string error;
    self->request(h, timeout, std::forward<Ts>(xs)...)
      .receive([&](T& x) { out = std::move(x); },
               [&](caf::error& e) { error = refit::render(e); });
    if (!out)
      throw bench_error(what + " failed: " + error);
    return std::move(*out);
  }

  template <class... Ts>
  refit::engine_status engine_cmd(const std::string& what, Ts&&... xs) {
    return ask<refit::engine_status>(what, rollout_.engine, caf::timespan{10min},
                                     std::forward<Ts>(xs)...);
  }

  pid_t runtime_pid() {
    auto d = ask<refit::runtime_description>("describe", rollout_.engine, caf::timespan{1min},
                                             refit::describe_atom::value);
    return static_cast<pid_t>(d.pid);
  }

  // One synthetic optimizer step on every rank (in parallel; untimed).
  void step_all(std::uint64_t version) {
    caf::scoped_actor self{*sys_};
    using handle = decltype(self->request(pub_.ranks[0], caf::timespan{10min},
                                          refit::step_atom::value));
    std::vector<handle> pending;
    for (const auto& rank : pub_.ranks)
      pending.push_back(self->request(rank, caf::timespan{10min}, refit::step_atom::value));
    for (std::size_t r = 0; r < pending.size(); ++r) {
      std::string error;
      pending[r].receive([](std::uint64_t) {},
                         [&](caf::error& e) { error = refit::render(e); });
      if (!error.empty())
        throw bench_error("optimizer step before version " + std::to_string(version)
                          + " (rank " + std::to_string(r) + ") failed: " + error);
    }
  }

  // The colocated schedule around one publication through `coordinator`.
  iteration_result publish(const refit::sync_coordinator_actor& coordinator,
                           std::uint64_t version) {
    const std::string v = "version " + std::to_string(version);
    engine_cmd("sleep(2) before " + v, refit::sleep_atom::value, std::uint32_t{2});
    engine_cmd("wake(weights) before " + v, refit::wake_atom::value,
               refit::wake_tags::only_weights());
    iteration_result it;
    peak_probe trainer, runtime;
    trainer.arm(::getpid());
    runtime.arm(runtime_pid());
    std::optional<device_memory_probe> device_probe;
    if (on_gpu())
      device_probe.emplace(trainer_ordinals());
    auto t0 = std::chrono::steady_clock::now();
    it.res = ask<refit::publication_result>("publication of " + v, coordinator,
                                            caf::timespan{60min}, refit::publish_atom::value,
                                            version);
    it.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (device_probe)
      it.device_extra = device_probe->finish();
    it.trainer_extra = trainer.peak_extra();
    it.runtime_extra = runtime.peak_extra();
    engine_cmd("wake(kv_cache) after " + v, refit::wake_atom::value,
               refit::wake_tags::only_kv_cache());
    return it;
  }

  void start();
  // The trainer side of one phase: the ranks over `source` (registered: fresh FSDP2 arenas).
  void start_trainers(const std::string& source);
  // Stops the phase's ranks and waits until they are gone (their device memory freed).
  void stop_trainers();
  void stop();
  // Device free bytes summed over the trainer GPUs (0 on CPU).
  std::uint64_t trainer_free_bytes() const;

  bool on_gpu() const { return cfg_.publication.transport == "cuda_ipc"; }
  // CUDA ordinals of the trainer ranks (colocated: the runtime's devices unless trainer.devices).
  std::vector<int> trainer_ordinals() const {
    std::vector<int> out;
    const auto& list = cfg_.trainer.devices.empty() ? cfg_.runtime.devices : cfg_.trainer.devices;
    for (const auto& d : list)
      out.push_back(refit::device::parse(d, "trainer device").index);
    return out;
  }

  options opts_;
  refit::config::refit_config cfg_;
  std::string runtime_exe_;
  std::unique_ptr<caf::actor_system_config> sys_cfg_;
  std::unique_ptr<caf::actor_system> sys_;
  refit::rollout_handles rollout_;
  refit::publication_handles pub_;
  refit::sync_coordinator_actor verifier_;
  bool started_ = false;
  std::vector<double> nccl_bound_; // GPU: NCCL all-gather bound samples (seconds)
  std::vector<double> copy_bound_; // GPU: single device-copy bound samples (seconds)
  std::vector<std::unique_ptr<fsdp_memory>> memory_; // --source registered: the ranks' memory
  std::vector<trainer_memory> trainer_memory_;        // one per phase
  std::uint64_t next_version_ = 1;
};

void bench::start() {
  sys_cfg_ = std::make_unique<caf::actor_system_config>();
  refit::configure(*sys_cfg_);
  // CAF's default work-stealing workers poll for work (100 aggressive polls, then 500 polls
  // 50 us apart) after every message burst; a publication sends bursts every few ms, so on a
  // 2-core machine the idle workers keep waking up on the cores that are copying. sharing
  // workers block on a condition variable instead.
  sys_cfg_->set("scheduler.policy",
                opts_.scheduler == "sharing" ? caf::atom("sharing") : caf::atom("stealing"));
  sys_ = std::make_unique<caf::actor_system>(*sys_cfg_);
  rollout_ = refit::spawn_rollout(*sys_, cfg_, refit::make_runtime_proxy_factory(cfg_, runtime_exe_));
  started_ = true;
  refit::engine_status st;
  auto timeout = std::chrono::milliseconds(cfg_.runtime.timeouts_ms.startup) + 10s;
  if (!refit::wait_until_ready(*sys_, rollout_.engine, timeout, &st))
    throw bench_error("the runtime did not become ready within "
                      + std::to_string(timeout.count() / 1000) + " s: "
                      + (st.last_error.empty() ? std::string("no error reported") : st.last_error));
  if (opts_.source != "registered" && opts_.source != "synthetic")
    throw bench_error("--source " + opts_.source + ": neither synthetic nor registered");
}

std::uint64_t bench::trainer_free_bytes() const {
  std::uint64_t total = 0;
#if REFIT_HAVE_CUDA
  if (on_gpu())
    for (int d : trainer_ordinals())
      total += refit::cuda::free_bytes(d);
#endif
  return total;
}

void bench::start_trainers(const std::string& source) {
  trainer_memory tm;
  tm.source = source;
  std::vector<std::shared_ptr<const refit::publication::registered_weights>> registered;
  if (source == "registered") {
    const refit::model::synthetic_weights w{cfg_.job.seed, cfg_.trainer.lr, cfg_.trainer.init_scale};
    const auto& devices = cfg_.trainer.devices.empty() ? cfg_.runtime.devices : cfg_.trainer.devices;
    const std::uint64_t before = trainer_free_bytes();
    for (std::uint32_t r = 0; r < cfg_.runtime.tp_size; ++r) {
      auto d = refit::device::parse(devices.at(r), "trainer device");
      try {
        memory_.push_back(
          std::make_unique<fsdp_memory>(cfg_.model, cfg_.runtime.tp_size, r, w, 0, d));
      } catch (const std::exception& e) {
        throw bench_error("allocating rank " + std::to_string(r) + "'s FSDP2 memory on "
                          + devices.at(r) + ": " + e.what());
      }
      registered.push_back(memory_.back()->registered());
      tm.arena_bytes += memory_.back()->allocated_bytes();
      tm.registered_bytes += memory_.back()->bytes();
    }
    if (on_gpu())
      tm.arena_device_bytes = before - std::min(before, trainer_free_bytes());
  }
  const std::uint64_t before = trainer_free_bytes();
  pub_ = refit::spawn_publication(*sys_, cfg_, rollout_, std::move(registered));
  // Ranks answer describe once their worker threads have allocated and filled their shards,
  // so no timed publication (or memory probe) overlaps that.
  for (const auto& rank : pub_.ranks)
    ask<refit::rank_info>("describe of a trainer rank", rank, caf::timespan{10min},
                          refit::describe_atom::value);
  if (on_gpu())
    tm.ranks_device_bytes = before - std::min(before, trainer_free_bytes());
  trainer_memory_.push_back(tm);
}

void bench::stop_trainers() {
  if (verifier_)
    caf::anon_send_exit(verifier_, caf::exit_reason::user_shutdown);
  verifier_ = nullptr;
  if (pub_.coordinator) {
    caf::scoped_actor self{*sys_};
    for (const auto& r : pub_.ranks)
      self->monitor(r);
    refit::shutdown_publication(pub_);
    for (std::size_t i = 0; i < pub_.ranks.size(); ++i)
      self->receive([](const caf::down_msg&) {},
                    caf::after(std::chrono::seconds(60)) >> [] {});
  }
  pub_ = {};
  memory_.clear(); // after the ranks that read it are gone
}

void bench::stop() {
  if (!started_)
    return;
  stop_trainers();
  refit::shutdown_rollout(*sys_, rollout_);
  rollout_ = {};
  sys_.reset();
  started_ = false;
}

json bench::run() {
  // Timed publications never run the verifier, whatever the recipe says.
  const bool recipe_verify = cfg_.publication.verify;
  cfg_.publication.verify = false;
  std::vector<iteration_result> runs;
  std::optional<iteration_result> verify_run;
  std::string verify_error;
  std::unique_ptr<memcpy_bound> bound;
  std::vector<iteration_result> compared; // --source registered: every phase's publications
  try {
    start();
    // --source registered: rounds of (synthetic, registered) phases on the same runtime, so
    // the registered figure has the synthetic one of the same run next to it; otherwise one
    // phase of the requested source.
    std::vector<std::pair<std::string, unsigned>> phases;
    for (unsigned round = 1; round <= opts_.rounds; ++round) {
      if (opts_.source == "registered")
        phases.push_back({"synthetic", round});
      phases.push_back({opts_.source, round});
    }
    for (std::size_t ph = 0; ph < phases.size(); ++ph) {
      const auto& [source, round] = phases[ph];
      if (ph > 0)
        stop_trainers();
      start_trainers(source);
      for (unsigned i = 1; i <= opts_.iterations; ++i) {
        const std::uint64_t v = next_version_++;
        if (i > 1)
          step_all(v);
        auto it = publish(pub_.coordinator, v);
        it.source = source;
        it.round = round;
        compared.push_back(it);
        if (source == opts_.source)
          runs.push_back(it);
        if (!on_gpu()) {
          if (!bound)
            bound = std::make_unique<memcpy_bound>(it.res.bytes);
          bound->sample(opts_.bound_reps);
        }
        if (!opts_.as_json) {
          const auto& r = it.res;
          std::fprintf(stderr, "%s: %s (round %u): version %llu: %.3f s (%.2f GB/s)\n",
                       program, source.c_str(), round, static_cast<unsigned long long>(v),
                       r.seconds, r.seconds > 0 ? r.bytes / r.seconds / 1e9 : 0.0);
        }
      }
    }
    if (opts_.verify) {
      // Same ranks, gate and runtime; a coordinator whose byte-exact verifier is on.
      const std::uint64_t v = next_version_++;
      step_all(v);
      refit::sync_coordinator_options so;
      so.model = cfg_.model;
      so.publication = cfg_.publication;
      so.publication.verify = true;
      so.timeouts_ms = cfg_.runtime.timeouts_ms;
      so.kill_grace_ms = cfg_.runtime.kill_grace_ms;
      so.weights = {cfg_.job.seed, cfg_.trainer.lr, cfg_.trainer.init_scale};
      verifier_ = sys_->spawn(refit::sync_coordinator, so, rollout_.engine, pub_.gate, pub_.ranks);
      try {
        verify_run = publish(verifier_, v);
      } catch (const bench_error& e) {
        verify_error = e.what();
      }
    }
#if REFIT_HAVE_CUDA
    if (on_gpu()) {
      // The NCCL bound, with the runtime and ranks still holding their memory (as during the
      // publications): the same output bytes per rank, in `chunks` equal all-gathers.
      for (unsigned i = 0; i < opts_.bound_reps; ++i) {
        // (at least one call per 4 GiB: a direct plan may be one chunk of the whole model)
        const std::uint64_t bytes = runs.front().res.bytes;
        const std::uint64_t calls = std::max<std::uint64_t>(
          runs.front().res.chunks, (bytes + (std::uint64_t{4} << 30) - 1) >> 32);
        nccl_bound_.push_back(refit::cuda::allgather_seconds(trainer_ordinals(), bytes,
                                                             static_cast<std::uint32_t>(calls)));
        // The copy bound: one device copy of the published bytes on the first trainer GPU.
        copy_bound_.push_back(
          refit::cuda::copy_seconds(trainer_ordinals().front(), runs.front().res.bytes));
      }
    }
#else
    if (on_gpu())
      throw bench_error("transport cuda_ipc needs a refit-bench built with REFIT_CUDA=ON");
#endif
  } catch (...) {
    stop();
    throw;
  }
  stop();

  const auto& first = runs.front().res;
  std::vector<double> seconds_all;
  for (const auto& r : runs)
    seconds_all.push_back(r.res.seconds);
  const double seconds = median(seconds_all);
  // The copy bound: a device copy (CPU: a memcpy) of the published bytes. At world 1 it is
  // the bound (an all-gather among one rank moves nothing); at world > 1 on GPUs the NCCL
  // all-gather bound is the main one and the copy bound is reported next to it.
  const std::vector<double> copy_all = on_gpu() ? copy_bound_ : bound->seconds();
  const bool world1 = first.trainer_ranks == 1;
  const std::vector<double> bound_all = on_gpu() && !world1 ? nccl_bound_ : copy_all;
  bound.reset();
  const double bound_seconds = median(bound_all);
  const double copy_seconds = median(copy_all);
  const double gbps = first.bytes / seconds / 1e9;
  const double bound_gbps = first.bytes / bound_seconds / 1e9;

  // Peak extra memory across the timed publications (the largest one).
  std::optional<std::uint64_t> trainer_extra, runtime_extra;
  for (const auto& r : runs) {
    if (r.trainer_extra)
      trainer_extra = std::max(trainer_extra.value_or(0), *r.trainer_extra);
    if (r.runtime_extra)
      runtime_extra = std::max(runtime_extra.value_or(0), *r.runtime_extra);
  }
  const std::uint64_t planned_buffers
    = cfg_.publication.buffer_bytes * cfg_.publication.buffer_count * first.trainer_ranks;

  json out;
  out["benchmark"] = "publish";
  out["config"] = opts_.config_path;
  out["model_type"] = cfg_.model.model_type;
  out["tensors"] = first.tensors;
  out["bytes"] = first.bytes;
  out["chunks"] = first.chunks;
  out["source"] = opts_.source;
  out["trainer_ranks"] = first.trainer_ranks;
  out["tp"] = first.tp;
  out["transport"] = cfg_.publication.transport;
  out["buffer_bytes"] = cfg_.publication.buffer_bytes;
  out["buffer_count"] = cfg_.publication.buffer_count;
  out["iterations"] = opts_.iterations;
  out["caf_scheduler"] = opts_.scheduler;
  out["seconds"] = seconds;
  out["seconds_all"] = seconds_all;
  out["timed_window"] = "publication_result.seconds: first chunk requested -> version committed "
                        "(median of the iterations), verifier off";
  out["gbps"] = gbps;
  out["bound_gbps"] = bound_gbps;
  out["ratio"] = gbps / bound_gbps;
  out["mode"] = cfg_.publication.mode;
  out["bytes_local"] = first.bytes_local;
  out["bytes_cross"] = first.bytes_cross;
  out["copy_bound_seconds"] = copy_seconds;
  out["copy_bound_gbps"] = first.bytes / copy_seconds / 1e9;
  out["ratio_to_copy"] = copy_seconds / seconds;
  out["copy_bound_method"]
    = on_gpu() ? "median of " + std::to_string(copy_all.size())
                   + " device-to-device copies of `bytes` bytes on the first trainer GPU "
                     "(cudaMemcpyAsync of 1 GiB pieces back to back, one untimed warm-up), "
                     "measured after the timed publications"
               : "the memcpy bound (bound_seconds)";
  if (on_gpu()) {
    const double ag = median(nccl_bound_);
    out["allgather_bound_seconds"] = ag;
    out["allgather_bound_gbps"] = first.bytes / ag / 1e9;
    out["ratio_to_allgather"] = ag / seconds;
  }
  out["bound_method"]
    = on_gpu() && world1
        ? std::string("the copy bound (copy_bound_method): at world 1 an all-gather moves "
                      "nothing")
    : on_gpu()
        ? "median of " + std::to_string(bound_all.size())
            + " NCCL all-gathers of `bytes` output bytes per rank among the trainer ranks' GPUs "
              "(one communicator per GPU in this process, as `chunks` equal grouped "
              "all-gathers, one untimed warm-up), measured after the timed publications"
        : "median of " + std::to_string(bound_all.size())
            + " plain single-threaded std::memcpy calls of `bytes` bytes between "
              "two pre-faulted, warmed buffers (one untimed warm-up copy), "
            + std::to_string(opts_.bound_reps)
            + " right after each timed publication, in this process";
  out["bound_seconds"] = bound_seconds;
  out["bound_seconds_all"] = bound_all;
  out["bound_best_gbps"]
    = first.bytes / *std::min_element(bound_all.begin(), bound_all.end()) / 1e9;
  std::vector<double> wall_all;
  for (const auto& r : runs)
    wall_all.push_back(r.wall_seconds);
  out["publish_wall_seconds_all"] = wall_all;
  auto opt = [](const std::optional<std::uint64_t>& x) { return x ? json(*x) : json(nullptr); };
  auto per_iteration = [&](std::optional<std::uint64_t> iteration_result::*field) {
    json all = json::array();
    for (const auto& r : runs)
      all.push_back(opt(r.*field));
    return all;
  };
  out["peak_extra_bytes"] = trainer_extra || runtime_extra
                              ? json(trainer_extra.value_or(0) + runtime_extra.value_or(0))
                              : json(nullptr);
  out["peak_extra"] = {
    {"counts", "max over the timed publications of (VmHWM - VmRSS) across publish(v), with "
               "VmHWM reset just before it: trainer_process_bytes (this process: trainer "
               "ranks' memfd packed buffers + transient allocations) + runtime_process_bytes "
               "(refit-runtime: its read-only mappings of those buffers as they are touched "
               "+ transient allocations). The memfd pages are shared, so mapped buffer "
               "pages are counted once in each process."},
    {"trainer_process_bytes", opt(trainer_extra)},
    {"runtime_process_bytes", opt(runtime_extra)},
    {"trainer_process_bytes_all", per_iteration(&iteration_result::trainer_extra)},
    {"runtime_process_bytes_all", per_iteration(&iteration_result::runtime_extra)},
    {"planned_packed_buffer_bytes", planned_buffers},
    {"peak_buffer_bytes_per_rank", first.peak_buffer_bytes},
  };
  if (cfg_.publication.mode == "direct")
    out["peak_extra"]["direct_mode"]
      = "no packed buffer exists (peak_buffer_bytes_per_rank 0); trainer_process_bytes counts the "
        "runtime's resident arenas mapped into this process as the ranks write them (shared "
        "memfd pages of the runtime's own memory, RssShmem), not an allocation";
  if (on_gpu()) {
    std::uint64_t worst = 0;
    json all = json::array();
    for (const auto& r : runs) {
      worst = std::max(worst, r.device_extra.value_or(0));
      all.push_back(opt(r.device_extra));
    }
    std::uint64_t largest = 0;
    for (const auto& p : refit::model::expected_key_stream(cfg_.model))
      largest = std::max<std::uint64_t>(largest, p.nbytes());
    out["peak_extra_device_bytes"] = worst;
    out["peak_extra_device_bytes_all"] = all;
    out["peak_extra_device_bar_bytes"]
      = cfg_.publication.buffer_count * cfg_.publication.buffer_bytes + largest + (1ull << 30);
    out["peak_extra_device_method"]
      = "max over the timed publications and the trainer GPUs of (cudaMemGetInfo free bytes "
        "just before publish(v)) - (lowest free bytes sampled every 100 us during it); "
        "device-wide, so it includes the runtime child's allocations";
    out["largest_tensor_bytes"] = largest;
  }
  if (opts_.verify) {
    const bool committed = verify_run.has_value();
    bool checksums = committed && !verify_run->res.receipts.empty();
    if (committed)
      for (const auto& r : verify_run->res.receipts)
        checksums = checksums && !r.checksums.empty();
    out["verified"] = committed && checksums;
    json v;
    v["model_version"] = next_version_ - 1;
    if (committed) {
      v["seconds"] = verify_run->res.seconds;
      v["wall_seconds"] = verify_run->wall_seconds;
      std::size_t sums = 0;
      for (const auto& r : verify_run->res.receipts)
        sums += r.checksums.size();
      v["resident_checksums"] = sums;
    } else {
      v["error"] = verify_error;
    }
    out["verify"] = v;
  }
  if (opts_.source == "registered") {
    std::vector<source_sample> samples;
    for (const auto& r : compared)
      samples.push_back({r.source, r.round, r.res.seconds, r.device_extra});
    out["rounds"] = opts_.rounds;
    out["comparison"] = compare_sources(samples, 0.05);
    out["comparison"]["schedule"]
      = "each round: --iterations publications from the synthetic shard store, then "
        "--iterations from the registered FSDP2 memory, on the same runtime; the ranks (and "
        "their memory) are replaced between the phases, versions continue";
  }
  json memory = json::array();
  for (const auto& m : trainer_memory_) {
    json j;
    j["source"] = m.source;
    if (m.source == "registered") {
      j["arena_bytes"] = m.arena_bytes;
      j["registered_bytes"] = m.registered_bytes;
      j["arena_allocations"] = cfg_.runtime.tp_size;
    }
    j["arena_device_bytes"] = m.arena_device_bytes ? json(*m.arena_device_bytes) : json(nullptr);
    j["ranks_device_bytes"] = m.ranks_device_bytes ? json(*m.ranks_device_bytes) : json(nullptr);
    memory.push_back(j);
  }
  out["trainer_memory"] = memory;
  out["trainer_memory_method"]
    = "per phase: arena_bytes = what the bench allocated for the registered FSDP2 memory (one "
      "allocation per rank); arena_device_bytes / ranks_device_bytes = drop of cudaMemGetInfo "
      "free bytes (summed over the trainer GPUs) while the arenas were filled / while the "
      "ranks started (synthetic: their shard store; registered: no copy of the weights)";
  if (recipe_verify)
    out["note"] = "publication.verify in the recipe was ignored for the timed publications";
  return out;
}

std::string gib(std::uint64_t bytes) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.3f GiB", bytes / 1073741824.0);
  return buf;
}

std::string mib(const json& bytes) {
  if (bytes.is_null())
    return "n/a";
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", bytes.get<std::uint64_t>() / 1048576.0);
  return buf;
}

void print_table(const json& r) {
  std::printf("refit-bench publish  %s\n", r["config"].get<std::string>().c_str());
  std::printf("  model              %s, %llu tensors, %s (%llu bytes)\n",
              r["model_type"].get<std::string>().c_str(), r["tensors"].get<unsigned long long>(),
              gib(r["bytes"].get<std::uint64_t>()).c_str(), r["bytes"].get<unsigned long long>());
  std::printf("  weight source      %s\n", r.value("source", std::string("synthetic")).c_str());
  std::printf("  topology           %u trainer ranks -> TP %u, transport %s\n",
              r["trainer_ranks"].get<unsigned>(), r["tp"].get<unsigned>(),
              r["transport"].get<std::string>().c_str());
  std::printf("  packed buffers     %u x %s per rank, %u chunks\n",
              r["buffer_count"].get<unsigned>(), mib(r["buffer_bytes"]).c_str(),
              r["chunks"].get<unsigned>());
  std::printf("  publications       %u, seconds:", r["iterations"].get<unsigned>());
  for (double s : r["seconds_all"])
    std::printf(" %.3f", s);
  std::printf("\n");
  std::printf("  median             %.3f s  ->  %.2f GB/s\n", r["seconds"].get<double>(),
              r["gbps"].get<double>());
  std::printf("  %s %.3f s  ->  %.2f GB/s (%s)\n",
              r["transport"] == "cuda_ipc" && r["trainer_ranks"].get<unsigned>() > 1
                ? "all-gather bound  "
                : r["transport"] == "cuda_ipc" ? "copy bound        " : "memcpy bound      ",
              r["bound_seconds"].get<double>(), r["bound_gbps"].get<double>(), "median");
  if (r.contains("peak_extra_device_bytes"))
    std::printf("  peak extra device  %s (bar: %s)\n", mib(r["peak_extra_device_bytes"]).c_str(),
                mib(r["peak_extra_device_bar_bytes"]).c_str());
  std::printf("  ratio              %.3f\n", r["ratio"].get<double>());
  std::printf("  mode               %s: %s placed locally, %s across devices\n",
              r["mode"].get<std::string>().c_str(), mib(r["bytes_local"]).c_str(),
              mib(r["bytes_cross"]).c_str());
  std::printf("  copy bound         %.4f s  ->  %.2f GB/s (ratio %.3f)\n",
              r["copy_bound_seconds"].get<double>(), r["copy_bound_gbps"].get<double>(),
              r["ratio_to_copy"].get<double>());
  std::printf("  peak extra memory  %s (trainer process %s, runtime process %s; planned "
              "packed buffers %s)\n",
              mib(r["peak_extra_bytes"]).c_str(),
              mib(r["peak_extra"]["trainer_process_bytes"]).c_str(),
              mib(r["peak_extra"]["runtime_process_bytes"]).c_str(),
              mib(r["peak_extra"]["planned_packed_buffer_bytes"]).c_str());
  if (r.contains("verified")) {
    std::printf("  verified           %s", r["verified"].get<bool>() ? "true" : "false");
    const auto& v = r["verify"];
    if (v.contains("seconds"))
      std::printf(" (version %llu, %.3f s with the verifier, %zu resident checksums)",
                  v["model_version"].get<unsigned long long>(), v["seconds"].get<double>(),
                  v["resident_checksums"].get<std::size_t>());
    else
      std::printf(" (%s)", v["error"].get<std::string>().c_str());
    std::printf("\n");
  }
}

} // namespace

json run_publish(const publish_options& o, const config::refit_config& cfg,
                 const std::string& runtime_exe) {
  auto c = cfg;
  if (!o.mode.empty()) {
    c.publication.mode = o.mode;
    try {
      config::validate(c);
    } catch (const std::exception& e) {
      throw bench_error(std::string("--mode ") + o.mode + ": " + e.what());
    }
  }
  bench b{o, c, runtime_exe};
  return b.run();
}

void print_publish_table(const json& r) { print_table(r); }

} // namespace refit::bench
