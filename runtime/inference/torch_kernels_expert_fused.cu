// A decode MoE layer's two routed-expert projections in ONE kernel (torch_kernels.hpp:
// expert_fused): gate_up (fused with SiLU) and down, with the warp tiles, MMAs and sums of
// expert_mma at k-split 1 (torch_kernels_expert_mma.cu), but resident blocks that take their
// work from a queue.
//
// Why: with one kernel per projection, each block's cp.async rings fill at its start and
// drain at its end, the device half-empties while gate_up's last wave finishes and down's
// first blocks wait, and a block that is handed its work statically finishes late when it
// started late. Here the work is one sequence of groups (8 neighbouring 16-row warp tiles of
// one expert, one tile per warp: the block's warps share the expert's token rows in L1): first
// every gate_up group, then every down group. A block takes its next group from a counter in
// device memory while it works on the current one, and each warp's ring of S cp.async stages
// runs on across groups, so the weights stream without a break from the layer's first group to
// its last. A down group reads the activations gate_up wrote in this kernel: it waits until its
// expert's gate_up groups have all been written (a counter per expert, released by each
// finished gate_up group, acquired before the first MMA).
//
// Why it cannot deadlock: groups are taken in increasing order and only by running blocks;
// every gate_up group is numbered below every down group, and a block holds at most its
// current group and the next. A block that holds a gate_up group is working on it or on an
// earlier gate_up group, neither of which waits on anything but the kernel before
// (griddepcontrol.wait). So every gate_up group a down group waits for is finished by a block
// that is running. A wait that still outlasts ~1 s traps (a CUDA error, not a hang).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_expert_mma.cuh"

namespace refit::inference::kernels {

using namespace detail;

namespace {

constexpr int group_rows = mma_warps * 16; // a group: one 16-row warp tile per warp
constexpr long long spin_limit = 1ll << 22; // 256-ns sleeps: past ~1 s a wait traps

// One projection: weights w [experts, rows, k], y (gate_up: the activations [copies, rows / 2]
// bf16; down: [copies, rows], fp32 with y_f32), x (gate_up: token rows through x_rows; down:
// the activations by sorted copy), `iters` k-iterations a pass, `groups` groups an expert.
struct fused_phase {
  const bf16* x;
  const i64* x_rows;
  const bf16* w;
  void* y;
  int rows, k, iters, groups;
  bool y_f32;
};

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void too_long(long long& spins) {
  if (++spins > spin_limit)
    __trap();
  __nanosleep(256);
}

// A block's published groups: slot seq & 1 holds {seq, group}, written and read as one 8-byte
// word (a reader sees the old sequence number or the new pair).
__device__ __forceinline__ void publish(int2* slot, int seq, int grp) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(slot + (seq & 1)));
  asm volatile("st.volatile.shared.v2.s32 [%0], {%1, %2};" ::"r"(a), "r"(seq), "r"(grp)
               : "memory");
}

__device__ __forceinline__ int published(const int2* slot, int seq) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(slot + (seq & 1)));
  long long spins = 0;
  for (;;) {
    int s, grp;
    asm volatile("ld.volatile.shared.v2.s32 {%0, %1}, [%2];" : "=r"(s), "=r"(grp) : "r"(a)
                 : "memory");
    if (s == seq)
      return grp;
    too_long(spins);
  }
}

