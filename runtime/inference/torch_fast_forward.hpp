// The bf16 engine's class (torch_fast_forward.cpp: construction, inputs, CUDA graphs, the
// rank_forward API; torch_fast_layers.cpp: the model's layers). Only the LibTorch module's
// translation units include this header.
//
// The bf16 engine of rank_forward (forward.hpp): bf16 weights read in place, bf16 activations
// into every GEMM (fp32 accumulation in the GEMM), the residual stream, norms, RoPE, softmaxes
// and the expert mix in fp32, KV cache in bf16.
//
// One step, per layer: qkv GEMM, q/k RMSNorm + RoPE, K/V scattered into their paged slots
// (index_put over a view of the arena), attention (prefill: one causal SDPA over the batch of
// fresh prompts, per item over the cache when a cached prefix precedes; decode: the items'
// block tables gathered into [B, kv heads, L, head_dim] and one SDPA with a length mask in
// which the q heads of one KV head play the query positions), o_proj (+ TP all-reduce);
// router softmax in fp32, top-k by a stable sort (ties: lower expert id), the token copies
// sorted by expert (stable) and one grouped GEMM per projection over the expert-contiguous
// rows (at::_grouped_mm where LibTorch has it, else a loop over the non-empty experts),
// SiLU(gate) * up, the results put back in token order and mixed by the routing weights in
// fp32 (+ all-reduce). Nothing in a step reads device memory on the host except the sampled
// tokens at its end (and the expert counts of the fallback loop).
//
// On a CUDA device at tp 1, or at tp > 1 with a device comm (NCCL: the all-reduces and the
// logits all-gather are enqueued on the engine's stream, so they are captured too; every rank
// captures and replays the same sequence), a decode step (every item one token) is captured
// once per (batch bucket, block-table bucket) as a CUDA graph and replayed: the step's inputs
// (tokens, positions, slots, block tables, lengths) are one int64 buffer copied host ->
// device before the replay; rows past the batch repeat row 0 and write row 0's K/V values to
// row 0's slot, so padding never touches another sequence's cache.
//
// On a GPU the fused kernels of torch_kernels.hpp replace the ATen chains above where the
// shapes allow (rank_forward_options::fused_kernels); the ATen chains stay the CPU path and
// the baseline the GPU tests compare the kernels against.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#if defined(REFIT_TORCH_CUDA)
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "runtime/inference/forward.hpp"
#include "runtime/inference/torch_device_sampling.hpp"
#if defined(REFIT_TORCH_CUDA)
#include "runtime/inference/torch_kernels.hpp"
#endif

#if __has_include(<ATen/ops/_grouped_mm.h>)
#define REFIT_HAVE_GROUPED_MM 1
#endif
#if __has_include(<ATen/ops/scaled_dot_product_attention.h>)
#define REFIT_HAVE_SDPA 1
#endif
#if __has_include(<torch/version.h>)
#include <torch/version.h>
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#define REFIT_HAVE_MM_DTYPE 1 // at::mm(a, b, out_dtype): bf16 inputs, fp32 output (CUDA)
#endif
#endif

namespace refit::inference {

rank_forward* create_fast_forward(const rank_forward_options& options);

namespace bf16 {

// What the fused kernels' 16-byte loads need: contiguous bf16 from a 16-byte aligned address.
bool streamable(const at::Tensor& t);

// Step inputs, all int64 on the device. tokens/positions/src_row/write_block/write_slot: [n]
// (n = tokens of the step); table: [B, W] block ids; lengths: [B] context lengths (decode).
struct step_inputs {
  at::Tensor tokens;
  at::Tensor positions;
  at::Tensor write_block;
  at::Tensor write_slot;
  at::Tensor src_row; // K/V written for token i are those of token src_row[i]
  at::Tensor table;
  at::Tensor lengths;
};

// The CUDA-graph batch bucket of n rows (0: no graph), and the power of two >= n.
std::int64_t bucket_of(std::int64_t n);
std::int64_t pow2_at_least(std::int64_t n);

class fast_rank_forward final : public rank_forward, private tp_rank_dims {
public:
  explicit fast_rank_forward(const rank_forward_options& o);

