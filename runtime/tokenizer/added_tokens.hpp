// tokenizer.json's added_tokens, split out of text the way HF tokenizers' AddedVocabulary does:
// leftmost-longest matching, then single_word / lstrip / rstrip applied to each match. Tokens
// with normalized:false are matched on the raw text, normalized:true ones on each normalized
// piece (their patterns normalized too).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace refit::tokenizer {

struct added_token {
  std::string content;
  std::int32_t id = 0;
  bool special = false;
  bool normalized = true; // HF's default when the field is absent
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// A set of patterns, matched leftmost-longest (buckets by first byte, longest first).
class added_matcher {
public:
  void add(std::string pattern, const added_token* token);
  bool empty() const { return count_ == 0; }

  // Calls f(piece, token-or-null) for the pieces of `s`, covering it in order.
  template <typename F>
  void split(std::string_view s, F&& f) const;

private:
  struct entry {
    std::string pattern;
    const added_token* token;
  };
  std::vector<entry> buckets_[256];
  std::size_t count_ = 0;

  struct match {
    std::size_t start, stop;
    const added_token* token;
  };
  // The matches after single_word / lstrip / rstrip, as HF's find_matches yields them.
  void find_matches(std::string_view s, std::vector<match>& out) const;
};

template <typename F>
void added_matcher::split(std::string_view s, F&& f) const {
  if (count_ == 0) {
    f(s, nullptr);
    return;
  }
  std::vector<match> ms;
  find_matches(s, ms);
  std::size_t offset = 0;
  for (const auto& m : ms) {
    if (offset < m.start)
      f(s.substr(offset, m.start - offset), nullptr);
    f(s.substr(m.start, m.stop - m.start), m.token);
    offset = m.stop;
  }
  if (offset < s.size())
    f(s.substr(offset), nullptr);
}

} // namespace refit::tokenizer
