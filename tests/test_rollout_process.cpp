// Real-process tests of the rollout subtree: RolloutSupervisor -> vLLMRuntimeProxy ->
// refit-runtime child, driven through the RolloutEngine. Faults are injected into the child
// with the test-only runtime.faults config (refit-runtime --fault).
#include <chrono>
#include <csignal>
#include <memory>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>
#include <gtest/gtest.h>
#include <unistd.h>

#include "runtime/system/bootstrap.hpp"
#include "runtime/control/process.hpp"

using namespace refit;
using namespace std::chrono_literals;

namespace {

config::refit_config tiny_config() {
  auto cfg = config::load_file(std::string(REFIT_SOURCE_DIR) + "/configs/tiny-synthetic.yaml");
  cfg.runtime.kill_grace_ms = 300;
  cfg.supervisor.backoff_initial_ms = 20;
  cfg.supervisor.backoff_max_ms = 100;
  return cfg;
}

bool group_gone(pid_t pgid, std::chrono::milliseconds within = 2s) {
  auto until = std::chrono::steady_clock::now() + within;
  while (!proc::processes_in_group(pgid).empty()) {
    if (std::chrono::steady_clock::now() > until)
      return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

class RolloutProcess : public ::testing::Test {
protected:
  config::refit_config cfg = tiny_config();
  std::unique_ptr<caf::actor_system_config> sys_cfg;
  std::unique_ptr<caf::actor_system> sys;
  rollout_handles h;

  void start(bool expect_ready = true) {
    sys_cfg = std::make_unique<caf::actor_system_config>();
    configure(*sys_cfg);
    sys = std::make_unique<caf::actor_system>(*sys_cfg);
    h = spawn_rollout(*sys, cfg, make_runtime_proxy_factory(cfg, REFIT_RUNTIME_EXE));
    if (expect_ready) {
      engine_status st;
      ASSERT_TRUE(wait_until_ready(*sys, h.engine, 20s, &st)) << st.last_error;
    }
  }

  void TearDown() override {
    if (sys) {
      shutdown_rollout(*sys, h);
      h = {};
      sys.reset();
    }
  }

  // Sends one request to the engine and waits for the typed answer.
  template <class T, class... Ts>
  caf::expected<T> call(Ts&&... xs) {
    caf::scoped_actor self{*sys};
    caf::expected<T> out{caf::error{}};
    self->request(h.engine, 60s, std::forward<Ts>(xs)...)
      .receive([&](T& x) { out = std::move(x); }, [&](caf::error& e) { out = std::move(e); });
    return out;
  }

  engine_status status() { return *call<engine_status>(status_atom::value); }

  runtime_description describe() {
    auto d = call<runtime_description>(describe_atom::value);
    EXPECT_TRUE(d) << render(d.error());
    return d ? *d : runtime_description{};
  }

  // Waits for the supervisor to attach a runtime of incarnation >= n and for it to be IDLE.
  bool wait_incarnation(std::uint64_t n, std::chrono::milliseconds within = 20s) {
    auto until = std::chrono::steady_clock::now() + within;
    while (std::chrono::steady_clock::now() < until) {
      auto st = status();
      if (st.incarnation >= n && st.conn() == connection_state::idle)
        return true;
      std::this_thread::sleep_for(10ms);
    }
    return false;
  }

  void add_fault(const std::string& command, const std::string& kind, std::uint32_t after = 0) {
    cfg.runtime.faults.push_back(config::runtime_fault{command, kind, after});
  }
};

errc code_of(const caf::error& e) {
  return static_cast<errc>(e.code());
}

} // namespace

TEST_F(RolloutProcess, LifecycleDescribeSleepWakeShutdownLeavesNothing) {
  auto fds_before = proc::open_fds(::getpid());
  start();
  auto d = describe();
  ASSERT_EQ(d.tp_world_size, 2u);
  ASSERT_EQ(d.workers.size(), 2u);
  EXPECT_EQ(d.runtime_kind, "refit-runtime");
  EXPECT_TRUE(d.weights_valid);
  EXPECT_EQ(d.model_version, 0u);
  pid_t pid = static_cast<pid_t>(d.pid);
  ASSERT_GT(pid, 0);
  EXPECT_EQ(::getpgid(pid), pid) << "the runtime runs in its own process group";

  auto st = call<engine_status>(sleep_atom::value, std::uint32_t{1});
  ASSERT_TRUE(st) << render(st.error());
  EXPECT_EQ(st->sleep_level, 1u);
  EXPECT_FALSE(st->weights_awake);
  EXPECT_FALSE(st->needs_publication) << "level 1 keeps the checkpoint weights";
  d = describe();
  EXPECT_EQ(d.workers[0].kv_cache_bytes_resident, 0u);
  EXPECT_EQ(d.workers[0].weight_bytes_resident, 0u);
  EXPECT_GT(d.workers[0].weight_bytes_offloaded, 0u);

  ASSERT_TRUE(call<engine_status>(wake_atom::value, wake_tags::only_weights()));
  d = describe();
  EXPECT_TRUE(d.weights_awake);
  EXPECT_FALSE(d.kv_cache_awake);
  ASSERT_TRUE(call<engine_status>(wake_atom::value, wake_tags::only_kv_cache()));
  st = call<engine_status>(status_atom::value);
  EXPECT_EQ(st->sleep_level, 0u);
  EXPECT_FALSE(st->needs_publication);

  st = call<engine_status>(sleep_atom::value, std::uint32_t{2});
  ASSERT_TRUE(st);
  EXPECT_TRUE(st->needs_publication) << "level 2 discards the weights";
  ASSERT_TRUE(call<engine_status>(wake_atom::value, wake_tags::all()));
  auto gen = call<generate_result>(generate_atom::value, generate_request{{{1, 2, 3}}, {}});
  ASSERT_FALSE(gen);
  EXPECT_EQ(code_of(gen.error()), errc::needs_publication);

  shutdown_rollout(*sys, h);
  h = {};
  sys.reset();
  EXPECT_TRUE(group_gone(pid));
  EXPECT_EQ(::kill(pid, 0), -1) << "the runtime was reaped";
  EXPECT_EQ(proc::open_fds(::getpid()), fds_before) << "no fd outlives the rollout subtree";
}

TEST_F(RolloutProcess, RuntimeErrorsAreTypedAndUnsafeOnesPoison) {
  start();
  // A request the runtime refuses (token id beyond the vocabulary) is safe: the typed error
  // leaves the connection IDLE.
  auto gen = call<generate_result>(generate_atom::value, generate_request{{{1, 2, 999}}, {}});
  ASSERT_FALSE(gen);
  EXPECT_EQ(code_of(gen.error()), errc::runtime_invalid_argument) << render(gen.error());
  EXPECT_EQ(error_where(gen.error()), "generate.prompts[0].token_ids[2]");
  EXPECT_EQ(status().conn(), connection_state::idle);
  // A weight-transfer command failing is unsafe: fail-stop poisons the runtime (this CPU
  // build has no CUDA IPC transport).
  auto pid = static_cast<pid_t>(describe().pid);
  auto init = call<engine_status>(init_wt_atom::value, transfer_init{"cuda_ipc", 1 << 20, 2});
  ASSERT_FALSE(init);
  EXPECT_EQ(code_of(init.error()), errc::runtime_invalid_argument) << render(init.error());
  EXPECT_EQ(error_where(init.error()), "init_weight_transfer.transport");
  EXPECT_TRUE(group_gone(pid));
  ASSERT_TRUE(wait_incarnation(2));
  EXPECT_TRUE(status().needs_publication);
}

TEST_F(RolloutProcess, HungChildIsKilledWithinItsTimeout) {
  cfg.runtime.timeouts_ms.sleep = 400;
  add_fault("sleep", "stall");
  start();
  auto pid = static_cast<pid_t>(describe().pid);
  auto t0 = std::chrono::steady_clock::now();
  auto st = call<engine_status>(sleep_atom::value, std::uint32_t{1});
  auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(st);
  EXPECT_EQ(code_of(st.error()), errc::runtime_timeout) << render(st.error());
  EXPECT_EQ(error_where(st.error()), "sleep");
  // timeout (400 ms) + kill grace (300 ms) + scheduling slack: bounded, never a hang.
  EXPECT_LT(took, 5s);
  EXPECT_GE(took, 400ms);
  EXPECT_TRUE(group_gone(pid, 100ms)) << "the error is delivered after the group was reaped";
  EXPECT_EQ(::kill(pid, 0), -1);
}

TEST_F(RolloutProcess, ChildKilledMidRequestBreaksTheConnection) {
  add_fault("sleep", "stall");
  start();
  auto pid = static_cast<pid_t>(describe().pid);
  std::thread killer([pid] {
    std::this_thread::sleep_for(200ms);
    ::kill(pid, SIGKILL);
  });
  auto st = call<engine_status>(sleep_atom::value, std::uint32_t{1});
  killer.join();
  ASSERT_FALSE(st);
  EXPECT_EQ(code_of(st.error()), errc::runtime_exited) << render(st.error());
  EXPECT_NE(error_message(st.error()).find("signal 9"), std::string::npos) << render(st.error());
  EXPECT_TRUE(group_gone(pid, 100ms));
}

TEST_F(RolloutProcess, ChildCrashWhileIdleIsNoticedAndRestarted) {
  start();
  auto pid = static_cast<pid_t>(describe().pid);
  ::kill(pid, SIGKILL);
  ASSERT_TRUE(wait_incarnation(2));
  auto st = status();
  EXPECT_TRUE(st.needs_publication);
  EXPECT_NE(st.last_error.find("signal 9"), std::string::npos) << st.last_error;
  auto d = describe();
  EXPECT_NE(static_cast<pid_t>(d.pid), pid);
  EXPECT_TRUE(group_gone(pid));
}

struct protocol_fault {
  const char* kind;
  errc code;
  const char* where;
  const char* message_part;
};

class RolloutProtocolFault : public RolloutProcess,
                             public ::testing::WithParamInterface<protocol_fault> {};

TEST_P(RolloutProtocolFault, BadAnswerBreaksKillsAndRestarts) {
  auto f = GetParam();
  add_fault("sleep", f.kind);
  start();
  auto pid = static_cast<pid_t>(describe().pid);
  auto st = call<engine_status>(sleep_atom::value, std::uint32_t{1});
  ASSERT_FALSE(st);
  EXPECT_EQ(code_of(st.error()), f.code) << render(st.error());
  EXPECT_EQ(error_where(st.error()), f.where) << render(st.error());
  EXPECT_NE(error_message(st.error()).find(f.message_part), std::string::npos) << render(st.error());
  EXPECT_TRUE(group_gone(pid, 100ms)) << "BROKEN => the whole group is killed and reaped";
  // The supervisor brings a working runtime back; it needs a full publication.
  ASSERT_TRUE(wait_incarnation(2));
  EXPECT_TRUE(status().needs_publication);
  auto d = describe();
  EXPECT_EQ(d.tp_world_size, 2u);
  EXPECT_NE(static_cast<pid_t>(d.pid), pid);
  auto gen = call<generate_result>(generate_atom::value, generate_request{{{1}}, {}});
  ASSERT_FALSE(gen);
  EXPECT_EQ(code_of(gen.error()), errc::needs_publication);
}

INSTANTIATE_TEST_SUITE_P(
  Faults, RolloutProtocolFault,
  ::testing::Values(
    protocol_fault{"wrong_id", errc::protocol_error, "response.request_id", "request id"},
    protocol_fault{"wrong_command", errc::protocol_error, "response.command", "command"},
    protocol_fault{"wrong_result", errc::protocol_error, "response.result", "result field"},
    protocol_fault{"wrong_version", errc::protocol_error, "response.protocol_version", "99"},
    protocol_fault{"bad_frame", errc::protocol_error, "frame", "magic"},
    protocol_fault{"exit", errc::runtime_exited, "sleep", "exited with code 3"},
    protocol_fault{"sigkill", errc::runtime_exited, "sleep", "signal 9"},
    protocol_fault{"error", errc::runtime_injected, "sleep", ""}),
  [](const ::testing::TestParamInfo<protocol_fault>& info) { return std::string(info.param.kind); });

TEST_F(RolloutProcess, SpawnFailureGivesUpAfterBoundedRestarts) {
  cfg.supervisor.max_restarts = 2;
  sys_cfg = std::make_unique<caf::actor_system_config>();
  configure(*sys_cfg);
  sys = std::make_unique<caf::actor_system>(*sys_cfg);
  h = spawn_rollout(*sys, cfg, make_runtime_proxy_factory(cfg, "/nonexistent/refit-runtime"));
  caf::scoped_actor self{*sys};
  supervisor_status sup;
  auto until = std::chrono::steady_clock::now() + 10s;
  do {
    self->request(h.supervisor, 5s, status_atom::value)
      .receive([&](supervisor_status& s) { sup = s; }, [](caf::error&) {});
    std::this_thread::sleep_for(10ms);
  } while (!sup.gave_up && std::chrono::steady_clock::now() < until);
  EXPECT_TRUE(sup.gave_up);
  EXPECT_EQ(sup.incarnation, 3u) << "1 start + 2 restarts";
  EXPECT_NE(sup.last_exit.find("spawn_failed"), std::string::npos) << sup.last_exit;
  EXPECT_NE(sup.last_exit.find("/nonexistent/refit-runtime"), std::string::npos) << sup.last_exit;
  auto d = call<runtime_description>(describe_atom::value);
  ASSERT_FALSE(d);
  EXPECT_EQ(code_of(d.error()), errc::restart_limit) << render(d.error());
  EXPECT_NE(error_message(d.error()).find("restart limit"), std::string::npos);
  EXPECT_TRUE(status().gave_up);
}

// A recipe that asks for more memory than the machine has (here a 2^62-byte KV cache per
// worker) is refused before anything is allocated, naming the key and both numbers, and the
// supervisor does not retry the deterministic failure as if it were a crash.
TEST_F(RolloutProcess, MemoryAskBeyondTheMachineIsRefusedOnceNamingTheKey) {
  cfg.runtime.kv_cache_bytes = std::uint64_t{1} << 62;
  cfg.supervisor.max_restarts = 3;
  start(false);
  caf::scoped_actor self{*sys};
  supervisor_status sup;
  auto until = std::chrono::steady_clock::now() + 20s;
  do {
    self->request(h.supervisor, 5s, status_atom::value)
      .receive([&](supervisor_status& s) { sup = s; }, [](caf::error&) {});
    std::this_thread::sleep_for(10ms);
  } while (!sup.gave_up && std::chrono::steady_clock::now() < until);
  ASSERT_TRUE(sup.gave_up);
  EXPECT_EQ(sup.incarnation, 1u) << "no restart of a deterministic startup failure";
  EXPECT_NE(sup.last_exit.find("preflight_failed at runtime.kv_cache_bytes"), std::string::npos)
    << sup.last_exit;
  EXPECT_NE(sup.last_exit.find("4611686018427387904 bytes each"), std::string::npos) << sup.last_exit;
  EXPECT_NE(sup.last_exit.find("available (MemAvailable)"), std::string::npos) << sup.last_exit;
  // The engine hears it from the supervisor (a message after the supervisor's own state).
  auto st = status();
  for (auto t = std::chrono::steady_clock::now() + 10s; !st.gave_up && std::chrono::steady_clock::now() < t;
       st = status())
    std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(st.gave_up);
  EXPECT_NE(st.last_error.find("not retried"), std::string::npos) << st.last_error;
}