  std::vector<float> forward(const std::vector<forward_item>& items, std::byte* kv_base,
                             logits_rows rows) override;

  forward_counters counters() const override;

  std::uint64_t graph_replays() const override { return counters_.graph_replays; }

  // Pipelined decode at TP 1 (on a GPU the step's draws come back through pinned memory and an
  // event; on the CPU begin_sample runs the step to the end and finish_sample only hands it
  // over, so the protocol is the same and CI exercises it).
  bool pipelines_samples() const override { return o_.tp == 1 && pipeline_decode_ != 0; }
  std::vector<sampled_token> finish_sample() override;
  void drop_samples() override;

protected:
  bool samples_on_device() const override { return true; }

  std::vector<sampled_token> forward_sample_device(const std::vector<forward_item>& items,
                                                   std::byte* kv_base,
                                                   const sampling_config& params,
                                                   const std::vector<sample_draw>& draws,
                                                   const std::vector<double>& uniforms) override;
  void begin_sample_device(const std::vector<forward_item>& items, std::byte* kv_base,
                           const sampling_config& params, const std::vector<sample_draw>& draws,
                           const std::vector<double>& uniforms,
                           const std::vector<std::int64_t>& feed) override;

private:
  // Inference mode, the device, the engine's stream and the threads, for one call.
  struct scope {
    explicit scope(const fast_rank_forward& f) : device_guard(f.device_) {
      if (f.o_.compute_threads > 0 && at::get_num_threads() != f.o_.compute_threads)
        at::set_num_threads(f.o_.compute_threads);
#if defined(REFIT_TORCH_CUDA)
      if (f.stream_)
        stream_guard.emplace(*f.stream_);
#endif
    }
    c10::InferenceMode inference_mode;
    c10::DeviceGuard device_guard;
#if defined(REFIT_TORCH_CUDA)
    std::optional<c10::cuda::CUDAStreamGuard> stream_guard;
#endif
  };

  struct layer_tensors {
    at::Tensor qkv, o, q_norm, k_norm, router, w13, w2, input_norm, post_norm;
  };

  at::Tensor view(const std::byte* p, at::IntArrayRef shape) const {
    return at::from_blob(const_cast<std::byte*>(p), shape, bf_); // never written
  }

  void bind();

  static bool is_decode(const std::vector<forward_item>& items) {
    return std::all_of(items.begin(), items.end(),
                       [](const forward_item& i) { return i.count == 1; });
  }

  // Host -> device (LibTorch synchronizes the stream for a pageable copy: with NCCL
  // collectives on it, first wait for them against the comm's deadline, so a dead peer is a
  // comm_error, not a hang).
  at::Tensor upload(const std::vector<std::int64_t>& values) const {
    wait_collectives();
    return at::from_blob(const_cast<std::int64_t*>(values.data()),
                         {static_cast<std::int64_t>(values.size())}, at::kLong)
      .to(device_);
  }

  // Host -> device without waiting on the stream: the values are staged in pinned memory on a
  // GPU (the caching host allocator keeps the staging block until the copy has run), copied as
  // they are elsewhere.
  at::Tensor upload_async(const void* values, at::ScalarType type, std::size_t count) const {
    const auto n = static_cast<std::int64_t>(count);
    const at::Tensor host = at::from_blob(const_cast<void*>(values), {n}, type);
    if (!device_.is_cuda())
      return host.clone();
    at::Tensor staged = at::empty({n}, at::TensorOptions().dtype(type).pinned_memory(true));
    staged.copy_(host);
    return staged.to(device_, /*non_blocking=*/true);
  }

