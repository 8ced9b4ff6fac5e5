// GoogleTest fixture for deterministic actor tests: an actor system on CAF's test_coordinator
// (no threads, no real time), refit's types registered, and helpers to ask actors from the
// test body without blocking (a probe actor collects the answer; `done` says if one came).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <caf/actor_addr.hpp>
#include <caf/actor_cast.hpp>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/exit_reason.hpp>
#include <caf/scheduler/test_coordinator.hpp>
#include <caf/sec.hpp>
#include <caf/message_id.hpp>
#include <caf/send.hpp>
#include <caf/system_messages.hpp>

#include "messages/errors.hpp"
#include "messages/types.hpp"
#include "runtime/system/bootstrap.hpp"

namespace refit_test {

// The answer to one request: a value or an error, once `done`.
template <class T>
struct reply {
  bool done = false;
  T value{};
  caf::error error;
  bool ok() const { return done && !error; }
};

// "refit.<code>" name of an error's code, or CAF's rendering for other categories.
inline std::string code_of(const caf::error& err) {
  if (!err)
    return "none";
  if (err.category() == caf::atom("refit"))
    return refit::to_string(static_cast<refit::errc>(err.code()));
  return caf::to_string(err);
}

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

inline std::string state_of(const refit::engine_status& s) {
  return refit::to_string(s.conn());
}

class actor_fixture : public ::testing::Test {
protected:
  static caf::actor_system_config& init_config(caf::actor_system_config& cfg) {
    refit::configure(cfg);
    cfg.set("scheduler.policy", caf::atom("testing"));
    cfg.set("logger.file-verbosity", caf::atom("quiet"));
    return cfg;
  }

  actor_fixture()
    : sys(init_config(cfg)),
      sched(dynamic_cast<caf::scheduler::test_coordinator&>(sys.scheduler())) {
    // Make sure the current time isn't 0.
    sched.clock().current_time += std::chrono::hours(1);
  }

  ~actor_fixture() override {
    // Nothing may outlive the test: the actor system's destructor waits for every actor.
    for (auto& a : tracked)
      caf::anon_send_exit(a, caf::exit_reason::kill);
    tracked.clear();
    sched.run();
  }

  template <class Handle>
  void track(const Handle& h) {
    tracked.push_back(h.address());
  }

  // Makes `h` exit with `reason` (an arbitrary error, unlike caf::anon_send_exit).
  template <class Handle>
  void send_exit(const Handle& h, caf::error reason) {
    auto ptr = caf::actor_cast<caf::strong_actor_ptr>(h);
    if (ptr)
      ptr->enqueue(nullptr, caf::make_message_id(),
                   caf::make_message(caf::exit_msg{ptr->address(), std::move(reason)}), nullptr);
  }

  // Sends a request through a fresh probe actor without running the scheduler.
  template <class T, class Handle, class... Ts>
  std::shared_ptr<reply<T>> send_request(const Handle& h, Ts... xs) {
    auto out = std::make_shared<reply<T>>();
    auto probe = sys.spawn([h, out, xs...](caf::event_based_actor* self) {
      self->request(h, caf::infinite, xs...)
        .then(
          [out](T& x) {
            out->value = std::move(x);
            out->done = true;
          },
          [out](caf::error& e) {
            out->error = std::move(e);
            out->done = true;
          });
    });
    track(probe);
    return out;
  }

  // Sends a request and runs all messages (never timeouts); the reply may stay !done.
  template <class T, class Handle, class... Ts>
  std::shared_ptr<reply<T>> ask(const Handle& h, Ts... xs) {
    auto out = send_request<T>(h, std::move(xs)...);
    sched.run();
    return out;
  }

  // Advances the test clock by `d` and runs what became due.
  void advance(std::chrono::milliseconds d) {
    sched.advance_time(d);
    sched.run();
  }

  caf::actor_system_config cfg;
  caf::actor_system sys;
  caf::scheduler::test_coordinator& sched;
  std::vector<caf::actor_addr> tracked;
};

} // namespace refit_test

// Asserts that `err` is the refit error `code` about `where`.
#define EXPECT_REFIT_ERROR(err, code, where)                                                   \
  do {                                                                                         \
    const caf::error e_ = (err);                                                               \
    EXPECT_EQ(::refit_test::code_of(e_), ::refit::to_string(code)) << ::refit::render(e_);     \
    EXPECT_EQ(::refit::error_where(e_), std::string(where)) << ::refit::render(e_);            \
  } while (false)
