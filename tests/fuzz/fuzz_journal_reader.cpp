// libFuzzer target: untrusted journal files as refit-replay reads them. The reader
// (record framing, protobuf records, header and entry checks) and the element codec (every
// element type decoded into its message struct, and rendered) must answer with a
// journal_error or a value, never crash, hang, read out of bounds or allocate without bound.
#include <cstddef>
#include <cstdint>
#include <string>

#include <caf/message.hpp>

#include "journal_input.hpp"
#include "runtime/journal/journal_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto f = refit::fuzz::parse_journal_input(data, size);
  if (!f)
    return 0;
  for (const auto& e : f->entries) {
    (void)refit::journal::render(e);
    (void)refit::journal::signature(e.elements);
    caf::message m;
    (void)refit::journal::decode(e.elements, {}, m);
  }
  return 0;
}