  // [nb, block, kv heads, head_dim] view of (layer, k|v) over the arena at kv_base (the bf16
  // engine's block layout: [layer][k|v][slot][kv head][head_dim]).
  at::Tensor kv_view(std::byte* kv_base, std::uint32_t layer, std::uint32_t kind) const {
    return at::from_blob(kv_base,
                         {static_cast<std::int64_t>(o_.kv_blocks), std::int64_t{cfg_.num_hidden_layers},
                          2, std::int64_t{o_.kv.block_size}, kv_heads_, head_dim_},
                         bf_)
      .select(1, layer)
      .select(1, kind);
  }

  void validate(const std::vector<forward_item>& items) const;

  // Host-side step inputs of `items`, padded to `batch` rows (decode) and W table columns.
  struct host_inputs {
    std::vector<std::int64_t> tokens, positions, write_block, write_slot, src_row, table,
      lengths;
  };
  host_inputs gather_inputs(const std::vector<forward_item>& items, std::int64_t batch,
                            std::int64_t width) const;

  // cos / sin tables [P, head_dim / 2] covering positions < `positions` (grown eagerly).
  void ensure_rope(std::int64_t positions);

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const;
  // x [m, k] . w [n, k]^T: the engine's GEMV for the few rows of a decode step (bf16,
  // kernels::dense_gemv), else at::matmul.
  at::Tensor linear(const at::Tensor& x, const at::Tensor& w) const;
  // The same with an fp32 output (fp32 accumulation, no bf16 rounding of y): dense_mma's fp32
  // epilogue for few rows (up to max_mma_rows; -1: dense_mma_max_rows_), cuBLAS with an fp32
  // output dtype above; on the device only.
  at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w,
                        std::int64_t max_mma_rows = -1) const;
  // The tensor-core kernel's dense mode for linear / linear_f32 up to max_rows rows (-1:
  // dense_mma_max_rows_); undefined where it does not apply (off, too many rows, a shape it
  // does not fit, no CUDA).
  at::Tensor dense_mma(const at::Tensor& x, const at::Tensor& w, bool f32,
                       std::int64_t max_rows = -1) const;
  // kernels::preload_gemm for x [m, k] . w [n, k]^T, bf16 or fp32 out, where it is on
  // (REFIT_PRELOAD_GEMM), m is past dense_mma's rows and a plan fits the device in one wave;
  // undefined otherwise. two_parts: x is the router's [2m, k] input, m high rows then m low rows,
  // and y [m, n] their sum's product (REFIT_PRELOAD_GEMM=2).
  at::Tensor preload_linear(const at::Tensor& x, const at::Tensor& w, bool f32,
                            bool two_parts = false) const;
#if defined(REFIT_TORCH_CUDA)
  // expert_mma_args with the knobs' staging set (chunks, L2 policy, stages, early start): what
  // the expert projections and the dense mode share.
  kernels::expert_mma_args tuned_mma_args() const;
#endif

  at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const;

  // Sum over the TP group: in place on the device with a device comm (NCCL), else through
  // host memory (t replaced).
  void all_reduce(at::Tensor& t) const;

  // Waits (comm deadline, abort) for the collectives enqueued on the engine's stream; call
  // before any host synchronization with it. A no-op without device collectives.
  void wait_collectives() const {
#if defined(REFIT_TORCH_CUDA)
    if (device_comm_)
      o_.comm->wait_device(o_.rank, stream());
#endif
  }

  // The model over the step; returns logits [rows, vocab] fp32 on the device. `decode`: every
  // item is one token and attention reads in.table / in.lengths; else `items` drive the
  // prefill attention.
  at::Tensor model(const step_inputs& in, std::byte* kv_base, const std::vector<forward_item>* items,
                   const at::Tensor& picked, bool decode);

  // softmax(q k^T / sqrt(d)) v over [B, heads, Lq, d] with a boolean mask (true: attend).
  at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& mask, bool causal) const;

