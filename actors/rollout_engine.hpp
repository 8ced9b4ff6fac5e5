// RolloutEngine: the rollout API of refit (generate, sleep/wake, the weight-transfer control
// surface). It never touches the runtime process itself: it forwards to the attached
// runtime_proxy_actor, validates the child's answers again, and poisons the runtime after any
// unsafe failure (sleep/wake/cache reset, or anything while a weight update is open).
#pragma once

#include <cstdint>
#include <string>

#include "actors/interfaces.hpp"
#include "runtime/config/config.hpp"
#include "runtime/journal/journal.hpp"

namespace refit {

struct rollout_engine_options {
  config::timeouts timeouts_ms;        // the proxy's per-command timeouts
  std::uint32_t kill_grace_ms = 2000;  // the proxy's SIGTERM -> SIGKILL grace
  std::uint32_t tp_size = 1;           // expected TP world size of the runtime
  journal::sink_ptr journal;           // set when journaling (requests to the proxy)
};

struct rollout_engine_state {
  static inline const char* name = "RolloutEngine";

  rollout_engine_options opts;
  runtime_proxy_actor proxy;           // null while detached
  std::uint64_t incarnation = 0;
  connection_state conn = connection_state::detached;
  std::uint64_t committed_version = 0;
  bool needs_publication = false;
  runtime_description runtime;         // last validated description/lifecycle of the runtime
  // Weight-transfer control surface.
  bool transfer_initialized = false;
  bool update_open = false;
  bool ipc_open = false;               // committed, imports not yet released
  publication_header header;           // of the open / last committed publication
  std::uint32_t next_chunk = 0;
  std::string last_error;
  bool gave_up = false;                // the supervisor will not attach another runtime
  // Why it gave up. Reported as last_error from then on: the proxy's own DOWN may reach the
  // engine after the supervisor's gave_up and must not replace the reason.
  std::string gave_up_reason;

  engine_status status() const;
};

rollout_engine_actor::behavior_type
rollout_engine(rollout_engine_actor::stateful_pointer<rollout_engine_state> self,
               rollout_engine_options opts);

} // namespace refit
