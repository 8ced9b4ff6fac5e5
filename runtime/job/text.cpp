#include "runtime/job/text.hpp"

#include <filesystem>

#include "runtime/inference/tokenizer.hpp"
#include "runtime/tokenizer/tokenizer.hpp"

namespace refit::job {

struct text_codec::impl {
  std::optional<tokenizer::tokenizer> tok; // empty: byte-level
};

text_codec::text_codec(const config::refit_config& cfg) : impl_(std::make_unique<impl>()) {
  if (cfg.model_path.empty()) {
    name_ = "byte-level";
    return;
  }
  impl_->tok = tokenizer::tokenizer::load(cfg.model_path);
  name_ = (std::filesystem::path(cfg.model_path) / "tokenizer.json").string();
  stop_ids_ = impl_->tok->stop_ids();
}

text_codec::~text_codec() = default;
text_codec::text_codec(text_codec&&) noexcept = default;
text_codec& text_codec::operator=(text_codec&&) noexcept = default;

std::vector<std::int32_t> text_codec::encode(const std::string& text) const {
  if (!impl_->tok)
    return inference::byte_tokenizer::encode(text);
  return impl_->tok->encode(text);
}

std::string text_codec::decode(const std::vector<std::int32_t>& ids) const {
  if (!impl_->tok)
    return inference::byte_tokenizer::decode(ids);
  // The model's vocab_size is padded past the tokenizer's ids (2112 vs 2051 for tiny-kjv); a
  // sample may hold such an id. HF's decode drops ids it does not know; so does the job.
  std::vector<std::int32_t> known;
  known.reserve(ids.size());
  for (auto id : ids)
    if (impl_->tok->id_to_token(id))
      known.push_back(id);
  return impl_->tok->decode(known, /*skip_special=*/true);
}

} // namespace refit::job
