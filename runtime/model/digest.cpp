#include "runtime/model/digest.hpp"

#include <cstring>
#include <stdexcept>

#include <openssl/evp.h>

namespace refit::model {

std::string sha256_hex(const void* data, std::size_t n) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data, n, digest, &len, EVP_sha256(), nullptr);
  static const char* hex = "0123456789abcdef";
  std::string out(2 * len, '0');
  for (unsigned int i = 0; i < len; ++i) {
    out[2 * i] = hex[digest[i] >> 4];
    out[2 * i + 1] = hex[digest[i] & 0xf];
  }
  return out;
}

namespace {

template <class Bits>
std::uint64_t digest_of(const unsigned char* p, std::uint64_t n) {
  std::uint64_t sum = 0;
  for (std::uint64_t i = 0; i < n; ++i) {
    Bits b;
    std::memcpy(&b, p + i * sizeof(Bits), sizeof(Bits));
    sum += element_term(i, b);
  }
  return sum;
}

} // namespace

std::uint64_t element_digest(const void* data, std::uint64_t nbytes, std::size_t element_size) {
  if ((element_size != 2 && element_size != 4) || nbytes % element_size != 0)
    throw std::invalid_argument("element digest: " + std::to_string(nbytes) + " bytes are not "
                                "whole elements of " + std::to_string(element_size) + " bytes");
  const auto* p = static_cast<const unsigned char*>(data);
  return element_size == 2 ? digest_of<std::uint16_t>(p, nbytes / 2)
                           : digest_of<std::uint32_t>(p, nbytes / 4);
}

std::uint64_t zero_digest(std::uint64_t n) {
  std::uint64_t sum = 0;
  for (std::uint64_t i = 0; i < n; ++i)
    sum += element_term(i, 0);
  return sum;
}

std::string digest_hex(std::uint64_t digest) {
  static const char* hex = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, digest >>= 4)
    out[static_cast<std::size_t>(i)] = hex[digest & 0xf];
  return out;
}

} // namespace refit::model
