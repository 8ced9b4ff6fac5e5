#include "runtime/inference/tokenizer.hpp"

namespace refit::inference {

std::vector<std::int32_t> byte_tokenizer::encode(std::string_view text) {
  std::vector<std::int32_t> ids;
  ids.reserve(text.size());
  for (char c : text)
    ids.push_back(static_cast<std::int32_t>(static_cast<unsigned char>(c)));
  return ids;
}

std::string byte_tokenizer::decode(const std::vector<std::int32_t>& ids) {
  std::string text;
  text.reserve(ids.size());
  for (std::int32_t id : ids) {
    if (id >= 0 && id < static_cast<std::int32_t>(vocab_size))
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    else
      text += "\xEF\xBF\xBD";
  }
  return text;
}

} // namespace refit::inference
