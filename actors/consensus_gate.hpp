// ConsensusGate: per (publication, phase), collects every trainer rank's report. The
// coordinator's `open` request is answered with all reports when every rank reported ok; the
// first failure, or a rank missing at the deadline, becomes one gate_failure (phase, rank,
// error) that fails the request and is sent to every rank as `abort` — so no rank advances to
// a later collective after another failed. Reports for a failed publication are dropped.
// The gate monitors the ranks it is attached to: a rank that goes away (its process died or its
// connection was lost, in a multi-process deployment) fails every open round at once, and every
// later round until the next attach, naming the rank instead of waiting for the deadline.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "actors/interfaces.hpp"
#include "runtime/journal/journal.hpp"

namespace refit {

struct consensus_gate_options {
  journal::sink_ptr journal; // set when journaling (aborts sent to the ranks)
};

struct consensus_gate_state {
  static inline const char* name = "ConsensusGate";

  struct round {
    std::uint32_t world = 0;
    std::uint32_t deadline_ms = 0;
    std::map<std::uint32_t, rank_report> reports;
    caf::typed_response_promise<std::vector<rank_report>> rp;
    std::int64_t trace_start_ns = 0; // --trace: when it opened (trace::start)
  };

  consensus_gate_options opts;
  std::vector<trainer_rank_actor> ranks;   // monitored: a rank that goes away fails its rounds
  std::map<std::uint32_t, std::string> gone; // rank -> why it went away (since the last attach)
  std::map<phase_id, round> open;
  std::map<phase_id, std::vector<rank_report>> early; // arrived before `open`
  std::set<std::string> failed;                       // publications that failed
  std::uint64_t passed = 0;                           // phases passed (for status/tests)
};

consensus_gate_actor::behavior_type
consensus_gate(consensus_gate_actor::stateful_pointer<consensus_gate_state> self,
               consensus_gate_options opts);

} // namespace refit
