// The routed experts' tensor-core kernels' shared device pieces (torch_kernels_expert_mma.cu:
// one block row per expert; torch_kernels_expert_stream.cu: resident warps streaming a sequence
// of expert tiles): the weight stream's loads and cp.async stages, the MMAs of one k-iteration,
// and the write of a finished tile.
#pragma once

#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_common.cuh"

namespace refit::inference::kernels::detail {

constexpr int mma_warps = 8;       // per block
constexpr int mma_token_tiles = 4; // tiles of 8 tokens per pass over an expert's weights

// An L2 policy for the weight stream: evict-first (the weights are read once; the token rows,
// read by every block of an expert, stay) or normal.
__device__ __forceinline__ unsigned long long stream_policy(bool evict_first) {
  unsigned long long p;
  if (evict_first)
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  else
    asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
  return p;
}

// 16 bytes of weights read once: not kept in L1; L2 fetches the 256 bytes around them (the
// row's next k-steps) under `policy`.
__device__ __forceinline__ uint4 load_stream(const bf16* p, unsigned long long policy) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p), "l"(policy));
  return v;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// One k-iteration's weight chunks of the thread's two rows.
template <int CH>
__device__ __forceinline__ void load_stage(const bf16* wa, const bf16* wb, int k0,
                                           unsigned long long policy, uint4 (&a)[CH],
                                           uint4 (&b)[CH]) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    a[c] = load_stream(wa + k0 + c * 32, policy);
    b[c] = load_stream(wb + k0 + c * 32, policy);
  }
}

// The MMAs of one k-iteration for the live token tiles.
template <int CH, int TT>
__device__ __forceinline__ void mma_stage(const bf16* const (&xr)[TT], int off, int tiles,
                                          const uint4 (&a)[CH], const uint4 (&b)[CH],
                                          float (&acc)[TT][4]) {
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) {
    if (tt < tiles) {
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const uint4 xv = __ldg(reinterpret_cast<const uint4*>(xr[tt] + off + c * 32));
        mma_bf16(acc[tt], a[c].x, b[c].x, a[c].y, b[c].y, xv.x, xv.y);
        mma_bf16(acc[tt], a[c].z, b[c].z, a[c].w, b[c].w, xv.z, xv.w);
      }
    }
  }
}

// One stage of a warp's ring: CH chunks of its two rows for each of the 32 lanes, in uint4s.
template <int CH>
constexpr int stage_uint4s = CH * 2 * 32;

// Shared memory of a block's rings: S stages of its 8 warps.
template <int CH, int S>
constexpr int ring_bytes = S * mma_warps * stage_uint4s<CH> * 16;

// The same k-iteration's chunks copied to shared memory (cp.async, no registers held while in
// flight): lane l's chunk (c, row r) of a stage sits at uint4 ((c * 2 + r) * 32 + l) of the
// stage's slot, so each lane reads back only what it wrote (no barrier; 512 contiguous bytes a
// warp per chunk: no bank conflicts).
__device__ __forceinline__ void cp_async_stream(uint4* dst, const bf16* src,
                                                unsigned long long policy) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;"
               ::"r"(d), "l"(src), "l"(policy) : "memory");
}

template <int CH>
__device__ __forceinline__ void copy_stage(uint4* slot, const bf16* wa, const bf16* wb, int k0,
                                           unsigned long long policy) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    cp_async_stream(slot + (c * 2) * 32, wa + k0 + c * 32, policy);
    cp_async_stream(slot + (c * 2 + 1) * 32, wb + k0 + c * 32, policy);
  }
}