  // Decode: q [B, Hq, d]; the blocks of in.table gathered to [B, Hkv, W * block, d].
  at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                              const step_inputs& in) const;

  // Prefill: fresh prompts (position 0) in one padded causal batch; items after a cached
  // prefix one by one over their cache.
  at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& kc, const at::Tensor& vc,
                               const std::vector<forward_item>& items) const;

  // x [M, K] (rows grouped by expert: counts) times w [E, N, K]^T per group -> [M, N].
  at::Tensor grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& counts,
                     const at::Tensor& offsets) const;

  // The routed experts of h, added into the residual stream x (after the TP all-reduce).
  // With next_norm (the next layer's input norm) the fused mix also returns RMSNorm(x) with
  // it; otherwise (or on the ATen path) an undefined tensor.
  // router_in (may be undefined): [2n, H] bf16, h's rows then their rounding errors (lo), the
  // router's input at about 16 mantissa bits (add_norm_bf16's split), or fp32 [n, H] (the ATen
  // path: the norm before its bf16 rounding).
  at::Tensor experts(const layer_tensors& w, const at::Tensor& h, bool decode, at::Tensor& x,
                     const at::Tensor* next_norm, const at::Tensor& router_in);
  // The counting sort done by the gate_up kernel instead of bucket (REFIT_EXPERT_SELF_SORT):
  // the routed ids, the inverse it fills (with counts and offsets), decode or not (the loads).
  struct in_kernel_sort {
    const at::Tensor* ids;
    const at::Tensor* inverse;
    bool decode;
  };
  at::Tensor expert_projections(const layer_tensors& w, const at::Tensor& h, std::int64_t copies,
                                const at::Tensor& chosen, const at::Tensor& counts,
                                const at::Tensor& offsets, const at::Tensor& order,
                                const at::Tensor& src_token, const at::Tensor& active,
                                const in_kernel_sort* sort = nullptr) const;
#if defined(REFIT_TORCH_CUDA)
  // The tensor-core expert path for these copies (knobs, copy counts, layouts): up and down
  // with their shapes, staging, early start and persistence, and their k-splits; false where
  // it does not apply (expert_projections then takes the GEMV or the grouped GEMM).
  bool expert_mma_plan(const layer_tensors& w, const at::Tensor& h, std::int64_t copies,
                       kernels::expert_mma_args& up, kernels::expert_mma_args& down, int& ks_up,
                       int& ks_down) const;
  // Whether that path runs early and not persistent for these copies at TP 1, with
  // REFIT_EXPERT_SELF_SORT on: gate_up may then sort the copies itself.
  bool self_sort_fits(const layer_tensors& w, const at::Tensor& h, std::int64_t copies) const;
#endif

  // x (fp32, contiguous) += the all-reduced bf16 `out`.
  void add_residual(at::Tensor& x, const at::Tensor& out);

  // RMSNorm of fp32 x (contiguous [n, H]) to bf16.
  at::Tensor norm_bf16(const at::Tensor& x, const at::Tensor& w) const;

  // add_residual(x, out), then norm_bf16(x, w): one kernel when fused and TP 1. With split
  // (router_split_) *split gets the router's input: fused at TP 1 bf16 [2n, H], the returned
  // rows then their rounding errors; else the fp32 norm [n, H].
  at::Tensor add_norm_bf16(at::Tensor& x, const at::Tensor& out, const at::Tensor& w,
                           at::Tensor* split = nullptr);

  // Whether o_proj and the experts' down projection hand fp32 to the residual add (the fused
  // add_rms_norm and mix, TP 1, REFIT_RESIDUAL_FP32): no bf16 rounding of either.
  bool fp32_residual_inputs() const { return fused_ && o_.tp == 1 && residual_fp32_ != 0; }

  // Decode attention of one layer through the fused kernels: q/k norm + RoPE + the K/V
  // writes, then attention over the paged cache.
  at::Tensor fused_decode_layer_attention(const at::Tensor& qkv, const layer_tensors& w,
                                          const step_inputs& in, std::byte* kv_base,
                                          std::uint32_t layer);

#if defined(REFIT_TORCH_CUDA)
  void* stream() const { return c10::cuda::getCurrentCUDAStream(device_.index()).stream(); }
