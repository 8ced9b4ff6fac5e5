// libFuzzer target: untrusted tokenizer.json bytes. Loading must either succeed or throw
// tokenizer_error (never crash, hang or read out of bounds); a loaded tokenizer must encode a
// fixed mixed-script string with added tokens and decode its ids back.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "runtime/tokenizer/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    auto tok = refit::tokenizer::tokenizer::from_json_bytes(bytes, "fuzz.json");
    auto ids = tok.encode("Hello wo\xCC\x81rld  it's 123 <|end|> \xE4\xBD\xA0\xE5\xA5\xBD\n\n ab");
    (void)tok.decode(ids, false);
    (void)tok.decode(ids, true);
  } catch (const refit::tokenizer::tokenizer_error&) {
  }
  return 0;
}
