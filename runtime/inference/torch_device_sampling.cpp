// Token sampling on the device (the bf16 engine): the semantics of sampling.hpp computed
// with ATen ops over the logits where they were produced (without top-k / top-p, on a GPU of
// the fused engine, two kernels: kernels::sample_plain), so only the sampled tokens and their
// log-probabilities cross to the host (one synchronization per step).
//
// The arithmetic follows process_logits/sample_token: z = logits / T in double, z - max(z),
// top-k by a stable descending sort (ties: lower id first), the top-p nucleus as the shortest
// prefix whose cumulative renormalized probability reaches top_p, then the inverse CDF of the
// uniform u of the draw over the kept tokens (in id order without filters, in descending order
// with them). Sums run as device scans, so a token whose cumulative probability lies within
// rounding of u can differ from the host sampler; run to run the result is fixed.
#include "runtime/inference/torch_device_sampling.hpp"

#include <stdexcept>

#if defined(REFIT_TORCH_CUDA)
#include <c10/cuda/CUDAStream.h>

#include "runtime/inference/torch_kernels.hpp"
#endif

namespace refit::inference {

at::Tensor sample_on_device_async(const at::Tensor& logits, const sampling_config& params,
                                  const at::Tensor& rows, const at::Tensor& uniforms,
                                  [[maybe_unused]] bool fused_kernel) {
  const std::int64_t vocab = logits.size(1);
  const double inv_t =
    params.temperature == 0.0f ? 1.0 : 1.0 / static_cast<double>(params.temperature);
  const bool greedy = params.temperature == 0.0f;
  const bool use_top_k = params.top_k > 0 && params.top_k < vocab;
  const bool use_top_p = params.top_p > 0.0f && params.top_p < 1.0f;

  at::Tensor packed; // [D, 2] double on the logits' device: token, logprob
#if defined(REFIT_TORCH_CUDA)
  if (fused_kernel && logits.is_cuda() && !use_top_k && !use_top_p
      && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1
      && (logits.size(0) == 1 || logits.stride(0) >= vocab)) {
    // A single row's stride is arbitrary in PyTorch (any value is valid for a size-1 dim); the
    // kernel checks row_stride >= vocab, so give it the row length there.
    const std::int64_t row_stride = logits.size(0) == 1 ? vocab : logits.stride(0);
    const at::Tensor r = rows.contiguous();
    const at::Tensor u = uniforms.contiguous();
    const int draws = static_cast<int>(r.size(0));
    at::Tensor drawn = at::empty({r.size(0), 2}, logits.options().dtype(at::kDouble));
    // The kernels' per-(draw, part) partial results; from the caching allocator, so this is
    // allowed while a CUDA graph is captured.
    at::Tensor scratch = at::empty(
      {static_cast<std::int64_t>(kernels::sample_plain_scratch_bytes(vocab, draws))},
      logits.options().dtype(at::kByte));
    kernels::sample_plain(logits.data_ptr<float>(), vocab, row_stride,
                          r.data_ptr<std::int64_t>(), greedy ? nullptr : u.data_ptr<double>(),
                          draws, inv_t, greedy, drawn.data_ptr<double>(), scratch.data_ptr(),
                          c10::cuda::getCurrentCUDAStream(logits.device().index()).stream());
    packed = drawn;
  }
#endif
  if (!packed.defined()) {
    at::Tensor z = logits.index_select(0, rows).to(at::kDouble) * inv_t; // [D, V]
    z = z - std::get<0>(z.max(-1, /*keepdim=*/true));
    const at::Tensor u = uniforms.unsqueeze(1);                           // [D, 1] double

    at::Tensor token;
    at::Tensor logprob;
    if (!use_top_k && !use_top_p) {
      const at::Tensor e = z.exp();
      const at::Tensor total = e.sum(-1, /*keepdim=*/true);
      if (greedy) {
        token = z.argmax(-1, /*keepdim=*/true); // first maximum: the lowest id on ties
      } else {
        const at::Tensor cdf = (e / total).cumsum(-1);
        token = (cdf <= u).sum(-1, /*keepdim=*/true).clamp_max(vocab - 1);
      }
      logprob = z.gather(1, token) - total.log();
    } else {
      auto sorted = at::sort(z, /*stable=*/true, /*dim=*/-1, /*descending=*/true);
      const std::int64_t keep = use_top_k ? params.top_k : vocab;
      const at::Tensor sz = std::get<0>(sorted).narrow(1, 0, keep);
      const at::Tensor order = std::get<1>(sorted).narrow(1, 0, keep);
      const at::Tensor se = sz.exp();
      at::Tensor nucleus = at::full({se.size(0), 1}, keep, se.options().dtype(at::kLong));
      if (use_top_p) {
        const at::Tensor cum = (se / se.sum(-1, /*keepdim=*/true)).cumsum(-1);
        nucleus = ((cum < static_cast<double>(params.top_p)).sum(-1, /*keepdim=*/true) + 1)
                    .clamp_max(keep);
      }
      const at::Tensor position = at::arange(keep, se.options().dtype(at::kLong)).unsqueeze(0);
      const at::Tensor kept = se * (position < nucleus).to(at::kDouble);
      const at::Tensor total = kept.sum(-1, /*keepdim=*/true);
      at::Tensor pick;
      if (greedy) {
        pick = at::zeros({se.size(0), 1}, nucleus.options());
      } else {
        const at::Tensor cdf = (kept / total).cumsum(-1);
        pick = at::minimum((cdf <= u).sum(-1, /*keepdim=*/true), nucleus - 1);
      }
      token = order.gather(1, pick);
      logprob = sz.gather(1, pick) - total.log();
    }
    // One transfer: [token, logprob] per draw as doubles (ids < 2^53 are exact).
    packed = at::cat({token.to(at::kDouble), logprob}, 1);
  }
  return packed;
}

device_samples take_samples(const at::Tensor& packed_on_device) {
  const at::Tensor packed = packed_on_device.cpu();
  device_samples out;
  const auto a = packed.accessor<double, 2>();
  out.tokens.resize(static_cast<std::size_t>(packed.size(0)));
  out.logprobs.resize(out.tokens.size());
  for (std::int64_t i = 0; i < packed.size(0); ++i) {
    out.tokens[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(a[i][0]);
    out.logprobs[static_cast<std::size_t>(i)] = static_cast<float>(a[i][1]);
  }
  return out;
}

device_samples sample_on_device(const at::Tensor& logits, const sampling_config& params,
                                const at::Tensor& rows, const at::Tensor& uniforms,
                                bool fused_kernel) {
  return take_samples(sample_on_device_async(logits, params, rows, uniforms, fused_kernel));
}

} // namespace refit::inference
