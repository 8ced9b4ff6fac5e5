// The routed experts' projections with resident warps (torch_kernels.hpp:
// expert_mma_args::persistent): the same warp tiles, MMAs and sums as expert_mma at k-split 1
// (torch_kernels_expert_mma.cu), but a grid of about the blocks that fit on the device at once,
// each warp streaming a sequence of (expert, tile) items through ONE ring of cp.async stages.
//
// Why: with a block per (expert, 8 tiles), a warp's ring is filled at its tile's start and
// drained at its end; at decode the down projection's tile is only k / 64 = 12 stages long, so
// a third of every tile is spent with fewer bytes in flight, and every block pays its launch.
// Here the ring runs ahead across item boundaries: the next tile's first stages are in flight
// while the last ones of this tile feed the MMAs.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_expert_mma.cuh"

namespace refit::inference::kernels::detail {

namespace {

// Warp w of the grid (W warps in all) takes the items w, w + W, w + 2W, ... of experts * tiles
// (item i: expert i / tiles, warp tile i % tiles, so a block's 8 warps take 8 neighbouring
// tiles of one expert and share its token rows in L1), skipping the empty experts, each item
// in passes of up to TT * 8 of its expert's copies; within a pass, the k-iterations. Two
// cursors walk that sequence: the prefetch cursor S stages ahead of the one feeding the MMAs.
// Stage q of the sequence sits in slot q % S of the warp's ring. The warp tiles, the per-lane
// k order and the sums are expert_mma_kernel's at k-split 1: the results are bitwise the same.
//
// early: the weights do not depend on the kernel before (griddepcontrol.wait), the counts do:
// the first stages of item w's first pass are copied before the wait; if expert(w) turns out
// empty they are awaited and dropped (its slots are refilled only after they landed).
//
// In-kernel sort (ss.ids set; gate_up, early): the kernel before it routed but did not sort.
// After the wait each block counts the routed ids per expert in shared memory (s_count) and
// scans them (s_less: the copies of lower experts, an expert's first sorted position); at an
// item of a new expert a warp lists that expert's copies in flat order (a ballot per 32 ids:
// bucket's stable order) for its token rows. Bucket's outputs for the kernels after it: block
// 0 writes every expert's count and end offset and adds the non-empty experts to the loads,
// the warp at an expert's tile 0 writes its copies' inverse.
template <int CH, bool GLU, int TT, int S>
__global__ void __launch_bounds__(mma_warps * 32, 2)
  expert_stream_kernel(const bf16* __restrict__ x, const i64* __restrict__ x_rows,
                       const bf16* __restrict__ w, const i64* __restrict__ counts,
                       const int* __restrict__ offsets, void* __restrict__ y_out, int rows, int k,
                       int experts, bool evict_first, bool y_f32, bool early,
                       expert_sort_args ss, bool lines) {
  extern __shared__ uint4 mma_smem[];
  __shared__ int s_count[expert_stream_sort_max_experts];
  __shared__ int s_less[expert_stream_sort_max_experts];
  __shared__ short s_list[mma_warps][expert_sort_max_tokens];
  const bool self_sorted = ss.ids != nullptr;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int lane_k = (lane & 3) * 8;
  const int tiles_per_expert = rows / 16;
  const int items = experts * tiles_per_expert;
  const int stride = gridDim.x * mma_warps;
  const int mine = blockIdx.x * mma_warps + warp; // the warp's first item
  const int iters = k / (32 * CH);
  const int cols = GLU ? rows / 2 : rows; // y's row length
  const unsigned long long policy = stream_policy(evict_first);
  uint4* ring = mma_smem + warp * (S * stage_uint4s<CH>) + lane;

  // The lane's two weight rows (A fragment rows g and g + 8) of item i: expert_mma_kernel's.
  const auto row_a = [&](int tile) -> i64 { return GLU ? tile * 8 + g : tile * 16 + g; };
  const auto row_b = [&](int tile) -> i64 {
    return GLU ? cols + tile * 8 + g : tile * 16 + 8 + g;
  };
  const auto weights = [&](int i, const bf16*& wa, const bf16*& wb) {
    const int e = i / tiles_per_expert;
    const int tile = i - e * tiles_per_expert;
    wa = w + (static_cast<i64>(e) * rows + row_a(tile)) * k;
    wb = w + (static_cast<i64>(e) * rows + row_b(tile)) * k;
  };
  // After the wait only: an expert's copies, passes of item i, and the warp's next item from i
  // on with copies.
  const auto count_of = [&](int e) {
    return self_sorted ? s_count[e] : static_cast<int>(counts[e]);
  };
  const auto passes = [&](int i) {
    return (count_of(i / tiles_per_expert) + 8 * TT - 1) / (8 * TT);
  };
  const auto next = [&](int i) {
    while (i < items && count_of(i / tiles_per_expert) == 0)
      i += stride;
    return i;
  };

  // The prefetch cursor: item pi (items: past the end), pass pp of pn, k-iteration pit.
  int pi = mine, pp = 0, pn = 0, pit = 0;
  const bf16 *pa = nullptr, *pb = nullptr;
  const auto aim = [&](int i) {
    pi = i;
    pp = 0;
    pit = 0;
    if (i < items) {
      weights(i, pa, pb);
      pn = passes(i);
    }
  };
  const auto step = [&]() {
    if (++pit == iters) {
      pit = 0;
      if (++pp == pn)
        aim(next(pi + stride));
    }
  };
  // A stage's copies (k0: the stage's first column): each lane its own chunks, or with `lines`
  // whole row segments an instruction (copy_stage_lines: lanes fill each other's places).
  const auto copy = [&](uint4* slot, const bf16* a, const bf16* b, int k0) {
    copy_stage_as<CH>(lines, slot, a, b, lane_k + k0, k, policy);
  };
  // Stage q's chunks into slot q % S (nothing past the end), one commit group either way: the
  // groups in flight stay S - 1 behind the one awaited.
  const auto issue = [&](unsigned q) {
    if (pi < items) {
      copy(ring + (q % S) * stage_uint4s<CH>, pa, pb, pit * 32 * CH);
      step();
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };

  unsigned issued = 0;
  if (early && mine < items) {
    weights(mine, pa, pb);
    for (; issued < S && issued < static_cast<unsigned>(iters); ++issued) {
      copy(ring + issued * stage_uint4s<CH>, pa, pb, static_cast<int>(issued) * 32 * CH);
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  }
  pdl_enter();
  if (self_sorted) { // the block's counts and first positions of every expert
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
      s_count[e] = 0;
    __syncthreads();
    for (int f = threadIdx.x; f < ss.copies; f += blockDim.x) {
      const i64 id = ss.ids[f];
      if (id < 0 || id >= experts)
        __trap(); // a routed id past the experts
      atomicAdd(&s_count[id], 1);
    }
    __syncthreads();
    if (warp == 0) { // exclusive scan, 32 experts at a time
      int run = 0;
      for (int base = 0; base < experts; base += 32) {
        const int e = base + lane;
        const int c = e < experts ? s_count[e] : 0;
        if (c > expert_sort_max_tokens)
          __trap(); // more copies than tokens: the routing gave a token this expert twice
        int incl = c;
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o)
            incl += v;
        }
        if (e < experts)
          s_less[e] = run + incl - c;
        run += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
    __syncthreads();
    if (blockIdx.x == 0) { // bucket's counts, offsets and loads, for the kernels after this one
      int used = 0;
      for (int base = 0; base < experts; base += blockDim.x) {
        const int e = base + static_cast<int>(threadIdx.x);
        if (e < experts) {
          ss.out.counts[e] = s_count[e];
          ss.out.offsets[e] = s_less[e] + s_count[e];
        }
        used += __syncthreads_count(e < experts && s_count[e] > 0);
      }
      if (static_cast<int>(threadIdx.x) < ss.out.loads_n)
        atomicAdd(reinterpret_cast<unsigned long long*>(ss.out.loads + threadIdx.x),
                  static_cast<unsigned long long>(used));
    }
  }
  const int start = next(mine);
  if (issued > 0 && start == mine) { // the early stages are the sequence's first
    pn = passes(mine);
    pit = static_cast<int>(issued) - 1;
    step();
  } else {
    if (issued > 0) { // expert(mine) is empty: let its copies land before the slots are reused
      asm volatile("cp.async.wait_all;" ::: "memory");
      if (lines)
        __syncwarp(); // every lane's: with `lines` a lane refills places other lanes filled
    }
    issued = 0;
    aim(start);
  }
  for (; issued < S; ++issued)
    issue(issued);

  unsigned q = 0; // the stage feeding the MMAs
  int listed = -1; // the expert whose copies s_list[warp] holds
  for (int i = start; i < items; i = next(i + stride)) {
    const int e = i / tiles_per_expert;
    const int tile = i - e * tiles_per_expert;
    const int count = count_of(e);
    const i64 first = self_sorted ? s_less[e] : offsets[e] - count; // e's first sorted position
    if (self_sorted && e != listed) { // e's copies in flat order
      int n = 0;
      for (int base = 0; base < ss.copies; base += 32) {
        const int f = base + lane;
        const bool hit = f < ss.copies && ss.ids[f] == e;
        const unsigned bal = __ballot_sync(0xffffffffu, hit);
        if (hit)
          s_list[warp][n + __popc(bal & ((1u << lane) - 1u))] = static_cast<short>(f);
        n += __popc(bal);
      }
      __syncwarp();
      listed = e;
      if (tile == 0)
        for (int j = lane; j < count; j += 32)
          ss.out.inverse[s_list[warp][j]] = first + j;
    }
    for (int base = 0; base < count; base += 8 * TT) {
      const int tiles = min(TT, (count - base + 7) / 8);
      const bf16* xr[TT];
      if (self_sorted) // the copy's token: its flat index / top_k
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
          xr[tt] = x + static_cast<i64>(s_list[warp][min(base + tt * 8 + g, count - 1)] / ss.top_k) * k
                   + lane_k;
      else
        token_rows<TT>(x, x_rows, first, base, count, k, lane_k, xr);
      float acc[TT][4] = {};
      for (int it = 0; it < iters; ++it, ++q) {
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory"); // stage q landed
        if (lines)
          __syncwarp(); // and the other lanes' copies into this lane's places too
        uint4 a[CH], b[CH];
        read_stage<CH>(ring + (q % S) * stage_uint4s<CH>, a, b);
        mma_stage<CH, TT>(xr, it * 32 * CH, tiles, a, b, acc);
        if (lines)
          __syncwarp(); // every lane has read the slot before any lane refills it
        issue(q + S); // into the slot just read: its registers fed the MMAs first
      }
      write_tile<GLU, TT>(acc, tiles, base, count, first, tile, row_a(tile), row_b(tile), cols,
                          y_out, y_f32);
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}

// The blocks of one launch: no more than fit on the device at once (the kernel's occupancy at
// its shared memory), nor than the items need.
template <class Kernel>
int resident_blocks(Kernel kernel, int smem) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, mma_warps * 32, smem)
        != cudaSuccess
      || per_sm < 1)
    per_sm = 1;
  return per_sm * multiprocessors();
}

template <int CH, bool GLU, int S>
void launch_stream(const expert_mma_args& a, int experts, cudaStream_t s) {
  const auto kernel = expert_stream_kernel<CH, GLU, mma_token_tiles, S>;
  const int smem = ring_bytes<CH, S>;
  const long long items = static_cast<long long>(experts) * (a.rows / 16);
  const long long wanted = (items + mma_warps - 1) / mma_warps;
  static const int resident = resident_blocks(kernel, smem); // once per instantiation
  const long long cap = a.max_blocks > 0 ? std::min(a.max_blocks, resident) : resident;
  const int blocks = static_cast<int>(std::min<long long>(wanted, cap));
  launch_smem("expert_stream", kernel, dim3(blocks), dim3(mma_warps * 32), smem, s,
              static_cast<const bf16*>(a.x), a.x_rows, static_cast<const bf16*>(a.w), a.counts,
              a.offsets, a.y, a.rows, a.k, experts, a.evict_first, a.y_f32 && !GLU, a.early,
              a.sort, a.line_copies);
}

template <int CH, bool GLU>
void stream_for_stages(const expert_mma_args& a, int experts, cudaStream_t s) {
  switch (a.stages) {
    case 4: return launch_stream<CH, GLU, 4>(a, experts, s);
    case 8:
      if constexpr (CH <= 2) // 8 stages of 4 chunks would not fit in shared memory
        return launch_stream<CH, GLU, 8>(a, experts, s);
      break;
  }
  throw std::invalid_argument("expert_mma (persistent): stages " + std::to_string(a.stages)
                              + " with " + std::to_string(CH)
                              + " chunks (4, or 8 with at most 2: the ring is cp.async stages)");
}

} // namespace

void expert_stream(const expert_mma_args& a, int chunks, int experts, cudaStream_t s) {
  if (a.max_blocks < 0)
    throw std::invalid_argument("expert_mma (persistent): max_blocks "
                                + std::to_string(a.max_blocks)
                                + " (0: as many as fit at once, or a positive cap)");
  if (experts < 1)
    return;
  if (a.sort.ids != nullptr && experts > expert_stream_sort_max_experts)
    throw std::invalid_argument("expert_mma (persistent): the in-kernel sort of "
                                + std::to_string(experts) + " experts (at most "
                                + std::to_string(expert_stream_sort_max_experts) + ")");
  switch (chunks) {
    case 4: return a.glu ? stream_for_stages<4, true>(a, experts, s)
                         : stream_for_stages<4, false>(a, experts, s);
    case 2: return a.glu ? stream_for_stages<2, true>(a, experts, s)
                         : stream_for_stages<2, false>(a, experts, s);
    case 1: return a.glu ? stream_for_stages<1, true>(a, experts, s)
                         : stream_for_stages<1, false>(a, experts, s);
  }
  throw std::invalid_argument("expert_mma (persistent): " + std::to_string(chunks)
                              + " chunks per lane (4, 2 or 1)");
}

} // namespace refit::inference::kernels::detail