// The same stage with each copy instruction taking whole row segments: the warp tile's 16 rows
// (8 of wa's half, rows g = 0..7 of it, then 8 of wb's) of CH * 64 bytes at stage offset k0,
// 4 * CH lanes a row and 8 / CH rows an instruction, instead of 8 rows x 64 bytes. A chunk lands
// where copy_stage puts it (row h * 8 + g, 16-byte chunk j = t + 4c: uint4 (c * 2 + h) * 32 +
// g * 4 + t of the slot), so read_stage is unchanged; but lanes now fill each other's places:
// wait for the stage, then __syncwarp before reading it, and again before refilling it.
// wa, wb: this lane's rows (row g of each half, as for copy_stage); k: the row length.
template <int CH>
__device__ __forceinline__ void copy_stage_lines(uint4* slot_lane, const bf16* wa,
                                                 const bf16* wb, int k0, int k,
                                                 unsigned long long policy) {
  constexpr int per_row = 4 * CH;         // lanes copying one row's segment
  constexpr int rows_per = 32 / per_row;  // rows an instruction
  const int lane = threadIdx.x & 31;
  const i64 g = lane >> 2;
  uint4* slot = slot_lane - lane;
  const bf16* a0 = wa - g * k; // row 0 of each half
  const bf16* b0 = wb - g * k;
  const int q = lane / per_row, j = lane % per_row;
#pragma unroll
  for (int i = 0; i < 2 * CH; ++i) {
    const int h = (i * rows_per) >> 3; // the half: the same for the whole instruction
    const int r = ((i * rows_per) & 7) + q;
    cp_async_stream(slot + ((j >> 2) * 2 + h) * 32 + r * 4 + (j & 3),
                    (h == 0 ? a0 : b0) + static_cast<i64>(r) * k + k0 + j * 8, policy);
  }
}

// copy_stage (at the lane's own k, lane_k0 = k0 + t * 8) or, with `lines`, copy_stage_lines.
template <int CH>
__device__ __forceinline__ void copy_stage_as(bool lines, uint4* slot, const bf16* wa,
                                              const bf16* wb, int lane_k0, int k,
                                              unsigned long long policy) {
  if (lines)
    copy_stage_lines<CH>(slot, wa, wb, lane_k0 - (threadIdx.x & 3) * 8, k, policy);
  else
    copy_stage<CH>(slot, wa, wb, lane_k0, policy);
}

template <int CH>
__device__ __forceinline__ void read_stage(const uint4* slot, uint4 (&a)[CH], uint4 (&b)[CH]) {
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    a[c] = slot[(c * 2) * 32];
    b[c] = slot[(c * 2 + 1) * 32];
  }
}

// The token rows of a pass: tile tt's B row for this lane (row group g) is copy
// first + base + 8 tt + g of the expert's sorted copies (its x row: x_rows[copy], or the copy
// itself), offset to the lane's k; past the last copy, the last one (a real row, its sums unused).
template <int TT>
__device__ __forceinline__ void token_rows(const bf16* x, const i64* x_rows, i64 first, int base,
                                           int count, int k, int lane_k, const bf16* (&xr)[TT]) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int tt = 0; tt < TT; ++tt) {
    const int q = first + min(base + tt * 8 + g, count - 1);
    xr[tt] = x + (x_rows != nullptr ? x_rows[q] : static_cast<i64>(q)) * k + lane_k;
  }
}

// A finished warp tile's sums, token tiles [0, tiles) of the pass at `base` of the expert's
// `count` copies (sorted rows first .. first + count - 1): GLU, y bf16 [copies, cols] =
// silu(gate) * up at column tile * 8 + g; else rows ra and rb of y (bf16, or fp32 with y_f32).
template <bool GLU, int TT>
__device__ __forceinline__ void write_tile(const float (&acc)[TT][4], int tiles, int base,
                                           int count, i64 first, int tile, i64 ra, i64 rb,
                                           int cols, void* __restrict__ y_out, bool y_f32) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  bf16* y = static_cast<bf16*>(y_out);
  float* yf = static_cast<float*>(y_out);
#pragma unroll
  for (int tt = 0; tt < TT; ++tt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int token = base + tt * 8 + 2 * t + j;
      if (tt >= tiles || token >= count)
        continue;
      const i64 p = first + token;
      if (GLU) {
        y[p * cols + tile * 8 + g] = to_bf(silu(acc[tt][j]) * acc[tt][2 + j]);
      } else if (y_f32) {
        yf[p * cols + ra] = acc[tt][j];
        yf[p * cols + rb] = acc[tt][2 + j];
      } else {
        y[p * cols + ra] = to_bf(acc[tt][j]);
        y[p * cols + rb] = to_bf(acc[tt][2 + j]);
      }
    }
}

// expert_mma at k-split 1 with resident warps (expert_mma_args::persistent;
// torch_kernels_expert_stream.cu): `chunks` per lane and k-step, experts by id.
void expert_stream(const expert_mma_args& a, int chunks, int experts, cudaStream_t s);

} // namespace refit::inference::kernels::detail
