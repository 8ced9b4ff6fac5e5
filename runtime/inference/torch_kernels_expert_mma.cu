// The routed experts' projections on the tensor cores (torch_kernels.hpp: expert_mma): for the
// few tokens per expert of a decode step, a GEMM shaped like a GEMV. Each warp streams 16 rows
// of one expert's weights once (the A operand of mma.m16n8k16, bf16 in, fp32 sums) against
// the expert's tokens in tiles of 8 (the B operand), so the weight bytes, not the tile shape,
// set the time; gate/up pairs land in one thread and leave as silu(gate) * up. The weights
// come through cp.async stages in shared memory (or two register stages), and may start
// coming before the kernel ahead of this one has finished (expert_mma_args::early).
#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_expert_mma.cuh"

namespace refit::inference::kernels {

using namespace detail;

namespace {

constexpr int dense_token_tiles = 8; // a dense projection's rows in one pass, up to 64
constexpr int mma_max_ksplit = 8;
// ksplit partial sums: (ksplit - 1) * (mma_warps / ksplit) warps * TT tiles * 32 lanes * 4,
// largest at ksplit 8.
template <int TT>
constexpr int mma_reduce_floats = (mma_max_ksplit - 1) * TT * 32 * 4;

// The first S stages of a pass (one commit group each, empty past the end: the counts stay).
template <int CH, int S>
__device__ __forceinline__ void prefetch_stages(uint4* ring, const bf16* wa, const bf16* wb,
                                                int lane_k, int iters, unsigned long long policy) {
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (s < iters)
      copy_stage<CH>(ring + s * stage_uint4s<CH>, wa, wb, lane_k + s * 32 * CH, policy);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
}

// One pass over the weight rows of the thread's warp tile for the live token tiles: with S == 0
// two register stages ping-pong (one in flight while the other feeds the MMAs); with S >= 2 S
// stages of cp.async in the warp's ring of shared memory (S - 1 in flight while one feeds the
// MMAs: more bytes in flight per SM than registers hold). Stage `it` is read into registers and
// used by the MMAs before its slot is refilled, in the lane's own program order (the MMAs wait
// for the registers), so a slot is never overwritten while it is read.
template <int CH, int TT, int S>
__device__ __forceinline__ void weight_pass(const bf16* const (&xr)[TT], int tiles,
                                            const bf16* wa, const bf16* wb, int lane_k, int iters,
                                            unsigned long long policy, uint4* ring,
                                            float (&acc)[TT][4], bool prefetched) {
  if constexpr (S == 0) {
    uint4 sa[2][CH], sb[2][CH];
    load_stage<CH>(wa, wb, lane_k, policy, sa[0], sb[0]);
    for (int it = 0; it < iters; it += 2) {
      const int off = it * 32 * CH;
      if (it + 1 < iters)
        load_stage<CH>(wa, wb, lane_k + off + 32 * CH, policy, sa[1], sb[1]);
      mma_stage<CH, TT>(xr, off, tiles, sa[0], sb[0], acc);
      if (it + 2 < iters)
        load_stage<CH>(wa, wb, lane_k + off + 64 * CH, policy, sa[0], sb[0]);
      if (it + 1 < iters)
        mma_stage<CH, TT>(xr, off + 32 * CH, tiles, sa[1], sb[1], acc);
    }
  } else {
    if (!prefetched)
      prefetch_stages<CH, S>(ring, wa, wb, lane_k, iters, policy);
    for (int it = 0; it < iters; ++it) {
      uint4* slot = ring + (it % S) * stage_uint4s<CH>;
      asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory"); // stage `it` landed
      uint4 a[CH], b[CH];
      read_stage<CH>(slot, a, b);
      mma_stage<CH, TT>(xr, it * 32 * CH, tiles, a, b, acc);
      if (it + S < iters)
        copy_stage<CH>(slot, wa, wb, lane_k + (it + S) * 32 * CH, policy);
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
  }
}

// Dynamic shared memory of a block: S stages of the 8 warps' rings (ring_bytes), then the
// k-split partial sums (ksplit > 1).
template <int CH, int TT, int S>
int mma_smem_bytes(int ksplit) {
  return ring_bytes<CH, S> + (ksplit > 1 ? mma_reduce_floats<TT> * 4 : 0);
}

// Block-wide (all threads, e's block): the flat indices of expert e's copies in flat order into
// sorted_f (at most expert_sort_max_tokens), their count, and the copies of lower experts (e's
// first sorted position). A count past the buffer traps (the routing gave a token e twice).
__device__ __forceinline__ void sort_expert(const expert_sort_args& ss, int e, short* sorted_f,
                                            int* warp_n, int& count, int& less) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  count = 0;
  less = 0;
  for (int base = 0; base < ss.copies; base += blockDim.x) {
    const int f = base + static_cast<int>(threadIdx.x);
    const int id = f < ss.copies ? static_cast<int>(ss.ids[f]) : -1;
    const bool mine = id == e;
    const unsigned bal = __ballot_sync(0xffffffffu, mine);
    if (lane == 0)
      warp_n[warp] = __popc(bal);
    less += __syncthreads_count(f < ss.copies && id < e); // also publishes warp_n
    int at = count + __popc(bal & ((1u << lane) - 1u));
    for (int w = 0; w < warp; ++w)
      at += warp_n[w];
    for (int w = 0; w < mma_warps; ++w)
      count += warp_n[w];
    if (count > expert_sort_max_tokens)
      __trap();
    if (mine)
      sorted_f[at] = static_cast<short>(f);
    __syncthreads(); // warp_n read before the next round writes it
  }
}

// A dot product may take its k in any order, if A and B take it alike. Thread t of a row group
// loads CH 16-byte chunks of its two weight rows at k0 + c * 32 + t * 8 (the group's four
// threads read 64 contiguous bytes of a row per load: whole sectors) and the same chunks of its
// token's row; chunk (e0..e7) feeds two MMAs, (e0 e1 | e2 e3) as the virtual columns
// (2t, 2t+1 | 2t+8, 2t+9) and (e4 e5 | e6 e7) likewise, for A and for B.
//
// Block (x, y): the y-th non-empty expert (active; early: expert y), warp tiles x * row_warps
// .. + row_warps (row_warps = 8 / ksplit), each tile's k split over ksplit warps (partial sums
// added through shared memory, in slice order: deterministic).
// GLU: tile r holds gate rows 8r..8r+7 (A rows 0..7) and their up rows rows / 2 + 8r.. (A
// rows 8..15) of w [e, rows, k]; y [m, rows / 2] = silu(gate) * up. Else tile r holds rows
// 16r..16r+15 of w [e, rows, k]; y [m, rows].
// Dense mode (dense_count > 0): w is one [rows, k] matrix, x [dense_count, k] its rows in
// order, in passes of up to TT * 8 of them (the active/counts/offsets lists unused).
// Registers: with S == 0, CH 4 holds two 4-chunk stages of two rows (64 registers) and runs one
// block per SM without spilling; CH 2 and 1 fit two blocks per SM (ptxas -v, sm_90).
template <int CH, bool GLU, int TT, int S>
__global__ void __launch_bounds__(mma_warps * 32, CH >= 4 && S == 0 ? 1 : 2)
  expert_mma_kernel(const bf16* __restrict__ x, const i64* __restrict__ x_rows,
                    const bf16* __restrict__ w, const int* __restrict__ active,
                    const int* __restrict__ active_count, const i64* __restrict__ counts,
                    const int* __restrict__ offsets, void* __restrict__ y_out, int rows,
                    int k, int ksplit, bool evict_first, int dense_count, bool y_f32,
                    bool early, expert_sort_args ss) {
  // early (S > 0): the weights do not depend on the kernel before this one, so a block
  // starts copying its first stages before waiting for it (griddepcontrol.wait). Experts are
  // then blocks by id (grid y = all experts, an empty one's block leaves after the wait), not
  // from the non-empty list the kernel before wrote.
  const bool by_id = early && dense_count == 0;
  if (!early)
    pdl_enter();
  extern __shared__ uint4 mma_smem[];
  float* partial = reinterpret_cast<float*>(mma_smem + ring_bytes<CH, S> / 16);
  int e = 0, count = dense_count, first = 0;
  if (by_id) {
    e = blockIdx.y;
  } else if (dense_count == 0) {
    if (static_cast<int>(blockIdx.y) >= *active_count)
      return; // the whole block: before any barrier
    e = active[blockIdx.y];
  }
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int row_warps = mma_warps / ksplit;
  const int wr = warp % row_warps;
  const int wk = warp / row_warps;
  const int tile = blockIdx.x * row_warps + wr;
  const bool live = tile < rows / 16; // the last block's spare warps only join the barriers
  const i64 ra = GLU ? tile * 8 + g : tile * 16 + g;
  const int cols = GLU ? rows / 2 : rows; // y's row length
  const i64 rb = GLU ? cols + tile * 8 + g : tile * 16 + 8 + g;
  const bf16* wa = w + (static_cast<i64>(e) * rows + ra) * k;
  const bf16* wb = w + (static_cast<i64>(e) * rows + rb) * k;
  const int span = k / ksplit;
  const int lane_k = wk * span + t * 8;
  const int iters = span / (32 * CH);
  const unsigned long long policy = stream_policy(evict_first);
  uint4* ring = mma_smem + warp * (S * stage_uint4s<CH>) + lane;
  if (early) {
    if constexpr (S > 0)
      if (live)
        prefetch_stages<CH, S>(ring, wa, wb, lane_k, iters, policy);
    pdl_enter();
  }
  __shared__ short sorted_f[expert_sort_max_tokens];
  __shared__ int warp_n[mma_warps];
  const bool self_sorted = by_id && ss.ids != nullptr;
  if (self_sorted) {
    int less = 0;
    sort_expert(ss, e, sorted_f, warp_n, count, less);
    first = less;
    if (blockIdx.x == 0) { // bucket's outputs for this expert, for the kernels after this one
      if (threadIdx.x == 0) {
        ss.out.counts[e] = count;
        ss.out.offsets[e] = less + count;
      }
      for (int i = threadIdx.x; i < count; i += blockDim.x)
        ss.out.inverse[sorted_f[i]] = less + i;
      if (count > 0 && static_cast<int>(threadIdx.x) < ss.out.loads_n)
        atomicAdd(reinterpret_cast<unsigned long long*>(ss.out.loads + threadIdx.x), 1ull);
    }
    if (count == 0) {
      asm volatile("cp.async.wait_all;" ::: "memory");
      return; // the whole block: after the sort's barriers, before any other
    }
  } else if (dense_count == 0) {
    count = static_cast<int>(counts[e]);
    first = offsets[e] - count;
    if (count == 0) { // an empty expert's block (by id): its prefetch is dropped
      asm volatile("cp.async.wait_all;" ::: "memory");
      return; // the whole block: before any barrier
    }
  }
  for (int base = 0; base < count; base += 8 * TT) {
    const int tiles = min(TT, (count - base + 7) / 8);
    const bf16* xr[TT];
    if (self_sorted) // the copy's token: its flat index / top_k (bucket's src_token)
#pragma unroll
      for (int tt = 0; tt < TT; ++tt)
        xr[tt] = x + static_cast<i64>(sorted_f[min(base + tt * 8 + g, count - 1)] / ss.top_k) * k
                 + lane_k;
    else
      token_rows<TT>(x, x_rows, first, base, count, k, lane_k, xr);
    float acc[TT][4] = {};
    if (live)
      weight_pass<CH, TT, S>(xr, tiles, wa, wb, lane_k, iters, policy, ring, acc,
                             early && base == 0);
    if (ksplit > 1) { // the k-slices' sums into the first slice's warp, in slice order
      __syncthreads();
      if (wk > 0) {
        float* mine = partial + ((wk - 1) * row_warps + wr) * (TT * 128) + lane * 4;
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
          if (tt < tiles)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              mine[tt * 128 + i] = acc[tt][i];
      }
      __syncthreads();
      if (wk == 0)
        for (int s = 1; s < ksplit; ++s) {
          const float* other =
            partial + ((s - 1) * row_warps + wr) * (TT * 128) + lane * 4;
#pragma unroll
          for (int tt = 0; tt < TT; ++tt)
            if (tt < tiles)
#pragma unroll
              for (int i = 0; i < 4; ++i)
                acc[tt][i] += other[tt * 128 + i];
        }
    }
    if (wk == 0 && live)
      write_tile<GLU, TT>(acc, tiles, base, count, first, tile, ra, rb, cols, y_out, y_f32);
  }
}

// The largest chunk count per lane and k-iteration, at most max_chunks, that divides a k-slice
// (4, 2 or 1), 0 if none.
int chunks_for(int span, int max_chunks) {
  for (int ch = max_chunks >= 4 ? 4 : max_chunks >= 2 ? 2 : 1; ch >= 1; ch /= 2)
    if (span % (32 * ch) == 0)
      return ch;
  return 0;
}

// The chunks per lane and k-iteration of a k-slice: 8 cp.async stages hold at most 2.
int lane_chunks(const expert_mma_args& a, int ksplit) {
  return chunks_for(a.k / ksplit, a.stages >= 8 && a.max_chunks > 2 ? 2 : a.max_chunks);
}

// Warp tiles per expert: 16 weight rows each (GLU: 8 gate rows and their 8 up rows).
int warp_tiles(const expert_mma_args& a) { return a.rows / 16; }

// Whole 16-row tiles, and 1, 2, 4 or 8 warps per tile dividing k (at least 32) into slices the
// staging divides.
bool ksplit_fits(const expert_mma_args& a, int ksplit) {
  return ksplit >= 1 && ksplit <= mma_max_ksplit && (ksplit & (ksplit - 1)) == 0
         && a.rows >= 16 && a.rows % 16 == 0 && a.k >= 32 && a.k % ksplit == 0
         && lane_chunks(a, ksplit) > 0;
}

// Blocks per expert: row_warps tiles each, the last one possibly in part.
int blocks_per_expert(const expert_mma_args& a, int ksplit) {
  const int row_warps = mma_warps / ksplit;
  return (warp_tiles(a) + row_warps - 1) / row_warps;
}

template <int CH, bool GLU, int TT, int S>
void launch_mma(const expert_mma_args& a, int ksplit, int grid_y, int dense_count,
                cudaStream_t s) {
  const dim3 grid(blocks_per_expert(a, ksplit), grid_y);
  launch_smem(dense_count > 0 ? "dense_mma" : "expert_mma", expert_mma_kernel<CH, GLU, TT, S>,
              grid, dim3(mma_warps * 32), mma_smem_bytes<CH, TT, S>(ksplit), s,
              static_cast<const bf16*>(a.x), a.x_rows, static_cast<const bf16*>(a.w), a.active,
              a.active_count, a.counts, a.offsets, a.y, a.rows, a.k, ksplit, a.evict_first,
              dense_count, a.y_f32 && !GLU, a.early, a.sort);
}

template <int CH, bool GLU, int TT>
void launch_for_stages(const expert_mma_args& a, int ksplit, int grid_y, int dense_count,
                       cudaStream_t s) {
  switch (a.stages) {
    case 0: return launch_mma<CH, GLU, TT, 0>(a, ksplit, grid_y, dense_count, s);
    case 4: return launch_mma<CH, GLU, TT, 4>(a, ksplit, grid_y, dense_count, s);
    case 8:
      if constexpr (CH <= 2) // 8 stages of 4 chunks would not fit in shared memory
        return launch_mma<CH, GLU, TT, 8>(a, ksplit, grid_y, dense_count, s);
      break;
  }
  throw std::invalid_argument("expert_mma: stages " + std::to_string(a.stages)
                              + " with " + std::to_string(CH) + " chunks (0, 4, or 8 with at most 2)");
}

template <bool GLU, int TT>
void launch_for_chunks(const expert_mma_args& a, int ksplit, int grid_y, int dense_count,
                       cudaStream_t s) {
  switch (lane_chunks(a, ksplit)) {
    case 4: return launch_for_stages<4, GLU, TT>(a, ksplit, grid_y, dense_count, s);
    case 2: return launch_for_stages<2, GLU, TT>(a, ksplit, grid_y, dense_count, s);
    case 1: return launch_for_stages<1, GLU, TT>(a, ksplit, grid_y, dense_count, s);
  }
  throw std::invalid_argument("expert_mma: k " + std::to_string(a.k) + " over " +
                              std::to_string(ksplit) + " slices is not a multiple of 32");
}

// The smallest k-split, from 1 up, that gives `bound` experts' blocks about one wave; else the
// largest that fits; `wanted` (> 0) only if it fits.
int choose_ksplit(const expert_mma_args& a, int bound, int wanted) {
  if (wanted > 0)
    return ksplit_fits(a, wanted) ? wanted : 0;
  const int want_blocks = multiprocessors(); // about one wave: more k-slices only add sums
  int chosen = 0;
  for (int ks = 1; ks <= mma_max_ksplit; ks *= 2) {
    if (!ksplit_fits(a, ks))
      continue;
    chosen = ks;
    if (static_cast<long long>(bound) * blocks_per_expert(a, ks) >= want_blocks)
      break;
  }
  return chosen;
}

void check_ksplit(const expert_mma_args& a, int ksplit) {
  if (!ksplit_fits(a, ksplit))
    throw std::invalid_argument("expert_mma: ksplit " + std::to_string(ksplit)
                                + " does not divide the projection (rows " + std::to_string(a.rows)
                                + ", k " + std::to_string(a.k) + ")");
}

} // namespace

int expert_mma_ksplit(const expert_mma_args& a, int copies, int experts, int wanted) {
  return choose_ksplit(a, copies < experts ? copies : experts, wanted); // bound: non-empty experts
}

bool expert_mma_supported(const expert_mma_args& a) { return expert_mma_ksplit(a, 1, 1, 0) > 0; }

void expert_mma(const expert_mma_args& a, int copies, int experts, int ksplit, void* stream) {
  check_ksplit(a, ksplit);
  if (a.sort.ids != nullptr) {
    const auto& o = a.sort.out;
    if (!a.early || !a.glu || a.stages == 0)
      throw std::invalid_argument("expert_mma: the in-kernel sort needs the early gate_up with "
                                  "cp.async stages");
    if (a.sort.top_k < 1 || a.sort.copies < 1 || a.sort.copies % a.sort.top_k != 0
        || a.sort.copies / a.sort.top_k > expert_sort_max_tokens)
      throw std::invalid_argument("expert_mma: the in-kernel sort of " + std::to_string(a.sort.copies)
                                  + " copies, top " + std::to_string(a.sort.top_k) + " (at most "
                                  + std::to_string(expert_sort_max_tokens) + " tokens)");
    if (o.counts == nullptr || o.offsets == nullptr || o.inverse == nullptr
        || (o.loads_n > 0 && o.loads == nullptr) || o.loads_n < 0 || o.loads_n > mma_warps * 32)
      throw std::invalid_argument("expert_mma: the in-kernel sort's outputs (counts, offsets, "
                                  "inverse, loads) are missing");
  }
  const int bound = copies < experts ? copies : experts;
  if (bound < 1)
    return;
  if (a.persistent) {
    if (ksplit != 1)
      throw std::invalid_argument("expert_mma: persistent with ksplit " + std::to_string(ksplit)
                                  + " (the resident warps take whole tiles: ksplit 1)");
    return expert_stream(a, lane_chunks(a, 1), experts, as_stream(stream));
  }
  const int grid_y = a.early ? experts : bound; // early: a block row per expert id
  if (a.glu)
    launch_for_chunks<true, mma_token_tiles>(a, ksplit, grid_y, 0, as_stream(stream));
  else
    launch_for_chunks<false, mma_token_tiles>(a, ksplit, grid_y, 0, as_stream(stream));
}

namespace {

// Past 32 rows the pass holds 8 token tiles: one 16-byte chunk per row and k-step keeps it
// within two blocks' registers per SM (ptxas -v: no spills).
expert_mma_args dense_args(const expert_mma_args& a, int m) {
  expert_mma_args d = a;
  if (m > 8 * mma_token_tiles)
    d.max_chunks = 1;
  return d;
}

} // namespace

int dense_mma_ksplit(const expert_mma_args& a, int m, int wanted) {
  if (m < 1 || m > dense_mma_max_rows || a.glu)
    return 0;
  return choose_ksplit(dense_args(a, m), 1, wanted);
}

void dense_mma(const expert_mma_args& a, int m, int ksplit, void* stream) {
  if (m < 1 || m > dense_mma_max_rows || a.glu)
    throw std::invalid_argument("dense_mma: " + std::to_string(m) + " rows (1.."
                                + std::to_string(dense_mma_max_rows) + ", no GLU)");
  const expert_mma_args d = dense_args(a, m);
  check_ksplit(d, ksplit);
  if (m > 8 * mma_token_tiles)
    launch_for_chunks<false, dense_token_tiles>(d, ksplit, 1, m, as_stream(stream));
  else
    launch_for_chunks<false, mma_token_tiles>(d, ksplit, 1, m, as_stream(stream));
}

} // namespace refit::inference::kernels
