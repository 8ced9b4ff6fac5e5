// Sampling without filters on the device (torch_kernels.hpp: sample_plain): what the ATen chain
// of sample_on_device does for top_k 0 and top_p 1 (z = logits * inv_t in double, z - max, exp,
// the inverse CDF of the draw's uniform in id order, or the first maximum when greedy), in two
// kernels that spread a draw's row over the whole GPU instead of one block per draw.
//
// The row is cut into parts of part_ids consecutive ids. Kernel 1 (a block per draw and part)
// reads its part once and writes the part's maximum m_p (with its first id) and
// s_p = sum exp(z - m_p). Kernel 2 (a block per draw) combines them: M = max m_p, total =
// sum s_p exp(m_p - M); for a sampled draw it finds the part where the cumulative mass passes
// u from the part masses, then scans only that part id by id. So the double-precision exp, the
// cost of this kernel, runs once per id plus once per id of one part per draw (the single
// block per draw ran it three times per id on at most `draws` SMs: ~198 us a step at batch 64
// on an H200). Every sum runs in a fixed order (no float atomics): the same bits run to run.
#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_common.cuh"

namespace refit::inference::kernels {

using namespace detail;

namespace {

// 256 threads of 16 ids: a part of 4096 ids, 38 parts for Qwen3's vocab of 151936, so 64 draws
// make 2432 blocks (~18 per SM of an H200: the SMs end within about one block of each other).
// Smaller parts would add per-block overhead and scratch, larger ones leave SMs idle at 1 draw.
constexpr int part_threads = 256;
constexpr int part_warps = part_threads / 32;
constexpr int per_thread = 16;
constexpr i64 part_ids = static_cast<i64>(part_threads) * per_thread;
// Blocks per draw are the grid's y dimension (the draws are x, up to 2^31 - 1).
constexpr i64 max_parts = 65535;

// One part of one draw, written by kernel 1 and read by kernel 2 (the caller's scratch).
struct part_stat {
  double m;   // the part's largest z
  double s;   // sum over the part of exp(z - m), 0 when every z is -inf
  i64 arg;    // the first id of the part where z == m
};

i64 parts_of(i64 vocab) { return (vocab + part_ids - 1) / part_ids; }

// z exactly as ATen's logits.to(double) * inv_t: a rounded product. __dmul_rn is never fused
// into a following subtraction (z - m as an FMA would carry the unrounded product).
__device__ __forceinline__ double scaled(float logit, double inv_t) {
  return __dmul_rn(static_cast<double>(logit), inv_t);
}

// The block's largest (value, id), ties to the lower id; every thread gets it. Reduced in a
// fixed order (warp trees, then the warps in order). The shared arrays are free on return.
__device__ __forceinline__ void block_argmax(double& best, i64& id, double* max_of,
                                             i64* arg_of) {
  warp_argmax(best, id);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    max_of[warp] = best;
    arg_of[warp] = id;
  }
  __syncthreads();
  best = max_of[0];
  id = arg_of[0];
  for (int w = 1; w < part_warps; ++w)
    if (max_of[w] > best || (max_of[w] == best && arg_of[w] < id)) {
      best = max_of[w];
      id = arg_of[w];
    }
  __syncthreads();
}

// Kernel 1, block (d, p): the ids [p * part_ids, (p + 1) * part_ids) of row rows[d]. Thread t
// holds ids t + 256 j, j < 16 (every load of a warp 128 contiguous bytes), read once into
// registers for both the maximum and the sum. At least 4 blocks an SM (<= 64 registers, 60
// without spills under ptxas for sm_90; unbounded it took 76, 3 blocks): 32 warps to hide the
// latency of the double exp chains. 5 or more blocks spill.
__global__ void __launch_bounds__(part_threads, 4)
  sample_parts_kernel(const float* __restrict__ logits, i64 vocab, i64 row_stride,
                      const i64* __restrict__ rows, double inv_t, part_stat* __restrict__ stats) {
  pdl_enter();
  __shared__ double max_of[part_warps];
  __shared__ i64 arg_of[part_warps];
  __shared__ double sum_of[part_warps];
  const float* row = logits + rows[blockIdx.x] * row_stride;
  const i64 lo = static_cast<i64>(blockIdx.y) * part_ids + threadIdx.x;
  float v[per_thread];
#pragma unroll
  for (int j = 0; j < per_thread; ++j) {
    const i64 i = lo + j * part_threads;
    v[j] = i < vocab ? __ldg(row + i) : 0.0f;
  }
  double m = -INFINITY;
  i64 arg = vocab; // no id yet: loses every tie below
#pragma unroll
  for (int j = 0; j < per_thread; ++j) {
    const i64 i = lo + j * part_threads;
    const double z = scaled(v[j], inv_t);
    if (i < vocab && (z > m || arg == vocab)) { // ids rise with j: strict > keeps the first
      m = z;
      arg = i;
    }
  }
  block_argmax(m, arg, max_of, arg_of);
  double s = 0.0;
  if (m != -INFINITY) { // all -inf: the part has no mass (exp(-inf - -inf) would be NaN)
#pragma unroll
    for (int j = 0; j < per_thread; ++j)
      if (lo + j * part_threads < vocab)
        s += exp(scaled(v[j], inv_t) - m);
  }
  s = block_sum(s, sum_of);
  if (threadIdx.x == 0)
    stats[static_cast<i64>(blockIdx.x) * gridDim.y + blockIdx.y] = part_stat{m, s, arg};
}

// A part's mass relative to the row maximum M: s_p exp(m_p - M), one expression for the total
// and for the search so both see the same bits.
__device__ __forceinline__ double part_mass(const part_stat& p, double M) {
  return p.s == 0.0 ? 0.0 : p.s * exp(p.m - M);
}

// Kernel 2, block d: out[d] = (token, logprob) as doubles from draw d's part_stat row.
// token = the first id whose cumulative probability exceeds u[d] (= the number of ids whose
// cdf is <= u, at most vocab - 1), or the first maximum when greedy; logprob = z[token] - M -
// log(total). The cdf of id i is (the exclusive prefix of the part masses / total, in part
// order) + (the prefix of exp(z - M) / total inside its part, in id order); a part is chosen
// when its inclusive mass passes u, and when rounding leaves every id of it at or below u, its
// last id is the token.
__global__ void __launch_bounds__(part_threads)
  sample_pick_kernel(const float* __restrict__ logits, i64 vocab, i64 row_stride,
                     const i64* __restrict__ rows, const double* __restrict__ u, double inv_t,
                     bool greedy, const part_stat* __restrict__ stats, int parts,
                     double* __restrict__ out) {
  pdl_enter();
  __shared__ double max_of[part_warps];
  __shared__ i64 arg_of[part_warps];
  __shared__ double sum_of[part_warps];
  __shared__ int found_part;
  __shared__ double found_before;
  __shared__ int first_above;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const part_stat* st = stats + static_cast<i64>(blockIdx.x) * parts;
  const float* row = logits + rows[blockIdx.x] * row_stride;
  // The row maximum and its first id: parts hold disjoint rising ranges, so the lowest arg
  // among the parts of maximum m is the row's first maximum.
  double M = -INFINITY;
  i64 arg = vocab;
  for (int p = threadIdx.x; p < parts; p += part_threads)
    if (st[p].m > M || (st[p].m == M && st[p].arg < arg)) {
      M = st[p].m;
      arg = st[p].arg;
    }
  block_argmax(M, arg, max_of, arg_of);
  double mass = 0.0;
  for (int p = threadIdx.x; p < parts; p += part_threads)
    mass += part_mass(st[p], M);
  const double total = block_sum(mass, sum_of);
  i64 token = arg;
  if (!greedy) {
    const double target = u[blockIdx.x];
    if (warp == 0) { // the first part whose inclusive cumulative mass exceeds u, 32 at a time
      int found = -1;
      double before = 0.0, carry = 0.0;
      for (int base = 0; base < parts; base += 32) {
        const int p = base + lane;
        const double w = p < parts ? part_mass(st[p], M) / total : 0.0;
        const double incl = warp_inclusive(w);
        double excl = __shfl_up_sync(0xffffffffu, incl, 1);
        if (lane == 0)
          excl = 0.0;
        const unsigned above = __ballot_sync(0xffffffffu, p < parts && carry + incl > target);
        if (above != 0) {
          const int f = __ffs(above) - 1;
          found = base + f;
          before = carry + __shfl_sync(0xffffffffu, excl, f);
          break;
        }
        carry += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) {
        found_part = found;
        found_before = before;
        first_above = static_cast<int>(part_ids);
      }
    }
    __syncthreads();
    const int part = found_part;
    if (part < 0) {
      token = vocab - 1; // every cdf <= u (u at 1 within rounding): ATen's clamp
    } else {
      // Thread t scans the ids lo + 16 t + j of the part in order: its running sums c[j] in
      // registers, then the block's exclusive prefix of the thread totals (a warp scan, then
      // the warp totals in warp order) places them in the row's cdf.
      const i64 part_lo = static_cast<i64>(part) * part_ids;
      const i64 part_hi = part_lo + part_ids < vocab ? part_lo + part_ids : vocab;
      const i64 lo = part_lo + static_cast<i64>(threadIdx.x) * per_thread;
      double c[per_thread];
      double run = 0.0;
#pragma unroll
      for (int j = 0; j < per_thread; ++j) {
        const i64 i = lo + j;
        if (i < part_hi)
          run += exp(scaled(__ldg(row + i), inv_t) - M) / total;
        c[j] = run;
      }
      const double incl = warp_inclusive(run);
      double excl = __shfl_up_sync(0xffffffffu, incl, 1);
      if (lane == 0)
        excl = 0.0;
      if (lane == 31)
        sum_of[warp] = incl; // block_sum above has released sum_of
      __syncthreads();
      double start = found_before;
      for (int w = 0; w < warp; ++w)
        start += sum_of[w];
      start += excl;
#pragma unroll
      for (int j = 0; j < per_thread; ++j)
        if (lo + j < part_hi && start + c[j] > target) {
          atomicMin(&first_above, static_cast<int>(lo + j - part_lo)); // min: order-free
          break;
        }
      __syncthreads();
      token = first_above < part_hi - part_lo ? part_lo + first_above : part_hi - 1;
    }
  }
  if (threadIdx.x == 0) {
    out[2 * static_cast<i64>(blockIdx.x)] = static_cast<double>(token);
    out[2 * static_cast<i64>(blockIdx.x) + 1] = scaled(row[token], inv_t) - M - log(total);
  }
}

void check_shape(std::int64_t vocab, int draws) {
  if (vocab < 1 || draws < 0)
    throw std::invalid_argument("sample_plain: vocab " + std::to_string(vocab) + " and "
                                + std::to_string(draws)
                                + " draws (needs vocab >= 1 and draws >= 0)");
  if (parts_of(vocab) > max_parts)
    throw std::invalid_argument("sample_plain: vocab " + std::to_string(vocab)
                                + " is above the kernel's " + std::to_string(max_parts * part_ids)
                                + " ids");
}

} // namespace

