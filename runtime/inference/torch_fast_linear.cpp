// The bf16 engine's dense projections (torch_fast_forward.hpp): x [m, k] . w [n, k]^T by the
// dense GEMV, the tensor-core kernel's dense mode or cuBLAS, with a bf16 or an fp32 output.
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

void fast_rank_forward::allocate_skinny() {
#if defined(REFIT_TORCH_CUDA)
  if (!fused_ || skinny_max_rows_ == 0 || layers_.empty())
    return;
  std::size_t floats = 0;
  std::int64_t tiles = 0;
  const layer_tensors& l = layers_.front();
  for (const at::Tensor* w : {&l.qkv, &l.o, &l.router}) {
    const auto n = static_cast<int>(w->size(0)), k = static_cast<int>(w->size(1));
    const int ks = kernels::skinny_gemm_ksplit(1, n, k, static_cast<int>(skinny_ksplit_));
    floats = std::max(floats, kernels::skinny_gemm_workspace_floats(n, ks));
    tiles = std::max<std::int64_t>(tiles, n / 64);
  }
  if (floats > 0) {
    skinny_workspace_ = at::empty({static_cast<std::int64_t>(floats)}, f32_);
    skinny_counters_ = at::zeros({tiles}, i64_.dtype(at::kInt));
  }
#endif
}

at::Tensor fast_rank_forward::skinny(const at::Tensor& x, const at::Tensor& w, bool f32,
                                     std::int64_t min_rows, const at::Tensor& x_lo) const {
#if defined(REFIT_TORCH_CUDA)
  if (!fused_ || x.dim() != 2 || w.dim() != 2 || x.size(1) != w.size(1) || x.size(0) <= min_rows
      || x.size(0) > skinny_max_rows_ || !streamable(x) || !streamable(w)
      || (x_lo.defined() && (!streamable(x_lo) || x_lo.sizes() != x.sizes())))
    return {};
  kernels::skinny_gemm_args a;
  a.m = static_cast<int>(x.size(0));
  a.n = static_cast<int>(w.size(0));
  a.k = static_cast<int>(x.size(1));
  const int ks = kernels::skinny_gemm_ksplit(a.m, a.n, a.k, static_cast<int>(skinny_ksplit_));
  if (ks == 0 || (ks > 1 && (!skinny_workspace_.defined()
                             || static_cast<std::size_t>(skinny_workspace_.numel())
                                  < kernels::skinny_gemm_workspace_floats(a.n, ks)
                             || skinny_counters_.numel() < a.n / 64)))
    return {};
  at::Tensor y = at::empty({x.size(0), w.size(0)}, f32 ? f32_ : bf_);
  a.x = x.data_ptr();
  a.x_lo = x_lo.defined() ? x_lo.data_ptr() : nullptr;
  a.w = w.data_ptr();
  a.y = y.data_ptr();
  a.y_f32 = f32;
  if (ks > 1) {
    a.workspace = skinny_workspace_.data_ptr<float>();
    a.workspace_floats = static_cast<std::size_t>(skinny_workspace_.numel());
    a.counters = skinny_counters_.data_ptr<int>();
  }
  kernels::skinny_gemm(a, ks, stream());
  return y;
#else
  (void)x, (void)w, (void)f32, (void)min_rows, (void)x_lo;
  return {};
#endif
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
  if (at::Tensor y = skinny(x, w, false, dense_mma_max_rows_); y.defined())
    return y;
  return at::matmul(x, w.t());
}

at::Tensor fast_rank_forward::linear_f32(const at::Tensor& x, const at::Tensor& w,
                                         std::int64_t max_mma_rows) const {
  if (at::Tensor y = dense_mma(x, w, true, max_mma_rows); y.defined())
    return y;
  if (at::Tensor y = skinny(x, w, true, max_mma_rows < 0 ? dense_mma_max_rows_ : max_mma_rows);
      y.defined())
    return y;
#if defined(REFIT_HAVE_MM_DTYPE)
  if (x.is_cuda() && x.scalar_type() == at::kBFloat16)
    return at::mm(x, w.t(), at::kFloat);
#endif
  return at::matmul(x.to(at::kFloat), w.to(at::kFloat).t());
}

} // namespace refit::inference::bf16
