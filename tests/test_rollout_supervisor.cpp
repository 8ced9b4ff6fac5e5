// RolloutSupervisor on CAF's test_coordinator: incarnations, restart after backoff (test
// clock), exponential backoff with a cap, the restart budget and its window, shutdown and
// kill. The proxies are scripted fakes; the engine is the real RolloutEngine.
#include "actors/rollout_supervisor.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/rollout_engine.hpp"
#include "tests/actor_fixture.hpp"
#include "tests/fake_proxy.hpp"

namespace {

using namespace refit;
using namespace refit_test;
using std::chrono::milliseconds;

class supervisor_test : public actor_fixture {
protected:
  static config::supervisor_config sup_cfg(std::uint32_t max_restarts = 3,
                                           std::uint32_t window_ms = 10000) {
    config::supervisor_config c;
    c.max_restarts = max_restarts;
    c.backoff_initial_ms = 100;
    c.backoff_max_ms = 400;
    c.restart_window_ms = window_ms;
    return c;
  }

  supervisor_test() {
    rollout_engine_options o;
    o.tp_size = 2;
    o.kill_grace_ms = 10;
    engine = sys.spawn(rollout_engine, o);
    track(engine);
    sched.run();
  }

  // A factory that spawns a fake proxy per incarnation and records it.
  proxy_factory factory() {
    return [this](caf::actor_system& s, std::uint64_t n) -> runtime_proxy_actor {
      auto sc = std::make_shared<fake_script>();
      sc->incarnation = n;
      scripts.push_back(sc);
      auto p = s.spawn(fake_proxy, sc);
      track(p);
      proxies.push_back(p);
      return p;
    };
  }

  void start_supervisor(config::supervisor_config c = sup_cfg()) {
    sup = sys.spawn(rollout_supervisor, c, factory(), engine);
    track(sup);
    sched.run();
  }

  supervisor_status sup_status() {
    auto r = ask<supervisor_status>(sup, status_atom::value);
    EXPECT_TRUE(r->ok()) << render(r->error);
    return r->value;
  }

  engine_status eng_status() {
    auto r = ask<engine_status>(engine, status_atom::value);
    EXPECT_TRUE(r->ok()) << render(r->error);
    return r->value;
  }

  // The current runtime proxy dies with an error.
  caf::error crash_current() {
    auto reason = make_refit_error(errc::runtime_exited, "runtime",
                                   "incarnation " + std::to_string(proxies.size())
                                     + " exited with status 1");
    send_exit(proxies.back(), reason);
    sched.run();
    return reason;
  }

  // Crashes the current proxy and checks that the next one starts exactly after `delay`.
  void expect_restart_after(milliseconds delay) {
    auto before = scripts.size();
    crash_current();
    advance(delay - milliseconds(1));
    ASSERT_EQ(scripts.size(), before) << "restarted before the backoff of " << delay.count()
                                      << " ms";
    advance(milliseconds(1));
    ASSERT_EQ(scripts.size(), before + 1) << "no restart after " << delay.count() << " ms";
  }

