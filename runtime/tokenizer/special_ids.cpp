// Stop / pad / bos ids from generation_config.json and tokenizer_config.json.
#include <cstdint>
#include <algorithm>

#include "runtime/tokenizer/state.hpp"

namespace refit::tokenizer {

namespace {

std::optional<nlohmann::json> read_optional(const std::filesystem::path& p, std::string& name) {
  name = p.string();
  std::error_code ec;
  if (!std::filesystem::exists(p, ec))
    return std::nullopt;
  return parse_json(read_regular_file(p, max_config_json_bytes), name);
}

std::int32_t token_id(const tokenizer::state& s, const json_node& where) {
  const std::string* content = nullptr;
  if (where.is_string())
    content = &where.str();
  else if (where.is_object())
    content = &where.at("content").str();
  else
    where.fail("expected a token string or {\"content\": ...}");
  auto a = s.added_by_content.find(*content);
  if (a != s.added_by_content.end())
    return a->second;
  auto v = s.model.vocab().find(*content);
  if (v != s.model.vocab().end())
    return v->second;
  where.fail("token '" + *content + "' is not in tokenizer.json");
}

void add_stop(tokenizer::state& s, std::int32_t id) {
  if (std::find(s.stop_ids.begin(), s.stop_ids.end(), id) == s.stop_ids.end())
    s.stop_ids.push_back(id);
}

std::int32_t checked_id(const tokenizer::state& s, const json_node& n) {
  auto id = n.integer();
  if (id < 0 || id >= static_cast<std::int64_t>(s.vocab_size))
    n.fail("token id " + std::to_string(id) + " outside the vocabulary (size " +
           std::to_string(s.vocab_size) + ")");
  return static_cast<std::int32_t>(id);
}

} // namespace

void load_special_ids(tokenizer::state& s, const std::filesystem::path& dir) {
  std::string gname, tname;
  if (auto gen = read_optional(dir / "generation_config.json", gname)) {
    json_node root(*gen, "", gname);
    if (!root.is_object())
      root.fail("expected a JSON object at the top level");
    if (auto eos = root.find("eos_token_id")) {
      if (eos->is_array())
        for (std::size_t i = 0; i < eos->size(); ++i)
          add_stop(s, checked_id(s, eos->at(i)));
      else
        add_stop(s, checked_id(s, *eos));
    }
    if (auto pad = root.find("pad_token_id"))
      s.pad_id = checked_id(s, *pad);
    if (auto bos = root.find("bos_token_id"))
      s.bos_id = checked_id(s, *bos);
  }
  if (auto cfg = read_optional(dir / "tokenizer_config.json", tname)) {
    json_node root(*cfg, "", tname);
    if (!root.is_object())
      root.fail("expected a JSON object at the top level");
    if (auto eos = root.find("eos_token"))
      add_stop(s, token_id(s, *eos));
    // tokenizer_config's pad / bos name the tokenizer's own choice and win over the model's.
    if (auto pad = root.find("pad_token"))
      s.pad_id = token_id(s, *pad);
    if (auto bos = root.find("bos_token"))
      s.bos_id = token_id(s, *bos);
  }
}

} // namespace refit::tokenizer
