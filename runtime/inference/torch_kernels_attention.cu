// Paged decode attention of the bf16 engine (see torch_kernels.hpp: decode_attention): over
// the block tables of a batch, split over the sequence (flash-decoding), on CUDA cores (mode 0)
// or on the tensor cores (mode 1 here, mode 2 in torch_kernels_attention_t.cu), and the merge
// of the splits.
#include "runtime/inference/torch_kernels_attention.cuh"

#include <cuda_pipeline.h>

#include <cmath>

namespace refit::inference::kernels {

using namespace detail;
using namespace attention_detail;

namespace {

// ------------------------------------------------------------- decode attention

// CUDA cores (REFIT_ATTENTION_MMA=0, and group 16). One block per (sequence, the G = hq / hkv
// query heads of one KV head, split); its NW warps take tiles of 32 positions in turn. In a
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
      const i64 off = kv_row<D>(kv, row_table, p, hkv, h);
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
  combine_warps<D, G, NW, G>(sm, sl, sacc, b, head0, hq, split, splits, out, partial);
}

// Tensor cores, mode 1 (mode 2, the default, is torch_kernels_attention_t.cu). Same blocks and
// tiles as the kernel above; per
// tile of 32 positions a warp computes S = Q . K^T with mma.m16n8k16, the group's query heads as
// the rows of A (8 of 16 used, the rest zero) and the positions as the columns of B in four
// tiles of 8: thread (g, t) loads 16-byte chunks of the K row of position 8 n + g straight from
// the cache (its four lanes 64 contiguous bytes), and takes the head dims in the same permuted
// order for Q and K (a dot product is order-free). The softmax state of head g lives in its
// four lanes (max through two shuffles). Then O += P . V: P leaves the accumulators as the A
// operand (the C layout of two column tiles is the A layout of one k-step), in two bf16 parts
// (hi + lo: P at about 16 mantissa bits, as the fp32 P of the CUDA-core kernel), and V, copied
// to shared memory with cp.async (16-byte chunks XOR-swizzled by row), enters as B through
// ldmatrix.trans. The warps' states are combined as above.
template <int D, int G, int NW>
__global__ void __launch_bounds__(NW * 32)
  decode_attention_mma_kernel(const bf16* __restrict__ q, kv_target kv,
                              const i64* __restrict__ table, int width,
                              const i64* __restrict__ lengths, bf16* __restrict__ out,
                              float* __restrict__ partial, int splits, int hq, int hkv,
                              float scale) {
  pdl_enter();
  static_assert(G >= 1 && G <= 8 && (D == 64 || D == 128), "decode attention (mma): shape");
  constexpr int TILE = 32;
  constexpr int KC = D / 32; // a thread's 16-byte chunks of one K row
  constexpr int VC = D / 8;  // 16-byte chunks of a V row
  constexpr int NT = D / 8;  // column tiles of O (8 head dims each)
  constexpr int P1 = NW * TILE * D * 2;
  constexpr int P2 = (2 * NW * 8 + NW * 8 * D) * 4;
  static_assert(P1 <= 48 * 1024 && P2 <= 48 * 1024, "decode attention (mma): shared memory");
  __shared__ __align__(16) unsigned char smem[P1 > P2 ? P1 : P2];
  const int b = blockIdx.x;
  const int h = blockIdx.y;
  const int split = blockIdx.z;
  const int head0 = h * G;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  uint4 qa[KC]; // head g's dims 32 j + 8 t .. + 7 (zero for g >= G)
#pragma unroll
  for (int j = 0; j < KC; ++j)
    qa[j] = g < G ? __ldg(reinterpret_cast<const uint4*>(
                      q + (static_cast<i64>(b) * hq + head0 + g) * D + 32 * j + 8 * t))
                  : make_uint4(0u, 0u, 0u, 0u);
  float m = -INFINITY; // head g's running max (equal in its four lanes)
  float l = 0.0f;      // this thread's share of head g's sum
  float acc[NT][4];    // [n][0..1]: O[head g][8 n + 2 t, + 1]; [2..3]: the zero rows
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      acc[n][i] = 0.0f;
  const i64 length = lengths[b];
  const bf16* cache = static_cast<const bf16*>(kv.base);
  const i64* row_table = table + static_cast<i64>(b) * width;
  const auto slot = [&](i64 p) { return kv_row<D>(kv, row_table, p, hkv, h); };
  bf16* vw = reinterpret_cast<bf16*>(smem) + warp * TILE * D;
  const i64 stride = static_cast<i64>(splits) * NW * TILE;
  for (i64 base = (split + static_cast<i64>(splits) * warp) * TILE; base < length;
       base += stride) {
    { // this lane's V row (position base + lane): chunk c at c ^ (lane % 8); zeros past the end
      const i64 p = base + lane;
      uint4* dst = reinterpret_cast<uint4*>(vw + lane * D);
      if (p < length) {
        const uint4* src = reinterpret_cast<const uint4*>(cache + slot(p) + kv.part_elems);
#pragma unroll
        for (int c = 0; c < VC; ++c)
          __pipeline_memcpy_async(dst + (c ^ (lane & 7)), src + c, 16);
      } else {
#pragma unroll
        for (int c = 0; c < VC; ++c)
          dst[c] = make_uint4(0u, 0u, 0u, 0u);
      }
      __pipeline_commit();
    }
    uint4 kb[4][KC]; // the K rows of positions base + 8 n + g
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const i64 p = base + 8 * n + g;
      const uint4* kp =
        p < length ? reinterpret_cast<const uint4*>(cache + slot(p) + 8 * t) : nullptr;
#pragma unroll
      for (int j = 0; j < KC; ++j)
        kb[n][j] = kp != nullptr ? __ldg(kp + 4 * j) : make_uint4(0u, 0u, 0u, 0u);
    }
    float s[4][4]; // [n][0..1]: head g at positions base + 8 n + 2 t, + 1
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        s[n][i] = 0.0f;
#pragma unroll
      for (int j = 0; j < KC; ++j) {
        mma_bf16(s[n], qa[j].x, 0u, qa[j].y, 0u, kb[n][j].x, kb[n][j].y);
        mma_bf16(s[n], qa[j].z, 0u, qa[j].w, 0u, kb[n][j].z, kb[n][j].w);
      }
    }
    const float corr = softmax_tile(s, base, t, length, scale, m, l);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      acc[n][0] *= corr;
      acc[n][1] *= corr;
    }
    __pipeline_wait_prior(0);
    __syncwarp();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) { // positions 16 kk .. + 15: column tiles 2 kk, 2 kk + 1
      unsigned h0, h1, l0, l1;
      split_p(s, kk, h0, h1, l0, l1);
      const int mi = lane >> 3;
      const int row = 16 * kk + (mi & 1) * 8 + (lane & 7);
#pragma unroll
      for (int n = 0; n < NT; n += 2) {
        unsigned vb[4]; // B of column tiles n (vb 0, 1) and n + 1 (vb 2, 3)
        ldmatrix_x4_trans(vb, vw + row * D + ((n + (mi >> 1)) ^ (lane & 7)) * 8);
        mma_bf16(acc[n], h0, 0u, h1, 0u, vb[0], vb[1]);
        mma_bf16(acc[n], l0, 0u, l1, 0u, vb[0], vb[1]);
        mma_bf16(acc[n + 1], h0, 0u, h1, 0u, vb[2], vb[3]);
        mma_bf16(acc[n + 1], l0, 0u, l1, 0u, vb[2], vb[3]);
      }
    }
    __syncwarp(); // the next tile overwrites this warp's V rows
  }
  finish_warps<D, G, NW>(m, l, smem, [&](float* sacc) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      sacc[(warp * 8 + g) * D + 8 * n + 2 * t] = acc[n][0];
      sacc[(warp * 8 + g) * D + 8 * n + 2 * t + 1] = acc[n][1];
    }
  }, b, head0, hq, split, splits, out, partial);
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

