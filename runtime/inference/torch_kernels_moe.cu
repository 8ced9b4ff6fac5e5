// The bf16 engine's MoE kernels (see torch_kernels.hpp): routing, the counting sort by expert,
// the per-expert GEMV of small batches, SiLU x up, and the weighted mix of the experts' outputs
// back into the residual stream (optionally fused with the next RMSNorm).
#include "runtime/inference/torch_kernels.hpp"
#include "runtime/inference/torch_kernels_common.cuh"

namespace refit::inference::kernels {

using namespace detail;

namespace {

constexpr int max_experts_per_lane = 8; // experts <= 256
constexpr int max_bucket_copies = 4096;
constexpr int max_bucket_experts = 1024;
constexpr int tally_experts = max_bucket_experts * 4 / 32; // one byte per (warp, expert): 128

// ----------------------------------------------------------------------- routing

// One warp routes one token: softmax over the experts (fp32), top_k by repeated warp arg-max
// (ties: lower id), renormalized when asked; lane 0 writes ids / weights. logit(token, e): the
// router's logit as a float.
template <class Logit>
__device__ void route_token(Logit logit, int token, int experts, int top_k, bool renormalize,
                            i64* __restrict__ ids, float* __restrict__ weights) {
  const int lane = threadIdx.x & 31;
  float v[max_experts_per_lane];
  float mx = -INFINITY;
  for (int j = 0; j < max_experts_per_lane; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < experts ? logit(token, e) : -INFINITY;
    mx = fmaxf(mx, v[j]);
  }
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int j = 0; j < max_experts_per_lane; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < experts ? expf(v[j] - mx) : -1.0f;
    sum += e < experts ? v[j] : 0.0f;
  }
  sum = warp_sum(sum);
  for (int j = 0; j < max_experts_per_lane; ++j)
    if (lane + 32 * j < experts)
      v[j] /= sum;
  // Choice k stays in lane k's registers (k < 32) and the lanes store them together at the
  // end, renormalized: no stores read back. Past 32 choices lane 0 stores them and divides
  // them in place afterwards. The same divisions either way: the same bits.
  float total = 0.0f;
  float mine = 0.0f;
  int mine_e = 0;
  i64* const token_ids = ids + static_cast<i64>(token) * top_k;
  float* const token_weights = weights + static_cast<i64>(token) * top_k;
  for (int k = 0; k < top_k; ++k) {
    float best = -1.0f;
    int best_e = 1 << 30;
    for (int j = 0; j < max_experts_per_lane; ++j) {
      const int e = lane + 32 * j;
      if (v[j] > best || (v[j] == best && e < best_e)) {
        best = v[j];
        best_e = e;
      }
    }
    warp_argmax(best, best_e);
    if ((best_e & 31) == lane)
      v[best_e >> 5] = -1.0f; // taken
    total += best;
    if (k < 32 && lane == k) {
      mine = best;
      mine_e = best_e;
    } else if (k >= 32 && lane == 0) {
      token_ids[k] = best_e;
      token_weights[k] = best;
    }
  }
  if (lane < top_k) {
    token_ids[lane] = mine_e;
    token_weights[lane] = renormalize ? mine / total : mine;
  }
  if (renormalize && top_k > 32) {
    __syncwarp(); // lane 0's stores above, read back by lane 0 only
    if (lane == 0)
      for (int k = 32; k < top_k; ++k)
        token_weights[k] /= total;
  }
}

__global__ void route_kernel(const bf16* __restrict__ logits, int n, int experts, int top_k,
                             bool renormalize, i64* __restrict__ ids, float* __restrict__ weights) {
  pdl_enter();
  const int token = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (token < n)
    route_token([&](int t, int e) { return to_f(logits[static_cast<i64>(t) * experts + e]); },
                token, experts, top_k, renormalize, ids, weights);
}

// fp32 logits, plus a second part (lo, may be null) added to them: the router of the split
// input hi + lo (route_token's logit(token, e)).
struct split_logit {
  const float* __restrict__ logits;
  const float* __restrict__ lo;
  int experts;
  __device__ float operator()(int t, int e) const {
    const i64 at = static_cast<i64>(t) * experts + e;
    return lo != nullptr ? logits[at] + lo[at] : logits[at];
  }
};

__global__ void route_f32_kernel(const float* __restrict__ logits, const float* __restrict__ lo,
                                 int n, int experts, int top_k, bool renormalize,
                                 i64* __restrict__ ids, float* __restrict__ weights) {
  pdl_enter();
  const int token = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (token < n)
    route_token(split_logit{logits, lo, experts}, token, experts, top_k, renormalize, ids,
                weights);
}

// ----------------------------------------------------------------- bucket by expert

// One block of 1024 threads: counts by shared atomics, exclusive scans over the experts of
// the counts and of the non-empty flags (warp scans + a scan of the warp totals), then the
// copies are placed 1024 at a time, one per thread: the lanes of a warp that share an expert
// find each other (match_any); up to 128 experts a table of each warp's count per expert gives
// a copy the place after the same expert's copies of the warps before (past 128 the warps
// claim their runs in order, a barrier each). Stable: flat index order within an expert;
// deterministic.
__device__ void bucket_block(const i64* __restrict__ ids, int copies, int top_k, int experts,
                             const bucket_out& out) {
  __shared__ int count[max_bucket_experts];
  __shared__ int start[max_bucket_experts]; // then the next free position of each expert
  __shared__ short id[max_bucket_copies];
  __shared__ int warp_total[32];
  __shared__ int warp_used[32];
  // Per round, the copies of each expert in each warp (experts <= tally_experts).
  __shared__ unsigned tally_words[max_bucket_experts];
  unsigned char* const tally = reinterpret_cast<unsigned char*>(tally_words);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  // The running expert loads, read now so their latency overlaps the sort (this kernel is
  // their only writer).
  const i64 loads_before =
    static_cast<int>(threadIdx.x) < out.loads_n ? out.loads[threadIdx.x] : 0;
  for (int e = threadIdx.x; e < experts; e += blockDim.x)
    count[e] = 0;
  __syncthreads();
  for (int f = threadIdx.x; f < copies; f += blockDim.x) {
    id[f] = static_cast<short>(ids[f]);
    atomicAdd(&count[id[f]], 1);
  }
  __syncthreads();
  const int e = threadIdx.x; // blockDim.x == max_bucket_experts
  const int c = e < experts ? count[e] : 0;
  const int inclusive = warp_inclusive(c);
  const unsigned nonempty = __ballot_sync(0xffffffffu, c > 0);
  if (lane == 31)
    warp_total[warp] = inclusive;
  if (lane == 0)
    warp_used[warp] = __popc(nonempty);
  const int used = __syncthreads_count(c > 0);
  if (warp == 0) {
    const int t = warp_inclusive(warp_total[lane]);
    const int u = warp_inclusive(warp_used[lane]);
    warp_total[lane] = t;
    warp_used[lane] = u;
  }
  __syncthreads();
  if (e < experts) {
    const int exclusive = inclusive - c + (warp > 0 ? warp_total[warp - 1] : 0);
    start[e] = exclusive;
    out.offsets[e] = exclusive + c;
    out.counts[e] = c;
    if (c > 0 && out.active != nullptr)
      out.active[(warp > 0 ? warp_used[warp - 1] : 0)
                 + __popc(nonempty & ((1u << lane) - 1u))] = e;
  }
  if (threadIdx.x == 0 && out.active_count != nullptr)
    *out.active_count = used;
  if (static_cast<int>(threadIdx.x) < out.loads_n)
    out.loads[threadIdx.x] = loads_before + used;
  __syncthreads();
  for (int base = 0; base < copies; base += blockDim.x) {
    const int f = base + static_cast<int>(threadIdx.x);
    const bool live = f < copies;
    const int ex = live ? id[f] : -1 - lane; // past the end: a lane of its own
    const unsigned peers = __match_any_sync(0xffffffffu, ex);
    const int before = __popc(peers & ((1u << lane) - 1u)); // same-expert lanes before this one
    const int leader = __ffs(peers) - 1;
    const int warps = (min(copies - base, static_cast<int>(blockDim.x)) + 31) >> 5;
    int r = 0;
    if (experts <= tally_experts) {
      // Each warp's count of each expert in a table (one barrier), a copy's place is its
      // expert's start + the counts of the warps before its own + its rank in its warp; then
      // each expert's start moves past the round: four barriers a round instead of one a warp.
      tally_words[threadIdx.x] = 0u; // blockDim.x == the table's words
      __syncthreads();
      if (live && before == 0)
        tally[warp * tally_experts + ex] = static_cast<unsigned char>(__popc(peers));
      __syncthreads();
      if (live) {
        int prior = start[ex];
        for (int w = 0; w < warp; ++w)
          prior += tally[w * tally_experts + ex];
        r = prior + before;
      }
      __syncthreads(); // every start read
      if (e < experts) {
        int round = 0;
        for (int w = 0; w < warps; ++w)
          round += tally[w * tally_experts + e];
        start[e] += round;
      }
      __syncthreads(); // the starts moved and the table read, before the next round clears it
    } else {
      int claimed = 0;
      for (int w = 0; w < warps; ++w) { // the warps claim in order: stable across warps
        if (warp == w && live && before == 0) {
          claimed = start[ex];
          start[ex] = claimed + __popc(peers);
        }
        __syncthreads();
      }
      r = __shfl_sync(0xffffffffu, claimed, leader) + before;
    }
    if (live) {
      out.order[r] = f;
      out.src_token[r] = f / top_k;
      out.inverse[f] = r;
    }
  }
}

__global__ void __launch_bounds__(1024)
  bucket_kernel(const i64* __restrict__ ids, int copies, int top_k, int experts, bucket_out out) {
  pdl_enter();
  bucket_block(ids, copies, top_k, experts, out);
}

// One block of 1024 threads routes the n tokens (warp w: tokens w, w + 32, ...), then sorts the
// copies it just chose (bucket_block reads the ids back after the barrier, from the block's own
// writes): few tokens route in one launch instead of two.
__global__ void __launch_bounds__(1024)
  route_bucket_f32_kernel(const float* __restrict__ logits, const float* __restrict__ lo, int n,
                          int experts, int top_k, bool renormalize, i64* __restrict__ ids,
                          float* __restrict__ weights, bucket_out out) {
  pdl_enter();
  for (int token = threadIdx.x >> 5; token < n; token += blockDim.x >> 5)
    route_token(split_logit{logits, lo, experts}, token, experts, top_k, renormalize, ids,
                weights);
  __syncthreads(); // the ids, written to global memory above, read back by the same block
  bucket_block(ids, n * top_k, top_k, experts, out);
}

// --------------------------------------------------------------- expert GEMV

// One block per (expert group, 8 output rows): the group's first sorted copy does the group
// (the other copies' blocks return), one warp per output row (gemv_row, common.cuh).
// x-row(p) = x[x_rows[p]] when x_rows is set (the token's hidden row: no gather), else x[p].
template <int KC>
__global__ void expert_gemv_kernel(const bf16* __restrict__ x, const i64* __restrict__ x_rows,
                                   const bf16* __restrict__ w, const i64* __restrict__ ids,
                                   const i64* __restrict__ order, const i64* __restrict__ counts,
                                   const int* __restrict__ offsets, bf16* __restrict__ y, int n,
                                   int k) {
  pdl_enter();
  const int p = blockIdx.x;
  const int e = static_cast<int>(ids[order[p]]);
  const int count = static_cast<int>(counts[e]);
  const int first = offsets[e] - count;
  if (p != first)
    return;
  const int row = blockIdx.y * gemv_rows_per_block + (threadIdx.x >> 5);
  if (row >= n)
    return;
  gemv_row<KC>(w + (static_cast<i64>(e) * n + row) * k, x, x_rows, first, count, y, n, row, k);
}

template <int KC>
void launch_gemv(const gemv_args& a, cudaStream_t s) {
  const dim3 grid(a.copies, (a.n + gemv_rows_per_block - 1) / gemv_rows_per_block);
  launch("expert_gemv", expert_gemv_kernel<KC>, grid, dim3(gemv_rows_per_block * 32), s,
         static_cast<const bf16*>(a.x), a.x_rows, static_cast<const bf16*>(a.w), a.ids, a.order,
         a.counts, a.offsets, static_cast<bf16*>(a.y), a.n, a.k);
}

// ------------------------------------------------------------------ elementwise

__global__ void silu_mul_kernel(const bf16* __restrict__ gate_up, bf16* __restrict__ act, i64 m,
                                int inter) {
  pdl_enter();
  const i64 total = m * inter;
  for (i64 idx = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 r = idx / inter;
    const i64 c = idx % inter;
    const float g = to_f(gate_up[r * 2 * inter + c]);
    const float u = to_f(gate_up[r * 2 * inter + inter + c]);
    act[idx] = to_bf(g / (1.0f + expf(-g)) * u);
  }
}

// One block per token: x[t] += sum_j weights[t, j] * y[inverse[t, j]], columns by 8 (one
// 16-byte load per expert) when h % 8 == 0; then, when norm_w is given, norm_out[t] =
// RMSNorm(x[t]) (the next layer's input norm).
//
// Early (one 8-column chunk a thread: h == 8 * blockDim.x, top_k <= max_mix_early_top_k): the
// routing (inverse, weights), the residual row and the norm weights are read before the wait
// (pdl_enter), through L2 (ld.global.cg), and the normed row comes from registers. That is
// sound because the kernel is launched (programmatically) only once every block of the kernel
// before it has passed its own wait, so the kernels before that one (routing, the sort, the
// residual add) have completed and their writes reached L2; only y, the kernel just before's
// output, is read after the wait. Same sums in the same order: the same bits.
constexpr int max_mix_early_top_k = 32;

// Columns c .. c + 7 of one token: (a, b) += sum_j weights[j] * y[rows[j]] (j in order, the
// sum first, then added: the same bits on both of mix_kernel's paths).
template <class Y>
__device__ __forceinline__ void mix_into(const Y* __restrict__ y, const i64* rows,
                                         const float* weights, int top_k, int h, int c,
                                         float4& a, float4& b) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll 8
  for (int j = 0; j < top_k; ++j) {
    float v[8];
    load8(y + rows[j] * h + c, v);
    const float wj = weights[j];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      acc[i] += wj * v[i];
  }
  a.x += acc[0], a.y += acc[1], a.z += acc[2], a.w += acc[3];
  b.x += acc[4], b.y += acc[5], b.z += acc[6], b.w += acc[7];
}

