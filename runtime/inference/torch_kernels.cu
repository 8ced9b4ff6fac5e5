// Fused CUDA kernels of the bf16 engine (see torch_kernels.hpp): RMSNorm (alone and fused
// with the residual add), q/k norm + RoPE + KV write, paged decode attention. The MoE kernels
// are in torch_kernels_moe.cu.
#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_common.cuh"

#include <cuda_pipeline.h>

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
__global__ void add_rms_norm_kernel(float* __restrict__ x, const bf16* __restrict__ y,
                                    const bf16* __restrict__ w, bf16* __restrict__ out, int n,
                                    float eps) {
  pdl_enter();
  __shared__ float shared[32];
  float* row = x + static_cast<i64>(blockIdx.x) * n;
  const bf16* yr = y + static_cast<i64>(blockIdx.x) * n;
  float ss = 0.0f;
  if ((n & 3) == 0) {
    for (int c = threadIdx.x * 4; c < n; c += blockDim.x * 4) {
      float4 v = *reinterpret_cast<const float4*>(row + c);
      const uint2 yv = *reinterpret_cast<const uint2*>(yr + c);
      const bf16* yb = reinterpret_cast<const bf16*>(&yv);
      v.x += to_f(yb[0]);
      v.y += to_f(yb[1]);
      v.z += to_f(yb[2]);
      v.w += to_f(yb[3]);
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
  norm_row(row, w, out + static_cast<i64>(blockIdx.x) * n, n, eps, ss, shared);
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

// ------------------------------------------------------------- decode attention

// One block per (sequence, the G = hq / hkv query heads of one KV head); its NW warps take tiles
// of 32 positions in turn. In a
// tile every lane owns one position: it starts the copy of its V row into shared memory
// (cp.async), loads its whole K row at once (16-byte loads) and scores it against the group's
// G query heads (q in shared memory): the tile costs one memory latency, not one per position.
// The tile's softmax update is one warp max and one warp sum per head; then P.V from shared
// memory with the lanes over the head dims. The warps' (max, sum, acc) are combined at the end.
template <int D, int G, int NW>
__global__ void __launch_bounds__(NW * 32)
  decode_attention_kernel(const bf16* __restrict__ q, kv_target kv, const i64* __restrict__ table,
                          int width, const i64* __restrict__ lengths, bf16* __restrict__ out,
                          float* __restrict__ partial, int splits, int hq, int hkv,
                          float scale) {
  pdl_enter();
  constexpr int DPL = D / 32; // head dims per lane in P.V
  constexpr int TILE = 32;
  constexpr int P1 = NW * TILE * D * 2 + (G * D + NW * G * TILE) * 4; // V tiles, q, p
  constexpr int P2 = (2 * NW * G + NW * G * D) * 4;                    // the combine
  static_assert(P1 <= 48 * 1024 && P2 <= 48 * 1024, "decode attention: shared memory");
  __shared__ __align__(16) unsigned char smem[P1 > P2 ? P1 : P2];
  bf16* vs = reinterpret_cast<bf16*>(smem);
  float* qs = reinterpret_cast<float*>(smem + NW * TILE * D * 2);
  float* ps = qs + G * D;
  const int b = blockIdx.x;
  const int h = blockIdx.y;     // the KV head
  const int split = blockIdx.z; // this block's share of the tiles
  const int head0 = h * G;      // its first query head
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const bf16* qg = q + (static_cast<i64>(b) * hq + head0) * D;
  for (int i = threadIdx.x; i < G * D; i += blockDim.x)
    qs[i] = to_f(qg[i]) * scale;
  __syncthreads();
  float m[G], l[G], acc[G][DPL];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int j = 0; j < DPL; ++j)
      acc[g][j] = 0.0f;
  }
  const i64 length = lengths[b];
  const bf16* cache = static_cast<const bf16*>(kv.base);
  float* pw = ps + warp * G * TILE;
  bf16* vw = vs + warp * TILE * D;
  const i64* row_table = table + static_cast<i64>(b) * width;
  const i64 stride = static_cast<i64>(splits) * NW * TILE;
  for (i64 base = (split + static_cast<i64>(splits) * warp) * TILE; base < length;
       base += stride) {
    const i64 p = base + lane;
    const bool valid = p < length;
    float s[G];
#pragma unroll
    for (int g = 0; g < G; ++g)
      s[g] = 0.0f;
    if (valid) {
      const i64 block = row_table[p / kv.block_size];
      const i64 off = block * kv.block_elems + kv.layer_offset
                      + ((p % kv.block_size) * hkv + h) * static_cast<i64>(D);
      const uint4* vp = reinterpret_cast<const uint4*>(cache + off + kv.part_elems);
      uint4* vdst = reinterpret_cast<uint4*>(vw + lane * D);
#pragma unroll
      for (int c = 0; c < D / 8; ++c)
        __pipeline_memcpy_async(vdst + c, vp + c, 16);
      __pipeline_commit();
      const uint4* kp = reinterpret_cast<const uint4*>(cache + off);
      uint4 kr[D / 8];
#pragma unroll
      for (int c = 0; c < D / 8; ++c)
        kr[c] = kp[c];
#pragma unroll
      for (int c = 0; c < D / 8; ++c) {
        float kf[8];
        unpack8(kr[c], kf);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float4 q0 = *reinterpret_cast<const float4*>(qs + g * D + c * 8);
          const float4 q1 = *reinterpret_cast<const float4*>(qs + g * D + c * 8 + 4);
          s[g] += q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3] + q1.x * kf[4]
                  + q1.y * kf[5] + q1.z * kf[6] + q1.w * kf[7];
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float sg = valid ? s[g] : -INFINITY;
      const float m_new = fmaxf(m[g], warp_max(sg)); // finite: lane 0's position is valid
      const float corr = expf(m[g] - m_new);
      const float e = valid ? expf(sg - m_new) : 0.0f;
      l[g] = l[g] * corr + warp_sum(e);
#pragma unroll
      for (int j = 0; j < DPL; ++j)
        acc[g][j] *= corr;
      m[g] = m_new;
      pw[g * TILE + lane] = e;
    }
    __pipeline_wait_prior(0);
    __syncwarp();
    const int count = static_cast<int>(length - base < TILE ? length - base : TILE);
    for (int t = 0; t < count; ++t) { // only the valid rows: the tile's tail is not loaded
      const bf16* vr = vw + t * D + lane * DPL;
      float vf[DPL];
      if constexpr (DPL == 4) {
        const uint2 v = *reinterpret_cast<const uint2*>(vr);
        const bf16* vb = reinterpret_cast<const bf16*>(&v);
        for (int j = 0; j < 4; ++j)
          vf[j] = to_f(vb[j]);
      } else {
        const unsigned v = *reinterpret_cast<const unsigned*>(vr);
        const bf16* vb = reinterpret_cast<const bf16*>(&v);
        for (int j = 0; j < DPL; ++j)
          vf[j] = to_f(vb[j]);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pe = pw[g * TILE + t];
#pragma unroll
        for (int j = 0; j < DPL; ++j)
          acc[g][j] += pe * vf[j];
      }
    }
    __syncwarp(); // the next tile overwrites this warp's V rows and p
  }
  __syncthreads(); // the combine reuses the shared memory
  float* sm = reinterpret_cast<float*>(smem);
  float* sl = sm + NW * G;
  float* sacc = sl + NW * G;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm[warp * G + g] = m[g];
      sl[warp * G + g] = l[g];
    }
#pragma unroll
    for (int j = 0; j < DPL; ++j)
      sacc[(warp * G + g) * D + lane * DPL + j] = acc[g][j];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D;
    const int c = idx % D;
    float mx = -INFINITY;
    for (int w = 0; w < NW; ++w)
      mx = fmaxf(mx, sm[w * G + g]);
    float total = 0.0f, value = 0.0f;
    for (int w = 0; w < NW; ++w) {
      const float f = sm[w * G + g] == -INFINITY ? 0.0f : expf(sm[w * G + g] - mx);
      total += sl[w * G + g] * f;
      value += sacc[(w * G + g) * D + c] * f;
    }
    if (splits == 1) {
      out[(static_cast<i64>(b) * hq + head0 + g) * D + c] = to_bf(value / total);
    } else { // this split's (max, sum, unnormalized P.V): attention_merge_kernel merges them
      float* part = partial + ((static_cast<i64>(b) * hq + head0 + g) * splits + split) * (D + 2);
      part[2 + c] = value;
      if (c == 0) {
        part[0] = mx;
        part[1] = total;
      }
    }
  }
}

