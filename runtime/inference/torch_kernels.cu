// Fused CUDA kernels of the bf16 engine (see torch_kernels.hpp).
#include "runtime/inference/torch_kernels.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>

namespace refit::inference::kernels {

namespace {

using bf16 = __nv_bfloat16;
using i64 = std::int64_t;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("bf16 engine kernel ") + what + ": "
                             + cudaGetErrorString(e));
}

__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ bf16 to_bf(float v) { return __float2bfloat16(v); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v, float* shared) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0)
    shared[warp] = v;
  __syncthreads();
  const int warps = blockDim.x >> 5;
  float total = lane < warps ? shared[lane] : 0.0f;
  total = warp_sum(total);
  __syncthreads();
  return total;
}

// ---------------------------------------------------------------------------- RMSNorm

__global__ void rms_norm_kernel(const float* x, const bf16* w, bf16* out, int n, float eps) {
  __shared__ float shared[32];
  const float* row = x + static_cast<i64>(blockIdx.x) * n;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    ss += row[i] * row[i];
  ss = block_sum(ss, shared);
  const float r = rsqrtf(ss / static_cast<float>(n) + eps);
  bf16* o = out + static_cast<i64>(blockIdx.x) * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    o[i] = to_bf(row[i] * r * to_f(w[i]));
}

// ------------------------------------------------------- q/k norm + RoPE + KV write

__global__ void qk_kernel(const bf16* qkv, const bf16* q_norm, const bf16* k_norm,
                          const float* cos, const float* sin, const i64* positions,
                          const i64* src_row, const i64* write_block, const i64* write_slot,
                          bf16* q_out, kv_target kv, int hq, int hkv, int d, float eps) {
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

template <int D, int G, int NW>
__global__ void decode_attention_kernel(const bf16* q, kv_target kv, const i64* table, int width,
                                        const i64* lengths, bf16* out, int hq, int hkv,
                                        float scale) {
  constexpr int DPL = D / 32;
  const int b = blockIdx.x;
  const int h = blockIdx.y;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  float qr[G][DPL];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < DPL; ++j)
      qr[g][j] = to_f(q[(static_cast<i64>(b) * hq + h * G + g) * D + lane * DPL + j]) * scale;
  float m[G], l[G], acc[G][DPL];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int j = 0; j < DPL; ++j)
      acc[g][j] = 0.0f;
  }
  const i64 length = lengths[b];
  const bf16* cache = static_cast<const bf16*>(kv.base);
  for (i64 p = warp; p < length; p += NW) {
    const i64 block = table[static_cast<i64>(b) * width + p / kv.block_size];
    const i64 slot = p % kv.block_size;
    const bf16* kp = cache + block * kv.block_elems + kv.layer_offset
                     + (slot * hkv + h) * static_cast<i64>(D) + lane * DPL;
    const bf16* vp = kp + kv.part_elems;
    float kf[DPL], vf[DPL];
    for (int j = 0; j < DPL; ++j) {
      kf[j] = to_f(kp[j]);
      vf[j] = to_f(vp[j]);
    }
    for (int g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int j = 0; j < DPL; ++j)
        s += qr[g][j] * kf[j];
      s = warp_sum(s);
      const float m_new = fmaxf(m[g], s);
      const float corr = expf(m[g] - m_new);
      const float e = expf(s - m_new);
      l[g] = l[g] * corr + e;
      for (int j = 0; j < DPL; ++j)
        acc[g][j] = acc[g][j] * corr + e * vf[j];
      m[g] = m_new;
    }
  }
  __shared__ float sm[NW][G];
  __shared__ float sl[NW][G];
  __shared__ float sacc[NW][G][D];
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm[warp][g] = m[g];
      sl[warp][g] = l[g];
    }
    for (int j = 0; j < DPL; ++j)
      sacc[warp][g][lane * DPL + j] = acc[g][j];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D;
    const int c = idx % D;
    float mx = -INFINITY;
    for (int w = 0; w < NW; ++w)
      mx = fmaxf(mx, sm[w][g]);
    float total = 0.0f, value = 0.0f;
    for (int w = 0; w < NW; ++w) {
      const float f = sm[w][g] == -INFINITY ? 0.0f : expf(sm[w][g] - mx);
      total += sl[w][g] * f;
      value += sacc[w][g][c] * f;
    }
    out[(static_cast<i64>(b) * hq + h * G + g) * D + c] = to_bf(value / total);
  }
}

