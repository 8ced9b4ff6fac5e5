// Decode attention's mode 2 (torch_kernels.hpp: decode_attention): the tensor-core kernel with O
// accumulated transposed, so no accumulator row is spent on the heads an m16n8k16 tile lacks.
#include "runtime/inference/torch_kernels_attention.cuh"

#include <cuda_pipeline.h>

#include <cmath>

namespace refit::inference::kernels::attention_detail {

namespace {

// Dynamic shared memory of the transposed kernel: the NW warps' K and V tiles and q's 8 rows
// (64 KiB + 2 KiB at D 128), later the combine's arrays (smaller).
template <int D, int NW>
constexpr int mma_t_smem() {
  static_assert((NW * 32 * 2 + 8) * D * 2 >= (2 * NW * 8 + NW * 8 * D) * 4, "mma_t: smem");
  return (NW * 32 * 2 + 8) * D * 2;
}

// qk_norm_rope_write's arithmetic for one head of one token, by one warp: in bf16 [D] RMS-normed
// with w (fp32 sums: each lane's pairs, then warp_sum), RoPE'd at position p, out(dim, value).
template <int D, class Out>
__device__ __forceinline__ void norm_rope_head(const bf16* in, const bf16* w, const attention_qk& qk,
                                               i64 p, int lane, Out&& out) {
  constexpr int half = D / 2;
  constexpr int PL = half / 32; // dim pairs (t, t + half) a lane takes
  float a[PL], b[PL];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < PL; ++j) {
    a[j] = to_f(in[lane + 32 * j]);
    b[j] = to_f(in[lane + 32 * j + half]);
    ss += a[j] * a[j] + b[j] * b[j];
  }
  const float r = rsqrtf(warp_sum(ss) / static_cast<float>(D) + qk.eps);
#pragma unroll
  for (int j = 0; j < PL; ++j) {
    const int t = lane + 32 * j;
    const float x = a[j] * r * to_f(w[t]);
    const float y = b[j] * r * to_f(w[t + half]);
    const float c = qk.cos[p * half + t];
    const float s = qk.sin[p * half + t];
    out(t, to_bf(x * c - y * s));
    out(t + half, to_bf(y * c + x * s));
  }
}

// The block's q rows in shared memory (qs: 8 rows of D, chunk c of row r at c ^ r; rows >= G
// zero): loaded from q, or (qk set) computed from qkv, and then the sequence's last position's K
// and V written into the cache by the split whose tile holds that position (the block that reads
// it; __syncthreads after this orders the write before its reads).
template <int D, int G, int NW>
__device__ __forceinline__ void stage_q(bf16* qs, const bf16* __restrict__ q, const attention_qk& qk,
                                        const kv_target& kv, int b, int h, int split, int splits,
                                        int length, int hq, int hkv) {
  constexpr int RC = D / 8;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int head0 = h * G;
  if (qk.qkv == nullptr) {
    const uint4* qg = reinterpret_cast<const uint4*>(q + (static_cast<i64>(b) * hq + head0) * D);
    for (int i = threadIdx.x; i < 8 * RC; i += NW * 32) { // row i / RC, chunk i % RC (swizzled)
      const int r = i / RC;
      reinterpret_cast<uint4*>(qs + r * D)[(i % RC) ^ r] =
        r < G ? __ldg(qg + i) : make_uint4(0u, 0u, 0u, 0u);
    }
    return;
  }
  const bf16* qkv = static_cast<const bf16*>(qk.qkv);
  const i64 cols = static_cast<i64>(hq + 2 * hkv) * D;
  for (int r = warp; r < 8; r += NW) {
    bf16* row = qs + r * D;
    if (r < G)
      norm_rope_head<D>(qkv + b * cols + static_cast<i64>(head0 + r) * D,
                        static_cast<const bf16*>(qk.q_norm), qk, qk.positions[b], lane,
                        [&](int dim, bf16 v) { row[(((dim >> 3) ^ r) << 3) + (dim & 7)] = v; });
    else
      for (int c = lane; c < RC; c += 32)
        reinterpret_cast<uint4*>(row)[c] = make_uint4(0u, 0u, 0u, 0u);
  }
  if (length < 1 || ((length - 1) / 32) % splits != split || warp > 1)
    return;
  const i64 src = qk.src_row[b];
  const i64 slot = qk.write_block[b] * kv.block_elems + kv.layer_offset
                   + qk.write_slot[b] * static_cast<i64>(hkv) * D + static_cast<i64>(h) * D;
  bf16* cache = static_cast<bf16*>(kv.base);
  const bf16* in = qkv + src * cols + static_cast<i64>(hq + (warp == 0 ? h : hkv + h)) * D;
  if (warp == 0) // K: normed and RoPE'd at the token's position
    norm_rope_head<D>(in, static_cast<const bf16*>(qk.k_norm), qk, qk.positions[src], lane,
                      [&](int dim, bf16 v) { cache[slot + dim] = v; });
  else // V: as it is
    for (int c = lane; c < RC; c += 32)
      reinterpret_cast<uint4*>(cache + slot + kv.part_elems)[c] =
        reinterpret_cast<const uint4*>(in)[c];
}

// Tensor cores, transposed (mode 2). Same blocks, tiles, softmax and combine as mode 1
// (torch_kernels_attention.cu), but both the K and the V rows of a tile are copied to shared
// memory (cp.async, whole rows an instruction; 16-byte chunk c of row r at c ^ (r % 8): the 8
// rows of an ldmatrix matrix fall in 8 different bank groups; zeros past the end), and O is
// accumulated transposed, so that no
// accumulator row is spent on the 8 heads an m16n8k16 tile lacks:
// S = Q . K^T: A = Q (heads as rows, rows >= G zero; a0 / a2 of thread (g, t): Q[head g][dims
// 2t, 2t+1 / 2t+8, 2t+9] of the k-step), B = K^T in four column tiles of 8 positions (b0 / b1:
// K[position g][the same dims]), both through ldmatrix from shared memory (q staged once).
// O^T += V^T . P^T: A = V^T (16 head dims as rows, D / 16 row tiles; ldmatrix.trans), B = P^T
// (the 8 heads as columns): its b0 / b1, P[head g][positions 2t, 2t+1 / 2t+8, 2t+9] of a
// 16-position k-step, are c0, c1 of S's two column tiles of that step, packed to bf16 in two
// parts (hi + lo) as above. C of O^T: thread (g, t) holds dims 16 k + g (c0, c1) and
// 16 k + 8 + g (c2, c3) of heads 2t, 2t+1. Positions and slots in 32-bit ints. NW warps a
// block (decode_attention_warps): at 4 a minimum of 4 blocks caps the registers at 128 (the
// shared memory holds 3 blocks an SM at D 128); 6 warps fit 2 blocks an SM, 8 warps 1.
template <int NW>
constexpr int mma_t_min_blocks = NW == 4 ? 4 : (NW == 6 ? 2 : 1);

template <int D, int G, int NW>
__global__ void __launch_bounds__(NW * 32, mma_t_min_blocks<NW>)
  decode_attention_mma_t_kernel(const bf16* __restrict__ q, kv_target kv,
                                const i64* __restrict__ table, int width,
                                const i64* __restrict__ lengths, bf16* __restrict__ out,
                                float* __restrict__ partial, int splits, int hq, int hkv,
                                float scale, attention_qk qk) {
  pdl_enter();
  static_assert(G >= 1 && G <= 8 && (D == 64 || D == 128), "decode attention (mma_t): shape");
  constexpr int TILE = 32;
  constexpr int KS = D / 16; // k-steps of S, row tiles of O^T
  constexpr int RC = D / 8;  // 16-byte chunks of a K or V row
  extern __shared__ __align__(16) unsigned char attention_smem[];
  const int b = blockIdx.x;
  const int h = blockIdx.y;
  const int split = blockIdx.z;
  const int head0 = h * G;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  bf16* qs = reinterpret_cast<bf16*>(attention_smem) + NW * 2 * TILE * D; // q: 8 rows of D
  const int length = static_cast<int>(lengths[b]);
  stage_q<D, G, NW>(qs, q, qk, kv, b, h, split, splits, length, hq, hkv);
  __syncthreads();
  float m = -INFINITY; // head g's running max (equal in its four lanes)
  float l = 0.0f;      // this thread's share of head g's sum
  float acc[KS][4] = {}; // O^T: [k][0], [1]: dim 16 k + g of heads 2t, 2t+1; [2], [3]: dim + 8
  const bf16* cache = static_cast<const bf16*>(kv.base);
  const i64* row_table = table + static_cast<i64>(b) * width;
  const i64 head_offset = kv.layer_offset + static_cast<i64>(h) * D;
  const int slot_elems = hkv * D; // from one slot of a block to the next
  const int block_size = kv.block_size;
  bf16* kw = reinterpret_cast<bf16*>(attention_smem) + warp * 2 * TILE * D;
  bf16* vw = kw + TILE * D;
  const int sw = lane & 7; // the swizzle of the rows this lane addresses (row % 8 == lane % 8)
  const int stride = splits * NW * TILE;
  for (int base = (split + splits * warp) * TILE; base < length; base += stride) {
    { // The tile's K and V rows, coalesced: one copy instruction takes 32 / RC whole rows
      // (lane l: chunk l % RC of row l / RC), each row's cache offset shuffled from the lane of
      // its position (lane l looks up position base + l); chunk c of row r lands at c ^ (r % 8),
      // rows past the end are zeros. (A lane copying a row of its own made every instruction
      // touch 32 rows: the L1 took 32 cycles an instruction.)
      const int p = base + lane;
      i64 off = -1;
      if (p < length) {
        const int blk = p / block_size;
        off = row_table[blk] * kv.block_elems + head_offset + (p - blk * block_size) * slot_elems;
      }
      constexpr int RPI = 32 / RC; // rows per copy instruction
      const int c = lane % RC;
#pragma unroll
      for (int r0 = 0; r0 < TILE; r0 += RPI) {
        const int r = r0 + lane / RC;
        const i64 row = __shfl_sync(0xffffffffu, off, r);
        uint4* kd = reinterpret_cast<uint4*>(kw + r * D) + (c ^ (r & 7));
        uint4* vd = reinterpret_cast<uint4*>(vw + r * D) + (c ^ (r & 7));
        if (row >= 0) {
          __pipeline_memcpy_async(kd, reinterpret_cast<const uint4*>(cache + row) + c, 16);
          __pipeline_memcpy_async(vd, reinterpret_cast<const uint4*>(cache + row + kv.part_elems) + c,
                                  16);
        } else {
          *kd = *vd = make_uint4(0u, 0u, 0u, 0u);
        }
      }
      __pipeline_commit();
      __pipeline_wait_prior(0);
      __syncwarp();
    }
    float s[4][4] = {}; // [n][0..1]: head g at positions base + 8 n + 2 t, + 1; [2..3]: zero rows
#pragma unroll
    for (int j = 0; j < KS / 2; ++j) { // k-steps 2 j, 2 j + 1; matrix i: dims 32 j + 8 i .. + 7
      const int chunk = (4 * j + (lane >> 3)) ^ sw;
      unsigned qa[4]; // a0, a2 of k-step 2 j (qa 0, 1) and of 2 j + 1 (qa 2, 3); rows: heads
      ldmatrix_x4(qa, qs + sw * D + chunk * 8);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        unsigned kb[4]; // b0, b1 of k-step 2 j (kb 0, 1) and of 2 j + 1 (kb 2, 3); rows: 8 n ..
        ldmatrix_x4(kb, kw + (8 * n + sw) * D + chunk * 8);
        mma_bf16(s[n], qa[0], 0u, qa[1], 0u, kb[0], kb[1]);
        mma_bf16(s[n], qa[2], 0u, qa[3], 0u, kb[2], kb[3]);
      }
    }
    const float corr = softmax_tile(s, base, t, length, scale, m, l);
    const float c0 = __shfl_sync(0xffffffffu, corr, 8 * t);     // head 2t's (lanes 8t..)
    const float c1 = __shfl_sync(0xffffffffu, corr, 8 * t + 4); // head 2t+1's
#pragma unroll
    for (int k = 0; k < KS; ++k) {
      acc[k][0] *= c0;
      acc[k][1] *= c1;
      acc[k][2] *= c0;
      acc[k][3] *= c1;
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) { // positions 16 kk .. + 15: S's column tiles 2 kk, 2 kk + 1
      unsigned h0, h1, l0, l1;
      split_p(s, kk, h0, h1, l0, l1);
      // matrix i: positions 16 kk + 8 (i / 2) .. + 7, dims 16 k + 8 (i % 2) .. + 7 -> a0..a3
      const bf16* vr = vw + (16 * kk + (lane >> 4) * 8 + sw) * D;
      const int half = (lane >> 3) & 1;
#pragma unroll
      for (int k = 0; k < KS; ++k) {
        unsigned va[4];
        ldmatrix_x4_trans(va, vr + ((2 * k + half) ^ sw) * 8);
        mma_bf16(acc[k], va[0], va[1], va[2], va[3], h0, h1);
        mma_bf16(acc[k], va[0], va[1], va[2], va[3], l0, l1);
      }
    }
    __syncwarp(); // the next tile overwrites this warp's K and V rows
  }
  finish_warps<D, G, NW>(m, l, attention_smem, [&](float* sacc) {
#pragma unroll
    for (int k = 0; k < KS; ++k) { // sacc[(warp * 8 + head) * D + dim]
      float* o = sacc + (warp * 8 + 2 * t) * D + 16 * k + g;
      o[0] = acc[k][0];
      o[D] = acc[k][1];
      o[8] = acc[k][2];
      o[D + 8] = acc[k][3];
    }
  }, b, head0, hq, split, splits, out, partial);
}

} // namespace

