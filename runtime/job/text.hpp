// Text in and out of the main job: the model's own tokenizer (tokenizer.json of model.path),
// or, for recipes with synthetic weights, the byte-level demo tokenizer (vocab 256).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/config/config.hpp"

namespace refit::job {

class text_codec {
public:
  // The tokenizer of `cfg`: model.path's tokenizer.json when the recipe has a model
  // directory (its eos ids become stop tokens), else byte-level. Throws naming the file.
  explicit text_codec(const config::refit_config& cfg);
  ~text_codec();
  text_codec(text_codec&&) noexcept;
  text_codec& operator=(text_codec&&) noexcept;

  std::vector<std::int32_t> encode(const std::string& text) const;
  // Special tokens (eos, chat markers) and ids the tokenizer does not have (padding rows of
  // the model's vocab) are left out of the text, as HF's decode(skip_special_tokens) does.
  std::string decode(const std::vector<std::int32_t>& ids) const;
  // Token ids that end a sample ("stop" finish reason).
  const std::vector<std::int32_t>& stop_ids() const { return stop_ids_; }
  // "byte-level" or the tokenizer.json path.
  const std::string& name() const { return name_; }

private:
  struct impl;
  std::unique_ptr<impl> impl_;
  std::vector<std::int32_t> stop_ids_;
  std::string name_;
};

} // namespace refit::job
