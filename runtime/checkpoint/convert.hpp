// Element conversion between the checkpoint dtypes refit reads (bf16, f16, f32): widening is
// exact, narrowing rounds to nearest even (NaN stays NaN, overflow gives infinity).
#pragma once

#include "runtime/model/qwen3_moe.hpp"

#include <cstddef>
#include <cstdint>

namespace refit::checkpoint {

// Converts `count` elements at `src` (dtype `from`, any alignment) to `to` at `dst`.
void convert_elements(model::dtype from, const std::byte* src, model::dtype to, std::byte* dst,
                      std::uint64_t count);

} // namespace refit::checkpoint