template <int D, int G>
void launch_attention(const void* q, kv_target kv, const i64* table, int width, const i64* lengths,
                      void* out, int b, int hq, int hkv, cudaStream_t s) {
  constexpr int NW = G <= 8 ? 8 : 4;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  decode_attention_kernel<D, G, NW><<<dim3(b, hkv), NW * 32, 0, s>>>(
    static_cast<const bf16*>(q), kv, table, width, lengths, static_cast<bf16*>(out), hq, hkv, scale);
}

template <int D>
void dispatch_group(int group, const void* q, kv_target kv, const i64* table, int width,
                    const i64* lengths, void* out, int b, int hq, int hkv, cudaStream_t s) {
  switch (group) {
    case 1: return launch_attention<D, 1>(q, kv, table, width, lengths, out, b, hq, hkv, s);
    case 2: return launch_attention<D, 2>(q, kv, table, width, lengths, out, b, hq, hkv, s);
    case 4: return launch_attention<D, 4>(q, kv, table, width, lengths, out, b, hq, hkv, s);
    case 8: return launch_attention<D, 8>(q, kv, table, width, lengths, out, b, hq, hkv, s);
    case 16: return launch_attention<D, 16>(q, kv, table, width, lengths, out, b, hq, hkv, s);
  }
  throw std::invalid_argument("decode_attention: unsupported group " + std::to_string(group));
}

// ----------------------------------------------------------------------- routing

constexpr int max_experts_per_lane = 8; // experts <= 256

__global__ void route_kernel(const bf16* logits, int n, int experts, int top_k, bool renormalize,
                             i64* ids, float* weights) {
  const int token = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (token >= n)
    return;
  float v[max_experts_per_lane];
  float mx = -INFINITY;
  for (int j = 0; j < max_experts_per_lane; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < experts ? to_f(logits[static_cast<i64>(token) * experts + e]) : -INFINITY;
    mx = fmaxf(mx, v[j]);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int j = 0; j < max_experts_per_lane; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < experts ? expf(v[j] - mx) : -1.0f;
    sum += e < experts ? v[j] : 0.0f;
  }
  sum = warp_sum(sum);
  for (int j = 0; j < max_experts_per_lane; ++j)
    if (lane + 32 * j < experts)
      v[j] /= sum;
  float total = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    float best = -1.0f;
    int best_e = 1 << 30;
    for (int j = 0; j < max_experts_per_lane; ++j) {
      const int e = lane + 32 * j;
      if (v[j] > best || (v[j] == best && e < best_e)) {
        best = v[j];
        best_e = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ob > best || (ob == best && oe < best_e)) {
        best = ob;
        best_e = oe;
      }
    }
    if ((best_e & 31) == lane)
      v[best_e >> 5] = -1.0f; // taken
    total += best;
    if (lane == 0) {
      ids[static_cast<i64>(token) * top_k + k] = best_e;
      weights[static_cast<i64>(token) * top_k + k] = best;
    }
  }
  if (renormalize && lane == 0)
    for (int k = 0; k < top_k; ++k)
      weights[static_cast<i64>(token) * top_k + k] /= total;
}

// ----------------------------------------------------------------- bucket by expert

constexpr int max_bucket_copies = 4096;
constexpr int max_bucket_experts = 1024;