// One block per (sequence, query head), one thread per head dim: the splits' partial results
// (max, sum, P.V) merged into the normalized output. A split that saw no position has max -inf.
template <int D>
__global__ void attention_merge_kernel(const float* __restrict__ partial, bf16* __restrict__ out,
                                       int hq, int splits) {
  pdl_enter();
  const int c = threadIdx.x;
  const i64 head = static_cast<i64>(blockIdx.x) * hq + blockIdx.y;
  const float* part = partial + head * splits * (D + 2);
  float mx = -INFINITY;
  for (int sp = 0; sp < splits; ++sp)
    mx = fmaxf(mx, part[sp * (D + 2)]);
  float total = 0.0f, value = 0.0f;
  for (int sp = 0; sp < splits; ++sp) {
    const float ms = part[sp * (D + 2)];
    const float f = ms == -INFINITY ? 0.0f : expf(ms - mx);
    total += part[sp * (D + 2) + 1] * f;
    value += part[sp * (D + 2) + 2 + c] * f;
  }
  out[head * D + c] = to_bf(value / total);
}

struct attention_call {
  const void* q;
  kv_target kv;
  const i64* table;
  int width;
  const i64* lengths;
  void* out;
  float* partial;
  int splits, b, hq, hkv;
};

template <int D, int G>
void launch_attention(const attention_call& a, cudaStream_t s) {
  constexpr int NW = 4;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  launch("decode_attention", decode_attention_kernel<D, G, NW>, dim3(a.b, a.hkv, a.splits),
         dim3(NW * 32), s, static_cast<const bf16*>(a.q), a.kv, a.table, a.width, a.lengths,
         static_cast<bf16*>(a.out), a.partial, a.splits, a.hq, a.hkv, scale);
  if (a.splits > 1)
    launch("decode_attention merge", attention_merge_kernel<D>, dim3(a.b, a.hq), dim3(D), s,
           static_cast<const float*>(a.partial), static_cast<bf16*>(a.out), a.hq, a.splits);
}

