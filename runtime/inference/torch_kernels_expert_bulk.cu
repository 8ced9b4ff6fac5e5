// The routed experts' projections with the weights brought in by the copy engine
// (torch_kernels.hpp: expert_mma_args::bulk): expert_mma's warp tiles of 16 weight rows, but
// whole tiles come through `cp.async.bulk` (one instruction copies a tile's contiguous rows,
// 24 to 64 KiB, into shared memory and signals an mbarrier) instead of 16-byte cp.async per
// lane, and about one block a SM walks an equal share of all the experts' tiles. On an H200 a kernel that only reads reached
// 4.45 TB/s this way against 4.18 TB/s with per-lane cp.async (.device/readbw.cu's probe, same
// lease): the expert weights are ~95% of a decode step's bytes.
//
// A stage holds `tps` whole warp tiles (GLU: each tile's 8 gate rows, then its 8 up rows: two
// contiguous row runs; else 16 rows: one run), S stages a ring. All 8 warps multiply each stage:
// its tiles' k split in 8 / tps slices, a warp a slice, the slices' sums added through shared
// memory in slice order (deterministic; not the k order of expert_mma, so not its bits). While
// the warps multiply stage i, stages i + 1 .. i + S - 1 are in flight; stage i + S is issued as
// soon as every warp is done reading stage i. The whole tile sits in shared memory, so more
// than 32 copies of an expert take further passes over it without reading the weights again.
#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_expert_mma.cuh"

namespace refit::inference::kernels::detail {

namespace {

constexpr int bulk_max_stages = 4;
constexpr int bulk_ring_budget = 192 * 1024; // shared memory for the ring, bytes
constexpr int bulk_partial_bytes = mma_warps * mma_token_tiles * 32 * 4 * 4;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(unsigned long long* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(b)) : "memory");
}

__device__ __forceinline__ void bar_wait(unsigned long long* b, unsigned parity) {
  asm volatile("{\n"
               " .reg .pred done;\n"
               " wait_%=:\n"
               " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               " @!done bra wait_%=;\n"
               "}" ::"r"(smem_u32(b)),
               "r"(parity)
               : "memory");
}

// One thread: stage `st`'s tiles of expert e into `dst`, completing on `bar`. GLU: gate rows
// 8 t0 .. 8 (t0 + n) - 1, then the up rows cols + the same; else rows 16 t0 .. 16 (t0 + n) - 1.
template <bool GLU>
__device__ __forceinline__ void issue_stage(bf16* dst, const bf16* w, int e, int rows, int k,
                                            int t0, int n, unsigned long long* bar,
                                            unsigned long long policy) {
  const i64 expert = static_cast<i64>(e) * rows;
  const unsigned run = static_cast<unsigned>((GLU ? 8 : 16) * n * k * 2); // bytes
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(GLU ? 2 * run : run)
               : "memory");
  const bf16* a = w + (expert + (GLU ? 8 : 16) * static_cast<i64>(t0)) * k;
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(dst)),
               "l"(a), "r"(run), "r"(smem_u32(bar)), "l"(policy)
               : "memory");
  if (GLU) {
    const bf16* b = a + static_cast<i64>(rows / 2) * k;
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                 " [%0], [%1], %2, [%3], %4;" ::"r"(smem_u32(dst + run / 2)),
                 "l"(b), "r"(run), "r"(smem_u32(bar)), "l"(policy)
                 : "memory");
  }
}

// Stage s of the launch's sequence: expert slot s / spe (the expert by id, or the slot-th
// non-empty one), its tiles (s % spe) * tps .. + tps (fewer at the expert's end). Block b
// takes the stages [b N / G, (b + 1) N / G) of the N in all (G blocks, about one a SM): equal
// shares, and its ring runs from one expert into the next without draining. Warp w takes tile
// w / (8 / tps) of a stage and k-slice w % (8 / tps) (span k / (8 / tps) columns, 32 a step:
// each lane's 16-byte chunk at column t * 8 of the step, of A rows g and g + 8 and of its
// token's row: expert_mma's k order within the slice). The warp's token-row chunks stay in
// registers while they serve (one expert's stages, when its copies take one pass and the
// slice at most max_steps steps). Sums of a pass: partial [warp][token tile][lane][4] in
// shared memory, then one thread per (stage tile, token tile, lane) adds the slices in order
// and writes.
constexpr int max_steps = 8;