  rollout_engine_actor engine;
  rollout_supervisor_actor sup;
  std::vector<std::shared_ptr<fake_script>> scripts;
  std::vector<fake_proxy_actor> proxies;
};

TEST_F(supervisor_test, StartsIncarnationOneAndAttachesIt) {
  start_supervisor();
  ASSERT_EQ(scripts.size(), 1u);
  EXPECT_EQ(scripts[0]->incarnation, 1u);
  EXPECT_EQ(scripts[0]->log, std::vector<std::string>{"describe"});
  auto s = sup_status();
  EXPECT_EQ(s.incarnation, 1u);
  EXPECT_TRUE(s.running);
  EXPECT_FALSE(s.gave_up);
  EXPECT_EQ(s.restarts, 0u);
  auto e = eng_status();
  EXPECT_EQ(state_of(e), "IDLE");
  EXPECT_EQ(e.incarnation, 1u);
  EXPECT_FALSE(e.needs_publication);
}

TEST_F(supervisor_test, RestartsOnlyAfterTheBackoffDelay) {
  start_supervisor();
  auto reason = crash_current();
  auto s = sup_status();
  EXPECT_FALSE(s.running);
  EXPECT_EQ(s.last_exit, render(reason));
  EXPECT_EQ(state_of(eng_status()), "DETACHED");
  // Nothing happens before the backoff (100 ms) has passed on the test clock.
  sched.run();
  advance(milliseconds(99));
  EXPECT_EQ(scripts.size(), 1u);
  EXPECT_EQ(state_of(eng_status()), "DETACHED");
  advance(milliseconds(1));
  ASSERT_EQ(scripts.size(), 2u);
  EXPECT_EQ(scripts[1]->incarnation, 2u);
  EXPECT_EQ(scripts[1]->log, std::vector<std::string>{"describe"});
  s = sup_status();
  EXPECT_EQ(s.incarnation, 2u);
  EXPECT_TRUE(s.running);
  EXPECT_EQ(s.restarts, 1u);
  auto e = eng_status();
  EXPECT_EQ(state_of(e), "IDLE");
  EXPECT_EQ(e.incarnation, 2u);
  EXPECT_TRUE(e.needs_publication); // a restarted runtime holds no committed weights
}

TEST_F(supervisor_test, BackoffDoublesAndIsCapped) {
  start_supervisor(sup_cfg(10));
  for (auto ms : {100, 200, 400, 400, 400})
    expect_restart_after(milliseconds(ms));
  EXPECT_EQ(sup_status().incarnation, 6u);
  EXPECT_EQ(eng_status().incarnation, 6u);
}

TEST_F(supervisor_test, GivesUpAfterMaxRestartsWithinTheWindow) {
  start_supervisor(sup_cfg(2));
  expect_restart_after(milliseconds(100));
  expect_restart_after(milliseconds(200));
  auto reason = crash_current();
  auto s = sup_status();
  EXPECT_TRUE(s.gave_up);
  EXPECT_FALSE(s.running);
  EXPECT_EQ(s.incarnation, 3u);
  EXPECT_EQ(s.restarts, 2u);
  EXPECT_EQ(s.last_exit, render(reason));
  advance(std::chrono::minutes(5));
  EXPECT_EQ(scripts.size(), 3u);
  auto e = eng_status();
  EXPECT_EQ(state_of(e), "DETACHED");
  EXPECT_TRUE(e.gave_up);
  EXPECT_NE(e.last_error.find("restart limit: 2 restarts"), std::string::npos) << e.last_error;
  auto g = ask<generate_result>(engine, generate_atom::value, generate_request{{{1, 2}}, {}});
  ASSERT_TRUE(g->done);
  EXPECT_REFIT_ERROR(g->error, errc::restart_limit, "generate");
}

TEST_F(supervisor_test, RestartsOlderThanTheWindowAreForgiven) {
  start_supervisor(sup_cfg(2, 1000));
  expect_restart_after(milliseconds(100));
  expect_restart_after(milliseconds(200));
  advance(milliseconds(2000)); // both restarts are now older than the window
  crash_current();
  auto s = sup_status();
  EXPECT_FALSE(s.gave_up);
  EXPECT_EQ(s.restarts, 1u);
  advance(milliseconds(400)); // backoff_max_ms bounds the delay whatever the history
  ASSERT_EQ(scripts.size(), 4u);
  s = sup_status();
  EXPECT_EQ(s.incarnation, 4u);
  EXPECT_TRUE(s.running);
  EXPECT_EQ(eng_status().incarnation, 4u);
}

TEST_F(supervisor_test, ProxyThatQuitsNormallyIsRestartedToo) {
  start_supervisor();
  auto r = ask<caf::ok_atom>(proxies.back(), shutdown_atom::value);
  ASSERT_TRUE(r->ok());
  EXPECT_EQ(sup_status().last_exit, "normal exit");
  advance(milliseconds(100));
  EXPECT_EQ(scripts.size(), 2u);
  EXPECT_EQ(sup_status().incarnation, 2u);
}

TEST_F(supervisor_test, PoisonedRuntimeIsReplaced) {
  start_supervisor();
  auto p = ask<engine_status>(engine, poison_atom::value, std::string("bad publication"));
  ASSERT_TRUE(p->ok());
  EXPECT_EQ(scripts[0]->poison_reasons.size(), 1u);
  EXPECT_FALSE(scripts[0]->alive);
  auto s = sup_status();
  EXPECT_TRUE(contains(s.last_exit, "refit.poisoned at runtime")) << s.last_exit;
  advance(milliseconds(100));
  ASSERT_EQ(scripts.size(), 2u);
  auto e = eng_status();
  EXPECT_EQ(state_of(e), "IDLE");
  EXPECT_EQ(e.incarnation, 2u);
  EXPECT_TRUE(e.needs_publication);
}

TEST_F(supervisor_test, ShutdownStopsTheProxyAndQuitsWithoutRestart) {
  start_supervisor();
  auto r = ask<caf::ok_atom>(sup, shutdown_atom::value);
  ASSERT_TRUE(r->ok()) << render(r->error);
  EXPECT_EQ(scripts[0]->count("shutdown"), 1u);
  EXPECT_FALSE(scripts[0]->alive);
  EXPECT_FALSE(scripts[0]->exit_reason) << render(scripts[0]->exit_reason); // graceful
  // The supervisor is gone.
  auto st = ask<supervisor_status>(sup, status_atom::value);
  ASSERT_TRUE(st->done);
  EXPECT_TRUE(st->error);
  advance(std::chrono::minutes(1));
  EXPECT_EQ(scripts.size(), 1u);
  EXPECT_EQ(state_of(eng_status()), "DETACHED");
}

TEST_F(supervisor_test, ShutdownDuringBackoffCancelsTheRestart) {
  start_supervisor();
  crash_current();
  auto r = ask<caf::ok_atom>(sup, shutdown_atom::value);
  ASSERT_TRUE(r->ok()) << render(r->error);
  advance(std::chrono::minutes(1));
  EXPECT_EQ(scripts.size(), 1u);
  EXPECT_EQ(state_of(eng_status()), "DETACHED");
}

TEST_F(supervisor_test, KillingTheSupervisorKillsTheProxy) {
  start_supervisor();
  caf::anon_send_exit(sup, caf::exit_reason::kill);
  sched.run();
  EXPECT_FALSE(scripts[0]->alive);
  EXPECT_TRUE(scripts[0]->exit_reason == caf::exit_reason::kill)
    << render(scripts[0]->exit_reason);
  EXPECT_EQ(state_of(eng_status()), "DETACHED");
  advance(std::chrono::minutes(1));
  EXPECT_EQ(scripts.size(), 1u);
}

} // namespace
