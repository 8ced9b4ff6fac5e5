// The dense projections of a decode step whose weights wait in shared memory (torch_kernels.hpp:
// preload_gemm): y = (x (+ x_lo)) . w^T for up to 64 token rows.
//
// Why: at 64 rows qkv, o_proj and the router are latency-bound cuBLAS kernels that take no part
// in programmatic dependent launch, so the kernel after each cannot start early and the one
// before cannot overlap it. The weights do not depend on the kernel before, so each block here
// copies its whole slice of them into shared memory before griddepcontrol.wait: the copies
// stream while the kernel before finishes, and after the wait only the token rows are read.
//
// Layout: a thread-block cluster of `split` blocks per tile of NT weight rows, block `rank`
// taking k columns [rank KS, (rank + 1) KS) of them (a block per SM: the grid must fit in one
// wave, plan_preload_gemm checks it). A warp (rg, kg) of the block's WR x WK warps holds RT
// 16-row A tiles (rows rg RT 16 ..) over KC 32-wide k chunks (kg KC 32 ..). Lane (g, t) copies
// the 16 bytes of rows g and g + 8 at k 8t .. 8t + 7 of each chunk into its own slots, and
// reads back only those (no barrier; consecutive lanes, consecutive 16 bytes: no bank
// conflicts): the A fragments of two k16 steps in the order the expert kernels use, the token
// rows (B) read in the same order from a shared tile (chunk q of token row r at q ^ 4 (r & 1):
// the two rows of an 8-lane phase in different banks).
// Sums: each warp's in mma order; the block's WK warps added in kg order in shared memory;
// the cluster's blocks added in rank order by the block that owns NT / split of the tile's rows,
// reading the others' shared memory (distributed shared memory). The same bits run to run.
#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_common.cuh"

#include <cooperative_groups.h>

#include <string>

