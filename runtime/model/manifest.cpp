#include "runtime/model/manifest.hpp"

#include <openssl/evp.h>

namespace refit::model {

namespace {

void put_u64(std::string& buf, std::uint64_t v) {
  for (int i = 0; i < 8; ++i)
    buf.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
}

void put_str(std::string& buf, const std::string& s) {
  put_u64(buf, s.size());
  buf += s;
}

} // namespace

struct manifest_stream::context {
  EVP_MD_CTX* md = EVP_MD_CTX_new();
  bool done = false;
  ~context() { EVP_MD_CTX_free(md); }
};

// Canonical encoding: a versioned tag, the entry count, then per entry every field
// length-prefixed (strings) or fixed-width little-endian (integers), so distinct streams never
// encode to the same bytes.
manifest_stream::manifest_stream(std::uint64_t expected_count)
  : ctx_(std::make_unique<context>()), expected_(expected_count) {
  if (!ctx_->md || EVP_DigestInit_ex(ctx_->md, EVP_sha256(), nullptr) != 1)
    throw model_error("manifest", "OpenSSL SHA-256 failed");
  put_str(scratch_, "refit.structural_manifest.v1");
  put_u64(scratch_, expected_count);
  update(scratch_);
}

manifest_stream::~manifest_stream() = default;

void manifest_stream::update(const std::string& bytes) {
  if (EVP_DigestUpdate(ctx_->md, bytes.data(), bytes.size()) != 1)
    throw model_error("manifest", "OpenSSL SHA-256 failed");
}

void manifest_stream::add(const param_meta& p) {
  if (ctx_->done)
    throw model_error("manifest", "a tensor added after the manifest was finished");
  scratch_.clear();
  put_str(scratch_, p.name);
  put_u64(scratch_, p.shape.size());
  for (auto d : p.shape)
    put_u64(scratch_, static_cast<std::uint64_t>(d));
  put_str(scratch_, dtype_name(p.dt));
  put_u64(scratch_, p.numel());
  put_u64(scratch_, p.nbytes());
  update(scratch_);
  ++added_;
}

std::optional<std::string> manifest_stream::finish() {
  if (ctx_->done)
    throw model_error("manifest", "the manifest was already finished");
  ctx_->done = true;
  if (added_ != expected_)
    return std::nullopt;
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int digest_len = 0;
  if (EVP_DigestFinal_ex(ctx_->md, digest, &digest_len) != 1)
    throw model_error("manifest", "OpenSSL SHA-256 failed");
  static const char hex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * digest_len);
  for (unsigned int i = 0; i < digest_len; ++i) {
    out.push_back(hex[digest[i] >> 4]);
    out.push_back(hex[digest[i] & 0xfu]);
  }
  return out;
}

std::string structural_manifest(const std::vector<param_meta>& params) {
  manifest_stream stream(params.size());
  for (const auto& p : params)
    stream.add(p);
  return *stream.finish();
}

} // namespace refit::model
