// Host-side launchers of runtime/cuda/kernels.cu (internal to runtime/cuda). Streams are
// cudaStream_t passed as void*; every pointer argument is device memory. Launches are
// asynchronous; a launch failure throws launch_error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "runtime/cuda/cuda.hpp"

namespace refit::cuda::kernels {

struct launch_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Work per block: a copy descriptor is split into units of this many bytes, a digest or
// expected-digest descriptor into units of this many elements.
inline constexpr std::uint64_t copy_unit_bytes = 64 * 1024;
inline constexpr std::uint64_t digest_unit_elements = 64 * 1024;

// One placement of a canonical tensor into a resident tensor, in elements, for the verifier.
struct expect_desc {
  std::uint32_t resident = 0;     // index of the resident tensor (digest slot)
  std::uint32_t element_size = 2; // 2 (bfloat16) or 4 (float32)
  std::uint32_t is_norm = 0;
  std::uint32_t nbases = 1;       // step + 1
  std::uint64_t bases_offset = 0; // into the bases array
  std::uint64_t src_element = 0;  // canonical element index of row 0
  std::uint64_t src_stride = 0;   // elements between rows in the canonical tensor
  std::uint64_t dst_element = 0;  // resident element index of row 0
  std::uint64_t dst_stride = 0;
  std::uint64_t row_elements = 0;
  std::uint64_t rows = 0;
};

// `block_start` (n + 1 entries) is the prefix sum of each descriptor's units; `blocks` its last.
void copy_batch(void* stream, const copy_desc* descs, const std::uint64_t* block_start,
                std::uint32_t n, std::uint64_t blocks);
// Adds each descriptor's digest to out[i] (zero it first).
void digests(void* stream, const digest_desc* descs, const std::uint64_t* block_start,
             std::uint32_t n, std::uint64_t blocks, std::uint64_t* out);
void fill(void* stream, std::byte* out, std::uint64_t begin, std::uint64_t count,
          const std::uint64_t* bases, std::uint32_t nbases, bool is_norm, float init_scale,
          float lr, std::uint32_t element_size);
void step(void* stream, std::byte* inout, std::uint64_t begin, std::uint64_t count,
          std::uint64_t base, float lr, std::uint32_t element_size);
// Adds element_term(dst, bits) - element_term(dst, 0) of every element of device memory the
// descriptors place to out[resident].
void placed(void* stream, const placed_desc* descs, const std::uint64_t* block_start,
            std::uint32_t n, std::uint64_t blocks, std::uint64_t* out);
// Adds element_term(dst, value) - element_term(dst, 0) of every placed element to
// out[resident]; add the zero digest of each resident tensor separately.
void expected(void* stream, const expect_desc* descs, const std::uint64_t* block_start,
              std::uint32_t n, std::uint64_t blocks, const std::uint64_t* bases, float init_scale,
              float lr, std::uint64_t* out);

} // namespace refit::cuda::kernels