#endif

  // `feed` (run_graph too): begin_sample's, or null.
  at::Tensor run_eager(const std::vector<forward_item>& items, std::byte* kv_base,
                       logits_rows rows, const std::vector<std::int64_t>* feed = nullptr);

  // The logits of a step and its draws enqueued: packed [D, 2] double (token, logprob) on the
  // device (sample_on_device_async).
  at::Tensor step_and_draws(const std::vector<forward_item>& items, std::byte* kv_base,
                            const sampling_config& params, const std::vector<sample_draw>& draws,
                            const std::vector<double>& uniforms,
                            const std::vector<std::int64_t>* feed);

  // Decode rows [0, rows) of `tokens` (int64, on the device) whose feed entry is a draw take
  // that draw's token of the step begun last (begun_.back()); rows past the feed (a graph's
  // padding, which repeats row 0) take row 0's.
  void apply_feed(const at::Tensor& tokens, const std::vector<std::int64_t>& feed,
                  std::int64_t rows) const;

#if defined(REFIT_TORCH_CUDA)
  struct graph_entry {
    at::cuda::CUDAGraph graph;
    at::Tensor device; // the same on the device; `in` are views of it
    step_inputs in;
    at::Tensor picked;
    at::Tensor logits; // the graph's output
    std::byte* kv_base = nullptr;
    std::uint64_t preload_gemms = 0; // preloading-GEMM launches the graph holds
  };

  static std::size_t allocated_bytes_of(c10::DeviceIndex d) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(d);
    return static_cast<std::size_t>(stats.reserved_bytes[0].current);
  }
  std::int64_t allocated_bytes() const {
    return static_cast<std::int64_t>(allocated_bytes_of(device_.index()));
  }