__global__ void bucket_kernel(const i64* ids, int copies, int top_k, int experts, i64* counts,
                              int* offsets, i64* order, i64* src_token, i64* inverse, i64* loads,
                              int loads_n) {
  __shared__ int count[max_bucket_experts];
  __shared__ int start[max_bucket_experts];
  __shared__ short id[max_bucket_copies];
  for (int e = threadIdx.x; e < experts; e += blockDim.x)
    count[e] = 0;
  __syncthreads();
  for (int f = threadIdx.x; f < copies; f += blockDim.x) {
    id[f] = static_cast<short>(ids[f]);
    atomicAdd(&count[id[f]], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0, used = 0;
    for (int e = 0; e < experts; ++e) {
      start[e] = run;
      run += count[e];
      offsets[e] = run;
      counts[e] = count[e];
      used += count[e] > 0;
    }
    for (int i = 0; i < loads_n; ++i)
      loads[i] += used;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    if (count[e] == 0)
      continue;
    int pos = start[e];
    for (int f = 0; f < copies; ++f)
      if (id[f] == e) {
        order[pos] = f;
        src_token[pos] = f / top_k;
        inverse[f] = pos;
        ++pos;
      }
  }
}

// --------------------------------------------------------------- expert GEMV

constexpr int gemv_max_copies = 64;
constexpr int gemv_rows_per_block = 8; // one warp per output row
constexpr int gemv_copies_per_pass = 8;

__global__ void expert_gemv_kernel(const bf16* x, const bf16* w, const i64* ids, const i64* order,
                                   const i64* counts, const int* offsets, bf16* y, int n, int k) {
  const int p = blockIdx.x;
  const int e = static_cast<int>(ids[order[p]]);
  const int first = e == 0 ? 0 : offsets[e - 1];
  if (p != first)
    return; // the group's first copy does the group
  const int count = static_cast<int>(counts[e]);
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.y * gemv_rows_per_block + (threadIdx.x >> 5);
  if (row >= n)
    return;
  const bf16* wr = w + (static_cast<i64>(e) * n + row) * k;
  for (int c0 = 0; c0 < count; c0 += gemv_copies_per_pass) {
    const int cs = min(gemv_copies_per_pass, count - c0);
    float acc[gemv_copies_per_pass];
    for (int c = 0; c < gemv_copies_per_pass; ++c)
      acc[c] = 0.0f;
    for (int k0 = lane * 8; k0 < k; k0 += 256) {
      const uint4 wv = *reinterpret_cast<const uint4*>(wr + k0);
      const bf16* wb = reinterpret_cast<const bf16*>(&wv);
      float wf[8];
      for (int j = 0; j < 8; ++j)
        wf[j] = to_f(wb[j]);
      for (int c = 0; c < cs; ++c) {
        const uint4 xv =
          *reinterpret_cast<const uint4*>(x + static_cast<i64>(first + c0 + c) * k + k0);
        const bf16* xb = reinterpret_cast<const bf16*>(&xv);
        for (int j = 0; j < 8; ++j)
          acc[c] += wf[j] * to_f(xb[j]);
      }
    }
    for (int c = 0; c < cs; ++c) {
      const float s = warp_sum(acc[c]);
      if (lane == 0)
        y[static_cast<i64>(first + c0 + c) * n + row] = to_bf(s);
    }
  }
}

// ------------------------------------------------------------------ elementwise

__global__ void silu_mul_kernel(const bf16* gate_up, bf16* act, i64 m, int inter) {
  const i64 total = m * inter;
  for (i64 idx = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 r = idx / inter;
    const i64 c = idx % inter;
    const float g = to_f(gate_up[r * 2 * inter + c]);
    const float u = to_f(gate_up[r * 2 * inter + inter + c]);
    act[idx] = to_bf(g / (1.0f + expf(-g)) * u);
  }
}

__global__ void mix_kernel(const bf16* y, const i64* inverse, const float* weights, float* x,
                           int top_k, int h) {
  const int t = blockIdx.x;
  for (int c = threadIdx.x; c < h; c += blockDim.x) {
    float sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
      const i64 f = static_cast<i64>(t) * top_k + j;
      sum += weights[f] * to_f(y[inverse[f] * h + c]);
    }
    x[static_cast<i64>(t) * h + c] += sum;
  }
}

__global__ void add_kernel(float* x, const bf16* y, i64 elements) {
  for (i64 idx = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; idx < elements;
       idx += static_cast<i64>(gridDim.x) * blockDim.x)
    x[idx] += to_f(y[idx]);
}

int grid_for(i64 elements, int threads) {
  const i64 blocks = (elements + threads - 1) / threads;
  return static_cast<int>(blocks < 4096 ? (blocks < 1 ? 1 : blocks) : 4096);
}

} // namespace

void rms_norm(const float* x, const void* w, void* out, int rows, int n, float eps, void* stream) {
  rms_norm_kernel<<<rows, 256, 0, as_stream(stream)>>>(x, static_cast<const bf16*>(w),
                                                       static_cast<bf16*>(out), n, eps);
  check("rms_norm");
}

