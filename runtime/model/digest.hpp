// SHA-256 helpers (OpenSSL libcrypto) for manifests, receipts and the byte-exact verifier.
#pragma once

#include <cstddef>
#include <string>

namespace refit::model {

// Lowercase hex SHA-256 of `n` bytes at `data`.
std::string sha256_hex(const void* data, std::size_t n);

} // namespace refit::model
