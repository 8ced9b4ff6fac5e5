// GPT-2's ByteLevel alphabet: every byte is one printable code point. The printable bytes
// '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for themselves; the other 68 bytes, in byte order,
// become U+0100, U+0101, ... The table is computed at start-up.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace refit::tokenizer {

class byte_level_alphabet {
public:
  static const byte_level_alphabet& get();

  std::int32_t code_point(unsigned char b) const { return cp_[b]; }
  // The UTF-8 spelling of byte b's code point.
  const std::string& utf8(unsigned char b) const { return utf8_[b]; }
  // Bytes -> their ByteLevel string (what the vocabulary of a byte-level BPE is keyed by).
  std::string encode(std::string_view bytes) const;
  // ByteLevel decoding of one token: its bytes when every character is in the alphabet,
  // false otherwise (HF then keeps the token's own UTF-8 bytes).
  bool decode_token(std::string_view token, std::string& out) const;

private:
  byte_level_alphabet();
  std::array<std::int32_t, 256> cp_{};
  std::array<std::string, 256> utf8_{};
  std::array<std::int16_t, 324> byte_of_{}; // code point -> byte, -1 when not in the alphabet
};

} // namespace refit::tokenizer
