// Fused CUDA kernels of the bf16 engine (torch_kernels.cu: norms, q/k, dense GEMV;
// torch_kernels_attention.cu, torch_kernels_attention_t.cu: decode attention; torch_kernels_moe.cu: the MoE; built into the LibTorch module in REFIT_CUDA builds only). Plain pointers and a cudaStream_t (as void*): no LibTorch here.
// Every kernel replaces a chain of ATen ops of torch_fast_forward.cpp with the same arithmetic
// (fp32 math, bf16 storage), so a decode step launches 14 kernels per layer instead of ~100.
//
// bf16 engine KV layout inside one block: [layer][k|v][slot][kv head][head_dim] bf16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace refit::inference::kernels {

// out[r] = bf16(x[r] * rsqrt(mean(x[r]^2) + eps) * w), x fp32 [rows, n], w bf16 [n].
void rms_norm(const float* x, const void* w, void* out, int rows, int n, float eps, void* stream);
// x[r] += y[r] (bf16, fp32 with y_f32), then out[r] = RMSNorm(x[r]) as rms_norm (the residual
// add and the next norm); with lo (bf16 [rows, n], may be null) also lo[r] = bf16(normed -
// out[r]), its rounding error.
void add_rms_norm(float* x, const void* y, const void* w, void* out, int rows, int n, float eps,
                  void* stream, void* lo = nullptr, bool y_f32 = false);

struct kv_target {
  void* base = nullptr;            // the arena
  std::int64_t block_elems = 0;    // bf16 elements per block
  std::int64_t part_elems = 0;     // elements of one (layer, k|v) part
  std::int64_t layer_offset = 0;   // elements from a block's start to this layer's K part
  int block_size = 0;
};

// From qkv bf16 [n, (hq + 2 hkv) * d]: q heads RMS-normed (q_norm), RoPE'd, written to q_out
// bf16 [n, hq, d]; k heads normed (k_norm) + RoPE'd and v heads copied into their cache slots
// (write_block / write_slot of token i, values of token src_row[i]). cos/sin fp32 [P, d/2].
void qk_norm_rope_write(const void* qkv, const void* q_norm, const void* k_norm,
                        const float* cos, const float* sin, const std::int64_t* positions,
                        const std::int64_t* src_row, const std::int64_t* write_block,
                        const std::int64_t* write_slot, void* q_out, kv_target kv, int n, int hq,
                        int hkv, int d, float eps, void* stream);

// y bf16 [m, n] = x bf16 [m, k] . w bf16 [n, k]^T (fp32 sums), all contiguous and 16-byte
// aligned, for the few rows of a decode step: m <= max_dense_gemv_rows, k % 8 == 0, k <= 4096.
inline constexpr std::int64_t max_dense_gemv_rows = 8;
bool dense_gemv_supported(std::int64_t m, std::int64_t k);
void dense_gemv(const void* x, const void* w, void* y, int m, int n, int k, void* stream);

// Programmatic dependent launch of every kernel here (on by default; the engine sets it from
// REFIT_PDL). Process-wide: it takes effect for launches (and graph captures) after the call.
void set_programmatic_launch(bool on);