template <bool GLU, int TT>
__global__ void __launch_bounds__(mma_warps * 32, 1)
  expert_bulk_kernel(const bf16* __restrict__ x, const i64* __restrict__ x_rows,
                     const bf16* __restrict__ w, const int* __restrict__ active,
                     const int* __restrict__ active_count, const i64* __restrict__ counts,
                     const int* __restrict__ offsets, void* __restrict__ y_out, int rows, int k,
                     int experts, int tps, int S, bool evict_first, bool y_f32, bool by_id,
                     expert_sort_args ss) {
  extern __shared__ uint4 bulk_smem[];
  __shared__ unsigned long long bar[bulk_max_stages];
  __shared__ short sorted_f[expert_sort_max_tokens];
  __shared__ int warp_n[mma_warps];
  const int tile_elems = 16 * k;
  bf16* ring = reinterpret_cast<bf16*>(bulk_smem);
  float* partial = reinterpret_cast<float*>(ring + static_cast<i64>(S) * tps * tile_elems);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int tiles_all = rows / 16;
  const int spe = (tiles_all + tps - 1) / tps; // stages an expert
  const unsigned long long policy = stream_policy(evict_first);
  const bool self_sorted = by_id && ss.ids != nullptr;
  int lo = 0, hi = 0;
  const auto share = [&](int slots) {
    const long long n = static_cast<long long>(slots) * spe;
    lo = static_cast<int>(n * blockIdx.x / gridDim.x);
    hi = static_cast<int>(n * (blockIdx.x + 1) / gridDim.x);
  };
  const auto expert_of = [&](int s) { return by_id ? s / spe : active[s / spe]; };
  const auto stage_tiles = [&](int s) { return min(tps, tiles_all - (s % spe) * tps); };
  const auto buffer = [&](int s) { return ring + static_cast<i64>((s - lo) % S) * tps * tile_elems; };
  const auto issue = [&](int s) { // thread 0
    issue_stage<GLU>(buffer(s), w, expert_of(s), rows, k, (s % spe) * tps, stage_tiles(s),
                     &bar[(s - lo) % S], policy);
  };

  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i)
      bar_init(&bar[i]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (by_id) { // the weights do not depend on the kernel before: the first stages go now
    share(experts);
    if (threadIdx.x == 0)
      for (int s = lo; s < hi && s < lo + S; ++s)
        issue(s);
  }
  pdl_enter();
  if (!by_id) {
    share(*active_count);
    if (threadIdx.x == 0)
      for (int s = lo; s < hi && s < lo + S; ++s)
        issue(s);
  }
  __syncthreads(); // the barriers are initialized

  const int wpt = mma_warps / tps; // warps a tile
  const int my_tile = warp / wpt;  // in the stage
  const int span = k / wpt;
  const int k0 = (warp % wpt) * span + t * 8;
  const int steps = span / 32;
  const int cols = GLU ? rows / 2 : rows; // y's row length
  float* mine = partial + warp * (TT * 128) + lane * 4;
  int slot = -1, count = 0, first = 0;
  bool x_held = false;
  uint4 xv[TT][max_steps];
  for (int s = lo; s < hi; ++s) {
    if (s / spe != slot) { // the next expert: block-uniform
      slot = s / spe;
      const int e = expert_of(s);
      if (self_sorted) {
        int less = 0;
        sort_expert(ss, e, sorted_f, warp_n, count, less);
        first = less;
        if (s % spe == 0) { // bucket's outputs for this expert, for the kernels after this one
          if (threadIdx.x == 0) {
            ss.out.counts[e] = count;
            ss.out.offsets[e] = less + count;
          }
          for (int i = threadIdx.x; i < count; i += blockDim.x)
            ss.out.inverse[sorted_f[i]] = less + i;
          if (count > 0 && static_cast<int>(threadIdx.x) < ss.out.loads_n)
            atomicAdd(reinterpret_cast<unsigned long long*>(ss.out.loads + threadIdx.x), 1ull);
        }
      } else {
        count = static_cast<int>(counts[e]);
        first = offsets[e] - count;
      }
      x_held = false;
    }
    const int n = stage_tiles(s);
    const int tile0 = (s % spe) * tps;
    const bf16* sp = buffer(s);
    const bf16* pa = sp + static_cast<i64>(GLU ? my_tile * 8 + g : my_tile * 16 + g) * k + k0;
    const bf16* pb =
      sp + static_cast<i64>(GLU ? n * 8 + my_tile * 8 + g : my_tile * 16 + 8 + g) * k + k0;
    bar_wait(&bar[(s - lo) % S], ((s - lo) / S) & 1);
    if (count == 0) { // an empty expert (by id): its stages land and are dropped
      __syncthreads();
      if (threadIdx.x == 0 && s + S < hi)
        issue(s + S);
      continue;
    }
    const bool one_pass = count <= 8 * TT;
    for (int base = 0; base < count; base += 8 * TT) {
      const int tiles = min(TT, (count - base + 7) / 8);
      const bf16* xr[TT];
      if (self_sorted)
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
          xr[tt] = x + static_cast<i64>(sorted_f[min(base + tt * 8 + g, count - 1)] / ss.top_k) * k
                   + k0;
      else
        token_rows<TT>(x, x_rows, first, base, count, k, k0, xr);
      float acc[TT][4] = {};
      for (int c0 = 0; c0 < steps; c0 += max_steps) {
        if (!(x_held && one_pass && steps <= max_steps)) { // all of the group's loads at once
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int c = 0; c < max_steps; ++c)
              if (tt < tiles && c0 + c < steps)
                xv[tt][c] = __ldg(reinterpret_cast<const uint4*>(xr[tt] + (c0 + c) * 32));
          x_held = true;
        }
        if (my_tile < n)
#pragma unroll
          for (int c = 0; c < max_steps; ++c)
            if (c0 + c < steps) {
              const uint4 a = *reinterpret_cast<const uint4*>(pa + (c0 + c) * 32);
              const uint4 b = *reinterpret_cast<const uint4*>(pb + (c0 + c) * 32);
#pragma unroll
              for (int tt = 0; tt < TT; ++tt)
                if (tt < tiles) {
                  mma_bf16(acc[tt], a.x, b.x, a.y, b.y, xv[tt][c].x, xv[tt][c].y);
                  mma_bf16(acc[tt], a.z, b.z, a.w, b.w, xv[tt][c].z, xv[tt][c].w);
                }
            }
      }
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
        if (tt < tiles)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            mine[tt * 128 + i] = acc[tt][i];
      __syncthreads(); // partials written; on the last pass, the stage read by every warp
      if (threadIdx.x == 0 && base + 8 * TT >= count && s + S < hi)
        issue(s + S);
      for (int idx = threadIdx.x; idx < n * TT * 32; idx += blockDim.x) {
        const int j = idx / (TT * 32);
        const int tt = (idx / 32) % TT;
        const int l = idx % 32;
        if (tt >= tiles)
          continue;
        float sum[4];
        const float* from = partial + (j * wpt) * (TT * 128) + tt * 128 + l * 4;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          sum[i] = from[i];
        for (int q = 1; q < wpt; ++q)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            sum[i] += from[q * (TT * 128) + i];
        const int tile = tile0 + j;
        const int lg = l >> 2, lt = l & 3;
        const i64 ra = GLU ? tile * 8 + lg : tile * 16 + lg;
        const i64 rb = GLU ? cols + tile * 8 + lg : tile * 16 + 8 + lg;
        for (int jj = 0; jj < 2; ++jj) {
          const int token = base + tt * 8 + 2 * lt + jj;
          if (token >= count)
            continue;
          const i64 p = first + token;
          if (GLU) {
            static_cast<bf16*>(y_out)[p * cols + tile * 8 + lg] = to_bf(silu(sum[jj]) * sum[2 + jj]);
          } else if (y_f32) {
            static_cast<float*>(y_out)[p * cols + ra] = sum[jj];
            static_cast<float*>(y_out)[p * cols + rb] = sum[2 + jj];
          } else {
            static_cast<bf16*>(y_out)[p * cols + ra] = to_bf(sum[jj]);
            static_cast<bf16*>(y_out)[p * cols + rb] = to_bf(sum[2 + jj]);
          }
        }
      }
      __syncthreads(); // the partials read before the next pass writes them
    }
  }
}

