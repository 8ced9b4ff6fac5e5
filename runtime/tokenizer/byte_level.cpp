#include <cstdint>
#include "runtime/tokenizer/byte_level.hpp"

#include "runtime/tokenizer/unicode.hpp"

namespace refit::tokenizer {

const byte_level_alphabet& byte_level_alphabet::get() {
  static const byte_level_alphabet table;
  return table;
}

byte_level_alphabet::byte_level_alphabet() {
  byte_of_.fill(-1);
  std::int32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    cp_[b] = printable ? b : next++;
    utf8_[b].clear();
    unicode::append_utf8(utf8_[b], cp_[b]);
    byte_of_[static_cast<std::size_t>(cp_[b])] = static_cast<std::int16_t>(b);
  }
}

std::string byte_level_alphabet::encode(std::string_view bytes) const {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes)
    out += utf8_[b];
  return out;
}

bool byte_level_alphabet::decode_token(std::string_view token, std::string& out) const {
  const std::size_t mark = out.size();
  std::size_t i = 0;
  while (i < token.size()) {
    std::size_t len = 0;
    auto cp = unicode::decode_at(token, i, len);
    if (cp < 0 || cp >= static_cast<std::int32_t>(byte_of_.size()) || byte_of_[cp] < 0) {
      out.resize(mark);
      return false;
    }
    out.push_back(static_cast<char>(static_cast<unsigned char>(byte_of_[cp])));
    i += len;
  }
  return true;
}

} // namespace refit::tokenizer
