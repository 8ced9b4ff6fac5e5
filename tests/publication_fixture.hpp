// Shared fixture of the end-to-end publication tests: the rollout subtree with the real
// refit-runtime child plus the in-process trainer side, driven through typed requests.
#pragma once

#include <chrono>
#include <dirent.h>
#include <memory>
#include <set>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <gtest/gtest.h>
#include <unistd.h>

#include "actors/sync_coordinator.hpp"
#include "runtime/system/bootstrap.hpp"
#include "runtime/control/process.hpp"
#include "runtime/publication/direct_backend.hpp"

namespace refit::testing {

using namespace std::chrono_literals;

inline std::set<std::string> shm_entries() {
  std::set<std::string> out;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (auto* e = ::readdir(d))
      out.insert(e->d_name);
    ::closedir(d);
  }
  return out;
}

inline config::refit_config tiny_config(std::uint32_t tp) {
  auto cfg = config::load_file(std::string(REFIT_SOURCE_DIR) + "/configs/tiny-synthetic.yaml");
  cfg.runtime.tp_size = tp;
  cfg.runtime.devices.clear();
  for (std::uint32_t r = 0; r < tp; ++r)
    cfg.runtime.devices.push_back("cpu:" + std::to_string(r));
  cfg.runtime.kill_grace_ms = 300;
  cfg.supervisor.backoff_initial_ms = 20;
  cfg.supervisor.backoff_max_ms = 100;
  cfg.publication.verify = true;
  cfg.publication.memory_headroom_bytes = 1 << 20;
  cfg.publication.republish_attempts = 0; // failure tests observe the poisoned state itself
  config::validate(cfg);
  return cfg;
}

class Publication : public ::testing::Test {
protected:
  config::refit_config cfg = tiny_config(2);
  std::unique_ptr<caf::actor_system_config> sys_cfg;
  std::unique_ptr<caf::actor_system> sys;
  rollout_handles rollout;
  publication_handles pub;

  void start() {
    sys_cfg = std::make_unique<caf::actor_system_config>();
    configure(*sys_cfg);
    sys = std::make_unique<caf::actor_system>(*sys_cfg);
    rollout = spawn_rollout(*sys, cfg, make_runtime_proxy_factory(cfg, REFIT_RUNTIME_EXE));
    engine_status st;
    ASSERT_TRUE(wait_until_ready(*sys, rollout.engine, 20s, &st)) << st.last_error;
    pub = spawn_publication(*sys, cfg, rollout);
    // A rank answers describe once its worker thread has allocated its shards.
    for (const auto& r : pub.ranks)
      ASSERT_TRUE(ask<rank_info>(r, describe_atom::value));
  }

  void TearDown() override {
    if (sys) {
      shutdown_publication(pub);
      shutdown_rollout(*sys, rollout);
      pub = {};
      rollout = {};
      sys.reset();
    }
  }

  template <class T, class Handle, class... Ts>
  caf::expected<T> ask(const Handle& h, Ts&&... xs) {
    caf::scoped_actor self{*sys};
    caf::expected<T> out{caf::error{}};
    self->request(h, 120s, std::forward<Ts>(xs)...)
      .receive([&](T& x) { out = std::move(x); }, [&](caf::error& e) { out = std::move(e); });
    return out;
  }

  engine_status engine() { return *ask<engine_status>(rollout.engine, status_atom::value); }

  // The colocated schedule around a publication: sleep(2) -> wake(weights) -> publish ->
  // wake(kv_cache).
  caf::expected<publication_result> publish(std::uint64_t version) {
    auto s = ask<engine_status>(rollout.engine, sleep_atom::value, std::uint32_t{2});
    if (!s)
      return s.error();
    s = ask<engine_status>(rollout.engine, wake_atom::value, wake_tags::only_weights());
    if (!s)
      return s.error();
    auto res = ask<publication_result>(pub.coordinator, publish_atom::value, version);
    if (!res)
      return res;
    s = ask<engine_status>(rollout.engine, wake_atom::value, wake_tags::only_kv_cache());
    if (!s)
      return s.error();
    return res;
  }

  void step_all() {
    for (const auto& r : pub.ranks)
      ASSERT_TRUE(ask<std::uint64_t>(r, step_atom::value));
  }

  std::uint64_t step_of_rank0() { return ask<rank_info>(pub.ranks[0], describe_atom::value)->step; }

  pid_t runtime_pid() {
    auto d = ask<runtime_description>(rollout.engine, describe_atom::value);
    return d ? static_cast<pid_t>(d->pid) : -1;
  }

  bool wait_incarnation(std::uint64_t n) {
    auto until = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < until) {
      auto st = engine();
      if (st.incarnation >= n && st.conn() == connection_state::idle)
        return true;
      std::this_thread::sleep_for(10ms);
    }
    return false;
  }

  // Asserts the publication failed with `code`, nothing was committed, and the runtime was
  // poisoned: its process group is gone and the supervisor brought up a fresh one.
  void expect_poisoned(const caf::expected<publication_result>& res, errc code,
                       const std::string& message_part, pid_t old_pid) {
    ASSERT_FALSE(res) << "publication unexpectedly committed";
    EXPECT_EQ(static_cast<errc>(res.error().code()), code) << render(res.error());
    EXPECT_NE(render(res.error()).find(message_part), std::string::npos) << render(res.error());
    auto status = *ask<coordinator_status>(pub.coordinator, status_atom::value);
    EXPECT_EQ(status.committed_version, 0u);
    EXPECT_EQ(status.state, static_cast<std::uint8_t>(publication_state::idle));
    ASSERT_FALSE(status.transitions.empty());
    EXPECT_EQ(status.transitions[status.transitions.size() - 2], "Poisoned");
    EXPECT_EQ(engine().committed_version, 0u);
    ASSERT_TRUE(wait_incarnation(2)) << "the supervisor restarts the poisoned runtime";
    EXPECT_TRUE(proc::processes_in_group(old_pid).empty());
    EXPECT_TRUE(engine().needs_publication);
  }
};


inline std::size_t fd_count() {
  return proc::open_fds(::getpid()).size();
}

// The count of IPC-opened resident arenas once the trainer ranks have handled the end of a
// direct publication: each rank closes its mappings when its final / abort message arrives,
// which races the coordinator's answer to the caller, so this waits (up to 5 s) for 0.
inline std::uint64_t open_targets_after_release() {
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (publication::open_resident_targets() != 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(5ms);
  return publication::open_resident_targets();
}

} // namespace refit::testing
