// Fused CUDA kernels of the bf16 engine (see torch_kernels.hpp): RMSNorm (alone and fused
// with the residual add), q/k norm + RoPE + KV write, the dense GEMV. Paged decode attention is
// in torch_kernels_attention.cu, the MoE kernels in torch_kernels_moe.cu.
#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_common.cuh"

#include <cmath>

namespace refit::inference::kernels {

using namespace detail;

namespace {

// ---------------------------------------------------------------------------- RMSNorm

// One block per row. Columns by 4 (float4) when n % 4 == 0.
__global__ void rms_norm_kernel(const float* __restrict__ x, const bf16* __restrict__ w,
                                bf16* __restrict__ out, int n, float eps) {
  pdl_enter();
  __shared__ float shared[32];
  const float* row = x + static_cast<i64>(blockIdx.x) * n;
  float ss = 0.0f;
  if ((n & 3) == 0) {
    for (int c = threadIdx.x * 4; c < n; c += blockDim.x * 4) {
      const float4 v = *reinterpret_cast<const float4*>(row + c);
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int c = threadIdx.x; c < n; c += blockDim.x)
      ss += row[c] * row[c];
  }
  norm_row(row, w, out + static_cast<i64>(blockIdx.x) * n, n, eps, ss, shared);
}

// x[r] += y[r] (bf16), then out[r] = RMSNorm(x[r]): the residual add and the next norm.
template <class Y>
__global__ void add_rms_norm_kernel(float* __restrict__ x, const Y* __restrict__ y,
                                    const bf16* __restrict__ w, bf16* __restrict__ out, int n,
                                    float eps, bf16* __restrict__ lo) {
  pdl_enter();
  __shared__ float shared[32];
  float* row = x + static_cast<i64>(blockIdx.x) * n;
  const Y* yr = y + static_cast<i64>(blockIdx.x) * n;
  float ss = 0.0f;
  if ((n & 3) == 0) {
    for (int c = threadIdx.x * 4; c < n; c += blockDim.x * 4) {
      float4 v = *reinterpret_cast<const float4*>(row + c);
      float yv[4];
      if constexpr (sizeof(Y) == 4) {
        const float4 f = *reinterpret_cast<const float4*>(yr + c);
        yv[0] = f.x, yv[1] = f.y, yv[2] = f.z, yv[3] = f.w;
      } else {
        const uint2 u = *reinterpret_cast<const uint2*>(yr + c);
        const bf16* yb = reinterpret_cast<const bf16*>(&u);
        for (int i = 0; i < 4; ++i)
          yv[i] = to_f(yb[i]);
      }
      v.x += yv[0];
      v.y += yv[1];
      v.z += yv[2];
      v.w += yv[3];
      *reinterpret_cast<float4*>(row + c) = v;
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const float v = row[c] + to_f(yr[c]);
      row[c] = v;
      ss += v * v;
    }
  }
  norm_row(row, w, out + static_cast<i64>(blockIdx.x) * n, n, eps, ss, shared,
           lo != nullptr ? lo + static_cast<i64>(blockIdx.x) * n : nullptr);
}

// ------------------------------------------------------- q/k norm + RoPE + KV write

__global__ void qk_kernel(const bf16* qkv, const bf16* q_norm, const bf16* k_norm,
                          const float* cos, const float* sin, const i64* positions,
                          const i64* src_row, const i64* write_block, const i64* write_slot,
                          bf16* q_out, kv_target kv, int hq, int hkv, int d, float eps) {
  pdl_enter();
  __shared__ float shared[32];
  const int i = blockIdx.x;
  const int head = blockIdx.y;
  const int half = d / 2;
  const int t = threadIdx.x;
  const i64 cols = static_cast<i64>(hq + 2 * hkv) * d;
  const bool is_q = head < hq;
  const bool is_k = !is_q && head < hq + hkv;
  const i64 row = is_q ? i : src_row[i];
  const bf16* in = qkv + row * cols + static_cast<i64>(head) * d;
  bf16* cache = static_cast<bf16*>(kv.base);
  const i64 slot_base = write_block[i] * kv.block_elems + kv.layer_offset
                        + write_slot[i] * static_cast<i64>(hkv) * d;
  if (!is_q && !is_k) { // v: a copy into the cache
    bf16* dst = cache + slot_base + kv.part_elems + static_cast<i64>(head - hq - hkv) * d;
    for (int c = t; c < d; c += blockDim.x)
      dst[c] = in[c];
    return;
  }
  float a = 0.0f, b = 0.0f;
  if (t < half) {
    a = to_f(in[t]);
    b = to_f(in[t + half]);
  }
  const float ss = block_sum(a * a + b * b, shared);
  const float r = rsqrtf(ss / static_cast<float>(d) + eps);
  if (t >= half)
    return;
  const bf16* w = is_q ? q_norm : k_norm;
  a = a * r * to_f(w[t]);
  b = b * r * to_f(w[t + half]);
  const i64 p = positions[row];
  const float c = cos[p * half + t];
  const float s = sin[p * half + t];
  const float o1 = a * c - b * s;
  const float o2 = b * c + a * s;
  bf16* dst = is_q ? q_out + (static_cast<i64>(i) * hq + head) * d
                   : cache + slot_base + static_cast<i64>(head - hq) * d;
  dst[t] = to_bf(o1);
  dst[t + half] = to_bf(o2);
}

// --------------------------------------------------------------- dense GEMV

// y [m, n] = x [m, k] . W [n, k]^T for a few rows m: one warp per output row, its weight row in
// registers across the m rows (gemv_row). cuBLAS picks split-K GEMM kernels at these shapes
// (plus a reduction kernel), ~40% of DRAM bandwidth at batch 1 under Nsight Compute.
template <int KC>
__global__ void dense_gemv_kernel(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                  bf16* __restrict__ y, int m, int n, int k) {
  pdl_enter();
  const int row = blockIdx.x * gemv_rows_per_block + (threadIdx.x >> 5);
  if (row >= n)
    return;
  gemv_row<KC>(w + static_cast<i64>(row) * k, x, nullptr, 0, m, y, n, row, k);
}

// ------------------------------------------------------------------ elementwise

__global__ void add_kernel(float* x, const bf16* y, i64 elements) {
  pdl_enter();
  for (i64 idx = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; idx < elements;
       idx += static_cast<i64>(gridDim.x) * blockDim.x)
    x[idx] += to_f(y[idx]);
}

} // namespace

void rms_norm(const float* x, const void* w, void* out, int rows, int n, float eps, void* stream) {
  launch("rms_norm", rms_norm_kernel, dim3(rows), dim3(256), as_stream(stream), x,
         static_cast<const bf16*>(w), static_cast<bf16*>(out), n, eps);
}

void add_rms_norm(float* x, const void* y, const void* w, void* out, int rows, int n, float eps,
                  void* stream, void* lo, bool y_f32) {
  if (y_f32)
    launch("add_rms_norm", add_rms_norm_kernel<float>, dim3(rows), dim3(256), as_stream(stream),
           x, static_cast<const float*>(y), static_cast<const bf16*>(w), static_cast<bf16*>(out),
           n, eps, static_cast<bf16*>(lo));
  else
    launch("add_rms_norm", add_rms_norm_kernel<bf16>, dim3(rows), dim3(256), as_stream(stream),
           x, static_cast<const bf16*>(y), static_cast<const bf16*>(w), static_cast<bf16*>(out),
           n, eps, static_cast<bf16*>(lo));
}

void qk_norm_rope_write(const void* qkv, const void* q_norm, const void* k_norm,
                        const float* cos, const float* sin, const std::int64_t* positions,
                        const std::int64_t* src_row, const std::int64_t* write_block,
                        const std::int64_t* write_slot, void* q_out, kv_target kv, int n, int hq,
                        int hkv, int d, float eps, void* stream) {
  const int threads = ((d / 2 + 31) / 32) * 32;
  launch("qk_norm_rope_write", qk_kernel, dim3(n, hq + 2 * hkv), dim3(threads),
         as_stream(stream), static_cast<const bf16*>(qkv), static_cast<const bf16*>(q_norm),
         static_cast<const bf16*>(k_norm), cos, sin, positions, src_row, write_block, write_slot,
         static_cast<bf16*>(q_out), kv, hq, hkv, d, eps);
}

bool dense_gemv_supported(std::int64_t m, std::int64_t k) {
  return m >= 1 && m <= max_dense_gemv_rows && k >= 8 && k % 8 == 0 && k <= gemv_max_k;
}

void dense_gemv(const void* x, const void* w, void* y, int m, int n, int k, void* stream) {
  const dim3 grid((n + gemv_rows_per_block - 1) / gemv_rows_per_block);
  with_chunks(k, "dense_gemv", [&](auto kc) {
    launch("dense_gemv", dense_gemv_kernel<decltype(kc)::value>, grid,
           dim3(gemv_rows_per_block * 32), as_stream(stream), static_cast<const bf16*>(x),
           static_cast<const bf16*>(w), static_cast<bf16*>(y), m, n, k);
  });
}

void set_programmatic_launch(bool on) { programmatic_launch.store(on); }

void add_bf16(float* x, const void* y, std::int64_t elements, void* stream) {
  launch("add_bf16", add_kernel, dim3(grid_for(elements, 256)), dim3(256), as_stream(stream), x,
         static_cast<const bf16*>(y), elements);
}

} // namespace refit::inference::kernels
