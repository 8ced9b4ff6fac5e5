// Device-side sampling of the bf16 engine (LibTorch; only torch_*.cpp of the module include it).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "runtime/inference/sampling.hpp"

namespace refit::inference {

struct device_samples {
  std::vector<std::int32_t> tokens;
  std::vector<float> logprobs;
};

// logits: [R, V] fp32 on any device; rows: [D] long, the logits row of each draw; uniforms:
// [D] double on the logits' device (sampling_uniform of each draw; ignored when greedy).
// fused_kernel: on a CUDA build and device, draws without top-k / top-p take the fused sampler
// (kernels::sample_plain, two kernels) instead of the ATen chain; the same arithmetic, its
// sums in another fixed order.
device_samples sample_on_device(const at::Tensor& logits, const sampling_config& params,
                                const at::Tensor& rows, const at::Tensor& uniforms,
                                bool fused_kernel = false);

} // namespace refit::inference