namespace refit::inference::kernels {

using namespace detail;
namespace cg = cooperative_groups;

namespace {

// One block shape: RT A tiles and KC k chunks a warp, WR x WK warps.
template <int RT_, int KC_, int WR_, int WK_, int NG_>
struct preload_shape {
  static constexpr int RT = RT_, KC = KC_, WR = WR_, WK = WK_;
  static constexpr int NG = NG_; // cp.async groups of the weight copies (k chunks in order)
  static constexpr int warps = WR * WK;
  static constexpr int threads = warps * 32;
  static constexpr int NT = WR * RT * 16; // weight rows of a tile
  static constexpr int KW = KC * 32;      // k of a warp
  static constexpr int KS = WK * KW;      // k of a block
  static constexpr int weight_uint4s = warps * RT * KC * 2 * 32;
  static_assert(KC % NG == 0, "preload_gemm: groups of whole chunks");
};

// The shapes, by index (preload_gemm_plan::shape): 0 qkv-like (160 rows x 512 k, 160 KiB of
// weights: Qwen3-30B-A3B's qkv in 32 clusters of 4), 1 o_proj-like (128 x 512, 128 KiB: its
// o_proj in 16 clusters of 8), 2 the router's two parts (16 x 256, 8 KiB: 8 clusters of 8);
// 3 and 4, one and two parts at 32 x 128 and 16 x 128, for the small models of hidden size 256
// to 1024 (the engine tests'); 5 (320 x 256, 160 KiB) the qkv in 16 clusters of 8, for a device
// that holds 16 of those but not 32 clusters of 4 (how its SMs are spread over GPCs decides);
// 6 (352 x 256, 176 KiB) the qkv in 15 clusters of 8, the last tile ragged, for a device that
// holds neither (an H200 and an H100 held 30 clusters of 4 and 15 of 8, or fewer).
// (10 warps of 4 A tiles each at 320 x 256 spilled registers at 64 rows: shapes 5 and 6 have 10
// and 11 warps of 2 A tiles, each over the block's whole k.)
// Ragged tiles: where no tile divides n (n a multiple of 16), the last tile's rows past n copy
// row n - 1 (read, never written) and its outputs past n are not written.
using shape0 = preload_shape<2, 8, 5, 2, 4>;
using shape1 = preload_shape<4, 4, 2, 4, 4>;
using shape2 = preload_shape<1, 1, 1, 8, 1>;
using shape3 = preload_shape<1, 2, 2, 2, 1>;
using shape4 = preload_shape<1, 1, 1, 4, 1>;
using shape5 = preload_shape<2, 8, 10, 1, 4>;
using shape6 = preload_shape<2, 8, 11, 1, 4>;
constexpr int shape_count = 7;

// Floats of a token row in the partial sums: NT + 4, so that the lanes of a warp writing
// rows g and tokens 2t fall in 32 different banks.
template <class S>
constexpr int partial_stride = S::NT + 4;

template <class S, int MT, int PARTS>
constexpr int token_bytes = PARTS * MT * 8 * S::KS * 2;

template <class S, int MT>
constexpr int partial_bytes = S::WK * MT * 8 * partial_stride<S> * 4;

template <class S, int MT, int PARTS>
constexpr int smem_bytes = (S::weight_uint4s * 16 + token_bytes<S, MT, PARTS>) > partial_bytes<S, MT>
                             ? S::weight_uint4s * 16 + token_bytes<S, MT, PARTS>
                             : partial_bytes<S, MT>;

__device__ __forceinline__ void copy16(uint4* dst, const bf16* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

template <int N>
__device__ __forceinline__ void wait_groups() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// f(integral_constant<G>) for G = FIRST .. END - 1, in order (wait_groups needs constants).
template <int FIRST, int END, class F>
__device__ __forceinline__ void for_groups(const F& f) {
  if constexpr (FIRST < END) {
    f(std::integral_constant<int, FIRST>{});
    for_groups<FIRST + 1, END>(f);
  }
}

// The token rows [0, 8 MT) of each part over the block's k columns into the shared tile (zeros
// past m), read through L2: the kernel before wrote them.
template <class S, int MT, int PARTS>
__device__ __forceinline__ void load_tokens(uint4* tile, const bf16* x, const bf16* x_lo, int m,
                                            int k, int k0) {
  constexpr int row_chunks = S::KS / 8;
  constexpr int total = PARTS * MT * 8 * row_chunks;
  constexpr int batch = 8;
  for (int base = threadIdx.x; base < total; base += batch * S::threads) {
    uint4 v[batch];
#pragma unroll
    for (int i = 0; i < batch; ++i) {
      const int idx = base + i * S::threads;
      const int part = idx / (MT * 8 * row_chunks);
      const int r = (idx / row_chunks) % (MT * 8);
      const int q = idx % row_chunks;
      const bf16* src = (part == 0 ? x : x_lo) + static_cast<i64>(r) * k + k0 + q * 8;
      v[i] = idx < total && r < m ? __ldcg(reinterpret_cast<const uint4*>(src))
                                  : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < batch; ++i) {
      const int idx = base + i * S::threads;
      if (idx < total) {
        const int part = idx / (MT * 8 * row_chunks);
        const int r = (idx / row_chunks) % (MT * 8);
        const int q = idx % row_chunks;
        tile[(part * MT * 8 + r) * row_chunks + (q ^ ((r & 1) << 2))] = v[i];
      }
    }
  }
}

template <class S, int MT, int PARTS>
__global__ void __launch_bounds__(S::threads, 1)
  preload_gemm_kernel(const bf16* __restrict__ x, const bf16* __restrict__ x_lo,
                      const bf16* __restrict__ w, void* __restrict__ y, bool y_f32, int m, int n,
                      int k) {
  extern __shared__ __align__(128) unsigned char preload_smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int split = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int rg = warp % S::WR;
  const int kg = warp / S::WR;
  const int k0 = rank * S::KS;
  const int row0 = blockIdx.y * S::NT;
  uint4* const wslots = reinterpret_cast<uint4*>(preload_smem) + warp * (S::RT * S::KC * 2 * 32);
  uint4* const tokens = reinterpret_cast<uint4*>(preload_smem) + S::weight_uint4s;

  // The weights, before the wait: chunk c of A tile rt, rows g (h 0) and g + 8 (h 1), at slot
  // ((c RT + rt) 2 + h) 32 + lane; NG commit groups of KC / NG chunks each. A ragged tile's
  // rows past n read row n - 1 instead (their sums are never written).
  {
    const bf16* wrows[S::RT][2];
#pragma unroll
    for (int rt = 0; rt < S::RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = min(row0 + (rg * S::RT + rt) * 16 + h * 8 + g, n - 1);
        wrows[rt][h] = w + static_cast<i64>(row) * k + k0 + kg * S::KW + 8 * t;
      }
#pragma unroll
    for (int grp = 0; grp < S::NG; ++grp) {
#pragma unroll
      for (int cc = 0; cc < S::KC / S::NG; ++cc) {
        const int c = grp * (S::KC / S::NG) + cc;
#pragma unroll
        for (int rt = 0; rt < S::RT; ++rt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            copy16(wslots + ((c * S::RT + rt) * 2 + h) * 32 + lane, wrows[rt][h] + c * 32);
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  }
  pdl_enter();
  load_tokens<S, MT, PARTS>(tokens, x, x_lo, m, k, k0);
  __syncthreads();

  float acc[S::RT][MT][4] = {};
  constexpr int row_chunks = S::KS / 8;
  const auto group = [&](auto grp_c) {
    constexpr int grp = decltype(grp_c)::value;
    wait_groups<S::NG - 1 - grp>(); // this lane's copies of group grp landed
#pragma unroll
    for (int cc = 0; cc < S::KC / S::NG; ++cc) {
      const int c = grp * (S::KC / S::NG) + cc;
      uint4 a[S::RT][2];
#pragma unroll
      for (int rt = 0; rt < S::RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          a[rt][h] = wslots[((c * S::RT + rt) * 2 + h) * 32 + lane];
      const int q = (kg * S::KW + c * 32) / 8 + t;
#pragma unroll
      for (int nt = 0; nt < MT; ++nt) {
        if (nt * 8 >= m)
          break;
        const int r = nt * 8 + g;
#pragma unroll
        for (int p = 0; p < PARTS; ++p) {
          const uint4 b = tokens[(p * MT * 8 + r) * row_chunks + (q ^ ((r & 1) << 2))];
#pragma unroll
          for (int rt = 0; rt < S::RT; ++rt) {
            mma_bf16(acc[rt][nt], a[rt][0].x, a[rt][1].x, a[rt][0].y, a[rt][1].y, b.x, b.y);
            mma_bf16(acc[rt][nt], a[rt][0].z, a[rt][1].z, a[rt][0].w, a[rt][1].w, b.z, b.w);
          }
        }
      }
    }
  };
  for_groups<0, S::NG>(group);

  // The warp's sums into partial[kg][token][row] (fp32, rows NT + 4 apart), over the weights
  // and tokens every warp is done with.
  __syncthreads();
  constexpr int stride = partial_stride<S>;
  float* const partial = reinterpret_cast<float*>(preload_smem);
#pragma unroll
  for (int rt = 0; rt < S::RT; ++rt)
#pragma unroll
    for (int nt = 0; nt < MT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = (rg * S::RT + rt) * 16 + g + (i >> 1) * 8;
        const int token = nt * 8 + 2 * t + (i & 1);
        partial[(kg * MT * 8 + token) * stride + row] = acc[rt][nt][i];
      }
  __syncthreads();
  // The block's sum (kg order) into partial[0], two rows at a time, live tokens only.
  if (S::WK > 1) {
    for (int e = threadIdx.x; e < m * (S::NT / 2); e += S::threads) {
      const int token = e / (S::NT / 2);
      const int row = (e % (S::NT / 2)) * 2;
      float2 s = *reinterpret_cast<const float2*>(partial + token * stride + row);
#pragma unroll
      for (int j = 1; j < S::WK; ++j) {
        const float2 v =
          *reinterpret_cast<const float2*>(partial + (j * MT * 8 + token) * stride + row);
        s.x += v.x;
        s.y += v.y;
      }
      *reinterpret_cast<float2*>(partial + token * stride + row) = s;
    }
  }
  cluster.sync(); // every block's sum is in its partial[0]
  // This block's rows of the tile: the cluster's sums in rank order, two rows at a time (none
  // past n: n is even).
  const int own = S::NT / split;
  for (int e = threadIdx.x; e < m * (own / 2); e += S::threads) {
    const int token = e / (own / 2);
    const int row = rank * own + (e % (own / 2)) * 2;
    if (row0 + row >= n)
      continue;
    float2 s = make_float2(0.0f, 0.0f);
    for (int r = 0; r < split; ++r) {
      const float* peer = cluster.map_shared_rank(partial, r);
      const float2 v = *reinterpret_cast<const float2*>(peer + token * stride + row);
      s.x += v.x;
      s.y += v.y;
    }
    const i64 at = static_cast<i64>(token) * n + row0 + row;
    if (y_f32) {
      *reinterpret_cast<float2*>(static_cast<float*>(y) + at) = s;
    } else {
      __nv_bfloat162 o;
      o.x = to_bf(s.x);
      o.y = to_bf(s.y);
      *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(y) + at) = o;
    }
  }
  cluster.sync(); // no block leaves while another reads its shared memory
}

// f(shape, MT, PARTS) for the compiled (shape index, token tiles, parts).
template <class F>
bool with_kernel(int shape, int token_tiles, int parts, F&& f) {
  const auto by_tiles = [&](auto s, auto p) {
    switch (token_tiles) {
      case 2: f(s, std::integral_constant<int, 2>{}, p); return true;
      case 4: f(s, std::integral_constant<int, 4>{}, p); return true;
      case 8: f(s, std::integral_constant<int, 8>{}, p); return true;
    }
    return false;
  };
  constexpr std::integral_constant<int, 1> one{};
  switch (shape) {
    case 0: return parts == 1 && by_tiles(shape0{}, one);
    case 1: return parts == 1 && by_tiles(shape1{}, one);
    case 2: return parts == 2 && by_tiles(shape2{}, std::integral_constant<int, 2>{});
    case 3: return parts == 1 && by_tiles(shape3{}, one);
    case 4: return parts == 2 && by_tiles(shape4{}, std::integral_constant<int, 2>{});
    case 5: return parts == 1 && by_tiles(shape5{}, one);
    case 6: return parts == 1 && by_tiles(shape6{}, one);
  }
  return false;
}

int token_tiles_for(int m) { return m <= 16 ? 2 : (m <= 32 ? 4 : 8); }

struct shape_facts {
  int tile_rows = 0, k_block = 0, threads = 0, smem = 0;
  const void* kernel = nullptr;
};

shape_facts facts(int shape, int token_tiles, int parts) {
  shape_facts f;
  with_kernel(shape, token_tiles, parts, [&](auto s, auto mt, auto p) {
    using S = decltype(s);
    constexpr int MT = decltype(mt)::value;
    constexpr int PARTS = decltype(p)::value;
    f.tile_rows = S::NT;
    f.k_block = S::KS;
    f.threads = S::threads;
    f.smem = smem_bytes<S, MT, PARTS>;
    f.kernel = reinterpret_cast<const void*>(preload_gemm_kernel<S, MT, PARTS>);
  });
  return f;
}

// Whether `split` blocks a cluster can take the shape's tiles: 2, 4 or 8 (portable cluster
// sizes), each block owning an even number of the tile's rows (written two at a time).
bool split_usable(const shape_facts& f, int split) {
  return (split == 2 || split == 4 || split == 8) && (f.tile_rows / split) % 2 == 0;
}

// Clusters of `split` blocks of this kernel that the current device holds at once, read once
// per (device, kernel, split).
int resident_clusters(int shape, int token_tiles, int parts, int split) {
  constexpr int devices = 16;
  constexpr int kernels = shape_count * 3 * 4; // shape x token tiles x split (2, 4, 8)
  static std::atomic<int> cached[devices][kernels] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess)
    throw std::runtime_error("bf16 engine: cannot read the current CUDA device");
  const int tiles_i = token_tiles == 2 ? 0 : (token_tiles == 4 ? 1 : 2);
  const int split_i = split == 2 ? 0 : (split == 4 ? 1 : 2);
  const int slot = (shape * 3 + tiles_i) * 4 + split_i;
  if (device >= 0 && device < devices) {
    if (const int c = cached[device][slot].load(); c > 0)
      return c;
  }
  const shape_facts f = facts(shape, token_tiles, parts);
  allow_smem("preload_gemm", f.kernel, f.smem);
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t config = launch_config(
    dim3(split, split), dim3(f.threads), f.smem, nullptr, /*programmatic=*/false, split, attrs);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, f.kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();
    clusters = 0;
  }
  if (device >= 0 && device < devices && clusters > 0)
    cached[device][slot].store(clusters);
  return clusters;
}

// Tiles of `tile_rows` over n rows: exact where they divide n; ragged (the last tile partly past
// n) only where allowed and n is a multiple of 16; 0 where neither.
int tiles_over(int n, int tile_rows, bool ragged) {
  if (n % tile_rows == 0)
    return n / tile_rows;
  return ragged && n % 16 == 0 ? (n + tile_rows - 1) / tile_rows : 0;
}

bool shape_fits(int shape, int parts, int m, int n, int k, int split_wanted, bool ragged,
                preload_gemm_plan& plan) {
  const int tt = token_tiles_for(m);
  const shape_facts f = facts(shape, tt, parts);
  if (f.kernel == nullptr || k % f.k_block != 0)
    return false;
  const int tiles = tiles_over(n, f.tile_rows, ragged);
  if (tiles == 0)
    return false;
  const int split = k / f.k_block;
  if (!split_usable(f, split) || (split_wanted > 0 && split != split_wanted))
    return false;
  if (tiles > resident_clusters(shape, tt, parts, split)) // one wave, or the preload is moot
    return false;
  plan.shape = shape;
  plan.token_tiles = tt;
  plan.parts = parts;
  plan.split = split;
  plan.tiles = tiles;
  return true;
}

} // namespace

void preload_gemm_prepare() {
  for (int shape = 0; shape < shape_count; ++shape)
    for (const int token_tiles : {2, 4, 8})
      for (const int parts : {1, 2})
        if (facts(shape, token_tiles, parts).kernel != nullptr)
          for (const int split : {2, 4, 8})
            resident_clusters(shape, token_tiles, parts, split);
}

preload_gemm_plan plan_preload_gemm(int m, int n, int k, bool two_parts, int wanted_shape) {
  preload_gemm_plan plan;
  if (m < 1 || m > preload_gemm_max_rows || n < 1 || k < 1)
    return plan;
  const int parts = two_parts ? 2 : 1;
  if (wanted_shape >= 0) {
    if (wanted_shape < shape_count)
      shape_fits(wanted_shape, parts, m, n, k, 0, /*ragged=*/true, plan);
    return plan;
  }
  // The fewest blocks a cluster (the least distributed-memory traffic) among the shapes that
  // divide the projection and fit in one wave; failing those, the same among ragged tilings
  // (copies of rows past n are the waste).
  for (const bool ragged : {false, true})
    for (const int split : {2, 4, 8})
      for (int shape = 0; shape < shape_count; ++shape)
        if (shape_fits(shape, parts, m, n, k, split, ragged, plan))
          return plan;
  return plan;
}

int preload_gemm_resident_clusters(int shape, int m, bool two_parts, int split) {
  if (shape < 0 || shape >= shape_count || m < 1 || m > preload_gemm_max_rows)
    return 0;
  const int parts = two_parts ? 2 : 1;
  const int tt = token_tiles_for(m);
  const shape_facts f = facts(shape, tt, parts);
  if (f.kernel == nullptr || !split_usable(f, split))
    return 0;
  return resident_clusters(shape, tt, parts, split);
}

std::string preload_gemm_candidates(int m, int n, int k, bool two_parts) {
  std::string out;
  const int parts = two_parts ? 2 : 1;
  const int tt = token_tiles_for(m < 1 ? 1 : m);
  for (int shape = 0; shape < shape_count; ++shape) {
    const shape_facts f = facts(shape, tt, parts);
    if (f.kernel == nullptr)
      continue;
    out += "shape " + std::to_string(shape) + " (" + std::to_string(f.tile_rows) + " x "
           + std::to_string(f.k_block) + "): ";
    const int tiles = tiles_over(n, f.tile_rows, true);
    if (tiles == 0 || k % f.k_block != 0) {
      out += "does not divide; ";
      continue;
    }
    const int split = k / f.k_block;
    out += "split " + std::to_string(split) + ", " + std::to_string(tiles)
           + (n % f.tile_rows != 0 ? " ragged" : "") + " clusters, the device holds "
           + (split_usable(f, split) ? std::to_string(resident_clusters(shape, tt, parts, split))
                                     : "-")
           + "; ";
  }
  return out;
}

void preload_gemm(const preload_gemm_args& a, const preload_gemm_plan& plan, void* stream) {
  const std::string what = "preload_gemm: m " + std::to_string(a.m) + ", n " + std::to_string(a.n)
                           + ", k " + std::to_string(a.k);
  if (a.x == nullptr || a.w == nullptr || a.y == nullptr || (plan.parts == 2) != (a.x_lo != nullptr))
    throw std::invalid_argument(what + ": x, w and y must be set, and x_lo exactly for a "
                                       "two-part plan");
  if (a.m < 1 || a.m > preload_gemm_max_rows || plan.token_tiles * 8 < a.m)
    throw std::invalid_argument(what + ": rows outside the plan's 1.."
                                + std::to_string(plan.token_tiles * 8));
  const shape_facts f = facts(plan.shape, plan.token_tiles, plan.parts);
  if (f.kernel == nullptr || plan.split < 1 || a.k != plan.split * f.k_block
      || plan.tiles != tiles_over(a.n, f.tile_rows, true))
    throw std::invalid_argument(what + ": not the plan's shape (plan_preload_gemm)");
  with_kernel(plan.shape, plan.token_tiles, plan.parts, [&](auto s, auto mt, auto p) {
    using S = decltype(s);
    launch_cluster("preload_gemm", preload_gemm_kernel<S, decltype(mt)::value, decltype(p)::value>,
                   dim3(plan.split, plan.tiles), dim3(S::threads), f.smem, plan.split,
                   as_stream(stream), static_cast<const bf16*>(a.x),
                   static_cast<const bf16*>(a.x_lo), static_cast<const bf16*>(a.w), a.y, a.y_f32,
                   a.m, a.n, a.k);
  });
}

} // namespace refit::inference::kernels