template <int D, int G>
void launch_attention(const attention_call& a, cudaStream_t s) {
  constexpr int NW = 4;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const dim3 grid(a.b, a.hkv, a.splits);
  bool launched = false;
  if constexpr (G <= 8) {
    if (a.mode == 1) {
      launch("decode_attention", decode_attention_mma_kernel<D, G, NW>, grid, dim3(NW * 32), s,
             static_cast<const bf16*>(a.q), a.kv, a.table, a.width, a.lengths,
             static_cast<bf16*>(a.out), a.partial, a.splits, a.hq, a.hkv, scale);
      launched = true;
    } else if (a.mode == 2) {
      launch_transposed<D, G>(a, s);
      launched = true;
    }
  }
  if (!launched)
    launch("decode_attention", decode_attention_kernel<D, G, NW>, grid, dim3(NW * 32), s,
           static_cast<const bf16*>(a.q), a.kv, a.table, a.width, a.lengths,
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

} // namespace

bool decode_attention_supported(int d, int group) {
  return (d == 64 || d == 128) && (group == 1 || group == 2 || group == 4 || group == 8
                                   || group == 16);
}

int decode_attention_splits(int b, int hkv) {
  const int sms = multiprocessors();
  const int blocks = b * hkv;
  // About one block per SM (the tensor-core kernel's registers hold 2): more splits cost more in
  // waves and the merge than their shorter slices save (H200, 4 KV heads: batch 64 at 1 split
  // 18.04 ms a step vs 18.89 at 2; batch 16 at 2 12.58 ms vs 12.83 at 4).
  const int want = sms / blocks;
  return want < 1 ? 1 : (want > max_attention_splits ? max_attention_splits : want);
}

namespace {

// Where decode_attention takes other than 4 warps a block: mode 2's kernel (groups up to 8).
bool warps_choosable(int mode, int group) { return mode == 2 && group >= 1 && group <= 8; }

} // namespace

int decode_attention_warps(int blocks, int mode, int group, int wanted) {
  if (!warps_choosable(mode, group))
    return 4;
  if (wanted > 0)
    return wanted;
  return blocks <= 2 * multiprocessors() ? 6 : 4;
}

void decode_attention(const void* q, kv_target kv, const std::int64_t* table, int width,
                      const std::int64_t* lengths, void* out, float* partial, int splits, int b,
                      int hq, int hkv, int d, void* stream, int mode, const attention_qk* qk,
                      int warps) {
  if (mode < 0 || mode > 2)
    throw std::invalid_argument("decode_attention: mode " + std::to_string(mode)
                                + " (0 CUDA cores, 1 tensor cores, 2 transposed tensor cores)");
  const int group = hkv > 0 ? hq / hkv : 0; // 0: refused by dispatch_group
  if (qk != nullptr && (mode != 2 || group > 8))
    throw std::invalid_argument("decode_attention: the fused q/k of mode " + std::to_string(mode)
                                + ", group " + std::to_string(group)
                                + " (mode 2, groups up to 8 only)");
  if (splits < 1 || splits > max_attention_splits || (splits > 1 && partial == nullptr))
    throw std::invalid_argument("decode_attention: " + std::to_string(splits)
                                + " splits (1.." + std::to_string(max_attention_splits)
                                + ", a partial buffer when > 1)");
  if ((warps != 4 && warps != 6 && warps != 8) || (warps != 4 && !warps_choosable(mode, group)))
    throw std::invalid_argument("decode_attention: " + std::to_string(warps)
                                + " warps a block in mode " + std::to_string(mode) + ", group "
                                + std::to_string(group)
                                + " (4; 6 or 8 in mode 2 up to group 8 only)");
  const attention_call a{q, kv, table, width, lengths, out, partial, splits, b, hq, hkv, mode, qk,
                         warps};
  if (d == 64)
    dispatch_group<64>(group, a, as_stream(stream));
  else if (d == 128)
    dispatch_group<128>(group, a, as_stream(stream));
  else
    throw std::invalid_argument("decode_attention: unsupported head_dim " + std::to_string(d));
}

} // namespace refit::inference::kernels
