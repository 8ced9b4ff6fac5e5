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

// The same in two halves: the draws enqueued on the current stream, [D, 2] double (token,
// logprob) on the logits' device, nothing waited for; then their copy to the host (which
// synchronizes with that stream).
at::Tensor sample_on_device_async(const at::Tensor& logits, const sampling_config& params,
                                  const at::Tensor& rows, const at::Tensor& uniforms,
                                  bool fused_kernel = false);
device_samples take_samples(const at::Tensor& packed_on_device);

} // namespace refit::inference
