#include "runtime/tokenizer/unicode.hpp"

#include <cstdint>
#include <cstdlib>
#include <memory>

#include <utf8proc.h>

namespace refit::tokenizer::unicode {

namespace {

// Bytes a valid sequence starting at s[i] takes, or a negative number.
utf8proc_ssize_t valid_len(const unsigned char* p, std::size_t n) {
  utf8proc_int32_t cp = 0;
  return utf8proc_iterate(p, static_cast<utf8proc_ssize_t>(n), &cp);
}

bool all_ascii(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80)
      return false;
  return true;
}

} // namespace

std::size_t invalid_utf8_offset(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  std::size_t i = 0;
  while (i < s.size()) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    auto n = valid_len(p + i, s.size() - i);
    if (n <= 0)
      return i;
    i += static_cast<std::size_t>(n);
  }
  return npos;
}

std::string nfc(std::string_view s) {
  if (s.empty() || all_ascii(s))
    return std::string(s);
  utf8proc_uint8_t* out = nullptr;
  auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                        static_cast<utf8proc_ssize_t>(s.size()), &out,
                        static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> hold(out, &std::free);
  if (n < 0)
    return std::string(s); // only on invalid UTF-8, which callers have refused already
  return std::string(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
}

std::int32_t decode_at(std::string_view s, std::size_t i, std::size_t& len) {
  utf8proc_int32_t cp = 0;
  auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                            static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
  len = n > 0 ? static_cast<std::size_t>(n) : 1;
  return n > 0 ? cp : -1;
}

std::int32_t decode_before(std::string_view s, std::size_t end, std::size_t& len) {
  std::size_t start = end - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80 && end - start < 4)
    --start;
  std::size_t n = 0;
  auto cp = decode_at(s.substr(0, end), start, n);
  len = end - start;
  return cp;
}

bool is_white_space(std::int32_t cp) {
  if ((cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85)
    return true;
  if (cp < 0xA0)
    return false;
  auto cat = utf8proc_category(cp);
  return cat == UTF8PROC_CATEGORY_ZS || cat == UTF8PROC_CATEGORY_ZL ||
         cat == UTF8PROC_CATEGORY_ZP;
}

bool is_word_char(std::int32_t cp) {
  if (cp == 0x200C || cp == 0x200D)
    return true;
  switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

void append_utf8(std::string& out, std::int32_t cp) {
  utf8proc_uint8_t buf[4];
  auto n = utf8proc_encode_char(cp, buf);
  out.append(reinterpret_cast<const char*>(buf), static_cast<std::size_t>(n));
}

std::string from_utf8_lossy(std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::size_t n = bytes.size();
  std::string out;
  out.reserve(n);
  std::size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      out.push_back(static_cast<char>(p[i++]));
      continue;
    }
    auto len = valid_len(p + i, n - i);
    if (len > 0) {
      out.append(bytes.data() + i, static_cast<std::size_t>(len));
      i += static_cast<std::size_t>(len);
      continue;
    }
    // Maximal subpart: the longest prefix of a well-formed sequence. Only the second byte
    // has lead-dependent ranges, so a prefix of k >= 2 bytes is a valid start exactly when
    // padding it with continuation bytes 0x80 gives a valid sequence.
    std::size_t want = static_cast<std::size_t>(utf8proc_utf8class[p[i]]);
    std::size_t take = 1;
    for (std::size_t k = 2; want > 1 && k < want && i + k <= n; ++k) {
      unsigned char buf[4] = {0x80, 0x80, 0x80, 0x80};
      for (std::size_t j = 0; j < k; ++j)
        buf[j] = p[i + j];
      if (valid_len(buf, want) != static_cast<utf8proc_ssize_t>(want))
        break;
      take = k;
    }
    out += "\xEF\xBF\xBD";
    i += take;
  }
  return out;
}

} // namespace refit::tokenizer::unicode
