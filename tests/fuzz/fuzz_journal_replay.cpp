// libFuzzer target: untrusted journals all the way through refit-replay. Past the reader
// (fuzz_journal_reader), every recorded input is rebuilt and delivered to the real
// SyncCoordinator, ConsensusGate and RolloutEngine on CAF's test_coordinator. Whatever the
// entries say, replay must end with a result (reproduced or diverged) or a journal_error,
// never crash or hang. The header's config digest makes mutations land in the entries.
#include <cstddef>
#include <cstdint>
#include <string>

#include "journal_input.hpp"
#include "runtime/config/config.hpp"
#include "runtime/journal/journal_file.hpp"
#include "runtime/system/replay.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto f = refit::fuzz::parse_journal_input(data, size);
  if (!f)
    return 0;
  if (f->entries.size() > 400)
    f->entries.resize(400); // bounds the work per input
  try {
    (void)refit::replay::run(*f, "<fuzz>");
  } catch (const refit::config::config_error&) {
  } catch (const refit::journal::journal_error&) {
  }
  return 0;
}
