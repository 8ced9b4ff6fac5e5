// The Unicode pieces the tokenizer needs, on top of utf8proc: UTF-8 validation, NFC,
// the character classes HF's added-token options use, and lossy UTF-8 decoding with the
// same replacement rule as Rust's String::from_utf8_lossy (one U+FFFD per maximal invalid
// subpart).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace refit::tokenizer::unicode {

inline constexpr std::size_t npos = static_cast<std::size_t>(-1);

// Offset of the first byte that does not start a valid UTF-8 sequence, or npos.
std::size_t invalid_utf8_offset(std::string_view s);

// NFC of valid UTF-8 (ASCII-only text is returned unchanged without calling utf8proc).
std::string nfc(std::string_view s);

// Decodes the code point at s[i] (valid UTF-8); sets `len` to its byte length.
std::int32_t decode_at(std::string_view s, std::size_t i, std::size_t& len);
// The code point that ends at s[end) (valid UTF-8); sets `len` to its byte length.
std::int32_t decode_before(std::string_view s, std::size_t end, std::size_t& len);

// Unicode White_Space (Rust char::is_whitespace, regex \s).
bool is_white_space(std::int32_t cp);
// A word character as Rust regex's \w sees it: letters, marks, decimal digits, letter
// numbers, connector punctuation, ZWNJ/ZWJ.
bool is_word_char(std::int32_t cp);

void append_utf8(std::string& out, std::int32_t cp);
// UTF-8 with every maximal invalid subpart replaced by U+FFFD.
std::string from_utf8_lossy(std::string_view bytes);

} // namespace refit::tokenizer::unicode