// The tiles a stage holds and the stages of the ring for a projection, 0 if it does not fit:
// whole tiles per stage (1, 2, 4 or 8) up to 64 KiB, their warps splitting k in 32-column
// steps, 2 to 4 stages within the ring's budget.
struct bulk_shape {
  int tps = 0;
  int stages = 0;
};

bulk_shape shape_for(const expert_mma_args& a) {
  bulk_shape best;
  const char* cap_tps = std::getenv("REFIT_BULK_TPS"); // experiment
  const char* cap_s = std::getenv("REFIT_BULK_S");
  const int max_tps = cap_tps ? std::atoi(cap_tps) : mma_warps;
  const int max_s = cap_s ? std::atoi(cap_s) : bulk_max_stages;
  if (a.rows < 16 || a.rows % 16 != 0 || a.k < 32 || a.k % 8 != 0)
    return best;
  const long long tile_bytes = 16LL * a.k * 2;
  for (int tps = 1; tps <= max_tps; tps *= 2) {
    const int wpt = mma_warps / tps;
    if (a.k % (32 * wpt) != 0)
      continue;
    if (tps > 1 && tile_bytes * tps > 64 * 1024)
      break;
    const long long fit = bulk_ring_budget / (tile_bytes * tps);
    if (fit < 2)
      break;
    best.tps = tps;
    best.stages = static_cast<int>(fit < max_s ? fit : max_s);
    if (tile_bytes * tps >= 32 * 1024) // copies large enough: stop at the fewest tiles
      break;
  }
  return best;
}