template <int D>
void dispatch_group(int group, const attention_call& a, cudaStream_t s) {
  switch (group) {
    case 1: return launch_attention<D, 1>(a, s);
    case 2: return launch_attention<D, 2>(a, s);
    case 4: return launch_attention<D, 4>(a, s);
    case 8: return launch_attention<D, 8>(a, s);
    case 16: return launch_attention<D, 16>(a, s);
  }
  throw std::invalid_argument("decode_attention: unsupported group " + std::to_string(group));
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
                  void* stream) {
  launch("add_rms_norm", add_rms_norm_kernel, dim3(rows), dim3(256), as_stream(stream), x,
         static_cast<const bf16*>(y), static_cast<const bf16*>(w), static_cast<bf16*>(out), n, eps);
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

bool decode_attention_supported(int d, int group) {
  return (d == 64 || d == 128) && (group == 1 || group == 2 || group == 4 || group == 8
                                   || group == 16);
}

int decode_attention_splits(int b, int hkv) {
  const int sms = multiprocessors();
  const int blocks = b * hkv;
  const int want = (2 * sms + blocks - 1) / blocks; // ~2 blocks per SM
  return want < 1 ? 1 : (want > max_attention_splits ? max_attention_splits : want);
}

void decode_attention(const void* q, kv_target kv, const std::int64_t* table, int width,
                      const std::int64_t* lengths, void* out, float* partial, int splits, int b,
                      int hq, int hkv, int d, void* stream) {
  if (splits < 1 || splits > max_attention_splits || (splits > 1 && partial == nullptr))
    throw std::invalid_argument("decode_attention: " + std::to_string(splits)
                                + " splits (1.." + std::to_string(max_attention_splits)
                                + ", a partial buffer when > 1)");
  const attention_call a{q, kv, table, width, lengths, out, partial, splits, b, hq, hkv};
  const int group = hq / hkv;
  if (d == 64)
    dispatch_group<64>(group, a, as_stream(stream));
  else if (d == 128)
    dispatch_group<128>(group, a, as_stream(stream));
  else
    throw std::invalid_argument("decode_attention: unsupported head_dim " + std::to_string(d));
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
