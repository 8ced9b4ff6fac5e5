// Digests: SHA-256 (OpenSSL libcrypto) for structural manifests, and the element digest
// ("elemsum64") of resident tensors that receipts carry and the byte-exact verifier checks.
// The mixing functions are usable from CUDA device code (the GPU build computes the same
// digests on the device).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define REFIT_HD __host__ __device__
#else
#define REFIT_HD
#endif

namespace refit::model {

// splitmix64's increment and output function: the counter-based mixing behind synthetic
// weights and sampling streams.
inline constexpr std::uint64_t golden_gamma = 0x9e3779b97f4a7c15ull;
REFIT_HD inline constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Lowercase hex SHA-256 of `n` bytes at `data`.
std::string sha256_hex(const void* data, std::size_t n);

// Element digest of a tensor of `n` elements e_0..e_{n-1} (raw bits, 16 or 32 wide):
//   D = sum over i of element_term(i, bits(e_i))   (mod 2^64)
// mix64 is a bijection, so for a fixed index the term is injective in the element's bits:
// changing any single element always changes D, and any other corruption survives with
// probability about 2^-64. Being a sum, D can be computed in parallel and in any order (one
// reduction on a GPU) and predicted from a layout without building the tensor: the verifier
// adds element_term(i, b) - element_term(i, 0) for every element a publication writes to the
// digest of an all-zero tensor.
REFIT_HD inline constexpr std::uint64_t element_term(std::uint64_t index, std::uint32_t bits) {
  return mix64((index << 32) ^ bits);
}
// D of `nbytes` at `data`, elements of `element_size` (2 or 4) bytes; throws
// std::invalid_argument for another element size or a size that is not a multiple of it.
std::uint64_t element_digest(const void* data, std::uint64_t nbytes, std::size_t element_size);
// D of `n` zero elements.
std::uint64_t zero_digest(std::uint64_t n);
// 16 lowercase hex digits.
std::string digest_hex(std::uint64_t digest);

} // namespace refit::model
