// The dense projections of a decode step's few tokens on the tensor cores (torch_kernels.hpp:
// skinny_gemm): y = x . w^T for up to 64 token rows, a GEMM shaped like a GEMV whose weight
// bytes set the time. A block takes 64 weight rows and all the token rows over a k-slice; the
// weight and token tiles come through cp.async stages in shared memory (the token tile shared
// by the block's four warps, read by ldmatrix), so each weight byte and each token byte leave
// L2 once per block. The weights' first stages are copied before the wait for the kernel before
// (they do not depend on it). The k-slices' partial sums meet through a workspace: the last
// slice of a tile to finish (an atomic count) adds them in slice order, so the result does not
// depend on which finished last.
#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_common.cuh"

#include <string>

namespace refit::inference::kernels {

using namespace detail;

namespace {

constexpr int sk_rows = 64;            // weight rows of a block (4 warps x 16)
constexpr int sk_threads = 128;
constexpr int sk_bk = 64;              // k of a stage: 128 bytes a row
constexpr int sk_stages = 4;
constexpr int sk_tile_bytes = 64 * 128; // 64 rows of one stage
constexpr int sk_max_ksplit = 16;
constexpr int sk_partial_floats = 32;  // a thread's accumulators: 8 token tiles x 4

template <int PARTS>
constexpr int sk_smem_bytes = sk_stages * (1 + PARTS) * sk_tile_bytes;

// 16 bytes into shared memory; the weights' copies also have L2 fetch the row's next stage
// (256 bytes around them: one DRAM request for two stages of a row).
template <bool PREFETCH>
__device__ __forceinline__ void sk_copy(unsigned char* dst, const bf16* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if (PREFETCH)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src)
                 : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

// One stage's 64 rows x 64 k of a row-major [rows, k] matrix at column k0: 16-byte chunk c of
// row r lands at byte r * 128 + (c ^ (r % 8)) * 16 (the 8 rows of an ldmatrix matrix fall in 8
// different bank groups). Rows past `limit` repeat row limit - 1 (real data, never written out).
// (No L2 eviction hint: with one, this kernel's first hinted copy faulted as an illegal
// instruction on the H200, compute-sanitizer pointing at that LDGSTS and its policy operand.)
template <bool PREFETCH>
__device__ __forceinline__ void sk_stage(unsigned char* tile, const bf16* src, int k, int k0,
                                         int limit) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int q = threadIdx.x + i * sk_threads; // chunk q of 512
    const int r = q >> 3;
    const int c = q & 7;
    const bf16* s = src + static_cast<i64>(r < limit ? r : limit - 1) * k + k0 + c * 8;
    unsigned char* d = tile + r * 128 + ((c ^ (r & 7)) << 4);
    sk_copy<PREFETCH>(d, s);
  }
}

__device__ __forceinline__ void sk_ldmatrix(unsigned (&r)[4], const unsigned char* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The MMAs of one stage for the warp's 16 weight rows against the live token tiles: A (weight
// rows) and B (token rows, as the columns) both by ldmatrix from the swizzled tiles.
__device__ __forceinline__ void sk_mma_stage(const unsigned char* wt, const unsigned char* xt,
                                             int pairs, float (&acc)[8][4]) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int ar = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8; // a0 / a1 rows; a2 / a3: +8 k
  const int br_lane = ((lane >> 4) << 3) + (lane & 7); // token within the tile pair
  const int bk = (lane >> 3) & 1;                      // b0 / b1: k 0..7 / 8..15 of the step
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    unsigned a[4];
    const int ac = 2 * ks + (lane >> 4);
    sk_ldmatrix(a, wt + ar * 128 + ((ac ^ (ar & 7)) << 4));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < pairs) {
        unsigned b[4]; // b0, b1 of token tile 2j; b0, b1 of 2j + 1
        const int br = 16 * j + br_lane;
        const int bc = 2 * ks + bk;
        sk_ldmatrix(b, xt + br * 128 + ((bc ^ (br & 7)) << 4));
        mma_bf16(acc[2 * j], a[0], a[1], a[2], a[3], b[0], b[1]);
        mma_bf16(acc[2 * j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
    }
  }
}

