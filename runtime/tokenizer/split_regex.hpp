// A pre-tokenizer pattern compiled with PCRE2 (UTF + UCP, JIT when available) and split with
// HF's "Isolated" behaviour: every match and every gap between matches is its own piece, in
// order; empty pieces are dropped. Matches are found the way the onig crate's find_iter does
// (HF's Split): search from the end of the previous match, with the whole piece as subject so
// lookarounds see their context; an empty match right at the previous match's end is skipped
// by moving one character on.
#pragma once

#include <cstdint>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace refit::tokenizer {

class split_regex {
public:
  // `literal`: the pattern is a plain string (HF's {"String": ...}). Errors name file/field.
  split_regex(const std::string& pattern, bool literal, const std::string& file,
              const std::string& field);
  ~split_regex();
  split_regex(const split_regex&) = delete;
  split_regex& operator=(const split_regex&) = delete;

  // Calls f(piece) for each match and gap of `s` (valid UTF-8).
  template <typename F>
  void split_isolated(std::string_view s, F&& f) const {
    std::size_t prev = 0, pos = 0, ms = 0, me = 0;
    bool have_last = false;
    std::size_t last_end = 0;
    while (pos <= s.size() && find(s, pos, ms, me)) {
      if (ms == me && have_last && last_end == me) {
        pos += pos < s.size() ? char_len(s, pos) : 1;
        continue;
      }
      pos = me;
      have_last = true;
      last_end = me;
      if (prev < ms)
        f(s.substr(prev, ms - prev));
      if (ms < me)
        f(s.substr(ms, me - ms));
      prev = me;
    }
    if (prev < s.size())
      f(s.substr(prev));
  }

  const std::string& pattern() const { return pattern_; }

private:
  bool find(std::string_view s, std::size_t start, std::size_t& ms, std::size_t& me) const;
  static std::size_t char_len(std::string_view s, std::size_t i);

  std::string pattern_;
  struct impl;
  std::unique_ptr<impl> impl_;
};

} // namespace refit::tokenizer
