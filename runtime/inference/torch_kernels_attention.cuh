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

// Mode 2's kernel (torch_kernels_attention_t.cu) over grid (b, hkv, splits) for head_dim d and
// group hq / hkv up to 8 (decode_attention checked the arguments); the merge is the caller's.
void launch_transposed(const void* q, kv_target kv, const i64* table, int width,
                       const i64* lengths, void* out, float* partial, int splits, int b, int hq,
                       int hkv, int d, cudaStream_t s);

} // namespace refit::inference::kernels::attention_detail
