// The bf16 engine's dense projections (torch_fast_forward.hpp): x [m, k] . w [n, k]^T by the
// dense GEMV, the tensor-core kernel's dense mode, the preloading GEMM or cuBLAS, with a bf16 or
// an fp32 output.
#include "runtime/inference/torch_fast_forward.hpp"

namespace refit::inference::bf16 {

bool streamable(const at::Tensor& t) {
  return t.is_contiguous() && t.scalar_type() == at::kBFloat16
         && reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
}

#if defined(REFIT_TORCH_CUDA)
kernels::expert_mma_args fast_rank_forward::tuned_mma_args() const {
  kernels::expert_mma_args a;
  a.max_chunks = static_cast<int>(mma_chunks_);
  a.evict_first = mma_evict_first_ != 0;
  a.stages = static_cast<int>(mma_stages_);
  a.early = mma_early_ != 0;
  a.line_copies = mma_line_copies_ != 0;
  return a;
}
#endif

// The dense mode of the tensor-core kernel for x [m, k] . w [n, k]^T, bf16 or fp32 out (every
// weight row streamed once); undefined when it is off or does not fit the shape.
at::Tensor fast_rank_forward::dense_mma(const at::Tensor& x, const at::Tensor& w, bool f32,
                                        std::int64_t max_rows) const {
#if defined(REFIT_TORCH_CUDA)
  if (fused_ && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && streamable(x)
      && streamable(w) && x.size(0) <= (max_rows < 0 ? dense_mma_max_rows_ : max_rows)) {
    kernels::expert_mma_args a = tuned_mma_args();
    a.x = x.data_ptr();
    a.w = w.data_ptr();
    a.rows = static_cast<int>(w.size(0));
    a.k = static_cast<int>(x.size(1));
    a.y_f32 = f32;
    const auto m = static_cast<int>(x.size(0));
    if (const int ks = kernels::dense_mma_ksplit(a, m, 0); ks > 0) {
      at::Tensor y = at::empty({x.size(0), w.size(0)}, f32 ? f32_ : bf_);
      a.y = y.data_ptr();
      kernels::dense_mma(a, m, ks, stream());
      return y;
    }
  }
#endif
  (void)x, (void)w, (void)f32, (void)max_rows;
  return {};
}

at::Tensor fast_rank_forward::preload_linear(const at::Tensor& x, const at::Tensor& w, bool f32,
                                             bool two_parts) const {
#if defined(REFIT_TORCH_CUDA)
  const std::int64_t rows = x.dim() == 2 ? x.size(0) / (two_parts ? 2 : 1) : 0;
  if (fused_ && preload_gemm_ >= (two_parts ? 2 : 1) && x.dim() == 2 && w.dim() == 2
      && x.size(1) == w.size(1) && (!two_parts || x.size(0) % 2 == 0)
      && rows > dense_mma_max_rows_ && streamable(x) && streamable(w)) {
    const auto m = static_cast<int>(rows);
    const kernels::preload_gemm_plan plan = kernels::plan_preload_gemm(
      m, static_cast<int>(w.size(0)), static_cast<int>(w.size(1)), two_parts);
    if (plan.shape >= 0) {
      at::Tensor y = at::empty({rows, w.size(0)}, f32 ? f32_ : bf_);
      kernels::preload_gemm_args a;
      a.x = x.data_ptr();
      // The low rows follow the high ones: x is contiguous (streamable) and each part starts 16-byte
      // aligned (a plan's k is a multiple of 128).
      a.x_lo = two_parts ? static_cast<const std::byte*>(x.data_ptr()) + rows * x.size(1) * 2
                         : nullptr;
      a.w = w.data_ptr();
      a.y = y.data_ptr();
      a.m = m;
      a.n = static_cast<int>(w.size(0));
      a.k = static_cast<int>(w.size(1));
      a.y_f32 = f32;
      kernels::preload_gemm(a, plan, stream());
      ++preload_gemms_;
      return y;
    }
  }
#endif
  (void)x, (void)w, (void)f32, (void)two_parts;
  return {};
}

// x [m, k] . w [n, k]^T: up to dense_gemv_max_rows_ (<= 8) rows the dense GEMV, up to
// dense_mma_max_rows_ the tensor-core kernel, else the ATen GEMM (cuBLAS).
at::Tensor fast_rank_forward::linear(const at::Tensor& x, const at::Tensor& w) const {
#if defined(REFIT_TORCH_CUDA)
  if (fused_ && x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && streamable(x)
      && streamable(w) && x.size(0) <= dense_gemv_max_rows_
      && kernels::dense_gemv_supported(x.size(0), x.size(1))) {
    at::Tensor y = at::empty({x.size(0), w.size(0)}, bf_);
    kernels::dense_gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), static_cast<int>(x.size(0)),
                        static_cast<int>(w.size(0)), static_cast<int>(x.size(1)), stream());
    return y;
  }
#endif
  if (at::Tensor y = dense_mma(x, w, false); y.defined())
    return y;
  if (at::Tensor y = preload_linear(x, w, false); y.defined())
    return y;
  return at::matmul(x, w.t());
}

at::Tensor fast_rank_forward::linear_f32(const at::Tensor& x, const at::Tensor& w,
                                         std::int64_t max_mma_rows) const {
  if (at::Tensor y = dense_mma(x, w, true, max_mma_rows); y.defined())
    return y;
  if (at::Tensor y = preload_linear(x, w, true); y.defined())
    return y;
#if defined(REFIT_HAVE_MM_DTYPE)
  if (x.is_cuda() && x.scalar_type() == at::kBFloat16)
    return at::mm(x, w.t(), at::kFloat);
#endif
  return at::matmul(x.to(at::kFloat), w.to(at::kFloat).t());
}

} // namespace refit::inference::bf16
