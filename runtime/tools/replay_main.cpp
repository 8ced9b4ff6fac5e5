// refit-replay: re-runs a recorded actor journal (journal.enabled / refit-coordinator --journal)
// deterministically on CAF's test_coordinator and checks that the SyncCoordinator,
// ConsensusGate and RolloutEngine make the same transitions and produce the same outputs in
// the same order (runtime/replay.hpp).
//   exit 0: reproduced; a summary line on stdout
//   exit 1: diverged; the first differing entry (seq, expected vs actual) on stderr
//   exit 2: the journal is malformed or unreadable (the error names the byte offset, seq and
//           field), or bad arguments
#include <cstdio>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>

#include "runtime/config/config.hpp"
#include "runtime/journal/journal_file.hpp"
#include "runtime/system/replay.hpp"

int main(int argc, char** argv) {
  CLI::App app{"refit-replay: re-runs the coordinator-side actors of refit (SyncCoordinator, "
               "ConsensusGate, RolloutEngine) from a journal on CAF's deterministic test "
               "scheduler, feeding the recorded outside inputs (runtime replies, rank reports, "
               "timers, process exits, driver requests), and checks that the same transitions "
               "and outputs happen in the same order. Exit 0: reproduced; 1: diverged (the first "
               "differing entry is printed); 2: malformed journal."};
  std::string path;
  bool verbose = false;
  app.add_option("journal", path, "journal file (journal.path of the recorded run)")->required();
  app.add_flag("-v,--verbose", verbose, "print every journal entry before replaying");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    auto rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  refit::journal::file j;
  try {
    j = refit::journal::read_file(path);
  } catch (const refit::journal::journal_error& e) {
    std::cerr << "refit-replay: malformed journal: " << e.what() << std::endl;
    return 2;
  }
  if (verbose)
    for (const auto& e : j.entries)
      std::cout << refit::journal::render(e) << "\n";
  refit::replay::result res;
  try {
    res = refit::replay::run(j, path);
  } catch (const refit::config::config_error& e) {
    std::cerr << "refit-replay: malformed journal: " << path
              << ": the header's config is invalid: " << e.what() << std::endl;
    return 2;
  } catch (const refit::journal::journal_error& e) {
    std::cerr << "refit-replay: malformed journal: " << e.what() << std::endl;
    return 2;
  }
  if (!res.ok) {
    std::cerr << "refit-replay: " << path << ": diverged: " << res.divergence << std::endl;
    return 1;
  }
  std::printf("refit-replay: %s: reproduced %zu entries (%zu inputs, %zu transitions, %zu outputs, "
              "%zu values); publications committed %llu, failed attempts %llu; replayed in %.3f s\n",
              path.c_str(), res.entries, res.inputs, res.transitions, res.outputs, res.values,
              static_cast<unsigned long long>(res.publications),
              static_cast<unsigned long long>(res.failures), res.seconds);
  if (res.unrecorded_tail > 0)
    std::printf("refit-replay: the journal ends inside a step: its last step produced %zu more "
                "entries that were not recorded\n",
                res.unrecorded_tail);
  return 0;
}
