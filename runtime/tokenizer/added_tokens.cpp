#include "runtime/tokenizer/added_tokens.hpp"

#include <cstdint>
#include <algorithm>

#include "runtime/tokenizer/unicode.hpp"

namespace refit::tokenizer {

void added_matcher::add(std::string pattern, const added_token* token) {
  if (pattern.empty())
    return;
  auto& b = buckets_[static_cast<unsigned char>(pattern[0])];
  b.push_back(entry{std::move(pattern), token});
  // Longest first; among equal lengths the earlier token wins.
  std::stable_sort(b.begin(), b.end(), [](const entry& x, const entry& y) {
    return x.pattern.size() > y.pattern.size();
  });
  ++count_;
}

void added_matcher::find_matches(std::string_view s, std::vector<match>& out) const {
  std::size_t start_offset = 0; // end of the previous accepted match (after rstrip)
  std::size_t i = 0;            // where the leftmost-longest scan continues
  while (i < s.size()) {
    const entry* hit = nullptr;
    for (const auto& e : buckets_[static_cast<unsigned char>(s[i])]) {
      if (s.compare(i, e.pattern.size(), e.pattern) == 0) {
        hit = &e;
        break;
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    std::size_t start = i, stop = i + hit->pattern.size();
    i = stop; // non-overlapping, like aho-corasick's find_iter
    const added_token& tok = *hit->token;
    if (tok.single_word) {
      std::size_t len = 0;
      bool start_space = start == 0 || !unicode::is_word_char(unicode::decode_before(s, start, len));
      bool stop_space = stop == s.size() || !unicode::is_word_char(unicode::decode_at(s, stop, len));
      if (!start_space || !stop_space)
        continue;
    }
    if (tok.lstrip) {
      std::size_t newstart = start, len = 0;
      while (newstart > 0 && unicode::is_white_space(unicode::decode_before(s, newstart, len)))
        newstart -= len;
      start = std::max(newstart, start_offset);
    }
    if (tok.rstrip) {
      std::size_t len = 0;
      while (stop < s.size() && unicode::is_white_space(unicode::decode_at(s, stop, len)))
        stop += len;
    }
    out.push_back(match{start, stop, &tok});
    start_offset = stop;
  }
}

} // namespace refit::tokenizer