void qk_norm_rope_write(const void* qkv, const void* q_norm, const void* k_norm,
                        const float* cos, const float* sin, const std::int64_t* positions,
                        const std::int64_t* src_row, const std::int64_t* write_block,
                        const std::int64_t* write_slot, void* q_out, kv_target kv, int n, int hq,
                        int hkv, int d, float eps, void* stream) {
  const int threads = ((d / 2 + 31) / 32) * 32;
  qk_kernel<<<dim3(n, hq + 2 * hkv), threads, 0, as_stream(stream)>>>(
    static_cast<const bf16*>(qkv), static_cast<const bf16*>(q_norm),
    static_cast<const bf16*>(k_norm), cos, sin, positions, src_row, write_block, write_slot,
    static_cast<bf16*>(q_out), kv, hq, hkv, d, eps);
  check("qk_norm_rope_write");
}

bool decode_attention_supported(int d, int group) {
  return (d == 64 || d == 128) && (group == 1 || group == 2 || group == 4 || group == 8
                                   || group == 16);
}

void decode_attention(const void* q, kv_target kv, const std::int64_t* table, int width,
                      const std::int64_t* lengths, void* out, int b, int hq, int hkv, int d,
                      void* stream) {
  const int group = hq / hkv;
  if (d == 64)
    dispatch_group<64>(group, q, kv, table, width, lengths, out, b, hq, hkv, as_stream(stream));
  else if (d == 128)
    dispatch_group<128>(group, q, kv, table, width, lengths, out, b, hq, hkv, as_stream(stream));
  else
    throw std::invalid_argument("decode_attention: unsupported head_dim " + std::to_string(d));
  check("decode_attention");
}

bool route_supported(int experts, int top_k) {
  return experts >= 1 && experts <= 32 * max_experts_per_lane && top_k >= 1 && top_k <= experts;
}

void route(const void* logits, int n, int experts, int top_k, bool renormalize,
           std::int64_t* ids, float* weights, void* stream) {
  const int threads = 256; // 8 tokens per block
  const int blocks = (n * 32 + threads - 1) / threads;
  route_kernel<<<blocks, threads, 0, as_stream(stream)>>>(static_cast<const bf16*>(logits), n,
                                                          experts, top_k, renormalize, ids,
                                                          weights);
  check("route");
}

bool bucket_supported(int copies, int experts) {
  return copies >= 1 && copies <= max_bucket_copies && experts >= 1
         && experts <= max_bucket_experts && experts <= 32767;
}

void bucket(const std::int64_t* ids, int copies, int top_k, int experts, std::int64_t* counts,
            int* offsets, std::int64_t* order, std::int64_t* src_token, std::int64_t* inverse,
            std::int64_t* loads, int loads_n, void* stream) {
  bucket_kernel<<<1, 1024, 0, as_stream(stream)>>>(ids, copies, top_k, experts, counts, offsets,
                                                   order, src_token, inverse, loads, loads_n);
  check("bucket");
}

bool expert_gemv_supported(std::int64_t copies, std::int64_t k) {
  return copies >= 1 && copies <= gemv_max_copies && k % 8 == 0;
}

void expert_gemv(const void* x, const void* w, const std::int64_t* ids, const std::int64_t* order,
                 const std::int64_t* counts, const int* offsets, void* y, int copies, int n, int k,
                 void* stream) {
  const dim3 grid(copies, (n + gemv_rows_per_block - 1) / gemv_rows_per_block);
  expert_gemv_kernel<<<grid, gemv_rows_per_block * 32, 0, as_stream(stream)>>>(
    static_cast<const bf16*>(x), static_cast<const bf16*>(w), ids, order, counts, offsets,
    static_cast<bf16*>(y), n, k);
  check("expert_gemv");
}

void silu_mul(const void* gate_up, void* act, std::int64_t m, int inter, void* stream) {
  silu_mul_kernel<<<grid_for(m * inter, 256), 256, 0, as_stream(stream)>>>(
    static_cast<const bf16*>(gate_up), static_cast<bf16*>(act), m, inter);
  check("silu_mul");
}

void mix_experts(const void* y, const std::int64_t* inverse, const float* weights, float* x,
                 int n, int top_k, int h, void* stream) {
  mix_kernel<<<n, 256, 0, as_stream(stream)>>>(static_cast<const bf16*>(y), inverse, weights, x,
                                               top_k, h);
  check("mix_experts");
}

void add_bf16(float* x, const void* y, std::int64_t elements, void* stream) {
  add_kernel<<<grid_for(elements, 256), 256, 0, as_stream(stream)>>>(
    x, static_cast<const bf16*>(y), elements);
  check("add_bf16");
}

} // namespace refit::inference::kernels