template <bool GLU>
void launch_bulk(const expert_mma_args& a, bulk_shape sh, int experts, cudaStream_t s) {
  const int smem = static_cast<int>(sh.stages * sh.tps * 16LL * a.k * 2) + bulk_partial_bytes;
  const int spe = (a.rows / 16 + sh.tps - 1) / sh.tps;
  const long long stages = static_cast<long long>(experts) * spe;
  const int blocks = static_cast<int>(std::min<long long>(stages, multiprocessors()));
  launch_smem("expert_bulk", expert_bulk_kernel<GLU, mma_token_tiles>, dim3(blocks),
              dim3(mma_warps * 32), smem, s, static_cast<const bf16*>(a.x), a.x_rows,
              static_cast<const bf16*>(a.w), a.active, a.active_count, a.counts, a.offsets, a.y,
              a.rows, a.k, experts, sh.tps, sh.stages, a.evict_first, a.y_f32 && !GLU, a.early,
              a.sort);
}

} // namespace

void expert_bulk(const expert_mma_args& a, int experts, cudaStream_t s) {
  const bulk_shape sh = shape_for(a);
  if (sh.tps == 0)
    throw std::invalid_argument("expert_mma (bulk): rows " + std::to_string(a.rows) + ", k "
                                + std::to_string(a.k)
                                + " do not fit whole 16-row tiles in a ring of 2+ stages");
  if (a.glu)
    launch_bulk<true>(a, sh, experts, s);
  else
    launch_bulk<false>(a, sh, experts, s);
}

} // namespace refit::inference::kernels::detail

namespace refit::inference::kernels {

bool expert_bulk_fits(const expert_mma_args& a) { return detail::shape_for(a).tps > 0; }

} // namespace refit::inference::kernels
