// tokenizer.json -> tokenizer::state: each section is read, and refused by name when it asks
// for something not implemented.
#include <cstdint>
#include <algorithm>

#include "runtime/tokenizer/byte_level.hpp"
#include "runtime/tokenizer/state.hpp"
#include "runtime/tokenizer/unicode.hpp"

namespace refit::tokenizer {

namespace {

// GPT-2's pre-tokenizer pattern (HF ByteLevel with use_regex: true).
constexpr const char* gpt2_pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Normalizers: NFC, Sequence of them, null. Returns whether NFC applies.
bool read_normalizer(const json_node& n) {
  if (n.is_null())
    return false;
  const auto& type = n.at("type").str();
  if (type == "NFC")
    return true;
  if (type == "Sequence") {
    auto list = n.at("normalizers");
    bool nfc = false;
    for (std::size_t i = 0; i < list.size(); ++i)
      nfc = read_normalizer(list.at(i)) || nfc; // NFC is idempotent: any number is one
    return nfc;
  }
  n.at("type").fail("unsupported normalizer type '" + type + "' in tokenizer.json");
}

void read_byte_level(const json_node& n, std::vector<pre_step>& out) {
  pre_step step;
  step.byte_level = true;
  step.add_prefix_space = n.flag("add_prefix_space", true);
  (void)n.flag("trim_offsets", true); // offsets only
  if (n.flag("use_regex", true))
    step.regex = std::make_unique<split_regex>(gpt2_pattern, false, n.file(), n.path());
  out.push_back(std::move(step));
}

void read_split(const json_node& n, std::vector<pre_step>& out) {
  const auto& behavior = n.at("behavior").str();
  if (behavior != "Isolated")
    n.at("behavior").fail("unsupported Split behavior '" + behavior + "' (only Isolated)");
  if (n.flag("invert", false))
    n.at("invert").fail("unsupported Split invert: true");
  auto pattern = n.at("pattern");
  pre_step step;
  if (auto re = pattern.find("Regex"))
    step.regex = std::make_unique<split_regex>(re->str(), false, n.file(), re->path());
  else if (auto lit = pattern.find("String"))
    step.regex = std::make_unique<split_regex>(lit->str(), true, n.file(), lit->path());
  else
    pattern.fail("expected {\"Regex\": ...} or {\"String\": ...}");
  out.push_back(std::move(step));
}

void read_pre_step(const json_node& n, std::vector<pre_step>& out) {
  const auto& type = n.at("type").str();
  if (type == "Split")
    read_split(n, out);
  else if (type == "ByteLevel")
    read_byte_level(n, out);
  else if (type == "Sequence") {
    auto list = n.at("pretokenizers");
    for (std::size_t i = 0; i < list.size(); ++i)
      read_pre_step(list.at(i), out);
  } else {
    n.at("type").fail("unsupported pre_tokenizer type '" + type + "' in tokenizer.json");
  }
}

std::vector<pre_step> read_pre_tokenizer(const json_node& n) {
  if (n.is_null())
    n.fail("a null pre_tokenizer is not supported (byte-level BPE needs ByteLevel)");
  std::vector<pre_step> steps;
  read_pre_step(n, steps);
  auto bl = std::count_if(steps.begin(), steps.end(), [](const pre_step& s) { return s.byte_level; });
  if (bl != 1 || !steps.back().byte_level)
    n.fail("unsupported pre_tokenizer: exactly one ByteLevel, as the last step, is required");
  return steps;
}

decoder_kind read_decoder(const json_node& n) {
  if (n.is_null())
    return decoder_kind::none;
  const auto& type = n.at("type").str();
  if (type != "ByteLevel")
    n.at("type").fail("unsupported decoder type '" + type + "' in tokenizer.json");
  return decoder_kind::byte_level;
}

void read_post_processor(const json_node& n) {
  if (n.is_null())
    return;
  const auto& type = n.at("type").str();
  if (type != "ByteLevel") // ByteLevel only adjusts offsets
    n.at("type").fail("unsupported post_processor type '" + type + "' in tokenizer.json");
}

void read_added_tokens(const json_node& list, tokenizer::state& s) {
  if (!list.is_array())
    list.fail("expected an array");
  for (std::size_t i = 0; i < list.size(); ++i) {
    auto n = list.at(i);
    auto t = std::make_unique<added_token>();
    auto idn = n.at("id");
    auto id = idn.integer();
    if (id < 0 || id > max_token_id)
      idn.fail("token id out of range: " + std::to_string(id));
    t->id = static_cast<std::int32_t>(id);
    t->content = n.at("content").str();
    if (t->content.empty())
      n.at("content").fail("empty added token");
    if (unicode::invalid_utf8_offset(t->content) != unicode::npos)
      n.at("content").fail("added token is not valid UTF-8");
    t->special = n.flag("special", false);
    t->normalized = n.flag("normalized", true);
    t->lstrip = n.flag("lstrip", false);
    t->rstrip = n.flag("rstrip", false);
    t->single_word = n.flag("single_word", false);
    auto in_vocab = s.model.vocab().find(t->content);
    if (in_vocab != s.model.vocab().end() && in_vocab->second != t->id)
      idn.fail("added token '" + t->content + "' has id " + std::to_string(t->id) +
               " but model.vocab gives it " + std::to_string(in_vocab->second));
    if (s.added_by_content.count(t->content))
      n.at("content").fail("added token '" + t->content + "' appears twice");
    if (s.added_by_id.count(t->id))
      idn.fail("id " + std::to_string(t->id) + " is used by two added tokens");
    s.added_by_content.emplace(t->content, t->id);
    s.added_by_id.emplace(t->id, t.get());
    if (t->special)
      s.special_contents.insert(t->content);
    s.added.push_back(std::move(t));
  }
  // HF builds the matchers from the special tokens first, then the others, each in file order.
  for (int pass = 0; pass < 2; ++pass)
    for (const auto& t : s.added) {
      if (t->special != (pass == 0))
        continue;
      if (t->normalized)
        s.normalized_matcher.add(s.nfc ? unicode::nfc(t->content) : t->content, t.get());
      else
        s.raw_matcher.add(t->content, t.get());
    }
}

void refuse_if_set(const json_node& root, const char* key) {
  if (auto n = root.find(key))
    n->fail(std::string("unsupported ") + key + " (must be null)");
}

} // namespace

std::unique_ptr<tokenizer::state> build_state(const nlohmann::json& doc, const std::string& file) {
  json_node root(doc, "", file);
  if (!root.is_object())
    root.fail("expected a JSON object at the top level");
  refuse_if_set(root, "truncation");
  refuse_if_set(root, "padding");
  auto s = std::make_unique<tokenizer::state>(bpe_model(root.at("model")));
  s->file = file;
  s->nfc = read_normalizer(root.at("normalizer"));
  s->pre = read_pre_tokenizer(root.at("pre_tokenizer"));
  s->decoder = read_decoder(root.at("decoder"));
  if (root.has("post_processor"))
    read_post_processor(root.at("post_processor"));
  if (root.has("added_tokens"))
    read_added_tokens(root.at("added_tokens"), *s);

  std::int32_t max_id = s->model.max_id();
  for (const auto& t : s->added)
    max_id = std::max(max_id, t->id);
  s->vocab_size = static_cast<std::uint32_t>(max_id + 1);
  s->id_to_token.assign(s->vocab_size, std::string());
  s->has_token.assign(s->vocab_size, false);
  for (const auto& [tok, id] : s->model.vocab()) {
    s->id_to_token[static_cast<std::size_t>(id)] = tok;
    s->has_token[static_cast<std::size_t>(id)] = true;
  }
  for (const auto& t : s->added) { // added tokens win on decode, as in HF
    s->id_to_token[static_cast<std::size_t>(t->id)] = t->content;
    s->has_token[static_cast<std::size_t>(t->id)] = true;
  }
  return s;
}

} // namespace refit::tokenizer