// Decode attention over the paged cache: q bf16 [b, hq, d]; table int64 [b, width]; lengths
// int64 [b]; out bf16 [b, hq * d]. Supports d in {64, 128} and hq / hkv in {1, 2, 4, 8, 16}.
// The positions of a sequence are split over `splits` blocks per KV head (flash-decoding), their
// partial results (partial: fp32 [b, hq, splits, d + 2]) merged by a second kernel; splits 1
// needs no partial buffer and no merge. decode_attention_splits(b, hkv) is the count for batch
// b on the current device (~2 blocks per SM, at most max_attention_splits): it depends only on
// b, so a CUDA graph captured at b splits as the eager step does. mode: 0 CUDA cores; 1 tensor
// cores, heads as the mma rows (torch_kernels_attention.cu); 2 tensor cores with O transposed
// (head dims as the mma rows, K and V staged in shared memory; torch_kernels_attention_t.cu). Group
// 16 always runs on CUDA cores; any other mode throws std::invalid_argument.
// With `qk` (mode 2 only), the kernel does qk_norm_rope_write's work itself: each block computes
// its group's q heads from qkv into shared memory (`q` unused), and the block that reads a
// sequence's last position writes that position's K and V (normed, RoPE'd) into the cache first.
// warps: mode 2's warps a block up to group 8, 4, 6 or 8 (each takes 32 positions at a time, so
// more warps run more of a block's tiles side by side while fewer blocks fit on an SM: 3, 2 and
// 1 at head_dim 128); other modes and groups take 4 only. decode_attention_warps(blocks, mode,
// group, wanted): the count for a grid of `blocks` (b * hkv * splits): 4 where the kernel has no
// choice, else `wanted` when > 0, else 6 when the grid fits two blocks an SM on the current
// device and 4 past that (H200, one lease: batch 64 17.718 / 17.719 ms a step at 6 against
// 17.749 / 17.762 at 4 and 17.906 / 17.913 at 8).
inline constexpr int max_attention_splits = 16;
struct attention_qk {
  const void* qkv = nullptr; // bf16 [b, (hq + 2 hkv) * d]
  const void* q_norm = nullptr;
  const void* k_norm = nullptr;
  const float* cos = nullptr; // fp32 [P, d / 2]
  const float* sin = nullptr;
  const std::int64_t* positions = nullptr;
  const std::int64_t* src_row = nullptr;
  const std::int64_t* write_block = nullptr;
  const std::int64_t* write_slot = nullptr;
  float eps = 0.0f;
};
bool decode_attention_supported(int d, int group);
int decode_attention_splits(int b, int hkv);
int decode_attention_warps(int blocks, int mode, int group, int wanted = 0);
void decode_attention(const void* q, kv_target kv, const std::int64_t* table, int width,
                      const std::int64_t* lengths, void* out, float* partial, int splits, int b,
                      int hq, int hkv, int d, void* stream, int mode = 1,
                      const attention_qk* qk = nullptr, int warps = 4);

// Router: logits bf16 [n, e] -> softmax (fp32) -> the top_k experts (ties: lower id), their
// probabilities renormalized when `renormalize`: ids int64 [n, top_k], weights fp32 [n, top_k].
bool route_supported(int experts, int top_k);
void route(const void* logits, int n, int experts, int top_k, bool renormalize,
           std::int64_t* ids, float* weights, void* stream);
// The same from fp32 logits [n, e], plus lo fp32 [n, e] when not null (logit = logits + lo: the
// router applied to the two bf16 parts of its input, hi + lo).
void route_f32(const float* logits, const float* lo, int n, int experts, int top_k,
               bool renormalize, std::int64_t* ids, float* weights, void* stream);

// Counting sort of the n * top_k routed copies by expert, stable in flat index order:
// counts int64 [e], offsets int32 [e] (cumulative ends), order int64 [m] (sorted position ->
// flat index), src_token int64 [m] (= order / top_k), inverse int64 [m] (flat -> sorted),
// active int32 [e] (the non-empty experts in id order; their number in *active_count; both
// optional);
// adds the number of non-empty experts to each of loads[0 .. loads_n).
bool bucket_supported(int copies, int experts);
struct bucket_out {
  std::int64_t* counts = nullptr;
  int* offsets = nullptr;
  std::int64_t* order = nullptr;
  std::int64_t* src_token = nullptr;
  std::int64_t* inverse = nullptr;
  int* active = nullptr;
  int* active_count = nullptr;
  std::int64_t* loads = nullptr;
  int loads_n = 0;
};
void bucket(const std::int64_t* ids, int copies, int top_k, int experts, const bucket_out& out,
            void* stream);
