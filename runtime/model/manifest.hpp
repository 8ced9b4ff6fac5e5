// The structural manifest (model::structural_manifest, qwen3_moe.hpp) computed as tensors are
// emitted: a trainer rank hashes each chunk's tensors while the chunk's bytes are copied, so the
// manifest phase after the last chunk only finalizes the hash.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "runtime/model/qwen3_moe.hpp"

namespace refit::model {

class manifest_stream {
public:
  // The encoding starts with the entry count, so the stream is hashed for `expected_count`
  // entries; finish() is structural_manifest(added) only if that many were added.
  explicit manifest_stream(std::uint64_t expected_count);
  ~manifest_stream();
  manifest_stream(const manifest_stream&) = delete;
  manifest_stream& operator=(const manifest_stream&) = delete;

  void add(const param_meta& p);
  std::uint64_t count() const { return added_; }
  // The hex SHA-256, or nullopt when count() differs from expected_count (the caller hashes
  // the tensors it actually emitted with structural_manifest). Once only; throws model_error
  // when OpenSSL fails.
  std::optional<std::string> finish();

private:
  struct context;
  std::unique_ptr<context> ctx_;
  std::uint64_t expected_ = 0;
  std::uint64_t added_ = 0;
  std::string scratch_;
  void update(const std::string& bytes);
};

} // namespace refit::model