// The thread's sums out: acc[nt][i] is y[token 8 nt + 2t + i % 2][row g + 8 (i / 2)] of the
// warp's 16 rows.
__device__ __forceinline__ void sk_write(const float (&acc)[8][4], void* __restrict__ y,
                                         bool y_f32, int m, int n, int row0) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const i64 ra = row0 + (threadIdx.x >> 5) * 16 + g;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int token = 8 * nt + 2 * t + i;
      if (token >= m)
        continue;
      const i64 at = static_cast<i64>(token) * n + ra;
      if (y_f32) {
        static_cast<float*>(y)[at] = acc[nt][i];
        static_cast<float*>(y)[at + 8] = acc[nt][2 + i];
      } else {
        static_cast<bf16*>(y)[at] = to_bf(acc[nt][i]);
        static_cast<bf16*>(y)[at + 8] = to_bf(acc[nt][2 + i]);
      }
    }
}

// Block (tile, slice): weight rows tile * 64 .. + 63 over k-slice `slice` of ksplit; x and (PARTS
// 2) x_lo [m, k] both against the same weights into the same sums (the router's two bf16
// parts). ksplit > 1: partial sums through ws [ksplit][tiles][128 threads][32], counters[tile]
// counts the finished slices (back to 0 by the last one, for the next call).
template <int PARTS>
__global__ void __launch_bounds__(sk_threads)
  skinny_gemm_kernel(const bf16* __restrict__ x, const bf16* __restrict__ x_lo,
                     const bf16* __restrict__ w, void* __restrict__ y, bool y_f32, int m, int n,
                     int k, int ksplit, float* __restrict__ ws, int* __restrict__ counters) {
  extern __shared__ __align__(128) unsigned char sk_smem[];
  __shared__ int sk_last;
  const int tile = blockIdx.x;
  const int slice = blockIdx.y;
  const int span = k / ksplit;
  const int k_begin = slice * span;
  const int iters = span / sk_bk;
  const bf16* wt = w + static_cast<i64>(tile) * sk_rows * k;
  const auto stage = [&](int s) { return sk_smem + s * (1 + PARTS) * sk_tile_bytes; };
  // The weights of the first stages before the wait (they belong to commit group 0).
#pragma unroll
  for (int s = 0; s < sk_stages - 1; ++s)
    if (s < iters)
      sk_stage<true>(stage(s), wt, k, k_begin + s * sk_bk, sk_rows);
  pdl_enter();
#pragma unroll
  for (int s = 0; s < sk_stages - 1; ++s) {
    if (s < iters) {
      sk_stage<false>(stage(s) + sk_tile_bytes, x, k, k_begin + s * sk_bk, m);
      if (PARTS == 2)
        sk_stage<false>(stage(s) + 2 * sk_tile_bytes, x_lo, k, k_begin + s * sk_bk, m);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  const int pairs = (m + 15) / 16; // token tile pairs holding a live row
  float acc[8][4] = {};
  for (int it = 0; it < iters; ++it) {
    asm volatile("cp.async.wait_group %0;" ::"n"(sk_stages - 2) : "memory"); // stage it, mine
    __syncthreads(); // everyone's copies of stage it landed; stage it - 1 read by all
    const int next = it + sk_stages - 1;
    if (next < iters) { // into the slot stage it - 1 used
      unsigned char* st = stage(next % sk_stages);
      const int k0 = k_begin + next * sk_bk;
      sk_stage<true>(st, wt, k, k0, sk_rows);
      sk_stage<false>(st + sk_tile_bytes, x, k, k0, m);
      if (PARTS == 2)
        sk_stage<false>(st + 2 * sk_tile_bytes, x_lo, k, k0, m);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    const unsigned char* st = stage(it % sk_stages);
    sk_mma_stage(st, st + sk_tile_bytes, pairs, acc);
    if (PARTS == 2)
      sk_mma_stage(st, st + 2 * sk_tile_bytes, pairs, acc);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  const int row0 = tile * sk_rows;
  if (ksplit == 1) {
    sk_write(acc, y, y_f32, m, n, row0);
    return;
  }
  const int tiles = gridDim.x;
  float4* mine = reinterpret_cast<float4*>(
    ws + ((static_cast<i64>(slice) * tiles + tile) * sk_threads + threadIdx.x) * sk_partial_floats);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
    mine[nt] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
  __threadfence(); // the partial sums before the count
  __syncthreads();
  if (threadIdx.x == 0)
    sk_last = atomicAdd(counters + tile, 1) == ksplit - 1;
  __syncthreads();
  if (!sk_last)
    return;
  __threadfence(); // the other slices' sums after their counts
  // Two slices' partial sums in flight at a time (one L2 round trip per pair, not per slice),
  // added in slice order: the same bits whichever slice is last.
  float sum[8][4] = {};
  const auto partial = [&](int s) {
    return reinterpret_cast<const float4*>(
      ws + ((static_cast<i64>(s) * tiles + tile) * sk_threads + threadIdx.x) * sk_partial_floats);
  };
  const auto add = [&](const float4 (&v)[8]) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      sum[nt][0] += v[nt].x;
      sum[nt][1] += v[nt].y;
      sum[nt][2] += v[nt].z;
      sum[nt][3] += v[nt].w;
    }
  };
  for (int s = 0; s < ksplit; s += 2) { // ksplit is even here
    float4 a[8], b[8];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float4 own = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
      a[nt] = s == slice ? own : __ldcg(partial(s) + nt);
      b[nt] = s + 1 == slice ? own : __ldcg(partial(s + 1) + nt);
    }
    add(a);
    add(b);
  }
  if (threadIdx.x == 0)
    counters[tile] = 0;
  sk_write(sum, y, y_f32, m, n, row0);
}

bool ksplit_fits(int k, int ksplit) {
  return ksplit >= 1 && ksplit <= sk_max_ksplit && (ksplit & (ksplit - 1)) == 0
         && k % (sk_bk * ksplit) == 0;
}

} // namespace