// route_f32 then bucket in one block (one launch instead of two, for a decode step's few
// tokens): the same ids, weights and bucket outputs, bit for bit.
constexpr int route_bucket_max_tokens = 256;
bool route_bucket_supported(int n, int experts, int top_k);
void route_bucket_f32(const float* logits, const float* lo, int n, int experts, int top_k,
                      bool renormalize, std::int64_t* ids, float* weights, const bucket_out& out,
                      void* stream);


// Few routed copies (decode at small batch): y bf16 [m, n] = x-row(p) times w bf16 [e, n, k]^T
// of copy p's expert, every expert's weights read once for all of its copies (a GEMV per
// expert; the grouped GEMM's tiles waste most of their reads at one or two rows per expert).
// ids: the flat expert ids, order: sorted position -> flat index, counts int64 [e], offsets
// int32 [e] (cumulative ends). x-row(p) = x[x_rows[p]] (x [tokens, k]: the hidden rows, no
// gather) when x_rows is set, else x[p] (x [m, k]).
struct gemv_args {
  const void* x = nullptr;
  const std::int64_t* x_rows = nullptr;
  const void* w = nullptr;
  const std::int64_t* ids = nullptr;
  const std::int64_t* order = nullptr;
  const std::int64_t* counts = nullptr;
  const int* offsets = nullptr;
  void* y = nullptr;
  int copies = 0;
  int n = 0;
  int k = 0;
};
bool expert_gemv_supported(std::int64_t copies, std::int64_t k, std::int64_t max_copies);
void expert_gemv(const gemv_args& args, void* stream);

// The counting sort done by the early gate_up kernel itself (expert_mma_args::sort): ids the
// flat routed ids [copies] (top_k a token, at most expert_sort_max_tokens tokens); each block
// finds its expert's copies (stable, in flat order) and block 0 of each expert writes what
// bucket would into out's counts, offsets, inverse and loads (order, src_token and active are
// left alone), for the kernels after it. The resident-warp kernel (expert_mma_args::persistent)
// counts every expert's copies in each block and lists an expert's copies per warp, for up to
// expert_stream_sort_max_experts experts.
constexpr int expert_sort_max_tokens = 256;
constexpr int expert_stream_sort_max_experts = 512;
struct expert_sort_args {
  const std::int64_t* ids = nullptr;
  int copies = 0;
  int top_k = 0;
  bucket_out out;
};