// sync: [0] the queue (groups taken), [1] blocks finished, [2, 2 + experts) gate_up groups
// written per expert; the last block to finish sets them back to zero.
template <int CH, int TT, int S>
__global__ void __launch_bounds__(mma_warps * 32, 2)
  expert_fused_kernel(fused_phase up, fused_phase down, const i64* __restrict__ counts,
                      const int* __restrict__ offsets, int experts, int* sync, bool evict_first) {
  extern __shared__ uint4 mma_smem[];
  __shared__ int2 slot[2];
  __shared__ int last_block;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int lane_k = (lane & 3) * 8;
  const int up_groups = experts * up.groups;
  const int total = up_groups + experts * down.groups;
  int* const queue = sync;
  int* const finished = sync + 1;
  int* const done = sync + 2;
  const unsigned long long policy = stream_policy(evict_first);
  uint4* ring = mma_smem + warp * (S * stage_uint4s<CH>) + lane;

  // Group grp: gate_up or down, its expert, this warp's tile, the lane's two weight rows.
  struct where {
    bool up;
    int e, tile;
    i64 ra, rb;
  };
  const auto locate = [&](int grp) {
    where p;
    p.up = grp < up_groups;
    const int j = p.up ? grp : grp - up_groups;
    const int per = p.up ? up.groups : down.groups;
    p.e = j / per;
    p.tile = (j - p.e * per) * mma_warps + warp;
    p.ra = p.up ? p.tile * 8 + g : p.tile * 16 + g;
    p.rb = p.up ? up.rows / 2 + p.tile * 8 + g : p.tile * 16 + 8 + g;
    return p;
  };
  const auto passes = [&](int e) { // after the wait only
    return (static_cast<int>(counts[e]) + 8 * TT - 1) / (8 * TT);
  };
  const auto take = [&]() { // thread 0, after the wait: the next group whose expert has copies
    int grp = atomicAdd(queue, 1);
    while (grp < total && counts[locate(grp).e] == 0)
      grp = atomicAdd(queue, 1);
    return min(grp, total);
  };

  // Before the wait (the weights do not depend on the kernel before; the queue is this
  // kernel's, set back to zero by its previous launch, which the stream completed): the
  // block's first group, and its first S stages.
  if (threadIdx.x == 0) {
    publish(slot, -1, 0); // slot 1: nothing yet
    publish(slot, 0, min(atomicAdd(queue, 1), total));
  }
  __syncthreads();
  const int grp0 = published(slot, 0);

  // The prefetch cursor: group number pseq (pgrp; total: past the end), pass pp of pn,
  // k-iteration pit of piters, the lane's weight rows pa, pb; ended: the group's last stage
  // is issued (the next one is looked up when its first stage is due, not before: it may not
  // be published yet).
  int pseq = 0, pgrp = grp0, pp = 0, pn = 1, pit = 0, piters = 0;
  bool ended = false;
  const bf16 *pa = nullptr, *pb = nullptr;
  const auto rows_of = [&](int grp) {
    const where p = locate(grp);
    const bf16* w = p.up ? up.w : down.w;
    const i64 k = p.up ? up.k : down.k;
    piters = p.up ? up.iters : down.iters;
    const int rows = p.up ? up.rows : down.rows;
    pa = w + (static_cast<i64>(p.e) * rows + p.ra) * k;
    pb = w + (static_cast<i64>(p.e) * rows + p.rb) * k;
    return p.e;
  };
  const auto aim = [&](int seq) { // the cursor onto the block's group `seq` (after the wait)
    pseq = seq;
    pgrp = published(slot, seq);
    pp = 0;
    pit = 0;
    if (pgrp < total)
      pn = passes(rows_of(pgrp));
  };
  const auto step = [&]() {
    if (++pit == piters) {
      pit = 0;
      ended = ++pp == pn;
    }
  };
  const auto issue = [&](unsigned q) { // stage q into slot q % S: one commit group either way
    if (ended) {
      ended = false;
      aim(pseq + 1);
    }
    if (pgrp < total) {
      copy_stage<CH>(ring + (q % S) * stage_uint4s<CH>, pa, pb, lane_k + pit * 32 * CH, policy);
      step();
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };

  unsigned issued = 0;
  if (grp0 < total) {
    rows_of(grp0);
    for (; issued < S; ++issued) { // iters >= S (expert_fused checks)
      copy_stage<CH>(ring + issued * stage_uint4s<CH>, pa, pb, lane_k + issued * 32 * CH,
                     policy);
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  }
  pdl_enter();
  if (threadIdx.x == 0 && grp0 < total)
    publish(slot, 1, take());
  bool skip0 = false;
  if (grp0 < total) {
    const int e0 = locate(grp0).e;
    if (counts[e0] == 0) { // taken before the counts were known: drop its stages
      skip0 = true;
      asm volatile("cp.async.wait_all;" ::: "memory");
      issued = 0;
      aim(1);
    } else {
      pn = passes(e0);
      pit = static_cast<int>(issued) - 1;
      step();
    }
  }
  for (; issued < S; ++issued)
    issue(issued);

  unsigned q = 0;   // the stage feeding the MMAs
  int signal = -1;  // the expert of the gate_up group just written
  for (int seq = 0;; ++seq) {
    int grp = grp0;
    if (seq > 0) {
      __syncthreads(); // group seq - 1's tiles are written (each writer fenced)
      grp = published(slot, seq);
      if (threadIdx.x == 0) {
        if (signal >= 0) { // the group's activations, every thread's ordered by the barrier
          __threadfence();
          atomicAdd(done + signal, 1);
        }
        if (grp < total)
          publish(slot, seq + 1, take());
      }
      signal = -1;
    }
    if (grp >= total)
      break;
    if (seq == 0 && skip0)
      continue;
    const where p = locate(grp);
    const int count = static_cast<int>(counts[p.e]);
    const i64 first = offsets[p.e] - count;
    const int iters = p.up ? up.iters : down.iters;
    const int k = p.up ? up.k : down.k;
    if (!p.up) { // the expert's activations: every gate_up group written
      long long spins = 0;
      while (load_acquire(done + p.e) < up.groups)
        too_long(spins);
    }
    for (int base = 0; base < count; base += 8 * TT) {
      const int tiles = min(TT, (count - base + 7) / 8);
      const bf16* xr[TT];
      token_rows<TT>(p.up ? up.x : down.x, p.up ? up.x_rows : nullptr, first, base, count, k,
                     lane_k, xr);
      float acc[TT][4] = {};
      for (int it = 0; it < iters; ++it, ++q) {
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory"); // stage q landed
        uint4 a[CH], b[CH];
        read_stage<CH>(ring + (q % S) * stage_uint4s<CH>, a, b);
        if (p.up)
          mma_stage<CH, TT>(xr, it * 32 * CH, tiles, a, b, acc);
        else
          mma_stage<CH, TT, true>(xr, it * 32 * CH, tiles, a, b, acc);
        issue(q + S); // into the slot just read: its registers fed the MMAs first
      }
      if (p.up)
        write_tile<true, TT>(acc, tiles, base, count, first, p.tile, p.ra, p.rb, up.rows / 2,
                             up.y, false);
      else
        write_tile<false, TT>(acc, tiles, base, count, first, p.tile, p.ra, p.rb, down.rows,
                              down.y, down.y_f32);
    }
    if (p.up)
      signal = p.e; // released at the next barrier
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads(); // the whole block is past its last wait on the counters
  if (threadIdx.x == 0) {
    __threadfence();
    last_block = atomicAdd(finished, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (last_block) { // every other block has finished: the counters back to zero
    for (int i = threadIdx.x; i < experts; i += blockDim.x)
      done[i] = 0;
    if (threadIdx.x == 0) {
      *queue = 0;
      *finished = 0;
    }
  }
}

// The per-warp variant (expert_mma_args::persistent): no queue and no block barriers. Warp w
// of the grid (W warps) takes items w, w + W, ... of one sequence, every gate_up tile of every
// expert and then every down tile (item i: expert, 16-row tile; a block's 8 warps take 8
// neighbouring tiles of one expert), skipping empty experts, its ring running on across
// items as in expert_stream. A finished gate_up tile is released per warp; a down tile waits
// until its expert's gate_up tiles are all written. No deadlock: a warp takes its items in
// order and every gate_up item is numbered below every down item, so a warp finishes all its
// gate_up tiles before it can wait; it relies on the grid's blocks all becoming resident
// (the grid is the blocks that fit at once; a block kept out by another kernel's blocks
// starts when they end). Nothing of sync is touched before the wait, so launches next to
// each other may share it. sync: [1] warps finished, [2, 2 + experts) gate_up tiles written.
template <int CH, int TT, int S>
__global__ void __launch_bounds__(mma_warps * 32, 2)
  expert_fused_warps_kernel(fused_phase up, fused_phase down, const i64* __restrict__ counts,
                            const int* __restrict__ offsets, int experts, int* sync,
                            bool evict_first) {
  extern __shared__ uint4 mma_smem[];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int lane_k = (lane & 3) * 8;
  const int up_tiles = up.rows / 16, down_tiles = down.rows / 16;
  const int up_items = experts * up_tiles;
  const int items = up_items + experts * down_tiles;
  const int stride = gridDim.x * mma_warps;
  const int mine = blockIdx.x * mma_warps + warp;
  int* const finished = sync + 1;
  int* const done = sync + 2;
  const unsigned long long policy = stream_policy(evict_first);
  uint4* ring = mma_smem + warp * (S * stage_uint4s<CH>) + lane;

  struct where {
    bool up;
    int e, tile;
    i64 ra, rb;
  };
  const auto locate = [&](int i) {
    where p;
    p.up = i < up_items;
    const int j = p.up ? i : i - up_items;
    const int per = p.up ? up_tiles : down_tiles;
    p.e = j / per;
    p.tile = j - p.e * per;
    p.ra = p.up ? p.tile * 8 + g : p.tile * 16 + g;
    p.rb = p.up ? up.rows / 2 + p.tile * 8 + g : p.tile * 16 + 8 + g;
    return p;
  };
  const auto passes = [&](int e) { // after the wait only
    return (static_cast<int>(counts[e]) + 8 * TT - 1) / (8 * TT);
  };
  const auto next = [&](int i) { // after the wait only: from i on, the warp's next item with copies
    while (i < items && counts[locate(i).e] == 0)
      i += stride;
    return i;
  };

  // The prefetch cursor: item pi (items: past the end), pass pp of pn, k-iteration pit of piters.
  int pi = mine, pp = 0, pn = 0, pit = 0, piters = 0;
  const bf16 *pa = nullptr, *pb = nullptr;
  const auto rows_of = [&](int i) {
    const where p = locate(i);
    const bf16* w = p.up ? up.w : down.w;
    const i64 k = p.up ? up.k : down.k;
    piters = p.up ? up.iters : down.iters;
    const int rows = p.up ? up.rows : down.rows;
    pa = w + (static_cast<i64>(p.e) * rows + p.ra) * k;
    pb = w + (static_cast<i64>(p.e) * rows + p.rb) * k;
    return p.e;
  };
  const auto aim = [&](int i) {
    pi = i;
    pp = 0;
    pit = 0;
    if (i < items)
      pn = passes(rows_of(i));
  };
  const auto step = [&]() {
    if (++pit == piters) {
      pit = 0;
      if (++pp == pn)
        aim(next(pi + stride));
    }
  };
  const auto issue = [&](unsigned q) {
    if (pi < items) {
      copy_stage<CH>(ring + (q % S) * stage_uint4s<CH>, pa, pb, lane_k + pit * 32 * CH, policy);
      step();
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };

  unsigned issued = 0;
  if (mine < items) { // before the wait: the first item's first stages (iters >= S)
    rows_of(mine);
    for (; issued < S; ++issued) {
      copy_stage<CH>(ring + issued * stage_uint4s<CH>, pa, pb, lane_k + issued * 32 * CH,
                     policy);
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  }
  pdl_enter();
  const int start = next(mine);
  if (issued > 0 && start == mine) {
    pn = passes(locate(mine).e);
    pit = static_cast<int>(issued) - 1;
    step();
  } else {
    if (issued > 0) // the first item's expert is empty: its copies land before the slots are reused
      asm volatile("cp.async.wait_all;" ::: "memory");
    issued = 0;
    aim(start);
  }
  for (; issued < S; ++issued)
    issue(issued);

  unsigned q = 0;
  for (int i = start; i < items; i = next(i + stride)) {
    const where p = locate(i);
    const int count = static_cast<int>(counts[p.e]);
    const i64 first = offsets[p.e] - count;
    const int iters = p.up ? up.iters : down.iters;
    const int k = p.up ? up.k : down.k;
    if (!p.up) { // the expert's activations: every gate_up tile written
      long long spins = 0;
      while (load_acquire(done + p.e) < up_tiles)
        too_long(spins);
    }
    for (int base = 0; base < count; base += 8 * TT) {
      const int tiles = min(TT, (count - base + 7) / 8);
      const bf16* xr[TT];
      token_rows<TT>(p.up ? up.x : down.x, p.up ? up.x_rows : nullptr, first, base, count, k,
                     lane_k, xr);
      float acc[TT][4] = {};
      for (int it = 0; it < iters; ++it, ++q) {
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory"); // stage q landed
        uint4 a[CH], b[CH];
        read_stage<CH>(ring + (q % S) * stage_uint4s<CH>, a, b);
        if (p.up)
          mma_stage<CH, TT>(xr, it * 32 * CH, tiles, a, b, acc);
        else
          mma_stage<CH, TT, true>(xr, it * 32 * CH, tiles, a, b, acc);
        issue(q + S);
      }
      if (p.up)
        write_tile<true, TT>(acc, tiles, base, count, first, p.tile, p.ra, p.rb, up.rows / 2,
                             up.y, false);
      else
        write_tile<false, TT>(acc, tiles, base, count, first, p.tile, p.ra, p.rb, down.rows,
                              down.y, down.y_f32);
    }
    if (p.up) { // release the tile: the lanes' writes, ordered by the warp barrier
      __syncwarp();
      if (lane == 0) {
        __threadfence();
        atomicAdd(done + p.e, 1);
      }
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncwarp(); // the warp is past its last wait on the counters
  int last = 0;
  if (lane == 0) {
    __threadfence();
    last = atomicAdd(finished, 1) == stride - 1;
  }
  if (__shfl_sync(0xffffffffu, last, 0) != 0) { // every other warp has finished
    for (int e = lane; e < experts; e += 32)
      done[e] = 0;
    if (lane == 0)
      *finished = 0;
  }
}

fused_phase phase(const expert_mma_args& a, int chunks, const void* x) {
  fused_phase p;
  p.x = static_cast<const bf16*>(x);
  p.x_rows = a.x_rows;
  p.w = static_cast<const bf16*>(a.w);
  p.y = a.y;
  p.rows = a.rows;
  p.k = a.k;
  p.iters = a.k / (32 * chunks);
  p.groups = a.rows / group_rows;
  p.y_f32 = a.y_f32 && !a.glu;
  return p;
}

template <int CH, int S>
void launch_fused(const expert_mma_args& up, const expert_mma_args& down, int experts,
                  int* sync, cudaStream_t s) {
  const auto queue_kernel = expert_fused_kernel<CH, mma_token_tiles, S>;
  const auto warps_kernel = expert_fused_warps_kernel<CH, mma_token_tiles, S>;
  const auto kernel = up.persistent ? warps_kernel : queue_kernel;
  const int smem = ring_bytes<CH, S>;
  static const int resident_queue = resident_blocks(queue_kernel, smem); // once per instantiation
  static const int resident_warps = resident_blocks(warps_kernel, smem);
  const int resident = up.persistent ? resident_warps : resident_queue;
  // A block a group of 8 tiles, or 8 warps each one tile: as many blocks either way.
  const long long groups =
    static_cast<long long>(experts) * (up.rows / group_rows + down.rows / group_rows);
  const long long cap = up.max_blocks > 0 ? std::min(up.max_blocks, resident) : resident;
  const int blocks = static_cast<int>(std::min(groups, cap));
  launch_smem("expert_fused", kernel, dim3(blocks), dim3(mma_warps * 32), smem, s,
              phase(up, CH, up.x), phase(down, CH, up.y), up.counts,
              up.offsets, experts, sync, up.evict_first);
}

// Why the pair does not fit the fused kernel, or "".
std::string refusal(const expert_mma_args& up, const expert_mma_args& down) {
  const auto dims = [](const expert_mma_args& a) {
    return "rows " + std::to_string(a.rows) + ", k " + std::to_string(a.k);
  };
  if (!up.glu || down.glu)
    return "up must be the GLU projection (gate_up) and down not";
  if (up.rows < group_rows || up.rows % group_rows != 0 || down.rows < group_rows
      || down.rows % group_rows != 0)
    return "rows must be multiples of " + std::to_string(group_rows) + " (up " + dims(up)
           + "; down " + dims(down) + ")";
  if (down.k != up.rows / 2)
    return "down's k " + std::to_string(down.k) + " is not up's rows / 2 ("
           + std::to_string(up.rows / 2) + ")";
  if (up.stages != 4 && up.stages != 8)
    return "stages " + std::to_string(up.stages) + " (4 or 8: the ring is cp.async stages)";
  if (up.max_blocks < 0)
    return "max_blocks " + std::to_string(up.max_blocks)
           + " (0: as many as fit at once, or a positive cap)";
  expert_mma_args d = down; // down takes up's staging
  d.max_chunks = up.max_chunks;
  d.stages = up.stages;
  const int ch = lane_chunks(up, 1);
  if (ch == 0 || lane_chunks(d, 1) != ch)
    return "no chunk count per lane divides both k (up " + dims(up) + "; down " + dims(down) + ")";
  if (up.k / (32 * ch) < up.stages || down.k / (32 * ch) < up.stages)
    return "a pass of " + std::to_string(std::min(up.k, down.k) / (32 * ch))
           + " k-iterations is shorter than the " + std::to_string(up.stages) + " stages";
  return "";
}

} // namespace

int expert_fused_sync_ints(int experts) { return experts + 2; }

bool expert_fused_supported(const expert_mma_args& up, const expert_mma_args& down) {
  return refusal(up, down).empty();
}

void expert_fused(const expert_mma_args& up, const expert_mma_args& down, int experts, int* sync,
                  void* stream) {
  const std::string why = refusal(up, down);
  if (!why.empty())
    throw std::invalid_argument("expert_fused: " + why);
  if (sync == nullptr)
    throw std::invalid_argument("expert_fused: no sync counters");
  if (experts < 1)
    return;
  const cudaStream_t s = as_stream(stream);
  switch (lane_chunks(up, 1) * 10 + up.stages) {
    case 44: return launch_fused<4, 4>(up, down, experts, sync, s);
    case 24: return launch_fused<2, 4>(up, down, experts, sync, s);
    case 28: return launch_fused<2, 8>(up, down, experts, sync, s);
    case 14: return launch_fused<1, 4>(up, down, experts, sync, s);
    case 18: return launch_fused<1, 8>(up, down, experts, sync, s);
  }
  throw std::invalid_argument("expert_fused: " + std::to_string(lane_chunks(up, 1))
                              + " chunks per lane with " + std::to_string(up.stages) + " stages");
}

} // namespace refit::inference::kernels
