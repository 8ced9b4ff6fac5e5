// SHA-256 helpers (OpenSSL libcrypto) for manifests, receipts and the byte-exact verifier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace refit::model {

// splitmix64's increment and output function: the counter-based mixing behind synthetic
// weights and sampling streams.
inline constexpr std::uint64_t golden_gamma = 0x9e3779b97f4a7c15ull;
inline constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Lowercase hex SHA-256 of `n` bytes at `data`.
std::string sha256_hex(const void* data, std::size_t n);

} // namespace refit::model