// The routed copies' projections on the tensor cores, for any number of copies per expert
// (the weights are streamed once per 32 of an expert's copies): w bf16 [e, rows, k]; the copies
// sorted by expert (bucket: counts, offsets, active, active_count); x-row(p) as for gemv_args.
// GLU (gate_up): y bf16 [m, rows / 2] = silu(gate) * up, the gate rows first in w; else
// y bf16 [m, rows]. ksplit warps share each 16-row tile's k (more blocks for few experts):
// expert_mma_ksplit picks it (enough blocks to fill the device for copies routed over
// `experts`), or checks `wanted` (> 0); 0: the shape does not divide (rows a multiple of 16,
// k of 32); expert_mma_supported: some k-split fits. max_chunks (4, 2 or 1)
// bounds the 16-byte weight chunks a lane holds per row and k-step (registers vs. bytes in
// flight).
struct expert_mma_args {
  const void* x = nullptr;
  const std::int64_t* x_rows = nullptr;
  const void* w = nullptr;
  const int* active = nullptr;
  const int* active_count = nullptr;
  const std::int64_t* counts = nullptr;
  const int* offsets = nullptr;
  void* y = nullptr;
  int rows = 0;
  int k = 0;
  bool glu = false;
  int max_chunks = 4;
  bool evict_first = true; // the weight stream's L2 policy: evict-first, else normal
  bool y_f32 = false;       // no GLU: y fp32 instead of bf16
  // The weight stream's staging: 0, two stages in registers; 4 or 8, that many cp.async stages
  // in shared memory (8 with at most 2 chunks).
  int stages = 0;
  // The weights do not depend on the kernel launched just before (nor does anything of the
  // bucket lists but counts and offsets): each block copies its first weight stages before it
  // waits for that kernel (programmatic dependent launch), and the blocks are laid out by
  // expert id over all `experts` (an empty expert's leave after the wait; worth it when nearly
  // every expert is routed) instead of over the non-empty list. The dense mode takes it too.
  bool early = false;
  // k-split 1 only (expert_mma refuses others; the dense mode ignores it): about as many
  // blocks as fit on the device at once, each warp streaming a sequence of (expert, tile)
  // items through one ring of `stages` (4 or 8) cp.async stages, so the next tile's weights
  // are in flight while this tile's last ones are multiplied; every expert by id (active
  // unused). The sums are the block-per-expert kernel's at k-split 1, bit for bit.
  bool persistent = false;
  int max_blocks = 0; // persistent: at most this many blocks (0: as many as fit at once)
  // persistent with cp.async stages: each copy instruction of a stage takes whole row segments
  // (8 / chunks rows of chunks * 64 bytes) instead of 8 rows x 64 bytes; the same bytes land in
  // the same places (copy_stage_lines), so the sums are the same bits.
  bool line_copies = false;
  // The counting sort in the kernel instead of bucket's (sort.ids set; the early gate_up,
  // persistent or not); counts, offsets and x_rows above are then unused.
  expert_sort_args sort;
};
bool expert_mma_supported(const expert_mma_args& args);
int expert_mma_ksplit(const expert_mma_args& args, int copies, int experts, int wanted);
void expert_mma(const expert_mma_args& args, int copies, int experts, int ksplit, void* stream);

// A dense projection of a few rows on the same kernel: y bf16 (fp32 with y_f32) [m, rows] =
// x bf16 [m, k] . w bf16 [rows, k]^T for 1 <= m <= dense_mma_max_rows, every weight row streamed
// once per pass of up to 64 rows (past 64, a second pass reads them again, from L2 when they
// fit: the router's 2n rows) (args: x, w, y, rows, k, max_chunks, evict_first, y_f32, stages,
// early; glu false; x_rows and the bucket lists unused).
// dense_mma_ksplit: the k-split (about one wave of blocks), `wanted` checked; 0: no fit.
constexpr int dense_mma_max_rows = 128;
int dense_mma_ksplit(const expert_mma_args& args, int m, int wanted);
void dense_mma(const expert_mma_args& args, int m, int ksplit, void* stream);

// A dense projection of a decode step's few rows with its weights copied into shared memory
// before the programmatic wait (torch_kernels_preload.cu): y [m, n] (bf16, fp32 with y_f32) =
// (x + x_lo) [m, k] . w [n, k]^T, all bf16, contiguous and 16-byte aligned, x_lo (the router's
// low part) only for a two-part plan. Thread-block clusters of `split` blocks share a tile of
// weight rows along k, one block an SM, their partial sums added in a fixed order through
// distributed shared memory (the same bits run to run). plan_preload_gemm(m, n, k, two_parts,
// wanted_shape) picks a compiled block shape that divides n and k into clusters of 2, 4 or 8
// blocks and whose grid the current device holds in one wave, or failing that one whose last
// tile of rows is ragged (n a multiple of 16; wanted_shape >= 0: that shape only, either way);
// shape < 0: none does (the caller takes another GEMM). m: 1..preload_gemm_max_rows.
inline constexpr int preload_gemm_max_rows = 64;
struct preload_gemm_args {
  const void* x = nullptr;
  const void* x_lo = nullptr;
  const void* w = nullptr;
  void* y = nullptr;
  int m = 0;
  int n = 0;
  int k = 0;
  bool y_f32 = false;
};
struct preload_gemm_plan {
  int shape = -1;      // the compiled block shape
  int token_tiles = 0; // 8-row token tiles (2, 4 or 8: m up to 16, 32 or 64)
  int parts = 0;       // 1, or 2 with x_lo
  int split = 0;       // blocks of a cluster along k
  int tiles = 0;       // clusters (tiles of weight rows)
};
preload_gemm_plan plan_preload_gemm(int m, int n, int k, bool two_parts, int wanted_shape = -1);
// The device queries behind plan_preload_gemm (resident clusters of every compiled kernel on the
// current device), made once: call it before capturing a CUDA graph that plans inside.
void preload_gemm_prepare();
// Every compiled shape's fit for (m, n, k): its split, its clusters and the clusters the current
// device holds at once (for a refusal's message, and the tests').
std::string preload_gemm_candidates(int m, int n, int k, bool two_parts);
// Clusters of `split` blocks of compiled shape `shape` at m rows (one or two parts) that the
// current device holds at once (cudaOccupancyMaxActiveClusters); 0 where that kernel or split
// does not exist. How the SMs are spread over GPCs decides it, not only their count.
int preload_gemm_resident_clusters(int shape, int m, bool two_parts, int split);
void preload_gemm(const preload_gemm_args& args, const preload_gemm_plan& plan, void* stream);

