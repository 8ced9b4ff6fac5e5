// refit::tokenizer: HF tokenizer.json byte-level BPE (as Qwen2 / Qwen3 use it) with exactly
// HF tokenizers' ids. Implemented: normalizer NFC / Sequence of NFC / null; pre_tokenizer
// Sequence of Split (Regex or String pattern, behavior Isolated, invert false) ending in
// ByteLevel, or ByteLevel alone (use_regex true uses GPT-2's pattern, add_prefix_space
// honoured); model BPE (ignore_merges honoured; dropout, unk_token, continuing_subword_prefix,
// end_of_word_suffix, byte_fallback only at their defaults); added_tokens with special /
// normalized / lstrip / rstrip / single_word; decoder ByteLevel or null; post_processor
// ByteLevel or null. Everything else is refused with an error naming file and field.
//
// Stop / pad / bos ids come from generation_config.json (eos_token_id, int or list) and
// tokenizer_config.json (eos_token, pad_token, bos_token: string or {"content": ...}) next to
// tokenizer.json, when those files exist.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tokenizer/error.hpp"

namespace refit::tokenizer {

class tokenizer {
public:
  // A directory holding tokenizer.json, or the tokenizer.json file itself.
  static tokenizer load(const std::filesystem::path& dir_or_tokenizer_json);
  // tokenizer.json from memory (no sibling config files); `name` appears in errors.
  static tokenizer from_json_bytes(std::string_view bytes, const std::string& name);

  tokenizer(tokenizer&&) noexcept;
  tokenizer& operator=(tokenizer&&) noexcept;
  ~tokenizer();

  // HF's encode(text, add_special_tokens=True) ids. Throws tokenizer_error for invalid UTF-8
  // (naming the byte offset). Thread-safe.
  std::vector<std::int32_t> encode(std::string_view text) const;
  // HF's decode(ids, skip_special_tokens). An id outside the vocabulary and the added tokens
  // is an error naming its position.
  std::string decode(const std::vector<std::int32_t>& ids, bool skip_special) const;

  // One past the largest id (vocab and added tokens): Qwen3 gives 151,669.
  std::uint32_t vocab_size() const;
  // The id of a token (added tokens first, then the vocabulary).
  std::optional<std::int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(std::int32_t id) const;
  bool is_special(std::int32_t id) const;

  // generation_config.json's eos ids, then tokenizer_config.json's eos_token (deduplicated).
  const std::vector<std::int32_t>& stop_ids() const;
  std::optional<std::int32_t> eos_id() const; // the first stop id
  std::optional<std::int32_t> pad_id() const;
  std::optional<std::int32_t> bos_id() const;

  // The file the tokenizer came from.
  const std::string& source() const;

  struct state;

private:
  explicit tokenizer(std::unique_ptr<state> s);
  std::unique_ptr<state> s_;
};

} // namespace refit::tokenizer