template <class Y>
__global__ void mix_kernel(const Y* __restrict__ y, const i64* __restrict__ inverse,
                           const float* __restrict__ weights, float* __restrict__ x, int top_k,
                           int h, const bf16* __restrict__ norm_w, bf16* __restrict__ norm_out,
                           float eps, bool early, bool trigger_early) {
  __shared__ float shared[32];
  if (trigger_early) // the next kernel (the next layer's qkv) may start during the down projection
    pdl_trigger();
  const int t = blockIdx.x;
  const i64* inv = inverse + static_cast<i64>(t) * top_k;
  const float* wt = weights + static_cast<i64>(t) * top_k;
  float* row = x + static_cast<i64>(t) * h;
  if (early) {
    __shared__ i64 early_inv[max_mix_early_top_k];
    __shared__ float early_wt[max_mix_early_top_k];
    const int c = threadIdx.x * 8;
    if (threadIdx.x < top_k) {
      early_inv[threadIdx.x] = __ldcg(reinterpret_cast<const long long*>(inv) + threadIdx.x);
      early_wt[threadIdx.x] = __ldcg(wt + threadIdx.x);
    }
    float4* xp = reinterpret_cast<float4*>(row + c);
    float4 a = __ldcg(xp), b = __ldcg(xp + 1);
    float nw[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (norm_w != nullptr)
      load8(norm_w + c, nw);
    pdl_enter();
    __syncthreads();
    mix_into(y, early_inv, early_wt, top_k, h, c, a, b);
    xp[0] = a;
    xp[1] = b;
    if (norm_w == nullptr)
      return;
    // norm_row's sums and products, from registers (two halves of 4 as norm_row's columns).
    float ss = a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y
               + b.z * b.z + b.w * b.w;
    ss = block_sum(ss, shared);
    const float r = rsqrtf(ss / static_cast<float>(h) + eps);
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    __align__(16) bf16 ob[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      ob[i] = to_bf(v[i] * r * nw[i]);
    *reinterpret_cast<uint4*>(norm_out + static_cast<i64>(t) * h + c) =
      *reinterpret_cast<const uint4*>(ob);
    return;
  }
  pdl_enter();
  float ss = 0.0f;
  if ((h & 7) == 0) {
    for (int c = threadIdx.x * 8; c < h; c += blockDim.x * 8) {
      float4* xp = reinterpret_cast<float4*>(row + c);
      float4 a = xp[0], b = xp[1];
      mix_into(y, inv, wt, top_k, h, c, a, b);
      xp[0] = a;
      xp[1] = b;
      ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z
            + b.w * b.w;
    }
  } else {
    for (int c = threadIdx.x; c < h; c += blockDim.x) {
      float sum = 0.0f;
      for (int j = 0; j < top_k; ++j)
        sum += wt[j] * to_f(y[inv[j] * h + c]);
      const float v = row[c] + sum;
      row[c] = v;
      ss += v * v;
    }
  }
  if (norm_w != nullptr)
    norm_row(row, norm_w, norm_out + static_cast<i64>(t) * h, h, eps, ss, shared);
}

} // namespace

bool route_supported(int experts, int top_k) {
  return experts >= 1 && experts <= 32 * max_experts_per_lane && top_k >= 1 && top_k <= experts;
}

void route(const void* logits, int n, int experts, int top_k, bool renormalize,
           std::int64_t* ids, float* weights, void* stream) {
  const int threads = 256; // 8 tokens per block
  const int blocks = (n * 32 + threads - 1) / threads;
  launch("route", route_kernel, dim3(blocks), dim3(threads), as_stream(stream),
         static_cast<const bf16*>(logits), n, experts, top_k, renormalize, ids, weights);
}

void route_f32(const float* logits, const float* lo, int n, int experts, int top_k,
               bool renormalize, std::int64_t* ids, float* weights, void* stream) {
  const int threads = 256;
  const int blocks = (n * 32 + threads - 1) / threads;
  launch("route", route_f32_kernel, dim3(blocks), dim3(threads), as_stream(stream), logits, lo, n,
         experts, top_k, renormalize, ids, weights);
}

bool bucket_supported(int copies, int experts) {
  return copies >= 1 && copies <= max_bucket_copies && experts >= 1
         && experts <= max_bucket_experts && experts <= 32767;
}

void bucket(const std::int64_t* ids, int copies, int top_k, int experts, const bucket_out& out,
            void* stream) {
  launch("bucket", bucket_kernel, dim3(1), dim3(max_bucket_experts), as_stream(stream), ids,
         copies, top_k, experts, out);
}

bool route_bucket_supported(int n, int experts, int top_k) {
  return n >= 1 && n <= route_bucket_max_tokens && route_supported(experts, top_k)
         && bucket_supported(n * top_k, experts);
}

void route_bucket_f32(const float* logits, const float* lo, int n, int experts, int top_k,
                      bool renormalize, std::int64_t* ids, float* weights, const bucket_out& out,
                      void* stream) {
  if (!route_bucket_supported(n, experts, top_k))
    throw std::invalid_argument("route_bucket_f32: " + std::to_string(n) + " tokens, "
                                + std::to_string(experts) + " experts, top_k "
                                + std::to_string(top_k) + " (at most "
                                + std::to_string(route_bucket_max_tokens)
                                + " tokens, and what route and bucket take)");
  launch("route_bucket", route_bucket_f32_kernel, dim3(1), dim3(max_bucket_experts),
         as_stream(stream), logits, lo, n, experts, top_k, renormalize, ids, weights, out);
}

bool expert_gemv_supported(std::int64_t copies, std::int64_t k, std::int64_t max_copies) {
  return copies >= 1 && copies <= max_copies && k % 8 == 0 && k <= gemv_max_k;
}

void expert_gemv(const gemv_args& a, void* stream) {
  const cudaStream_t s = as_stream(stream);
  with_chunks(a.k, "expert_gemv", [&](auto kc) { launch_gemv<decltype(kc)::value>(a, s); });
}

void silu_mul(const void* gate_up, void* act, std::int64_t m, int inter, void* stream) {
  launch("silu_mul", silu_mul_kernel, dim3(grid_for(m * inter, 256)), dim3(256),
         as_stream(stream), static_cast<const bf16*>(gate_up), static_cast<bf16*>(act), m, inter);
}

void mix_experts(const void* y, const std::int64_t* inverse, const float* weights, float* x,
                 int n, int top_k, int h, const void* norm_w, void* norm_out, float eps,
                 void* stream, bool y_f32, bool early, bool trigger_early) {
  // Early: a thread per 8 columns (h a multiple of 256 up to 8192: whole warps).
  early = early && h % 256 == 0 && h / 8 <= 1024 && top_k <= max_mix_early_top_k;
  const int threads = early ? h / 8 : 256;
  if (y_f32)
    launch("mix_experts", mix_kernel<float>, dim3(n), dim3(threads), as_stream(stream),
           static_cast<const float*>(y), inverse, weights, x, top_k, h,
           static_cast<const bf16*>(norm_w), static_cast<bf16*>(norm_out), eps, early,
           trigger_early);
  else
    launch("mix_experts", mix_kernel<bf16>, dim3(n), dim3(threads), as_stream(stream),
           static_cast<const bf16*>(y), inverse, weights, x, top_k, h,
           static_cast<const bf16*>(norm_w), static_cast<bf16*>(norm_out), eps, early,
           trigger_early);
}

} // namespace refit::inference::kernels
