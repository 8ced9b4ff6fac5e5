// Sampling without filters on the device (torch_kernels.hpp: sample_plain): one block per draw
// does what the ATen chain of sample_on_device does for top_k 0 and top_p 1 (z = logits / T in
// double, z - max, exp, the inverse CDF of the draw's uniform in id order, or the first
// maximum when greedy), reading the row a few times instead of a dozen [draws, vocab] double
// tensors passing through memory.
#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_common.cuh"

namespace refit::inference::kernels {

using namespace detail;

namespace {

constexpr int sample_threads = 1024;
constexpr int sample_warps = sample_threads / 32;
static_assert(sample_warps == 32, "the scans take one warp total per lane");

// Block d: row rows[d] of logits (row_stride floats apart). out[d] = (token, logprob) as
// doubles: token = the number of ids whose cumulative probability is <= u[d] (at most
// vocab - 1), or the first maximum when greedy; logprob = z[token] - log(sum exp z), z =
// logits * inv_t - max. Warp w owns the ids [w * span, (w + 1) * span) for the sums and lane l
// of it the ids 32 j + l of that range: every load of a warp is 128 contiguous bytes. (A
// thread per contiguous range, as before, made each load 32 sectors: ~170 us a step at batch
// 64 under Nsight Compute, bound by L1 transactions.) Every sum runs in a fixed order.
__global__ void __launch_bounds__(sample_threads)
  sample_plain_kernel(const float* __restrict__ logits, i64 vocab, i64 row_stride,
                      const i64* __restrict__ rows, const double* __restrict__ u,
                      double inv_t, bool greedy, double* __restrict__ out) {
  pdl_enter();
  __shared__ double dshared[sample_warps];
  __shared__ double before_of[sample_warps];
  __shared__ double max_of[sample_warps];
  __shared__ i64 arg_of[sample_warps];
  __shared__ unsigned long long first_above;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* row = logits + rows[blockIdx.x] * row_stride;
  // The maximum of z and its first id: strided (coalesced) reads, ties to the lower id.
  double best = -INFINITY;
  i64 best_id = vocab; // no id yet: loses every tie below
  for (i64 i = threadIdx.x; i < vocab; i += sample_threads) {
    const double z = static_cast<double>(row[i]) * inv_t;
    if (z > best || best_id == vocab) {
      best = z;
      best_id = i;
    }
  }
  warp_argmax(best, best_id);
  if (lane == 0) {
    max_of[warp] = best;
    arg_of[warp] = best_id;
  }
  if (threadIdx.x == 0)
    first_above = static_cast<unsigned long long>(vocab);
  __syncthreads();
  double mx = max_of[0];
  i64 arg = arg_of[0];
  for (int w = 1; w < sample_warps; ++w)
    if (max_of[w] > mx || (max_of[w] == mx && arg_of[w] < arg)) {
      mx = max_of[w];
      arg = arg_of[w];
    }
  const i64 span = ((vocab + sample_warps - 1) / sample_warps + 31) / 32 * 32;
  const i64 lo = warp * span;
  const i64 hi = lo + span < vocab ? lo + span : vocab;
  double sum = 0.0;
  for (i64 i = lo + lane; i < hi; i += 32)
    sum += exp(static_cast<double>(row[i]) * inv_t - mx);
  const double total = block_sum(sum, dshared);
  i64 token = arg;
  if (!greedy) {
    // cdf_i = the sum of exp(z_j) / total over j <= i; the token is the first id above u.
    double mass = 0.0;
    for (i64 i = lo + lane; i < hi; i += 32)
      mass += exp(static_cast<double>(row[i]) * inv_t - mx) / total;
    mass = warp_sum(mass); // the warp's mass, the same bits in every lane
    if (lane == 0)
      dshared[warp] = mass;
    __syncthreads();
    if (warp == 0) { // exclusive prefix of the warp masses, in warp order
      double incl = dshared[lane];
      for (int o = 1; o < 32; o <<= 1) {
        const double v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o)
          incl += v;
      }
      before_of[lane] = incl - dshared[lane];
    }
    __syncthreads();
    const double target = u[blockIdx.x];
    double cdf = before_of[warp];
    if (lo < hi && cdf + mass > target) { // this warp's range holds an id above u
      // Walk the range 32 ids at a time: a warp scan of their probabilities in id order.
      for (i64 base = lo; base < hi; base += 32) {
        const i64 i = base + lane;
        const double p = i < hi ? exp(static_cast<double>(row[i]) * inv_t - mx) / total : 0.0;
        double incl = p;
        for (int o = 1; o < 32; o <<= 1) {
          const double v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o)
            incl += v;
        }
        const unsigned above = __ballot_sync(0xffffffffu, i < hi && cdf + incl > target);
        if (above != 0) {
          if (lane == 0)
            atomicMin(&first_above, static_cast<unsigned long long>(base + __ffs(above) - 1));
          break;
        }
        cdf += __shfl_sync(0xffffffffu, incl, 31);
      }
    }
    __syncthreads();
    token = static_cast<i64>(first_above);
    if (token > vocab - 1)
      token = vocab - 1;
  }
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = static_cast<double>(token);
    out[2 * blockIdx.x + 1] = static_cast<double>(row[token]) * inv_t - mx - log(total);
  }
}

} // namespace

void sample_plain(const float* logits, std::int64_t vocab, std::int64_t row_stride,
                  const std::int64_t* rows, const double* uniforms, int draws, double inv_t,
                  bool greedy, double* out, void* stream) {
  if (vocab < 1 || draws < 0)
    throw std::invalid_argument("sample_plain: vocab " + std::to_string(vocab) + ", "
                                + std::to_string(draws) + " draws");
  if (draws == 0)
    return;
  launch("sample_plain", sample_plain_kernel, dim3(draws), dim3(sample_threads),
         as_stream(stream), logits, vocab, row_stride, rows, uniforms, inv_t, greedy, out);
}

} // namespace refit::inference::kernels