#endif

  at::Tensor run_graph(const std::vector<forward_item>& items, std::byte* kv_base,
                       const std::vector<std::int64_t>* feed = nullptr);

  // A begun step (begin_sample): its draws on the device (the next step's feed, while it is
  // the last begun) and on their way to the host.
  struct begun_step {
    at::Tensor drawn; // [D, 2] double (token, logprob) on the step's device
    at::Tensor host;  // the same on the host; pinned on a GPU
#if defined(REFIT_TORCH_CUDA)
    std::optional<at::cuda::CUDAEvent> landed; // recorded after the copy to `host`
#endif
  };
  std::deque<begun_step> begun_;

  const rank_forward_options o_;
  const model::model_config& cfg_;
  const at::Device device_;
  const at::TensorOptions bf_, f32_, i64_;
  at::Tensor embed_, final_norm_, lm_head_;
  std::vector<layer_tensors> layers_;
  std::vector<float> inv_freq_;
  at::Tensor cos_, sin_;
  std::int64_t rope_positions_ = 0;
  at::Tensor expert_loads_;
  forward_counters counters_;
  mutable std::uint64_t preload_gemms_ = 0; // counters().preload_gemms (counted in const paths)
  bool graphs_enabled_ = false;
  bool device_comm_ = false;            // tp > 1 on a GPU with a device comm (NCCL)
  bool fused_ = false;                  // the fused CUDA kernels (torch_kernels.cu)
  bool fused_decode_attention_ = false; // their decode attention supports this shape
  // Routed copies up to which a step uses the expert GEMV instead of the tensor-core kernel or
  // the grouped GEMM (REFIT_EXPERT_GEMV_MAX_COPIES overrides it, for tuning). 0: on the H200
  // expert_mma beats it from batch 1 on (bench/results/*-h200-experts.json).
  std::int64_t gemv_max_copies_ = 0;
  // Routed copies up to which a step uses the tensor-core expert kernel (expert_mma) instead of
  // the grouped GEMM (from gemv_max_copies_ on), its k-split (0: chosen per shape) and its
  // chunks per lane and k-step; REFIT_EXPERT_MMA_MAX_COPIES, REFIT_EXPERT_MMA_KSPLIT and
  // REFIT_EXPERT_MMA_CHUNKS set them. 2048: decode up to batch 256 of a top-8 model (about 16
  // tokens per expert; the kernel takes 32 per pass over the weights), prefill on the GEMM.
  std::int64_t mma_max_copies_ = 2048;
  std::int64_t mma_ksplit_ = 0;
  std::int64_t mma_chunks_ = 2; // expert_mma_args::max_chunks: 2 runs two blocks per SM
  std::int64_t mma_evict_first_ = 1; // expert_mma_args::evict_first (REFIT_EXPERT_MMA_EVICT_FIRST)
  // expert_mma_args::stages (REFIT_EXPERT_MMA_STAGES): 4 cp.async stages in shared memory keep
  // more weight bytes in flight per SM than the two register stages (0).
  std::int64_t mma_stages_ = 4;
  // expert_mma_args::early (REFIT_EXPERT_MMA_EARLY): the first weight stages copied before the
  // wait for the kernel before (the experts by id from 4 routed copies an expert on).
  std::int64_t mma_early_ = 1;
  // expert_mma_args::persistent (REFIT_EXPERT_MMA_PERSISTENT): at k-split 1 with the early
  // start (by expert id) resident warps each stream a sequence of expert tiles through one
  // ring of stages (no refill at tile starts); 1: both projections (gate_up sorting the copies
  // itself), 2: the down projection only (its tiles are 12 k-steps at decode); 0: off.
  std::int64_t mma_persistent_ = 1;
  // gate_up sorts the routed copies itself instead of the bucket kernel before it, where
  // self_sort_fits (REFIT_EXPERT_SELF_SORT): its weights stream from the end of routing, not
  // of the sort (H200 batch 64: 18.21 vs 18.40 ms a step in one lease).
  std::int64_t expert_self_sort_ = 1;
  // The resident-warp kernels' stage copies by whole row segments
  // (REFIT_EXPERT_MMA_LINES=0|1, kernels::expert_mma_args::line_copies; the same bits). H100,
  // batch 64: 22.704 / 22.700 ms a step against 23.561 / 23.569 with per-lane chunks (23.685 vs
  // 23.987 on another H100).
  std::int64_t mma_line_copies_ = 1;
  // Tokens up to which routing and the counting sort run as one kernel (route_bucket_f32, one
  // block) instead of two (REFIT_ROUTE_BUCKET_MAX_TOKENS, at most 256; 0: always two).
  std::int64_t route_bucket_max_tokens_ = 0;
  // Rows up to which qkv, o_proj and the router take the dense GEMV (REFIT_DENSE_GEMV_MAX_ROWS,
  // at most 8), then the tensor-core kernel (dense_mma) instead of cuBLAS
  // (REFIT_DENSE_MMA_MAX_ROWS, at most 64; 0: off).
  // H200, Qwen3-30B-A3B: dense_mma beats the GEMV at batch 1 (4.49 vs 4.87 ms a step), ties
  // cuBLAS at 16 and loses at 64 (24.5 vs 21.2 ms: 64 token rows read from L2 per weight row
  // outweigh the weights).
  std::int64_t dense_gemv_max_rows_ = 0;
  std::int64_t dense_mma_max_rows_ = 16;
  // Rows (the 2n of the split router input; at most 128, in passes of 64) up to which the router
  // takes the dense mode (REFIT_ROUTER_MMA_MAX_ROWS; 0: cuBLAS). H200: at batch 16 (32 rows) it
  // beats cuBLAS (12.72 vs 12.95 ms a step); at 64 (128 rows, two passes) it loses (19.38 vs
  // 18.85).
  std::int64_t router_mma_max_rows_ = 32;
  // qkv and o_proj (1), and the router's two parts (2), past dense_mma's rows on
  // kernels::preload_gemm, whose blocks copy their whole slice of the weights into shared
  // memory before the programmatic wait, instead of cuBLAS (REFIT_PRELOAD_GEMM=0|1|2). Off until
  // it is measured on a GPU: it was written in a session without one.
  std::int64_t preload_gemm_ = 0;
  // The mix lets the next kernel be scheduled when its blocks start rather than after its wait
  // for the down projection (REFIT_MIX_TRIGGER_EARLY=0|1), so that the next layer's qkv on the
  // preloading GEMM can copy its weights while the down projection ends. Every kernel that can
  // follow the mix reads nothing but weights before its wait (qkv on our kernels), or takes no
  // part in programmatic launch (cuBLAS, ATen). Off, like the GEMM, until measured.
  std::int64_t mix_trigger_early_ = 0;
  // Draws without top-k / top-p by the fused sampler (kernels::sample_plain) instead of the
  // ATen chain (REFIT_FUSED_SAMPLING=0|1).
  std::int64_t fused_sampling_ = 1;
  // The router from the post-attention norm split into two bf16 parts (hi + lo, one GEMM of 2n
  // rows, fp32 logits) instead of from bf16 h with bf16 logits (REFIT_ROUTER_SPLIT=0|1): expert
  // choices flip against the fp32 reference where two logits are closer than the rounding.
  std::int64_t router_split_ = 1;
  // The lm_head's logits in fp32 straight from the GEMM's accumulators instead of rounded to
  // bf16 first (REFIT_LOGITS_FP32=0|1; needs at::mm's out_dtype, LibTorch >= 2.9).
  std::int64_t logits_fp32_ = 1;
  // o_proj and the routed experts' down projection leave their fp32 accumulators into the fp32
  // residual stream instead of bf16 (fused kernels, TP 1; REFIT_RESIDUAL_FP32=0|1).
  std::int64_t residual_fp32_ = 1;
  // The mix kernel reads the routing (expert rows, weights), the residual row and the norm
  // weights before it waits on the down projection (REFIT_MIX_EARLY=0|1; the same bits). H200,
  // batch 64, one lease, two rounds: 17.602 / 17.599 ms a step against 17.652 / 17.653.
  std::int64_t mix_early_ = 1;
  // Decode attention's kernel (REFIT_ATTENTION_MMA, kernels::decode_attention's mode): 0 CUDA
  // cores, 1 tensor cores with the heads as rows, 2 tensor cores with O transposed (groups up to
  // 8; group 16 takes CUDA cores). Mode 2 with its own q/k (REFIT_ATTENTION_FUSED_QK=0|1: the
  // attention kernel does the q/k norm + RoPE + K/V writes instead of qk_norm_rope_write).
  // H200, batch 64, one lease, two interleaved runs each: mode 1 18.36 / 18.28 ms a step, mode 2
  // 18.31 / 18.20, mode 2 with its own q/k 18.29 / 18.17; batch 1, 16 and 256 within noise.
  std::int64_t attention_mma_ = 2;
  std::int64_t attention_fused_qk_ = 1;
  // Decode attention's splits of each sequence (REFIT_ATTENTION_SPLITS, at most 16); 0: chosen
  // from the batch (decode_attention_splits).
  std::int64_t attention_splits_ = 0;
  // Mode 2's warps a block (REFIT_ATTENTION_WARPS=4|6|8); 0: chosen from the grid
  // (decode_attention_warps: 6 where two blocks an SM hold it, else 4).
  std::int64_t attention_warps_ = 0;
  // Pipelined decode steps (REFIT_PIPELINE_DECODE, 0 turns it off for comparison).
  std::int64_t pipeline_decode_ = 1;
#if defined(REFIT_TORCH_CUDA)
  std::optional<c10::cuda::CUDAStream> stream_;
  std::int64_t baseline_bytes_ = 0;
  std::map<std::pair<std::int64_t, std::int64_t>, std::unique_ptr<graph_entry>> graphs_;
  std::uint64_t graphs_epoch_ = 0; // the comm's device_epoch() the graphs were captured in
#endif
};

} // namespace bf16

} // namespace refit::inference
