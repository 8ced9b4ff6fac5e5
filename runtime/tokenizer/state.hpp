// The parsed pieces of a tokenizer (private to runtime/tokenizer).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "runtime/tokenizer/added_tokens.hpp"
#include "runtime/tokenizer/bpe.hpp"
#include "runtime/tokenizer/json_file.hpp"
#include "runtime/tokenizer/split_regex.hpp"
#include "runtime/tokenizer/tokenizer.hpp"

namespace refit::tokenizer {

// One pre-tokenizer step: a Split (regex set) or the final ByteLevel (prefix space, and the
// GPT-2 regex when use_regex).
struct pre_step {
  std::unique_ptr<split_regex> regex;
  bool byte_level = false;
  bool add_prefix_space = false;
};

enum class decoder_kind { none, byte_level };

struct tokenizer::state {
  explicit state(bpe_model m) : model(std::move(m)) {}
  std::string file;
  bool nfc = false;
  std::vector<pre_step> pre;
  bpe_model model;
  decoder_kind decoder = decoder_kind::none;
  std::vector<std::unique_ptr<added_token>> added;
  std::unordered_map<std::string, std::int32_t> added_by_content;
  std::unordered_map<std::int32_t, const added_token*> added_by_id;
  std::unordered_set<std::string> special_contents;
  added_matcher raw_matcher;        // normalized:false tokens, on the raw text
  added_matcher normalized_matcher; // normalized:true tokens, on normalized pieces
  std::vector<std::string> id_to_token; // vocab and added tokens ("" + !has_token: none)
  std::vector<bool> has_token;
  std::uint32_t vocab_size = 0;
  std::vector<std::int32_t> stop_ids;
  std::optional<std::int32_t> pad_id, bos_id;
};

// Builds the state from tokenizer.json's parsed document (tokenizer_load.cpp).
std::unique_ptr<tokenizer::state> build_state(const nlohmann::json& doc, const std::string& file);
// Reads generation_config.json / tokenizer_config.json in `dir` into the special ids.
void load_special_ids(tokenizer::state& s, const std::filesystem::path& dir);

} // namespace refit::tokenizer
