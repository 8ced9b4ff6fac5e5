// refit-bench publish: times whole publications (first chunk requested -> version committed)
// against a bound measured in the same run. See publish_bench.cpp for the schedule.
#pragma once

#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/config/config.hpp"

namespace refit::bench {

struct publish_options {
  std::string config_path;
  unsigned iterations = 5;
  unsigned bound_reps = 3;
  std::string scheduler = "sharing";
  bool verify = false;
  // "synthetic": the ranks' synthetic shard store; "registered": each rank publishes memory
  // laid out as an FSDP2 trainer holds it (bench/fsdp_memory.hpp), registered zero copy.
  std::string source = "synthetic";
  // --source registered: rounds of (synthetic, registered) phases of `iterations`
  // publications each, in one run (source_compare.hpp); other sources: repeated phases.
  unsigned rounds = 1;
  // publication.mode for this run: "packed", "direct", or "" (the recipe's).
  std::string mode;
  bool as_json = false;
};

// A failure that ends the run: `what` is the one line printed.
struct bench_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs the benchmark on `cfg`; throws bench_error.
nlohmann::ordered_json run_publish(const publish_options& o, const config::refit_config& cfg,
                                   const std::string& runtime_exe);
// The result as a table on stdout.
void print_publish_table(const nlohmann::ordered_json& r);

} // namespace refit::bench