// Sampling without top-k / top-p filters: out double [draws, 2] = (token, logprob) of draw d
// from row rows[d] of logits fp32 (row_stride >= vocab floats apart, vocab columns) with
// uniform uniforms[d] (null when greedy); the arithmetic of sample_on_device (z = logits * inv_t
// - max in double, the first id whose cumulative probability exceeds u (at most vocab - 1), or
// the first maximum when greedy; logprob = z[token] - log(sum exp z)), its sums in a fixed
// order: the same bits run to run. Two kernels: blocks of (draw, part of 4096 ids) write each
// part's max and sum of exp to `scratch`, then a block per draw combines the parts and scans
// only the part where the cdf passes u. scratch: device memory of sample_plain_scratch_bytes(
// vocab, draws) bytes, 8-byte aligned, no initialization needed. No host synchronization nor
// allocation: capturable in a CUDA graph. Bad shapes or null pointers throw
// std::invalid_argument.
std::size_t sample_plain_scratch_bytes(std::int64_t vocab, int draws);
void sample_plain(const float* logits, std::int64_t vocab, std::int64_t row_stride,
                  const std::int64_t* rows, const double* uniforms, int draws, double inv_t,
                  bool greedy, double* out, void* scratch, void* stream);

// act bf16 [m, i] = silu(gate) * up of gate_up bf16 [m, 2i] (fp32 math).
void silu_mul(const void* gate_up, void* act, std::int64_t m, int i, void* stream);

// x fp32 [n, h] += sum_j weights[t, j] * y[inverse[t * top_k + j]] (y bf16 [n * top_k, h], fp32
// with y_f32); then, when norm_w is given, norm_out bf16 [n, h] = RMSNorm(x) with norm_w.
// early (where h % 256 == 0, h <= 8192, top_k <= 32): inverse, weights, x and norm_w are read
// before the programmatic wait, so they must have been written by kernels that ran before the
// one just before this (which writes y); the same bits either way.
// trigger_early: the kernel after it may be scheduled as soon as this one's blocks start, before
// they wait for the kernel before (the down projection): that next kernel must read before its
// own wait only what kernels before the down projection wrote (the preloading GEMM: weights).
void mix_experts(const void* y, const std::int64_t* inverse, const float* weights, float* x,
                 int n, int top_k, int h, const void* norm_w, void* norm_out, float eps,
                 void* stream, bool y_f32 = false, bool early = false,
                 bool trigger_early = false);

// x fp32 [n, h] += bf16 y [n, h].
void add_bf16(float* x, const void* y, std::int64_t elements, void* stream);

} // namespace refit::inference::kernels
