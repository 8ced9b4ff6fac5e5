// Encoding and decoding, in HF tokenizers' order: added tokens split out of the raw text,
// normalization, normalized added tokens, the pre-tokenizer steps, BPE per piece.
#include <cstdint>
#include "runtime/tokenizer/tokenizer.hpp"

#include "runtime/tokenizer/byte_level.hpp"
#include "runtime/tokenizer/state.hpp"
#include "runtime/tokenizer/unicode.hpp"

namespace refit::tokenizer {

namespace fs = std::filesystem;

namespace {

void pre_tokenize(const tokenizer::state& s, std::size_t step, std::string_view piece,
                  std::vector<std::int32_t>& out) {
  if (piece.empty())
    return;
  if (step == s.pre.size()) {
    s.model.encode_piece(piece, out);
    return;
  }
  const pre_step& p = s.pre[step];
  auto next = [&](std::string_view sub) { pre_tokenize(s, step + 1, sub, out); };
  if (p.add_prefix_space && piece.front() != ' ') {
    std::string spaced = " " + std::string(piece);
    if (p.regex)
      p.regex->split_isolated(spaced, next);
    else
      next(spaced);
    return;
  }
  if (p.regex)
    p.regex->split_isolated(piece, next);
  else
    next(piece);
}

} // namespace

tokenizer::tokenizer(std::unique_ptr<state> s) : s_(std::move(s)) {}
tokenizer::tokenizer(tokenizer&&) noexcept = default;
tokenizer& tokenizer::operator=(tokenizer&&) noexcept = default;
tokenizer::~tokenizer() = default;

tokenizer tokenizer::load(const fs::path& dir_or_tokenizer_json) {
  std::error_code ec;
  fs::path file = dir_or_tokenizer_json;
  if (fs::is_directory(dir_or_tokenizer_json, ec))
    file = dir_or_tokenizer_json / "tokenizer.json";
  const std::string name = file.string();
  auto doc = parse_json(read_regular_file(file, max_tokenizer_json_bytes), name);
  auto s = build_state(doc, name);
  load_special_ids(*s, file.parent_path().empty() ? fs::path(".") : file.parent_path());
  return tokenizer(std::move(s));
}

tokenizer tokenizer::from_json_bytes(std::string_view bytes, const std::string& name) {
  if (bytes.size() > max_tokenizer_json_bytes)
    throw tokenizer_error(name, "", "over the cap of " + std::to_string(max_tokenizer_json_bytes) +
                                        " bytes");
  return tokenizer(build_state(parse_json(bytes, name), name));
}

std::vector<std::int32_t> tokenizer::encode(std::string_view text) const {
  if (auto bad = unicode::invalid_utf8_offset(text); bad != unicode::npos)
    throw tokenizer_error("", "text", "invalid UTF-8 at byte " + std::to_string(bad));
  const state& s = *s_;
  std::vector<std::int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  s.raw_matcher.split(text, [&](std::string_view raw, const added_token* tok) {
    if (tok) {
      ids.push_back(tok->id);
      return;
    }
    if (raw.empty())
      return;
    std::string normalized;
    std::string_view piece = raw;
    if (s.nfc) {
      normalized = unicode::nfc(raw);
      piece = normalized;
    }
    s.normalized_matcher.split(piece, [&](std::string_view sub, const added_token* ntok) {
      if (ntok)
        ids.push_back(ntok->id);
      else
        pre_tokenize(s, 0, sub, ids);
    });
  });
  return ids;
}

std::string tokenizer::decode(const std::vector<std::int32_t>& ids, bool skip_special) const {
  const state& s = *s_;
  std::vector<const std::string*> tokens;
  tokens.reserve(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    auto id = ids[i];
    if (id < 0 || static_cast<std::uint32_t>(id) >= s.vocab_size ||
        !s.has_token[static_cast<std::size_t>(id)])
      throw tokenizer_error("", "ids[" + std::to_string(i) + "]",
                            "id " + std::to_string(id) + " is not in the vocabulary of " + s.file);
    const std::string& tok = s.id_to_token[static_cast<std::size_t>(id)];
    if (skip_special && s.special_contents.count(tok))
      continue;
    tokens.push_back(&tok);
  }
  std::string out;
  if (s.decoder == decoder_kind::none) {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (i)
        out.push_back(' ');
      out += *tokens[i];
    }
    return out;
  }
  std::string bytes;
  const auto& alphabet = byte_level_alphabet::get();
  for (const auto* t : tokens)
    if (!alphabet.decode_token(*t, bytes))
      bytes += *t;
  return unicode::from_utf8_lossy(bytes);
}

std::uint32_t tokenizer::vocab_size() const { return s_->vocab_size; }

std::optional<std::int32_t> tokenizer::token_to_id(std::string_view token) const {
  std::string key(token);
  if (auto a = s_->added_by_content.find(key); a != s_->added_by_content.end())
    return a->second;
  if (auto v = s_->model.vocab().find(key); v != s_->model.vocab().end())
    return v->second;
  return std::nullopt;
}

std::optional<std::string> tokenizer::id_to_token(std::int32_t id) const {
  if (id < 0 || static_cast<std::uint32_t>(id) >= s_->vocab_size ||
      !s_->has_token[static_cast<std::size_t>(id)])
    return std::nullopt;
  return s_->id_to_token[static_cast<std::size_t>(id)];
}

bool tokenizer::is_special(std::int32_t id) const {
  auto t = id_to_token(id);
  return t && s_->special_contents.count(*t);
}

const std::vector<std::int32_t>& tokenizer::stop_ids() const { return s_->stop_ids; }
std::optional<std::int32_t> tokenizer::eos_id() const {
  if (s_->stop_ids.empty())
    return std::nullopt;
  return s_->stop_ids.front();
}
std::optional<std::int32_t> tokenizer::pad_id() const { return s_->pad_id; }
std::optional<std::int32_t> tokenizer::bos_id() const { return s_->bos_id; }
const std::string& tokenizer::source() const { return s_->file; }

} // namespace refit::tokenizer