std::size_t sample_plain_scratch_bytes(std::int64_t vocab, int draws) {
  check_shape(vocab, draws);
  return static_cast<std::size_t>(draws) * static_cast<std::size_t>(parts_of(vocab))
         * sizeof(part_stat);
}

void sample_plain(const float* logits, std::int64_t vocab, std::int64_t row_stride,
                  const std::int64_t* rows, const double* uniforms, int draws, double inv_t,
                  bool greedy, double* out, void* scratch, void* stream) {
  check_shape(vocab, draws);
  if (row_stride < vocab)
    throw std::invalid_argument("sample_plain: row stride " + std::to_string(row_stride)
                                + " is below the vocab " + std::to_string(vocab));
  if (draws == 0)
    return;
  if (logits == nullptr || rows == nullptr || out == nullptr || scratch == nullptr
      || (!greedy && uniforms == nullptr))
    throw std::invalid_argument("sample_plain: null logits, rows, out, scratch or (sampled "
                                "draws) uniforms");
  if (reinterpret_cast<std::uintptr_t>(scratch) % alignof(part_stat) != 0)
    throw std::invalid_argument("sample_plain: scratch is not 8-byte aligned");
  const i64 parts = parts_of(vocab);
  auto* stats = static_cast<part_stat*>(scratch);
  const cudaStream_t s = as_stream(stream);
  launch("sample_plain parts", sample_parts_kernel, dim3(static_cast<unsigned>(draws),
         static_cast<unsigned>(parts)), dim3(part_threads), s, logits, vocab, row_stride, rows,
         inv_t, stats);
  launch("sample_plain pick", sample_pick_kernel, dim3(static_cast<unsigned>(draws)),
         dim3(part_threads), s, logits, vocab, row_stride, rows, uniforms, inv_t, greedy,
         static_cast<const part_stat*>(stats), static_cast<int>(parts), out);
}

} // namespace refit::inference::kernels
