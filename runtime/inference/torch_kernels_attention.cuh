// Device helpers of the decode-attention kernels (torch_kernels_attention.cu: modes 0 and 1 and
// the merge; torch_kernels_attention_t.cu: mode 2). CUDA only; included by those .cu files.
#pragma once
#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_common.cuh"

namespace refit::inference::kernels::attention_detail {

using namespace detail;

// The element offset in the cache of position p's K row of KV head h (its V row: + part_elems),
// through the sequence's block table row.
template <int D>
__device__ __forceinline__ i64 kv_row(const kv_target& kv, const i64* row_table, i64 p, int hkv,
                                      int h) {
  return row_table[p / kv.block_size] * kv.block_elems + kv.layer_offset
         + ((p % kv.block_size) * hkv + h) * static_cast<i64>(D);
}

// The NW warps' online-softmax states of a block's G heads (shared memory: max sm[w * HS + g],
// sum sl[w * HS + g], P.V sacc[(w * HS + g) * D + c]) merged. splits 1: the normalized output;
// else this split's (max, sum, unnormalized P.V) into partial for attention_merge_kernel.
template <int D, int G, int NW, int HS>
__device__ void combine_warps(const float* sm, const float* sl, const float* sacc, int b,
                              int head0, int hq, int split, int splits, bf16* __restrict__ out,
                              float* __restrict__ partial) {
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D;
    const int c = idx % D;
    float mx = -INFINITY;
    for (int w = 0; w < NW; ++w)
      mx = fmaxf(mx, sm[w * HS + g]);
    float total = 0.0f, value = 0.0f;
    for (int w = 0; w < NW; ++w) {
      const float f = sm[w * HS + g] == -INFINITY ? 0.0f : expf(sm[w * HS + g] - mx);
      total += sl[w * HS + g] * f;
      value += sacc[(w * HS + g) * D + c] * f;
    }
    if (splits == 1) {
      out[(static_cast<i64>(b) * hq + head0 + g) * D + c] = to_bf(value / total);
    } else {
      float* part = partial + ((static_cast<i64>(b) * hq + head0 + g) * splits + split) * (D + 2);
      part[2 + c] = value;
      if (c == 0) {
        part[0] = mx;
        part[1] = total;
      }
    }
  }
}

__device__ __forceinline__ unsigned pack_bf16x2(float first, float second) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(first, second); // first in the low half
  return *reinterpret_cast<const unsigned*>(&v);
}

__device__ __forceinline__ float low_bf16(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float high_bf16(unsigned v) { return __uint_as_float(v & 0xffff0000u); }

// Four 8x8 bf16 matrices from shared memory: lane l gives the address of row l % 8 of matrix
// l / 8; register i of thread (g, t) holds matrix i's (row g, col 2t), (row g, col 2t+1).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// Four 8x8 bf16 matrices from shared memory, transposed: lane l gives the address of row l % 8
// of matrix l / 8; register i of thread (g, t) holds matrix i's (row 2t, col g), (row 2t+1, col g).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// P of one 16-position k-step (S's column tiles 2 kk and 2 kk + 1: s[2 kk][0..1], s[2 kk +
// 1][0..1] of head g) as bf16 pairs in two parts, hi (h0, h1) and the rounding left (l0, l1): P at
// about 16 mantissa bits, as an fp32 P. The pairs are both an A fragment (heads as rows) and a B
// fragment (heads as columns) of m16n8k16.
__device__ __forceinline__ void split_p(const float (&s)[4][4], int kk, unsigned& h0, unsigned& h1,
                                        unsigned& l0, unsigned& l1) {
  h0 = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
  h1 = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  l0 = pack_bf16x2(s[2 * kk][0] - low_bf16(h0), s[2 * kk][1] - high_bf16(h0));
  l1 = pack_bf16x2(s[2 * kk + 1][0] - low_bf16(h1), s[2 * kk + 1][1] - high_bf16(h1));
}

// The online-softmax step of a tile of 32 positions for head g, whose state (running max m,
// this thread's share l of the sum) lives in the row group's four lanes: s[n][0..1] are head g's
// raw scores at positions base + 8 n + 2 t, + 1; scaled, -inf past `length`, then replaced by
// exp(s - new max). Returns the factor exp(old max - new max) the old P.V sums take (position
// base is valid, so the new max is finite).
template <class P>
__device__ __forceinline__ float softmax_tile(float (&s)[4][4], P base, int t, P length,
                                              float scale, float& m, float& l) {
  float mx = -INFINITY;
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[n][i] = base + 8 * n + 2 * t + i < length ? s[n][i] * scale : -INFINITY;
      mx = fmaxf(mx, s[n][i]);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx);
  const float corr = expf(m - m_new);
  m = m_new;
  float sum = 0.0f;
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[n][i] = expf(s[n][i] - m_new); // 0 past the end
      sum += s[n][i];
    }
  l = l * corr + sum;
  return corr;
}

// The end of a tensor-core kernel's block: head g's sum l gathered from its four lanes, the NW
// warps' (max, sum) and P.V (`store(sacc)` writes the warp's P.V at sacc[(warp * 8 + head) * D
// + dim]) into shared memory `smem` (free by then), and combine_warps.
template <int D, int G, int NW, class Store>
__device__ __forceinline__ void finish_warps(float m, float l, unsigned char* smem, Store&& store,
                                             int b, int head0, int hq, int split, int splits,
                                             bf16* __restrict__ out, float* __restrict__ partial) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads(); // the combine reuses the shared memory
  float* sm = reinterpret_cast<float*>(smem);
  float* sl = sm + NW * 8;
  float* sacc = sl + NW * 8;
  if ((lane & 3) == 0) {
    sm[warp * 8 + (lane >> 2)] = m;
    sl[warp * 8 + (lane >> 2)] = l;
  }
  store(sacc);
  __syncthreads();
  combine_warps<D, G, NW, 8>(sm, sl, sacc, b, head0, hq, split, splits, out, partial);
}

// decode_attention's arguments, checked.
struct attention_call {
  const void* q;
  kv_target kv;
  const i64* table;
  int width;
  const i64* lengths;
  void* out;
  float* partial;
  int splits, b, hq, hkv;
  int mode; // decode_attention's
  const attention_qk* qk;
  int warps; // mode 2's warps a block: 4, 6 or 8
};

// Mode 2's kernel (torch_kernels_attention_t.cu, instantiated for D 64 and 128, G 1, 2, 4 and 8,
// 4, 6 or 8 warps a block) over grid (b, hkv, splits), with its own q/k when a.qk is set; the
// merge is the caller's.
template <int D, int G>
void launch_transposed(const attention_call& a, cudaStream_t s);

} // namespace refit::inference::kernels::attention_detail
