// refit-bench soak: many publish / fault / restart cycles in one process (one actor system,
// one rollout supervisor), with a seeded random runtime fault in every cycle, a generation
// and parity check after every commit, and process / shm / fd leak accounting at the end.
//
// The runtime faults are one-shot and fixed when an incarnation is spawned, so the whole
// fault plan is made up front (one fault per runtime incarnation) and put into the config
// before the actor system starts:
//
//   cycle i publishes version i on incarnation i; the fault poisons it, the supervisor starts
//   incarnation i+1 and the coordinator republishes version i on it (incarnation i+1's FIRST
//   publication); cycle i+1's publication is incarnation i+1's SECOND one, where its fault
//   fires. Incarnation 1's fault targets its first publication.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/config/config.hpp"

namespace refit::soak {

struct soak_options {
  std::string config_path;
  unsigned cycles = 10;
  std::uint64_t seed = 1;
  bool as_json = false;
  // Timeout of the publication commands (init/start/update/finish/release) in the soak's
  // copy of the config, so that injected stalls are detected quickly.
  std::uint32_t command_timeout_ms = 500;
};

// Runs the soak on a copy of `cfg` (its runtime/trainer faults are replaced by the plan).
// Throws std::runtime_error for a setup failure (bad plan, runtime never ready); a cycle that
// fails is reported in the result (`ok` false, `failed_cycle`, `error`), not thrown.
nlohmann::ordered_json run(const soak_options& opts, config::refit_config cfg,
                           const std::string& runtime_exe);

// True if every cycle committed, no generation was stale and nothing leaked.
bool passed(const nlohmann::ordered_json& result);

// A human-readable summary of `result` on stdout.
void print_table(const nlohmann::ordered_json& result);

} // namespace refit::soak
