// Deterministic replay of an actor journal (runtime/journal.hpp): the SyncCoordinator,
// ConsensusGate and RolloutEngine are rebuilt from the journal header's config on CAF's
// test_coordinator (no threads, no real time, no processes). Stand-ins take the place of the
// runtime proxies, the trainer ranks and the driver; they never answer by themselves. The
// replay walks the journal: each recorded input is delivered to its actor at its recorded
// place (a message the actors sent each other is taken from what the replay produced; an
// outside input — runtime reply, rank report, timer, DOWN, driver request — is rebuilt from
// the journal), the actor processes it, and everything the replay journals must equal the
// recorded entries in order: state transitions, messages to the outside, replies, drawn
// values.
#pragma once

#include <cstdint>
#include <string>

#include "runtime/journal/journal_file.hpp"

namespace refit::replay {

struct result {
  bool ok = false;
  std::size_t entries = 0;     // in the journal
  std::size_t inputs = 0;      // messages the actors processed
  std::size_t transitions = 0;
  std::size_t outputs = 0;     // sends and replies to the outside
  std::size_t values = 0;      // drawn values (publication ids, clock readings)
  std::uint64_t publications = 0; // committed, per the SyncCoordinator's last recorded state
  std::uint64_t failures = 0;     // poisoned attempts, likewise
  std::uint64_t diverged_seq = 0; // the first recorded entry replay did not reproduce
  std::string divergence;         // what differed (expected vs actual)
  std::size_t unrecorded_tail = 0; // entries the last step produced past the journal's end
  double seconds = 0;             // wall time of the replay
};

// Replays `j`. Throws config::config_error when the header's config is invalid and
// journal::journal_error when a recorded input cannot be rebuilt; a journal the actors do not
// reproduce is a result with ok = false.
result run(const journal::file& j, const std::string& origin = "<journal>");

} // namespace refit::replay