template <int D, int G, int NW>
void launch_transposed_warps(const attention_call& a, cudaStream_t s) {
  launch_smem("decode_attention", decode_attention_mma_t_kernel<D, G, NW>,
              dim3(a.b, a.hkv, a.splits), dim3(NW * 32), mma_t_smem<D, NW>(), s,
              static_cast<const bf16*>(a.q), a.kv, a.table, a.width, a.lengths,
              static_cast<bf16*>(a.out), a.partial, a.splits, a.hq, a.hkv,
              1.0f / std::sqrt(static_cast<float>(D)), a.qk != nullptr ? *a.qk : attention_qk{});
}

template <int D, int G>
void launch_transposed(const attention_call& a, cudaStream_t s) {
  switch (a.warps) { // checked by decode_attention
    case 6: return launch_transposed_warps<D, G, 6>(a, s);
    case 8: return launch_transposed_warps<D, G, 8>(a, s);
    default: return launch_transposed_warps<D, G, 4>(a, s);
  }
}

template void launch_transposed<64, 1>(const attention_call&, cudaStream_t);
template void launch_transposed<64, 2>(const attention_call&, cudaStream_t);
template void launch_transposed<64, 4>(const attention_call&, cudaStream_t);
template void launch_transposed<64, 8>(const attention_call&, cudaStream_t);
template void launch_transposed<128, 1>(const attention_call&, cudaStream_t);
template void launch_transposed<128, 2>(const attention_call&, cudaStream_t);
template void launch_transposed<128, 4>(const attention_call&, cudaStream_t);
template void launch_transposed<128, 8>(const attention_call&, cudaStream_t);

} // namespace refit::inference::kernels::attention_detail