bool skinny_gemm_supported(int m, int n, int k) {
  return m >= 1 && m <= skinny_max_rows && n >= sk_rows && n % sk_rows == 0 && k >= sk_bk
         && k % sk_bk == 0;
}

int skinny_gemm_ksplit(int m, int n, int k, int wanted) {
  if (!skinny_gemm_supported(m, n, k))
    return 0;
  if (wanted > 0)
    return ksplit_fits(k, wanted) ? wanted : 0;
  // About 1.5 blocks an SM (a block keeps 3 stages of 8 KiB of weights in flight), slices of at
  // least 4 stages.
  const int tiles = n / sk_rows;
  const int want_blocks = 3 * multiprocessors() / 2;
  int chosen = 1;
  for (int ks = 2; ks <= sk_max_ksplit; ks *= 2) {
    if (tiles * chosen >= want_blocks || !ksplit_fits(k, ks) || k / ks < 4 * sk_bk)
      break;
    chosen = ks;
  }
  return chosen;
}

std::size_t skinny_gemm_workspace_floats(int n, int ksplit) {
  return ksplit > 1 ? static_cast<std::size_t>(ksplit) * static_cast<std::size_t>(n / sk_rows)
                        * sk_threads * sk_partial_floats
                    : 0;
}

void skinny_gemm(const skinny_gemm_args& a, int ksplit, void* stream) {
  if (!skinny_gemm_supported(a.m, a.n, a.k) || !ksplit_fits(a.k, ksplit))
    throw std::invalid_argument("skinny_gemm: m " + std::to_string(a.m) + ", n "
                                + std::to_string(a.n) + ", k " + std::to_string(a.k)
                                + ", ksplit " + std::to_string(ksplit)
                                + " (m 1.." + std::to_string(skinny_max_rows)
                                + ", n and k multiples of 64, k a multiple of 64 x ksplit)");
  if (ksplit > 1 && (a.workspace == nullptr || a.counters == nullptr
                     || a.workspace_floats < skinny_gemm_workspace_floats(a.n, ksplit)))
    throw std::invalid_argument("skinny_gemm: ksplit " + std::to_string(ksplit)
                                + " needs a workspace of "
                                + std::to_string(skinny_gemm_workspace_floats(a.n, ksplit))
                                + " floats and n / 64 zeroed counters");
  const dim3 grid(a.n / sk_rows, ksplit);
  const auto* x = static_cast<const bf16*>(a.x);
  const auto* w = static_cast<const bf16*>(a.w);
  if (a.x_lo != nullptr)
    launch_smem("skinny_gemm", skinny_gemm_kernel<2>, grid, dim3(sk_threads), sk_smem_bytes<2>,
                as_stream(stream), x, static_cast<const bf16*>(a.x_lo), w, a.y, a.y_f32, a.m, a.n,
                a.k, ksplit, a.workspace, a.counters);
  else
    launch_smem("skinny_gemm", skinny_gemm_kernel<1>, grid, dim3(sk_threads), sk_smem_bytes<1>,
                as_stream(stream), x, static_cast<const bf16*>(nullptr), w, a.y, a.y_f32, a.m,
                a.n, a.k, ksplit, a.workspace, a.counters);
}

} // namespace refit::inference::kernels
